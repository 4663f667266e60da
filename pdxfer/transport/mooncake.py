"""The Mooncake transfer engine as a Transport.

Writes are submitted one block at a time with ``transfer_submit_write`` and finished
with ``transfer_check_status``: both return at once, whereas the engine's batch and
synchronous calls spin a core until the whole batch is done (and
``transfer_check_status`` only looks at the first block of a multi-block batch).
The engine is imported here only, so the rest of pdxfer runs without it.
"""

from __future__ import annotations

from ..errors import Unsupported
from ..paths import ENGINE_PROTOCOL
from . import Status

# transfer_check_status: 1 completed, 0 pending, -1 failed, -2 timed out.
_STATUS = {1: Status.DONE, 0: Status.PENDING, -1: Status.FAILED, -2: Status.FAILED}


def load_engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise Unsupported(
            "the Mooncake transfer engine is not importable "
            f"({exc}); install mooncake-transfer-engine-non-cuda (CPU hosts, needs "
            "libibverbs1 and libnuma1) or mooncake-transfer-engine (CUDA hosts)"
        ) from None
    return TransferEngine


class MooncakeTransport:
    def __init__(self, host: str, protocol: str = "tcp", devices: str = "", metadata: str = "P2PHANDSHAKE") -> None:
        self.host = host
        self.protocol = protocol
        self.devices = devices
        self.metadata = metadata
        self._engine = None

    def start(self) -> str:
        engine = load_engine_class()()
        rc = engine.initialize(self.host, self.metadata, ENGINE_PROTOCOL[self.protocol], self.devices)
        if rc != 0:
            raise Unsupported(
                f"transfer engine failed to initialise protocol {self.protocol} on {self.host} (code {rc}); "
                "see the engine's log lines above"
            )
        self._engine = engine
        return f"{self.host}:{engine.get_rpc_port()}"

    def register(self, address: int, length: int) -> None:
        rc = self._engine.register_memory(address, length)
        if rc != 0:
            raise Unsupported(f"transfer engine refused to register {length} bytes at {address:#x} (code {rc})")

    def unregister(self, address: int) -> None:
        self._engine.unregister_memory(address)

    def submit(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> list[int]:
        write = self._engine.transfer_submit_write
        return [write(peer, s, d, n) for s, d, n in zip(src, dst, length)]

    def poll(self, handle: int) -> Status:
        return _STATUS.get(self._engine.transfer_check_status(handle), Status.FAILED)

    def close(self) -> None:
        self._engine = None
