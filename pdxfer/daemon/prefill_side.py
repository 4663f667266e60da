"""A prefill daemon's own wiring: its bootstrap endpoint (wire.bootstrap.MessageServer),
where decode daemons connect, and its role's port (roles.ports.PrefillPort): replies
to decode daemons, writes through the pump, CUDA events polled on the loop."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from ..core import paths
from ..core.config import Config
from ..core.errors import PdxferError
from ..core.protocol import Codec, ErrorCode, Message, PeerRefused, Role
from ..host import memory
from ..roles.prefill.service import PrefillService
from ..roles.staging import Staging
from ..transport import Job, Peer
from ..transport.pump import TransferPump
from ..wire.bootstrap import MessageServer
from ..wire.seal import Seal
from .ports import DaemonPort, EngineHost

log = logging.getLogger("pdxfer.daemon")

EVENT_POLL_SECONDS = 0.0002  # how often a chunk's CUDA event is asked whether it completed


class PrefillDaemonPort(DaemonPort):
    """roles.ports.PrefillPort: decode daemons on the bootstrap endpoint, writes through the pump."""

    def __init__(self, host: EngineHost, observe, staging: memory.SharedMemory | None, server: MessageServer, pump: TransferPump,
                 device: str) -> None:
        super().__init__(host, observe, staging)
        self._server = server
        self._pump = pump
        self._device = device

    def send_peer(self, identity: bytes, message: Message) -> None:
        self._server.post(identity, message)

    def submit(self, job: Job) -> None:
        self._pump.submit(job)

    def cancel(self, job: Job) -> None:
        self._pump.cancel(job)

    def after_event(self, handle: bytes, done: Callable[[str], None]) -> None:
        """Polled on the loop's thread (the device is current there, D1) every
        EVENT_POLL_SECONDS: the chunk waits, the loop does not."""
        if paths.device_kind(self._device) != "cuda":
            done(f"this daemon runs on {self._device}, not a CUDA device: send() a CUDA event only to a daemon started with --device cuda:N")
            return
        try:
            event = memory.CudaIpcEvent(handle)
        except PdxferError as exc:
            done(exc.message)
            return
        loop = asyncio.get_running_loop()

        def check() -> None:
            try:
                finished = event.done()
            except PdxferError as exc:
                event.close()
                done(exc.message)
                return
            if finished:
                event.close()
                done("")
            else:
                loop.call_later(EVENT_POLL_SECONDS, check)

        check()


class PrefillSide:
    """The bootstrap endpoint and the prefill role behind it."""

    role = Role.PREFILL

    def __init__(self, config: Config, incarnation: str, seal: Seal, codec: Codec, count_failure: Callable[[str, int], None]) -> None:
        self.config = config
        self.incarnation = incarnation
        self.seal = seal
        self.codec = codec
        self.count_failure = count_failure  # before the role exists, the daemon's own count
        self.service: PrefillService | None = None
        self.bootstrap = ""  # host:port decode daemons reach us at
        self.server = MessageServer(
            config.host, config.bootstrap_port, config.max_message_bytes, seal, codec, on_dropped=self._dropped, on_refused=self._refused, on_error=lambda: self.count_failure("task:peer-message", 1),
        )

    async def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the bootstrap endpoint (connections are taken from ``serve``, once the role exists)."""
        self.bootstrap = (await self.server.start(loop))[len("tcp://") :]

    def make_service(self, host: EngineHost, observe, sessions: Peer, staging: memory.SharedMemory | None, backed: bool,
                     pump: TransferPump, scratch: int) -> PrefillService:
        port = PrefillDaemonPort(host, observe, staging, self.server, pump, self.config.device)
        buffer = Staging(staging, port.back_staging, backed) if staging is not None else None
        self.service = PrefillService(self.config, self.incarnation, port, sessions=sessions, bootstrap_address=self.bootstrap, staging=buffer)
        return self.service

    async def serve(self) -> None:
        service = self.service
        await self.server.serve(service.on_peer, service.on_connection, service.refuse_unauthenticated)

    def write_failed(self, sessions: Peer) -> None:
        """A write to ``sessions`` failed: the role judges whether that decode daemon is gone."""
        self.service.write_failed(sessions)

    def transport_reset(self, sessions: Peer) -> None:
        self.service.new_sessions(sessions)

    def transport_lost(self, sessions: Peer, current: bool) -> None:
        """An engine process of ours died: nothing for the role (its writes settled failed)."""

    def transport_closed(self) -> None:
        """Before the bootstrap sockets close: the decode sides wait for this proof."""
        fenced = self.service.transport_closed() if self.service is not None else 0
        if fenced:
            log.info("transfer engines closed: %d failed rooms confirmed fenced to their decode daemons", fenced)

    def _dropped(self, to: bytes | None, messages: list[Message]) -> None:
        """Messages to a decode daemon that could not be queued (logged by the channel):
        counted, and their rooms failed on the next turn of the loop, since a drop can
        happen inside the very handler that posted the message."""
        self.count_failure("dropped:peer-message", len(messages))
        asyncio.get_running_loop().call_soon(self.service.unsent, messages)

    def _refused(self, code: ErrorCode, why: str) -> list[bytes]:
        """A bootstrap connection this prefill refused (the channel logged it): counted,
        and one refused over the cluster secret hears why, which fails that decode
        daemon's rooms here at once, with that reason, rather than at their timeout. The
        reason says nothing a stranger could not know."""
        self.count_failure(f"{code.value}:peer-connection", 1)
        if code is not ErrorCode.UNAUTHENTICATED:
            return []
        return self.seal.seal([self.codec.encode(PeerRefused(code=code, reason=why))])

    def close(self) -> None:
        self.server.close()
