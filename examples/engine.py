"""An engine with tensor parallelism beside the pdxfer daemon of its node: each TP rank is
a process of its own that allocates its KV cache, registers that memory with the daemon
(one daemon serves every rank), and takes part in moving one request's KV cache and aux
record from the prefill engine to the decode engine. Usage:

    python examples/engine.py prefill ROOM [--tp 2]
    python examples/engine.py decode ROOM PREFILL_BOOTSTRAP [--tp 1] [--prefill-tp 2]

ROOM, the room id, names one request's transfer: a number from 1 to 2**64 - 1 that the
router draws for the request and gives to both its prefill and its decode engine (as
SGLang's router does with `bootstrap_room`). The same id on both sides is what pairs
them; a daemon refuses a second live room with an id it holds (`duplicate_room`) until
the first is released. PREFILL_BOOTSTRAP is the prefill daemon's `bootstrap` address
(`host:port`, printed in its ready line), which the router also passes to the decode,
and --prefill-tp the prefill engine's TP size. TP sizes where one divides the other
work: 2 -> 1 (a decode rank gathers the heads of two prefill ranks), 1 -> 2, 2 -> 2, ...

The model has 4 layers of 8 KV heads of 128 float32 values per token. TP rank r of T
holds heads r*8//T onwards, max(1, 8//T) of them. Its KV cache is laid out as SGLang's:
per layer a K and a V tensor [tokens, heads, head_dim], each in shared memory of its
own (the standard library's), token t of page p at row p * 16 + t.

Pages and tokens: a page is 16 tokens of every layer's K and V. The prefill names the
pages that hold the prompt's 40 tokens, in token order: exactly ceil(40 / 16) of them.
The decode names the pages it set aside, enough for the prompt plus the draft tokens of
speculative decoding: at least ceil((40 + 4) / 16). The i-th prefill page lands in the
i-th decode page; each list names pages of its own cache (0 to 63). Every rank of an
engine names the same pages, as SGLang's ranks do.

Shared memory (/dev/shm), per rank: the KV cache is 4 layers x K and V x 64 pages x 16
tokens x 8/TP heads x 512 bytes = 32 MiB / TP; the aux buffer 256 slots x (a 32-byte
stamp + 4096 bytes of payload) = 1.0 MiB.
"""

import argparse
import contextlib
import multiprocessing
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from pdxfer import Client, Heads, KVRegion, KVSpec, Rank, RegionKind, Role, RoomState, ShmHandle, errors
from pdxfer.core import config

LAYERS, HEADS, HEAD_DIM, PAGE_SIZE, NUM_PAGES = 4, 8, 128, 16, 64
AUX_SLOTS, AUX_PAYLOAD_BYTES = 256, 4096          # one slot per request in flight
NUM_TOKENS, DRAFT_TOKENS = 40, 4                  # the prompt: 3 pages of 16 tokens
METADATA = b"first token 1734"                    # first token, logprobs, ...
KINDS = (RegionKind.K, RegionKind.V)


def rank_heads(rank: int, tp: int) -> range:
    """The global KV heads TP rank ``rank`` of ``tp`` holds (replicated when fewer than ranks)."""
    first = rank * HEADS // tp
    return range(first, first + max(1, HEADS // tp))


@contextlib.contextmanager
def kv_cache(heads: int):
    """This rank's KV cache, (layer, kind) -> shared memory; closed and removed at the end
    (the daemon keeps its own mapping until the rank registers other memory)."""
    nbytes = NUM_PAGES * PAGE_SIZE * heads * HEAD_DIM * 4
    memory = {(layer, kind): SharedMemory(create=True, size=nbytes) for layer in range(LAYERS) for kind in KINDS}
    try:
        yield memory
    finally:
        for m in memory.values():
            m.close()
            m.unlink()


def tensor(m: SharedMemory, heads: int) -> np.ndarray:
    return np.ndarray((NUM_PAGES * PAGE_SIZE, heads, HEAD_DIM), np.float32, m.buf)


def token_rows(pages: list[int]) -> np.ndarray:
    """The rows of the prompt's tokens (SGLang's out_cache_loc)."""
    t = np.arange(NUM_TOKENS)
    return np.asarray(pages)[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE


def kv_values(layer: int, kind: RegionKind, heads: range) -> np.ndarray:
    """What the forward pass writes, [token, head, 1]: the number LKTTTHH (layer, K 0 or
    V 1, token, global head), so every value says where it belongs."""
    t, h = np.arange(NUM_TOKENS)[:, None, None], np.array(heads)[None, :, None]
    return (layer * 10**6 + KINDS.index(kind) * 10**5 + t * 100 + h).astype(np.float32)


def connect(role: Role, rank: int, tp: int, memory: dict, heads: int) -> Client:
    """This rank's client, its KV cache registered where it is: a buffer and a region per (layer, kind)."""
    endpoint = config.load({"role": role.value}).engine_address   # the daemon's default socket, as it finds it
    client = Client(endpoint, engine_id=f"example-{role.value}", rank=Rank(tp=rank), sizes=Rank(tp=tp), role=role, device="cpu")
    client.connect()
    page_bytes = PAGE_SIZE * heads * HEAD_DIM * 4
    client.register_kv(
        [ShmHandle(name=m.name, size=m.size) for m in memory.values()],
        KVSpec(page_size=PAGE_SIZE, dtype="float32", num_layers_total=LAYERS, layers=(0, LAYERS),
               heads=Heads(local=heads, total=HEADS, bytes_per_token_head=HEAD_DIM * 4)),
        [KVRegion(buffer=i, offset=0, page_bytes=page_bytes, num_pages=NUM_PAGES, layer=layer, kind=kind)
         for i, (layer, kind) in enumerate(memory)],
    )
    return client


def prefill(room: int, rank: int, tp: int, ranks_up) -> str:
    heads = rank_heads(rank, tp)
    with kv_cache(len(heads)) as memory, contextlib.closing(connect(Role.PREFILL, rank, tp, memory, len(heads))) as client:
        aux = client.create_aux_buffer(AUX_SLOTS, AUX_PAYLOAD_BYTES)
        ranks_up.wait(60)                         # the engine serves once all its ranks are up
        client.announce(room)                     # waiting_for_input once the decode set pages aside
        while (status := client.poll(room)).state is RoomState.BOOTSTRAPPING:
            time.sleep(0.01)
        if status.state is RoomState.WAITING_FOR_INPUT:  # else it failed already: nothing to send
            pages = [0, 1, 2]                     # where the forward pass puts the prompt's KV
            for (layer, kind), m in memory.items():  # stands in for the forward pass
                tensor(m, len(heads))[token_rows(pages)] = kv_values(layer, kind, heads)
            slot = client.alloc_slot()            # (index, generation), handed out by the daemon
            aux.payload(slot)[: len(METADATA)] = np.frombuffer(METADATA, np.uint8)
            try:
                client.send(room, pages[:2], first_page=0, last=False)  # a chunk, written at once
                client.send(room, pages[2:], NUM_TOKENS, slot, aux_bytes=len(METADATA), first_page=2)
            except errors.PdxferError:            # the room failed meanwhile: wait() says why
                pass
        status = client.wait(room)                # Success, or Failed once fenced
        client.release(room)                      # now the pages and the slot may be reused
    return f"{status.state.value} {status.reason}".rstrip()


def decode(room: int, bootstrap: str, prefill_tp: int, rank: int, tp: int, ranks_up) -> str:
    heads = rank_heads(rank, tp)
    with kv_cache(len(heads)) as memory, contextlib.closing(connect(Role.DECODE, rank, tp, memory, len(heads))) as client:
        aux = client.create_aux_buffer(AUX_SLOTS, AUX_PAYLOAD_BYTES)
        ranks_up.wait(60)                         # every rank expects the room: one request for them all
        pages = [7, 8, 9]                         # room for 40 prompt + 4 draft tokens: 3 pages of 16
        slot = client.alloc_slot()
        client.expect(room, bootstrap, pages, slot, DRAFT_TOKENS, prefill_sizes=Rank(tp=prefill_tp))
        status = client.wait(room)
        outcome = f"{status.state.value} {status.reason}".rstrip()
        if status.state is RoomState.SUCCESS:
            assert aux.read(slot, room) == METADATA   # checked against the room's stamp as it is read
            wrong = [f"layer {layer} {kind.value}" for (layer, kind), m in memory.items()
                     if not (tensor(m, len(heads))[token_rows(pages)] == kv_values(layer, kind, heads)).all()]
            assert not wrong, f"wrong KV in {wrong}"
            outcome += f"; heads {heads.start}-{heads.stop - 1} of every layer and the aux record as the prefill wrote them"
        client.release(room)                      # pages and slot may be reused
    return outcome


def run_rank(args, rank: int, tp: int, ranks_up) -> None:
    if args.role == "prefill":
        outcome = prefill(args.room, rank, tp, ranks_up)
    else:
        outcome = decode(args.room, args.bootstrap, args.prefill_tp, rank, tp, ranks_up)
    print(f"{args.role} rank {rank} of {tp}, room {args.room}: {outcome}\n", end="", flush=True)  # one write: ranks share stdout
    raise SystemExit(0 if outcome.startswith("success") else 1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one TP engine of either role (see the file's docstring)")
    parser.add_argument("role", choices=("prefill", "decode"))
    parser.add_argument("room", type=int)
    parser.add_argument("bootstrap", nargs="?", help="decode: the prefill daemon's bootstrap address")
    parser.add_argument("--tp", type=int, help="this engine's TP size (prefill 2, decode 1)")
    parser.add_argument("--prefill-tp", type=int, default=2, help="decode: the prefill engine's TP size")
    args = parser.parse_args()
    if args.role == "decode" and not args.bootstrap:
        parser.error("decode needs PREFILL_BOOTSTRAP")
    tp = args.tp or (2 if args.role == "prefill" else 1)
    spawn = multiprocessing.get_context("spawn")
    ranks_up = spawn.Barrier(tp)
    ranks = [spawn.Process(target=run_rank, args=(args, rank, tp, ranks_up)) for rank in range(tp)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    raise SystemExit(0 if all(p.exitcode == 0 for p in ranks) else 1)
