"""An engine beside a pdxfer daemon: the prefill side ships one request's KV pages and
aux record, the decode side receives and checks them. Usage (ROOM: the same number on
both sides, as a router would give it):

    python examples/engine.py prefill ENGINE_ENDPOINT ROOM
    python examples/engine.py decode ENGINE_ENDPOINT ROOM PREFILL_BOOTSTRAP
"""

import sys

import numpy as np

from pdxfer import Client, KVLayout, Layout

layout = KVLayout(layout=Layout.MHA, num_layers=32, num_pages=64, page_size=16,
                  token_bytes=8 * 128 * 2, dtype="bfloat16")   # kv heads x head dim x bytes
num_tokens = 40                                   # the prompt
metadata = b"first token 1734"                    # first token, logprobs, ...


def prefill(endpoint: str, room: int) -> bool:
    with Client(endpoint) as client:
        kv = client.create_kv_pool(layout)            # shared memory; kv.tensors() are the K/V buffers
        aux = client.create_aux_buffer(num_slots=256, payload_bytes=4096)
        pages = [0, 1, 2]                             # 40 tokens in pages of 16
        for buffer in kv.tensors():
            buffer[pages] = 0.5                       # stands in for the forward pass
        slot = client.alloc_slot()                    # (index, generation), handed out by the daemon
        aux.payload(slot)[: len(metadata)] = np.frombuffer(metadata, np.uint8)
        client.send(room, pages, num_tokens, slot, aux_bytes=len(metadata))
        status = client.wait(room)                    # Success, or Failed once fenced
        client.release(room)                          # now the pages may be reused
    print(f"prefill room {room}: {status.state.value} {status.reason}".rstrip())
    return status.state.value == "success"


def decode(endpoint: str, room: int, bootstrap: str) -> bool:
    with Client(endpoint) as client:
        kv = client.create_kv_pool(layout)
        aux = client.create_aux_buffer(num_slots=256, payload_bytes=4096)
        pages = [7, 8, 9]                             # room for the prompt plus 4 draft tokens
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
    role, endpoint, room, *bootstrap = sys.argv[1:]
    ok = prefill(endpoint, int(room)) if role == "prefill" else decode(endpoint, int(room), *bootstrap)
    sys.exit(0 if ok else 1)
