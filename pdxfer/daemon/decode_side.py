"""A decode daemon's own wiring: a link (wire.bootstrap.MessageLink) to each prefill
daemon it asks rooms of, and its role's port (roles.ports.DecodePort): messages on
links, timers and copies beside the loop, names from the registry, and the rotation of
its transfer sessions (new engines, old ones ended, through the pump)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..core.config import Config
from ..core.protocol import Codec, ErrorCode, Message, Role
from ..host import memory
from ..roles.decode.service import DecodeService
from ..roles.staging import Staging
from ..transport import Peer
from ..transport.pump import TransferPump
from ..wire.bootstrap import MessageLink
from ..wire.seal import Seal
from .ports import DaemonPort, EngineHost

log = logging.getLogger("pdxfer.daemon")

# Staged legs are copied into their pages beside the event loop (numpy lets go of the
# GIL while it copies): on 16 cores, large staged rooms at 2:1 moved 2.40 GB/s with the
# loop copying and 3.27 with these threads (HISTORY.md).
COPY_THREADS = 4


class DecodeDaemonPort(DaemonPort):
    """roles.ports.DecodePort: one link per prefill daemon, timers on the loop, names in
    the registry (--registry), sessions rotated and ended through the pump."""

    def __init__(self, host: EngineHost, observe, staging: memory.SharedMemory | None, side: "DecodeSide") -> None:
        super().__init__(host, observe, staging)
        self._side = side

    def open_link(self, endpoint: str) -> None:
        self._side.open_link(endpoint)

    def close_link(self, endpoint: str) -> None:
        self._side.close_link(endpoint)

    def send_link(self, endpoint: str, message: Message) -> None:
        link = self._side.links.get(endpoint)
        if link is not None:
            link.post(message)

    def later(self, delay: float, fn: Callable[[], None]) -> asyncio.TimerHandle:
        return asyncio.get_running_loop().call_later(delay, fn)

    def off_loop(self, work: Callable[[], None], done: Callable[[BaseException | None], None]) -> None:
        future = asyncio.get_running_loop().run_in_executor(self._side.copier, work)
        future.add_done_callback(lambda f: None if f.cancelled() else done(f.exception()))

    def resolve(self, name: str) -> str | None:
        return self._host.resolve(name)

    def incarnation_of(self, name: str) -> str:
        return self._host.incarnation_of(name)

    def rotate_sessions(self) -> None:
        self._side.rotate()

    def end_sessions(self, sessions: Peer) -> None:
        self._side.end(sessions)


class DecodeSide:
    """The links to prefill daemons and the decode role behind them."""

    role = Role.DECODE
    bootstrap = ""  # a decode daemon has no bootstrap endpoint

    def __init__(self, config: Config, incarnation: str, seal: Seal, codec: Codec, count_failure: Callable[[str, int], None]) -> None:
        self.config = config
        self.incarnation = incarnation
        self.seal = seal
        self.codec = codec
        self.count_failure = count_failure
        self.service: DecodeService | None = None
        self.links: dict[str, MessageLink] = {}
        self.copier: ThreadPoolExecutor | None = None  # threads copying staged legs into pages
        self._host: EngineHost | None = None
        self._pump: TransferPump | None = None

    async def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """A decode daemon listens for no peer."""

    def make_service(self, host: EngineHost, observe, sessions: Peer, staging: memory.SharedMemory | None, backed: bool,
                     pump: TransferPump, scratch: int) -> DecodeService:
        from ..transport import PROBE_BYTES
        from ..transport.mooncake import installed_release

        self._host, self._pump = host, pump
        port = DecodeDaemonPort(host, observe, staging, self)
        buffer = None
        if staging is not None:
            buffer = Staging(staging, port.back_staging, backed)
            self.copier = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="pdxfer-copy")
        self.service = DecodeService(self.config, self.incarnation, port, sessions=sessions, probe_base=scratch + PROBE_BYTES,
                                     engine_release=installed_release(), staging=buffer)
        return self.service

    async def serve(self) -> None:
        """Links open as rooms name prefill daemons."""

    # --- links

    def open_link(self, endpoint: str) -> None:
        service = self.service
        link = MessageLink(
            endpoint, self.incarnation.encode(), self.config.max_message_bytes, self.seal, self.codec,
            on_message=service.on_link, on_connection=service.on_connection,
            on_unauthenticated=lambda why: service.link_unauthenticated(endpoint, why),
            on_bad=lambda why: self._bad(endpoint, why),
            on_dropped=self._dropped, on_refused=lambda code, why: self._refused(endpoint, code, why),
            on_error=lambda: self.count_failure("task:peer-message", 1),
            keep=service.still_wanted, greeting=lambda: service.hello(endpoint),
            on_unreachable=service.unreachable,
        )
        link.start(asyncio.get_running_loop())
        self.links[endpoint] = link

    def close_link(self, endpoint: str) -> None:
        link = self.links.pop(endpoint, None)
        if link is not None:
            link.close()

    def _bad(self, endpoint: str, why: str) -> None:
        self.count_failure("bad_message", 1)
        log.warning("dropped a message from prefill %s: %s", endpoint, why, extra={"peer": endpoint})

    def _dropped(self, messages: list[Message]) -> None:
        """Messages to a prefill that could not be queued (logged by the channel): counted,
        and their rooms failed on the next turn of the loop, since a drop can happen
        inside the very handler that posted the message."""
        self.count_failure("dropped:peer-message", len(messages))
        asyncio.get_running_loop().call_soon(self.service.unsent, messages)

    def _refused(self, endpoint: str, code: ErrorCode, why: str) -> list[bytes]:
        """A connection to a prefill that this daemon refused (the channel logged it):
        counted; one that did not prove the cluster secret fails the link's rooms now,
        naming it. It is told nothing: it proved nothing."""
        self.count_failure(f"{code.value}:peer-connection", 1)
        if code is ErrorCode.UNAUTHENTICATED:
            self.service.link_unproven(endpoint, why)
        return []

    # --- sessions (roles/decode/rotation.py)

    def rotate(self) -> None:
        """New transfer engines beside the current ones; the role hears their sessions."""
        self._host.oneshot(self._rotate())

    async def _rotate(self) -> None:
        try:
            sessions = await asyncio.wrap_future(self._pump.when_idle(lambda transport: transport.rotate()))
        except Exception as exc:
            self.service.rotation_failed(str(exc))
            return
        self._host.sessions_changed(sessions)
        self.service.sessions_rotated(sessions)

    def end(self, sessions: Peer) -> None:
        """End the engines at ``sessions``; the role hears once nothing sent to them can land."""
        self._host.oneshot(self._end(sessions))

    async def _end(self, sessions: Peer) -> None:
        await asyncio.wrap_future(self._pump.when_idle(lambda transport: transport.end(sessions)))
        self.service.sessions_ended(sessions)

    def cut(self, peer: str):
        """Operator cut (``pdxfer peer P --cut``): checked now; the coroutine that answers
        with how many rooms were fenced, once the old sessions ended."""
        self.service.check_cut(peer)
        return self._cut(peer)

    async def _cut(self, peer: str) -> int:
        done = asyncio.get_running_loop().create_future()
        self.service.cut(peer, lambda fenced: done.done() or done.set_result(fenced))
        return await done

    def write_failed(self, sessions: Peer) -> None:
        """A decode daemon's pump writes nothing of its own."""

    def transport_reset(self, sessions: Peer) -> None:
        """Not for a decode daemon: it rotates (a pump of no writes never stalls or probes)."""

    def transport_lost(self, sessions: Peer, current: bool) -> None:
        """An engine process died: nothing sent to its sessions can land any more."""
        self.service.sessions_ended(sessions)

    def replaced(self, sessions: Peer) -> None:
        """A new engine process took over from a dead one: prefills hear of it."""
        self.service.sessions_rotated(sessions)

    def transport_closed(self) -> None:
        """Nothing to confirm: a decode daemon writes into no peer."""

    def close(self) -> None:
        if self.copier is not None:  # a copy still reading the staging buffer finishes first (milliseconds)
            self.copier.shutdown(wait=True)
            self.copier = None
        for link in self.links.values():
            link.close()
        self.links.clear()
