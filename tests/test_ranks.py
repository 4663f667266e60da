"""Issue 27 step 2: one daemon per node serves every rank of an engine (A1), and a room
moves between rank sets of different TP and PP sizes as legs (A4, A6-A8), asked for in
one request per room per node pair (A5).

Real daemons and the real transfer engine over TCP on loopback, one client process per
rank. Each rank's KV is real shared memory laid out as the engines lay theirs out:
SGLang's per-layer K and V tensors [tokens, heads, head_dim] (token-major), or vLLM's CPU
cache, one storage [layers, blocks, heads, block_size, 2 * head_dim] (head-major, K and V
packed per token). The rooms' KV comes from one model, known for every global head; every
decode rank's whole buffer is compared with a reference made here by slicing that rank's
heads out of the model with numpy, so the mapping is checked too, not only the copying."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

import zmq

from pdxfer import Client, Heads, KVPacking, KVRegion, KVSpec, PageOrder, Rank, RegionKind, Role, RoomState
from pdxfer.core import errors
from pdxfer.core.stamp import HEADER_BYTES
from pdxfer.core.topology import first_head, local_heads, stage_layers
from pdxfer.host.memory import KV_POOL_PREFIX, SharedMemory
from pdxfer.ops.inspection import daemon_counters

from .conftest import needs_mooncake
from .roomkit import free_port, kill

pytestmark = [needs_mooncake, pytest.mark.integration]

K, V, KV, LATENT = RegionKind.K, RegionKind.V, RegionKind.KV, RegionKind.LATENT
PAGE_SIZE, LAYERS, NUM_PAGES, SLOTS, PAYLOAD = 4, 3, 24, 8, 48
HEAD_DIM, LATENT_DIM = 8, 20  # bytes of one head's K (or V), and of the MLA latent, for one token


@dataclass
class RankKV:
    """One rank's KV cache in shared memory; ``shape`` sees a copy of its buffers (or
    the buffers themselves: ``views``) as (layer, kind) -> [page, token, head, unit] bytes."""

    memory: list
    buffers: list
    regions: list[KVRegion]
    spec: KVSpec
    shape: Callable[[list[np.ndarray]], dict]

    def __post_init__(self) -> None:
        self.views = self.shape([m.array for m in self.memory])

    def close(self) -> None:
        for m in self.memory:
            m.close()


def sglang_rank(layers: tuple[int, int], heads: int, total: int, mla: bool = False) -> RankKV:
    """SGLang's MHATokenToKVPool (or MLATokenToKVPool): a tensor per (layer, kind) in a
    buffer of its own, every K layer listed before any V."""
    kinds, unit = ((LATENT,), LATENT_DIM) if mla else ((K, V), HEAD_DIM)
    keys = [(layer, kind) for kind in kinds for layer in range(*layers)]
    page_bytes = PAGE_SIZE * heads * unit
    memory = [SharedMemory.create(NUM_PAGES * page_bytes, prefix=KV_POOL_PREFIX) for _ in keys]
    return RankKV(
        memory, [m.handle for m in memory],
        [KVRegion(buffer=i, offset=0, page_bytes=page_bytes, num_pages=NUM_PAGES, layer=layer, kind=kind) for i, (layer, kind) in enumerate(keys)],
        KVSpec(page_size=PAGE_SIZE, dtype="uint8", num_layers_total=LAYERS, layers=layers, mla=mla,
               heads=Heads(local=heads, total=total, bytes_per_token_head=unit)),
        lambda arrays: {key: a.reshape(NUM_PAGES, PAGE_SIZE, heads, unit) for key, a in zip(keys, arrays)},
    )


def vllm_rank(layers: tuple[int, int], heads: int, total: int, mla: bool = False) -> RankKV:
    """vLLM's CPU cache: one storage, a KV region per layer at its offset, head-major
    inside a block, K and V packed per token. The connector names the storage once per
    layer: the daemon maps it once."""
    assert not mla
    count, unit = layers[1] - layers[0], 2 * HEAD_DIM
    page_bytes = heads * PAGE_SIZE * unit
    memory = SharedMemory.create(count * NUM_PAGES * page_bytes, prefix=KV_POOL_PREFIX)

    def shape(arrays):
        storage = arrays[0].reshape(count, NUM_PAGES, heads, PAGE_SIZE, unit)
        return {(layer, KV): storage[i].transpose(0, 2, 1, 3) for i, layer in enumerate(range(*layers))}

    return RankKV(
        [memory], [memory.handle] * count,
        [KVRegion(buffer=i, offset=i * NUM_PAGES * page_bytes, page_bytes=page_bytes, num_pages=NUM_PAGES, layer=layer, kind=KV)
         for i, layer in enumerate(range(*layers))],
        KVSpec(page_size=PAGE_SIZE, dtype="uint8", num_layers_total=LAYERS, layers=layers,
               heads=Heads(local=heads, total=total, bytes_per_token_head=HEAD_DIM),
               page_order=PageOrder.HEAD_MAJOR, kv_packing=KVPacking.PACKED_PER_TOKEN),
        shape,
    )


LAYOUTS = {"sglang": sglang_rank, "vllm": vllm_rank}


def run_rank(endpoint: str, role: Role, rank: Rank, sizes: Rank, kv: tuple, steps: list, ready, results) -> None:
    """One engine rank in a process of its own: register its memory, wait for every rank
    to have registered (an engine's ranks are all up before it serves), then run
    ``steps``, each a tuple naming what to do:

    - ("announce", room); ("send", room, pages, tokens, aux, first_page, last): a chunk,
      once the decode asked for the room (the last chunk carries an aux record);
    - ("expect", room, pages, bootstrap, prefill_sizes);
    - ("wait", rooms): each room's final status (or "daemon_gone") goes in the report;
    - ("tell", what): the test hears ``what`` now; ("hang",): stay until killed;
    - ("reconnect",): the daemon went: connect again until it is back, register the
      same memory.

    At the end it reports every status, the decode's aux records and the time."""
    buffers, spec, regions = kv
    out, slots = {}, {}

    def connected() -> Client:
        client = Client(endpoint, timeout=30.0, engine_id=f"test-{role.value}", rank=rank, sizes=sizes, role=role, device="cpu")
        client.connect()
        client.register_kv(buffers, spec, regions)
        client.create_aux_buffer(SLOTS, PAYLOAD)
        return client

    client = connected()
    try:
        ready.wait(60)
        for step in steps:
            if step[0] == "announce":
                client.announce(step[1])
            elif step[0] == "send":
                room, pages, tokens, aux, first, last = step[1:]
                if first == 0:
                    _until_waiting(client, room)
                if last:
                    slots[room] = slot = client.alloc_slot()
                    client.aux.payload(slot)[:] = np.frombuffer(aux, np.uint8)
                    client.send(room, pages, num_tokens=tokens, slot=slot, aux_bytes=PAYLOAD, first_page=first, last=True)
                else:
                    client.send(room, pages, first_page=first, last=False)
            elif step[0] == "expect":
                room, pages, boot, prefill_sizes = step[1:]
                slots[room] = slot = client.alloc_slot()
                client.expect(room, boot, pages, slot, prefill_sizes=prefill_sizes)
            elif step[0] == "wait":
                for room in step[1]:
                    try:
                        status = client.wait(room, timeout=30.0)
                    except errors.DaemonGone:
                        out[room] = ("daemon_gone", "", "")
                        continue
                    out[room] = (status.state.value, status.code.value if status.code else "", status.reason)
                    if role is Role.DECODE and status.state is RoomState.SUCCESS:
                        out[room] += (client.aux.read(slots[room], room),)
            elif step[0] == "tell":
                results.send(step[1])
            elif step[0] == "hang":
                time.sleep(3600)
            elif step[0] == "reconnect":
                client.close()
                deadline = time.monotonic() + 60
                while True:
                    try:
                        client = connected()
                        break
                    except (errors.PdxferError, zmq.ZMQError):
                        if time.monotonic() > deadline:
                            raise
                        client.close()
                        time.sleep(0.2)
    except Exception as exc:  # reported, so the test says which rank failed and why
        out["error"] = repr(exc)
    finally:
        client.close()
    out["finished"] = time.monotonic()
    results.send(out)


def _until_waiting(client: Client, room: int) -> None:
    deadline = time.monotonic() + 30.0
    while client.poll(room).state is not RoomState.WAITING_FOR_INPUT:
        if time.monotonic() > deadline:
            raise TimeoutError(f"room {room} never waited for input")
        time.sleep(0.005)


class Ranks:
    """Every rank in a process of its own, all at once. Each reports on a pipe of its
    own: a rank killed while writing to a shared queue would leave its lock held."""

    def __init__(self, jobs: list[tuple]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready = ctx.Barrier(len(jobs))  # kept: the children open it as they start
        self.procs, self.pipes = {}, {}
        for job in jobs:
            key = (job[1].value, job[2].pp, job[2].tp)
            reader, writer = ctx.Pipe(duplex=False)
            self.procs[key] = ctx.Process(target=run_rank, args=(*job, self.ready, writer))
            self.pipes[reader] = key
        for p in self.procs.values():
            p.start()
        self.reports: dict = {}
        self.told: list = []

    def heard(self, timeout: float = 90) -> tuple:
        """The next thing a rank tells or reports: (rank key, what)."""
        while not self.told:
            ready = multiprocessing.connection.wait([r for r, key in self.pipes.items() if key not in self.reports], timeout)
            if not ready:
                pytest.fail(f"no rank said anything in {timeout}s; reports so far: {sorted(self.reports)}")
            for reader in ready:
                try:
                    what = reader.recv()
                except EOFError:  # killed, or it died: it has nothing more to say
                    self.reports[self.pipes[reader]] = {"error": "exited without a report"}
                    continue
                if isinstance(what, dict):
                    self.reports[self.pipes[reader]] = what
                self.told.append((self.pipes[reader], what))
        return self.told.pop(0)

    def kill(self, key: tuple) -> float:
        self.procs[key].kill()
        self.procs[key].join(10)
        return time.monotonic()

    def collect(self) -> dict:
        """Every rank's report (a killed one's says so)."""
        while len(self.reports) < len(self.procs):
            self.heard()
        for p in self.procs.values():
            p.join(10)
        return self.reports

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(10)


def run_ranks(jobs: list[tuple]) -> dict:
    ranks = Ranks(jobs)
    try:
        return ranks.collect()
    finally:
        ranks.close()


@dataclass
class Topology:
    prefill_tp: int
    decode_tp: int
    heads: int  # total KV heads (the latent's 1 for MLA)
    mla: bool = False
    prefill_pp: int = 1


CASES = {
    "tp2-tp1": Topology(2, 1, 4),
    "tp1-tp2": Topology(1, 2, 4),
    "tp4-tp2-gqa": Topology(4, 2, 2),
    "mla-tp4-tp2": Topology(4, 2, 1, mla=True),
    "pp2-pp1": Topology(1, 1, 4, prefill_pp=2),
    "tp2-tp2": Topology(2, 2, 4),
}
ROOMS = {  # room: (source pages, destination pages); the decode pages of one room are its own
    501: ([3, 4, 5, 6, 7], [20, 21, 2, 3, 11]),
    502: ([12, 1, 9], [8, 9, 10]),
}


def prefill_steps(rooms: dict, aux: Callable[[int], bytes], chunks: int = 1) -> list:
    """Announce every room, then send each (in ``chunks`` chunks) once the decode asked; wait."""
    steps = [("announce", room) for room in rooms]
    for room, (src, _) in rooms.items():
        bounds = np.linspace(0, len(src), chunks + 1).astype(int)
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            steps.append(("send", room, src[a:b], len(src) * PAGE_SIZE - 1, aux(room), int(a), i == chunks - 1))
    return steps + [("wait", list(rooms))]


def decode_steps(rooms: dict, boot: str, prefill_sizes: Rank) -> list:
    return [("expect", room, dst, boot, prefill_sizes) for room, (_, dst) in rooms.items()] + [("wait", list(rooms))]


def model_for(topo: Topology, kinds, unit: int, rng) -> dict:
    """Every room's KV, every global head of every (layer, kind): [page, token, head, unit]."""
    return {room: {(layer, kind): rng.integers(0, 256, (len(src), PAGE_SIZE, topo.heads, unit), dtype=np.uint8)
                   for layer in range(LAYERS) for kind in kinds}
            for room, (src, _) in ROOMS.items()}


def aux_payload(room: int, stage: int) -> bytes:
    """What every TP rank of a prefill stage has for a room (SGLang's ranks hold the same
    metadata); only the last stage's reaches the decode."""
    return np.random.default_rng(room * 10 + stage).integers(0, 256, PAYLOAD, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("case,layout,staging", [
    ("tp2-tp1", "sglang", True), ("tp2-tp1", "vllm", True), ("tp2-tp1", "vllm", False), ("tp1-tp2", "sglang", True), ("tp1-tp2", "vllm", True),
    ("tp1-tp2", "sglang", False),
    ("tp4-tp2-gqa", "sglang", True), ("mla-tp4-tp2", "sglang", True), ("pp2-pp1", "vllm", True), ("tp2-tp2", "sglang", True),
])
def test_a_room_moves_between_rank_sets_as_legs(daemons, case, layout, staging):
    """``staging`` false: daemons without a staging buffer (--staging-mib 0), so a slice
    of each page is written span by span; with one, this test's spans are all short
    enough to stage (core/staging.py): at the decode from prefill ranks holding fewer
    heads, at the prefill for decode ranks holding fewer."""
    topo = CASES[case]
    build = LAYOUTS[layout]
    unstaged = () if staging else ("--staging-mib", "0")
    prefill_daemon = daemons("prefill", *unstaged)
    decode_daemon = daemons("decode", "--expect-batch-ms", "10000", *unstaged)
    kinds, unit = ((LATENT,), LATENT_DIM) if topo.mla else (((K, V), HEAD_DIM) if layout == "sglang" else ((KV,), 2 * HEAD_DIM))
    rng = np.random.default_rng(27)
    model = model_for(topo, kinds, unit, rng)
    h_p = topo.heads if topo.mla else local_heads(topo.heads, topo.prefill_tp)
    h_d = topo.heads if topo.mla else local_heads(topo.heads, topo.decode_tp)
    stages = stage_layers(LAYERS, topo.prefill_pp)
    prefill_sizes = Rank(tp=topo.prefill_tp, pp=topo.prefill_pp)
    ranks, jobs = [], []
    try:
        for pp in range(topo.prefill_pp):
            for tp in range(topo.prefill_tp):
                kv = build(stages[pp], h_p, topo.heads, topo.mla)
                ranks.append(kv)
                h0 = 0 if topo.mla else first_head(topo.heads, topo.prefill_tp, tp)
                for (layer, kind), view in kv.views.items():
                    view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
                    for room, (src, _) in ROOMS.items():
                        view[src] = model[room][layer, kind][:, :, h0 : h0 + h_p]
                jobs.append((prefill_daemon.engine, Role.PREFILL, Rank(tp=tp, pp=pp), prefill_sizes, (kv.buffers, kv.spec, kv.regions),
                             prefill_steps(ROOMS, aux=lambda room, pp=pp: aux_payload(room, pp))))
        decode_ranks = []
        for tp in range(topo.decode_tp):
            kv = build((0, LAYERS), h_d, topo.heads, topo.mla)
            ranks.append(kv)
            for view in kv.views.values():
                view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
            want = [m.array.copy() for m in kv.memory]  # every byte the rooms do not write stays as it is
            h0 = 0 if topo.mla else first_head(topo.heads, topo.decode_tp, tp)
            for (layer, kind), view in kv.shape(want).items():
                for room, (_, dst) in ROOMS.items():
                    view[dst] = model[room][layer, kind][:, :, h0 : h0 + h_d]
            decode_ranks.append((kv, want))
            jobs.append((decode_daemon.engine, Role.DECODE, Rank(tp=tp), Rank(tp=topo.decode_tp), (kv.buffers, kv.spec, kv.regions),
                         decode_steps(ROOMS, prefill_daemon.bootstrap, prefill_sizes)))
        received_before = daemon_counters(decode_daemon.ready["admin"])["bytes_received"]
        moved_before = daemon_counters(prefill_daemon.ready["admin"])["bytes_moved"]

        reports = run_ranks(jobs)

        for key, out in sorted(reports.items()):
            assert "error" not in out, f"{key}: {out['error']}"
            for room in ROOMS:
                assert out[room][0] == "success", f"{key} room {room}: {out[room]}"
        for tp, (kv, want) in enumerate(decode_ranks):
            for room in ROOMS:
                assert reports["decode", 0, tp][room][3] == aux_payload(room, topo.prefill_pp - 1), f"decode rank {tp} room {room}: aux record"
            for i, (got, expect) in enumerate(zip(kv.memory, want)):
                assert np.array_equal(got.array, expect), f"decode rank {tp} buffer {i}: bytes {np.flatnonzero(got.array != expect)[:8]} differ"

        decode_counters = daemon_counters(decode_daemon.ready["admin"])
        prefill_counters = daemon_counters(prefill_daemon.ready["admin"])
        # One daemon per node served every rank: a lane each.
        assert prefill_counters["lanes"] == topo.prefill_tp * topo.prefill_pp
        assert decode_counters["lanes"] == topo.decode_tp
        # A5: the decode ranks' expects of a room left as one request, answered once.
        assert prefill_counters["peer_messages_in:room_request"] == len(ROOMS)
        assert decode_counters["peer_messages_in:room_accepted"] == len(ROOMS)
        # Each decode rank received its pages' worth of its own heads in every layer, once
        # (MLA: one latent copy per decode rank, not one per prefill rank), and one aux record.
        page_bytes = sum(r.page_bytes for r in decode_ranks[0][0].regions)
        pages = sum(len(dst) for _, dst in ROOMS.values())
        assert decode_counters["bytes_received"] - received_before == topo.decode_tp * (pages * page_bytes + len(ROOMS) * (HEADER_BYTES + PAYLOAD))
        # ... and that is what the transfer engine moved (aux records travel on the bootstrap channel here).
        assert prefill_counters["bytes_moved"] - moved_before == topo.decode_tp * pages * page_bytes
        # A leg from a prefill rank holding fewer heads than its decode rank landed through the decode's staging
        # buffer; one for a decode rank holding fewer was gathered into the prefill's (one chunk a leg here).
        staged = staging and not topo.mla
        assert decode_counters["legs_staged"] == (len(ROOMS) * topo.decode_tp * (h_d // h_p) if staged and h_p < h_d else 0)
        assert prefill_counters["chunks_gathered"] == (len(ROOMS) * topo.decode_tp if staged and h_p > h_d else 0)
        assert decode_counters["staging_taken_bytes"] == prefill_counters["staging_taken_bytes"] == 0  # every extent came back
    finally:
        for kv in ranks:
            kv.close()



def equal_tp_ranks(daemons_pair, rooms: dict, tp: int = 2, layout: str = "sglang"):
    """``tp`` prefill and ``tp`` decode ranks (4 heads) with the rooms' source pages
    filled; returns (prefill KVs, decode KVs, the expected decode buffers)."""
    rng = np.random.default_rng(61)
    heads = local_heads(4, tp)
    prefill, decode, want = [], [], []
    for _ in range(tp):
        kv = LAYOUTS[layout]((0, LAYERS), heads, 4)
        for view in kv.views.values():
            view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
        prefill.append(kv)
    for t in range(tp):
        kv = LAYOUTS[layout]((0, LAYERS), heads, 4)
        for view in kv.views.values():
            view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
        expected = [m.array.copy() for m in kv.memory]
        for key, view in kv.shape(expected).items():
            for src, dst in rooms.values():
                view[dst] = prefill[t].views[key][src]
        decode.append(kv)
        want.append(expected)
    return prefill, decode, want


def test_a_killed_rank_fails_only_its_own_rooms(daemons):
    """TP2 -> TP2: prefill rank 1 hands over the first chunk of each room and is killed
    (SIGKILL). Its daemon sees the process go and fails its rooms at once, naming it;
    the decode rank it wrote to hears so, with its pages held until nothing of the dead
    rank can land (fenced). Rank 0's rooms, on both sides, succeed byte for byte."""
    prefill_daemon, decode_daemon = daemons("prefill"), daemons("decode", "--expect-batch-ms", "10000")
    rooms = {601: ([1, 2, 3, 4], [5, 6, 7, 8]), 602: ([9, 10, 11, 12, 13, 14], [0, 1, 2, 3, 4, 9])}
    prefill, decode, want = equal_tp_ranks(daemons, rooms)
    sizes = Rank(tp=2)
    aux = lambda room: aux_payload(room, 0)  # noqa: E731
    doomed = [("announce", room) for room in rooms] + [
        ("send", room, src[:2], len(src) * PAGE_SIZE - 1, aux(room), 0, False) for room, (src, _) in rooms.items()
    ] + [("tell", "chunked"), ("hang",)]
    jobs = [
        (prefill_daemon.engine, Role.PREFILL, Rank(tp=0), sizes, _kv(prefill[0]), prefill_steps(rooms, aux, chunks=2)),
        (prefill_daemon.engine, Role.PREFILL, Rank(tp=1), sizes, _kv(prefill[1]), doomed),
    ] + [(decode_daemon.engine, Role.DECODE, Rank(tp=t), sizes, _kv(decode[t]), decode_steps(rooms, prefill_daemon.bootstrap, sizes))
         for t in range(2)]
    ranks = Ranks(jobs)
    try:
        while ranks.heard() != (("prefill", 0, 1), "chunked"):
            pass
        killed = ranks.kill(("prefill", 0, 1))
        reports = ranks.collect()
        _check_killed_rank(rooms, reports, killed, decode, want, prefill_daemon)
    finally:
        ranks.close()
        for kv in prefill + decode:
            kv.close()


def _check_killed_rank(rooms, reports, killed, decode, want, prefill_daemon) -> None:
    for key in (("prefill", 0, 0), ("decode", 0, 0)):
        assert "error" not in reports[key], reports[key]
        assert {room: reports[key][room][0] for room in rooms} == {room: "success" for room in rooms}, reports[key]
    for i, (got, expect) in enumerate(zip(decode[0].memory, want[0])):
        assert np.array_equal(got.array, expect), f"decode rank 0 buffer {i} differs"
    lost = reports["decode", 0, 1]
    for room in rooms:
        state, code, reason = lost[room][:3]
        assert (state, code) == ("failed", "engine_gone"), lost[room]
        assert "exited" in reason and "pp=0 tp=1" in reason, reason
    # At once, not at a timeout: the decode rank's waits ended (fenced) seconds after the kill.
    assert lost["finished"] - killed < 10, lost["finished"] - killed
    counters = daemon_counters(prefill_daemon.ready["admin"])
    assert counters["rooms_succeeded"] == len(rooms) and counters["rooms_failed"] == len(rooms)


def _kv(kv: RankKV) -> tuple:
    return kv.buffers, kv.spec, kv.regions


def test_a_daemon_restarted_under_load_is_found_again_by_every_rank(daemons):
    """TP2 -> TP1. The prefill daemon is killed while both its ranks' rooms are half
    handed over, and started again at the same address. Both ranks hear DaemonGone,
    connect again and register the same memory; the decode's rooms of the lost daemon
    fail and are fenced, their pages go to new rooms, and those succeed byte for byte."""
    port = free_port()
    prefill_daemon = daemons("prefill", "--bootstrap-port", str(port), name="p")
    decode_daemon = daemons("decode", "--expect-batch-ms", "10000")
    first = {701: ([1, 2, 3], [4, 5, 6]), 702: ([7, 8], [7, 8])}
    lost = {711: ([10, 11, 12, 13], [12, 13, 14, 15]), 712: ([14, 15, 16], [16, 17, 18])}
    again = {721: ([17, 18, 19, 20], [12, 13, 14, 15]), 722: ([0, 21, 22], [16, 17, 18])}  # the lost rooms' pages, once fenced
    rng = np.random.default_rng(71)
    prefill = [sglang_rank((0, LAYERS), 2, 4) for _ in range(2)]
    decode = sglang_rank((0, LAYERS), 4, 4)
    try:
        for kv in (*prefill, decode):
            for view in kv.views.values():
                view[...] = rng.integers(0, 256, view.shape, dtype=np.uint8)
        want = [m.array.copy() for m in decode.memory]
        for key, view in decode.shape(want).items():
            for src, dst in (*first.values(), *again.values()):
                view[dst] = np.concatenate([prefill[0].views[key][src], prefill[1].views[key][src]], axis=2)
        sizes, aux = Rank(tp=2), (lambda room: aux_payload(room, 0))
        half = [("announce", room) for room in lost] + [
            ("send", room, src[:2], len(src) * PAGE_SIZE - 1, aux(room), 0, False) for room, (src, _) in lost.items()]
        prefill_script = prefill_steps(first, aux) + half + [("tell", "half"), ("wait", list(lost)), ("reconnect",)] + prefill_steps(again, aux)
        decode_script = (decode_steps(first, prefill_daemon.bootstrap, sizes) + decode_steps(lost, prefill_daemon.bootstrap, sizes)
                         + decode_steps(again, prefill_daemon.bootstrap, sizes))
        jobs = [(prefill_daemon.engine, Role.PREFILL, Rank(tp=t), sizes, _kv(prefill[t]), prefill_script) for t in range(2)]
        jobs.append((decode_daemon.engine, Role.DECODE, Rank(), Rank(), _kv(decode), decode_script))
        ranks = Ranks(jobs)
        try:
            halves = 0
            while halves < 2:
                halves += ranks.heard()[1] == "half"
            kill(prefill_daemon)
            prefill_daemon.proc.wait(10)
            daemons("prefill", "--bootstrap-port", str(port), name="p")
            reports = ranks.collect()
        finally:
            ranks.close()
        assert not [(key, out["error"]) for key, out in reports.items() if "error" in out]
        for key, out in sorted(reports.items()):
            assert [out[room][0] for room in (*first, *again)] == ["success"] * 4, f"{key}: {out}"
        for t in range(2):
            assert [reports["prefill", 0, t][room][0] for room in lost] == ["daemon_gone"] * 2
        for room in lost:
            state, code, reason = reports["decode", 0, 0][room][:3]
            assert (state, code) == ("failed", "peer_dead"), reports["decode", 0, 0][room]
        for i, (got, expect) in enumerate(zip(decode.memory, want)):
            assert np.array_equal(got.array, expect), f"decode buffer {i}: bytes {np.flatnonzero(got.array != expect)[:8]} differ"
    finally:
        for kv in (*prefill, decode):
            kv.close()
