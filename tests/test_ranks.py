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
import queue as queues
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from pdxfer import Client, Heads, KVPacking, KVRegion, KVSpec, PageOrder, Rank, RegionKind, Role, RoomState
from pdxfer.core.stamp import HEADER_BYTES
from pdxfer.core.topology import first_head, local_heads, stage_layers
from pdxfer.host.memory import KV_POOL_PREFIX, SharedMemory
from pdxfer.ops.inspection import daemon_counters

from .conftest import needs_mooncake

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


def run_rank(endpoint: str, role: Role, rank: Rank, sizes: Rank, kv: tuple, script: list, ready, results) -> None:
    """One engine rank in a process of its own: register its memory and wait for every
    rank to have registered (as an engine's ranks are all up before it serves), then
    (prefill) announce each room and send it once the decode asked, or (decode) expect
    each room; report every room's final status, and on the decode the aux record it read."""
    buffers, spec, regions = kv
    client = Client(endpoint, timeout=30.0, engine_id=f"test-{role.value}", rank=rank, sizes=sizes, role=role, device="cpu")
    out = {}
    try:
        client.connect()
        client.register_kv(buffers, spec, regions)
        client.create_aux_buffer(SLOTS, PAYLOAD)
        ready.wait(60)
        slots = {}
        if role is Role.PREFILL:
            for room, *_ in script:
                client.announce(room)
            for room, pages, tokens, aux in script:
                _until_waiting(client, room)
                slots[room] = slot = client.alloc_slot()
                client.aux.payload(slot)[:] = np.frombuffer(aux, np.uint8)
                client.send(room, pages, num_tokens=tokens, slot=slot, aux_bytes=PAYLOAD)
        else:
            for room, pages, boot, prefill_sizes in script:
                slots[room] = slot = client.alloc_slot()
                client.expect(room, boot, pages, slot, prefill_sizes=prefill_sizes)
        for room, *_ in script:
            status = client.wait(room, timeout=30.0)
            out[room] = (status.state.value, status.code.value if status.code else "", status.reason)
            if role is Role.DECODE and status.state is RoomState.SUCCESS:
                out[room] += (client.aux.read(slots[room], room),)
    except Exception as exc:  # reported, so the test says which rank failed and why
        out["error"] = repr(exc)
    finally:
        client.close()
    results.put(((role.value, rank.pp, rank.tp), out))


def _until_waiting(client: Client, room: int) -> None:
    deadline = time.monotonic() + 30.0
    while client.poll(room).state is not RoomState.WAITING_FOR_INPUT:
        if time.monotonic() > deadline:
            raise TimeoutError(f"room {room} never waited for input")
        time.sleep(0.005)


def run_ranks(jobs: list[tuple]) -> dict:
    """Every rank in a process of its own, all at once; their reports by (role, pp, tp)."""
    ctx = multiprocessing.get_context("spawn")
    results, ready = ctx.Queue(), ctx.Barrier(len(jobs))
    procs = [ctx.Process(target=run_rank, args=(*job, ready, results)) for job in jobs]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in procs:
            key, out = results.get(timeout=120)
            reports[key] = out
    except queues.Empty:
        pytest.fail(f"ranks that never reported: {[job[2] for job in jobs if (job[1].value, job[2].pp, job[2].tp) not in reports]}")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return reports


@dataclass
class Topology:
    prefill_tp: int
    decode_tp: int
    heads: int  # total KV heads (the latent's 1 for MLA)
    mla: bool = False
    prefill_pp: int = 1


CASES = {
    "tp2-tp1": Topology(2, 1, 4),
    "tp4-tp2-gqa": Topology(4, 2, 2),
    "mla-tp4-tp2": Topology(4, 2, 1, mla=True),
    "pp2-pp1": Topology(1, 1, 4, prefill_pp=2),
    "tp2-tp2": Topology(2, 2, 4),
}
ROOMS = {  # room: (source pages, destination pages); the decode pages of one room are its own
    501: ([3, 4, 5, 6, 7], [20, 21, 2, 3, 11]),
    502: ([12, 1, 9], [8, 9, 10]),
}


def model_for(topo: Topology, kinds, unit: int, rng) -> dict:
    """Every room's KV, every global head of every (layer, kind): [page, token, head, unit]."""
    return {room: {(layer, kind): rng.integers(0, 256, (len(src), PAGE_SIZE, topo.heads, unit), dtype=np.uint8)
                   for layer in range(LAYERS) for kind in kinds}
            for room, (src, _) in ROOMS.items()}


def aux_payload(room: int, stage: int) -> bytes:
    """What every TP rank of a prefill stage has for a room (SGLang's ranks hold the same
    metadata); only the last stage's reaches the decode."""
    return np.random.default_rng(room * 10 + stage).integers(0, 256, PAYLOAD, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("case,layout", [
    ("tp2-tp1", "sglang"), ("tp2-tp1", "vllm"), ("tp4-tp2-gqa", "sglang"), ("mla-tp4-tp2", "sglang"),
    ("pp2-pp1", "vllm"), ("tp2-tp2", "sglang"),
])
def test_a_room_moves_between_rank_sets_as_legs(daemons, case, layout):
    topo = CASES[case]
    build = LAYOUTS[layout]
    prefill_daemon = daemons("prefill")
    decode_daemon = daemons("decode", "--expect-batch-ms", "10000")
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
                script = [(room, src, len(src) * PAGE_SIZE - 1, aux_payload(room, pp)) for room, (src, _) in ROOMS.items()]
                jobs.append((prefill_daemon.engine, Role.PREFILL, Rank(tp=tp, pp=pp), prefill_sizes, (kv.buffers, kv.spec, kv.regions), script))
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
            script = [(room, dst, prefill_daemon.bootstrap, prefill_sizes) for room, (_, dst) in ROOMS.items()]
            jobs.append((decode_daemon.engine, Role.DECODE, Rank(tp=tp), Rank(tp=topo.decode_tp), (kv.buffers, kv.spec, kv.regions), script))
        received_before = daemon_counters(decode_daemon.ready["admin"])["bytes_received"]

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
    finally:
        for kv in ranks:
            kv.close()

