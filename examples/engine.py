"""An engine beside a pdxfer daemon: the prefill side ships one request's KV pages and
aux record, the decode side receives and checks them. Usage:

    python examples/engine.py prefill ROOM
    python examples/engine.py decode ROOM PREFILL_BOOTSTRAP

ROOM, the room id, names one request's transfer: a number from 1 to 2**64 - 1 that the
router draws for the request and gives to both its prefill and its decode engine (as
SGLang's router does with `bootstrap_room`). The same id on both sides is what pairs
them; a daemon refuses a second live room with an id it holds (`duplicate_room`) until
the first is released. PREFILL_BOOTSTRAP is the prefill daemon's `bootstrap` address
(`host:port`, printed in its ready line), which the router also passes to the decode.

Pages and tokens: the KV pool is `num_pages` pages of `page_size` tokens each, every
page holding those tokens' K and V for every layer. The prefill names the pages that
hold the prompt's `num_tokens` tokens, in token order: exactly ceil(num_tokens /
page_size) of them. The decode names the pages it set aside for the request, enough
for the prompt plus the draft tokens of speculative decoding: at least
ceil((num_tokens + num_draft_tokens) / page_size). The i-th prefill page lands in the
i-th decode page. Each list names pages of its own pool (0 to num_pages - 1), so the
two need not hold the same numbers.

Shared memory (/dev/shm), per engine: the KV pool is 32 layers x K and V x 64 pages x
16 tokens x 2048 bytes = 128 MiB; the aux buffer 256 slots x (a 32-byte stamp + 4096
bytes of payload) = 1.0 MiB.
"""

import sys

import numpy as np

from pdxfer import Client, KVLayout, Layout
from pdxfer.core import config

layout = KVLayout(layout=Layout.MHA, num_layers=32, num_pages=64, page_size=16,
                  token_bytes=8 * 128 * 2, dtype="bfloat16")   # kv heads x head dim x bytes
AUX_SLOTS, AUX_PAYLOAD_BYTES = 256, 4096          # one slot per request in flight
num_tokens = 40                                   # the prompt: 3 pages of 16 tokens
metadata = b"first token 1734"                    # first token, logprobs, ...


def daemon_endpoint(role: str) -> str:
    """The engine endpoint of the daemon beside this engine, found as that daemon finds
    it: PDXFER_ENGINE_ENDPOINT, or NAME.engine.sock (PDXFER_NAME, else the role) in
    PDXFER_RUNTIME_DIR, else $XDG_RUNTIME_DIR/pdxfer, else /tmp/pdxfer-<this user's id>."""
    return config.load({"role": role}).engine_address


def prefill(room: int) -> bool:
    with Client(daemon_endpoint("prefill")) as client:
        kv = client.create_kv_pool(layout)            # shared memory; kv.tensors() are the K/V buffers
        aux = client.create_aux_buffer(num_slots=AUX_SLOTS, payload_bytes=AUX_PAYLOAD_BYTES)
        pages = [0, 1, 2]                             # where the forward pass put the prompt's KV
        for buffer in kv.tensors():
            buffer[pages] = 0.5                       # stands in for the forward pass
        slot = client.alloc_slot()                    # (index, generation), handed out by the daemon
        aux.payload(slot)[: len(metadata)] = np.frombuffer(metadata, np.uint8)  # the payload is a uint8 array
        client.send(room, pages, num_tokens, slot, aux_bytes=len(metadata))
        status = client.wait(room)                    # Success, or Failed once fenced
        client.release(room)                          # now the pages and the slot may be reused
    print(f"prefill room {room}: {status.state.value} {status.reason}".rstrip())
    return status.state.value == "success"


def decode(room: int, bootstrap: str) -> bool:
    with Client(daemon_endpoint("decode")) as client:
        kv = client.create_kv_pool(layout)
        aux = client.create_aux_buffer(num_slots=AUX_SLOTS, payload_bytes=AUX_PAYLOAD_BYTES)
        pages = [7, 8, 9]                             # room for 40 prompt + 4 draft tokens: 3 pages of 16
        slot = client.alloc_slot()
        client.expect(room, bootstrap, pages, slot, num_draft_tokens=4)
        status = client.wait(room)
        received = status.state.value == "success"
        if received:
            assert aux.read(slot, room) == metadata   # checked against the room's stamp as it is read
            assert all(bool((buffer[pages] == 0.5).all()) for buffer in kv.tensors())  # the prompt's KV
        client.release(room)                          # pages and slot may be reused
    print(f"decode room {room}: {status.state.value} {status.reason}".rstrip())
    return received


if __name__ == "__main__":
    role, room, *bootstrap = sys.argv[1:]
    ok = prefill(int(room)) if role == "prefill" else decode(int(room), *bootstrap)
    sys.exit(0 if ok else 1)
