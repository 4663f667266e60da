"""What both roles' ports do in a daemon (roles/ports.py): a role's effects become
posts on the daemon's engine endpoint, memory mapped and registered with its transport,
engine processes watched, timers on its loop. Each role's side (prefill_side.py,
decode_side.py) adds its own. A port reaches the daemon only through the daemon's
public ``EngineHost`` methods."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Protocol

from ..core.protocol import MemoryHandle, Message, RoomState, ShmHandle
from ..core.rooms import Room
from ..host import memory
from ..roles.ports import Mapping


class EngineHost(Protocol):
    """What a daemon offers its ports."""

    def post_engine(self, identity: bytes, message: Message) -> None: ...

    async def register_memory(self, address: int, size: int) -> None:
        """Register [address, +size) with the transport, off the loop."""

    def unregister_memory(self, address: int) -> Awaitable[None]: ...

    def watch_engine(self, identity: bytes, pid: int, pid_namespace: int) -> None: ...

    def oneshot(self, coro: Awaitable[None]) -> None:
        """Run a step in the background; its failure is logged and counted."""

    def sessions_changed(self, sessions: tuple[str, ...]) -> None:
        """The transfer engines' sessions are these now."""

    def resolve(self, name: str) -> str | None:
        """The bootstrap address the registry holds for a daemon's name; None without a registry."""

    def incarnation_of(self, name: str) -> str:
        """The incarnation the registry holds for a daemon's name ("" if none)."""


class DaemonPort:
    """roles.ports.Port in a daemon."""

    clock = staticmethod(time.monotonic)
    wall = staticmethod(time.time)
    same_memory = staticmethod(memory.same_memory)

    def __init__(self, host: EngineHost, observe: Callable[[Room, RoomState | None, float], None] | None,
                 staging: memory.SharedMemory | None = None) -> None:
        self._host = host
        self.observe = observe  # with debug logging, one that logs each transition; else None
        self._staging = staging
        self.send_engine: Callable[[bytes, Message], None] = host.post_engine  # every status of every room: no hop of our own

    async def map_memory(self, handle: MemoryHandle) -> Mapping:
        """Host memory is mapped off the event loop: populating a big pool takes seconds
        (0.28 s per 2 GiB here), longer than heartbeats may wait. Device handles open
        on the loop's thread, the one the device was made current on (D1). Memory is
        registered with the transport off the loop too."""
        if isinstance(handle, ShmHandle):
            mapped = await asyncio.get_running_loop().run_in_executor(None, memory.open_handle, handle)
        else:
            mapped = memory.open_handle(handle)
        try:
            await self._host.register_memory(mapped.address, handle.size)
        except BaseException:
            mapped.close()
            raise
        return mapped

    def release_mapping(self, mapping: Mapping) -> None:
        """Unregister a replaced engine buffer from the transport, then unmap it, in the background."""

        async def release() -> None:
            await self._host.unregister_memory(mapping.address)
            mapping.close()

        self._host.oneshot(release())

    def watch_engine(self, identity: bytes, pid: int, pid_namespace: int) -> None:
        self._host.watch_engine(identity, pid, pid_namespace)

    def back_staging(self, offset: int, nbytes: int) -> None:
        """Back [offset, +nbytes) of the staging buffer with pages (SharedMemory.reserve:
        InsufficientCapacity when /dev/shm cannot)."""
        self._staging.reserve(offset, nbytes)
