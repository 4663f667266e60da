"""A2 on a GPU: an engine process's own torch tensors, shaped like SGLang's per-layer K
and V and like vLLM's per-layer views of one storage, exported by CUDA IPC
(adapters/cuda.py) and opened by a daemon process (host/memory.py), which checks every
byte and writes its own; the engine reads those back through its tensors, and the
tensors around them are untouched. Expandable segments are refused, naming the fix; a
block the engine exported and freed is not reused under the daemon."""

from __future__ import annotations

import multiprocessing

import pytest

from . import cuda_missing, sides

MISSING = cuda_missing()
pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "-")

SPAWN = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
ANSWER_TIMEOUT = 120.0


class Side:
    """A spawned process of tests.gpu.sides and our end of its pipe."""

    def __init__(self, target, *args) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def answer(self, expected: str) -> list:
        assert self.conn.poll(ANSWER_TIMEOUT), f"{self.proc.name} did not answer within {ANSWER_TIMEOUT:g}s"
        try:
            kind, *rest = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise AssertionError(f"{self.proc.name} exited with {self.proc.exitcode} before it answered") from None
        assert kind != "error", rest[0]
        assert kind == expected, (kind, rest)
        return rest

    def finish(self) -> None:
        self.proc.join(30)
        assert self.proc.exitcode == 0, f"{self.proc.name} exited with {self.proc.exitcode}"


@pytest.fixture
def spawned():
    started = []

    def start(target, *args) -> Side:
        side = Side(target, *args)
        started.append(side)
        return side

    yield start
    for side in started:
        if side.proc.is_alive():
            side.proc.kill()
        side.proc.join()


@pytest.mark.parametrize("shape", ["sglang", "vllm"])
def test_engine_tensors_cross_to_a_daemon_process_and_back(spawned, shape):
    engine = spawned(sides.engine, shape)
    handles, places, facts = engine.answer("exported")
    assert facts["problems"] == []
    assert len(handles) == facts["blocks"] < len(places)  # one handle per block, shared by its tensors
    assert any(p.offset > 0 for p in places)  # tensors inside their blocks, not at their starts
    if shape == "vllm":
        assert len(handles) == 1  # every layer a view of one storage
        assert all(b.offset == a.offset + a.length for a, b in zip(places, places[1:]))

    daemon = spawned(sides.daemon, handles, places)
    (seen,) = daemon.answer("checked")
    daemon.finish()
    assert seen["differing"] == [0] * len(places)
    assert seen["reopened"]["differing"] == 0

    engine.conn.send("check")
    (back,) = engine.answer("checked")
    engine.finish()
    assert back["kv"] == [0] * len(places)  # the daemon's writes, seen through the engine's tensors
    assert back["pads"] == [0] * len(back["pads"])  # and nothing written beside them
    print(
        f"\n{shape}: {len(places)} tensors in {len(handles)} blocks, offsets {[p.offset for p in places]}, "
        f"{seen['bytes']} bytes checked each way; export {facts['export_ms']:.2f} ms, open {seen['open_ms']:.2f} ms, "
        f"read {seen['read_ms']:.2f} ms; the same handle opened twice gave the same address: {seen['reopened']['same_address']}"
    )


def test_expandable_segments_are_refused_naming_the_fix(spawned, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    engine = spawned(sides.expandable_engine)
    expandable, message = engine.answer("refused")
    engine.finish()
    assert expandable  # the allocator really took the setting
    assert "expandable_segments:False" in message
    print(f"\nrefused: {message}")


def test_an_exported_storage_the_engine_frees_is_not_handed_to_another_tensor(spawned):
    """torch holds an exported block back from reuse (adapters/cuda.py): the daemon may
    still write it. One not exported is reused at once, so the check can fail."""
    engine = spawned(sides.freeing_engine)
    (reused,) = engine.answer("freed")
    engine.finish()
    assert reused == {False: True, True: False}


def test_c4_vllm_layers_registered_by_the_connector_cross_to_a_daemon_and_back(spawned):
    """PdxferConnector's registration (adapters/vllm/registration.py) of vLLM's per-layer
    views of one CUDA storage: one buffer, a region per layer where export_tensors
    places it, whose pages hold exactly that layer's bytes for a daemon process, and
    whose writes the engine reads back through its tensors."""
    engine = spawned(sides.vllm_registered_engine)
    handles, places, facts = engine.answer("registered")
    assert facts["device"] == "cuda:0" and len(handles) == 1 and facts["layers"] == [0, 1, 2, 3]
    assert [(p.buffer, p.offset, p.length) for p in places] == [(e.buffer, e.offset, e.length) for e in facts["exported"]]
    assert facts["spec"].layers == (0, 4) and facts["spec"].dtype == "bfloat16"
    daemon = spawned(sides.daemon, handles, places)
    (checked,) = daemon.answer("checked")
    assert checked["differing"] == [0, 0, 0, 0]
    engine.conn.send("check")
    (back,) = engine.answer("checked")
    assert back == [0, 0, 0, 0]
    engine.finish()
    daemon.finish()
