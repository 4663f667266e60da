"""The daemon: wires a role to its sockets, the transfer pump and the transport, and
owns the lifecycle (start, serve, drain, stop). What only one role's daemon does (its
bootstrap channel, its port) is its side's: prefill_side.py, decode_side.py.

Start-up follows paths.startup_steps: bind the device, initialise the transport,
open the bootstrap endpoint, and open the engine endpoint (with the admin endpoint
and the HTTP endpoint) last. Every background task is supervised: an exception is
logged, counted, and the task restarted (H1). SIGTERM drains: no new rooms, live
rooms get --drain-timeout to finish, the rest fail with a reason, then it exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from typing import Awaitable, Callable, Protocol

import msgspec
import zmq

from ..core import paths
from ..core.config import Config
from ..core.errors import PdxferError, Unsupported
from ..core.protocol import UNDECODABLE, AdminPeers, Codec, Error, ErrorCode, Message, PeersReply, Role
from ..core.topology import key_label, room_of
from ..host import cpu_yield, memory
from ..host.processes import EngineWatch
from ..roles.inbound import RoleInbound
from ..transport import Peer, Transport, build, label, primary
from ..transport.pump import TransferPump
from ..wire.batch import MAX_BATCH
from ..wire.bootstrap import RefusalLog
from ..wire.seal import Seal, read_secret
from ..wire.sockets import Router
from . import admin, preflight
from .decode_side import DecodeSide
from .http import HttpEndpoint
from .metrics import Metrics
from .prefill_side import PrefillSide
from .registry import DaemonRecord, Registry

log = logging.getLogger("pdxfer.daemon")

TICK_SECONDS = 0.05
DRAIN_SETTLE = 2.0  # seconds a drain waits for the writes of the rooms it failed


class RoleSide(Protocol):
    """What only one role's daemon does (PrefillSide, DecodeSide)."""

    role: Role
    bootstrap: str  # host:port of the bootstrap endpoint (prefill), ""
    service: RoleInbound | None

    async def open(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def make_service(self, host, observe, sessions: Peer, staging: memory.SharedMemory | None, backed: bool,
                     pump: TransferPump, scratch: int) -> RoleInbound: ...

    async def serve(self) -> None: ...

    def write_failed(self, sessions: Peer) -> None: ...

    def transport_reset(self, sessions: Peer) -> None: ...

    def transport_lost(self, sessions: Peer, current: bool) -> None: ...

    def transport_closed(self) -> None: ...

    def close(self) -> None: ...


def loose_req(raw: bytes) -> int:
    """The request id of a message that failed validation, if it has a usable one,
    so the engine can match the error to its request."""
    try:
        req = msgspec.msgpack.decode(raw).get("req", 0)
    except (msgspec.DecodeError, AttributeError, ValueError, TypeError):  # garbage of any shape
        return 0
    return req if type(req) is int and 0 <= req < 2**63 else 0


class Daemon:
    def __init__(self, config: Config, transport: Transport | None = None) -> None:
        self.config = config
        self.transport = transport
        self.incarnation = uuid.uuid4().hex[:16]
        self.codec = Codec()
        self.seal = Seal(self.incarnation)
        self.side: RoleSide | None = None  # made once the secret is read (start)
        self.service: RoleInbound | None = None
        self.pump: TransferPump | None = None
        self.engine_endpoint = ""
        self.sessions: Peer = ()  # our transfer engines' sessions
        self.task_failures = 0
        self.early_failures: dict[str, int] = {}  # counted before the role existed
        self.engine_process_restarts = 0
        self.engine_watch = EngineWatch()  # engine processes this daemon sees: a killed one's rooms fail at once
        self.started = time.monotonic()
        self.draining = False
        self.metrics: Metrics | None = None
        self.http_port = 0
        self.admin_endpoint = ""
        self.yielding: cpu_yield.Yielding | None = None  # None: the daemon's threads keep the normal policy
        self.cpu_takebacks = 0
        self.staging: memory.SharedMemory | None = None  # the staging buffer (core/staging.py)
        self.staging_backed = False  # every page of it backed and mapped at start (--staging-at-start)
        self._taken_back: list[int] = []  # threads that left SCHED_IDLE, to yield again
        self._engine_calls_in_window = 0  # work for the daemon that cpu_yield judges starvation by
        self._http: HttpEndpoint | None = None
        self.registry: Registry | None = None
        self._admin: Router | None = None
        self._admin_refusals = RefusalLog(log)  # rate-limited: a script without the secret may poll in a loop
        self._ctx: zmq.Context | None = None
        self._engine: Router | None = None
        self._tasks: list[asyncio.Task] = []
        self._oneshots: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self._name_lock: preflight.NameLock | None = None

    @property
    def bootstrap_address(self) -> str:
        return self.side.bootstrap if self.side is not None else ""

    @property
    def session(self) -> str:
        return primary(self.sessions)

    # --- lifecycle

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config
        # Before anything starts: what would fail later with a traceback, or not at all.
        self._name_lock = preflight.prepare(cfg, engine_needed=self.transport is None)
        self.seal = Seal(self.incarnation, read_secret(cfg.cluster_secret_file))
        side = PrefillSide if cfg.role is Role.PREFILL else DecodeSide
        self.side = side(cfg, self.incarnation, self.seal, self.codec, self.count_failure)
        self._ctx = zmq.Context()
        for step in paths.startup_steps(cfg.device):
            if step == "bind_device":
                memory.bind_device(cfg.device)
            elif step == "init_transport":
                if self.transport is None:
                    self.transport = build.daemon_transport(cfg, lambda sessions, current: loop.call_soon_threadsafe(self._engine_process_lost, sessions, current))
                self.sessions = await loop.run_in_executor(None, self.transport.start)
                self._yield_cpu()
            elif step == "open_bootstrap":
                await self.side.open(loop)
            elif step == "open_engine_endpoint":
                self._engine = Router(self._ctx, cfg.engine_address, cfg.max_message_bytes, cfg.engine_queue,
                                      on_error=lambda: self.count_failure("task:engine-message"))
                self._admin = Router(self._ctx, cfg.admin_address, cfg.max_message_bytes, cfg.engine_queue,
                                     on_error=lambda: self.count_failure("task:admin-message"))
        if cfg.staging_bytes:
            self.staging = await self._open_staging(cfg.staging_bytes)
        self.pump = TransferPump(self.transport, self._window(), loop, cfg.stall_timeout,
                                 on_write_failed=self.side.write_failed, on_reset=self._transport_reset)
        self.metrics = Metrics(self)
        # The log level is set once, before this: without debug logging nothing is told of each transition.
        observe = self._observe if log.isEnabledFor(logging.DEBUG) else None
        self.service = self.side.make_service(self, observe, self.sessions, self.staging, self.staging_backed, self.pump, self.transport.scratch)
        # Peers, engines and operators are let in only now that the role exists.
        await self.side.serve()
        self.engine_endpoint = self._engine.start(loop, self._on_engine)
        self.admin_endpoint = self._admin.start(loop, self._on_admin, self.seal.head)
        self.pump.start()
        if cfg.http_port:
            self._http = HttpEndpoint(cfg.host, cfg.http_port, {"/metrics": self._metrics_page, "/healthz": self._healthz, "/readyz": self._readyz})
            self.http_port = await self._http.start()
        self._spawn("ticker", self._ticker)
        if cfg.registry:
            await self._join_registry()
        log.info(
            "pdxfer %s daemon %s ready: engine %s, bootstrap %s, transfer sessions %s (%s), incarnation %s",
            cfg.role.value, cfg.instance, self.engine_endpoint, self.bootstrap_address or "-", label(self.sessions), cfg.protocol, self.incarnation,
        )

    def _yield_cpu(self) -> None:
        """From now on the threads this daemon starts, and its loop, yield the cores to
        the transfer engine's (cpu_yield.py), where it can take them back."""
        if not self.config.yield_cpu:
            return
        why = cpu_yield.why_not(True, self.config.silence_bound)
        if why:
            log.info("the daemon's threads keep the normal CPU policy (--yield-cpu): %s", why)
            return
        cpu_yield.yield_this_thread()
        self.yielding = cpu_yield.Yielding(time.monotonic())

    def _cpu_window(self, span: float, loop_wait: float, own_cpu: float) -> None:
        working = self._engine_calls_in_window > 0 or self.service.rooms.live() > 0
        self._engine_calls_in_window = 0
        change = self.yielding.window(span, loop_wait, own_cpu, time.monotonic(), working)
        if change is False:
            self._taken_back = cpu_yield.take_back()
            self.cpu_takebacks += 1
            log.warning(
                "the event loop waited %.0f%% of the last %.1fs for a core while this process ran %.0f%% of one: other "
                "processes hold the cores, so the daemon's %d threads leave SCHED_IDLE; they yield again after %.0fs of calm",
                100 * loop_wait / span, span, 100 * own_cpu / span, len(self._taken_back), self.yielding.calm_needed,
            )
        elif change is True:
            cpu_yield.yield_again(self._taken_back)
            log.info("calm for %.0fs: the daemon's threads yield the cores to the transfer engine again", self.yielding.calm_needed)

    def _window(self) -> int:
        """Writes in flight per peer: the configured window, kept at half the engine's
        own per-peer queue so that queue never refuses us."""
        from ..transport.mooncake import peer_queue_limit

        limit = peer_queue_limit(self.config.protocol, os.environ)
        if limit is not None and self.config.peer_window > limit // 2:
            window = max(1, limit // 2)
            log.warning("peer window %d is above half the transfer engine's per-peer queue (%d): using %d", self.config.peer_window, limit, window)
            return window
        return self.config.peer_window

    async def _open_staging(self, size: int) -> memory.SharedMemory | None:
        """The staging buffer (core/staging.py), registered with the transport; None, with a
        warning, when shared memory cannot hold it (legs then write between the pages).
        With --staging-at-start its pages are backed and mapped now (self.staging_backed)."""
        loop = asyncio.get_running_loop()
        try:
            # Not populated: it takes memory only as legs are staged into it (an idle or equal-TP daemon's stays empty).
            staging = await loop.run_in_executor(None, memory.SharedMemory.create, size, "pdxfer-staging", False)
        except PdxferError as exc:
            log.warning("no staging buffer (--staging-mib %d): %s; legs between ranks of different TP write between the pages", size >> 20, exc)
            return None
        if self.config.staging_at_start:
            why_not = await loop.run_in_executor(None, staging.populate)
            if why_not:
                log.warning("--staging-at-start: %s; the staging buffer is backed as legs reach it instead", why_not)
            self.staging_backed = not why_not
        try:
            # Backed whole, the engine's process maps it populated: a new one after a restart too.
            await loop.run_in_executor(None, self.transport.register, staging.address, size, self.staging_backed)
        except BaseException:
            staging.close()
            raise
        return staging

    def ready_line(self) -> str:
        return json.dumps(
            {
                "event": "ready",
                "role": self.config.role.value,
                "name": self.config.instance,
                "engine": self.engine_endpoint,
                "admin": self.admin_endpoint,
                "http_port": self.http_port,
                "bootstrap": self.bootstrap_address,
                "session": self.session,
                "sessions": list(self.sessions),
                "incarnation": self.incarnation,
                "pid": os.getpid(),
                "engine_pid": getattr(self.transport, "pid", 0) or os.getpid(),  # the transfer engine's process
            }
        )

    async def run(self) -> None:
        """Start, print the ready line, serve until SIGTERM/SIGINT, drain, then stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        try:
            await self.start()
            sys.stdout.write(self.ready_line() + "\n")
            sys.stdout.flush()
            await self._stopping.wait()
            await self.drain()
        finally:
            await self.stop()

    async def _join_registry(self) -> None:
        cfg = self.config
        self.registry = Registry(cfg.registry, cfg.registry_ttl, self.service.peer_gone)
        record = DaemonRecord(
            role=cfg.role, name=cfg.instance, incarnation=self.incarnation, bootstrap=self.bootstrap_address,
            session=self.session, host=cfg.host,
        )
        await self.registry.register(record)
        self._spawn("registry-keepalive", self.registry.keep_alive)
        self._spawn("registry-watch", self._watch_registry)

    async def _watch_registry(self) -> None:
        await self.registry.watch()
        raise ConnectionError("the etcd watch stream ended")  # restarted by the supervisor

    async def drain(self) -> None:
        """Admit no new rooms; give live ones drain_timeout to finish; fail the rest."""
        self.draining = True
        self.service.desk.start_draining()
        live = self.service.rooms.live
        log.info("draining: %d live rooms, up to %gs", live(), self.config.drain_timeout)
        deadline = time.monotonic() + self.config.drain_timeout
        while live() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        failed = self.service.desk.fail_live(ErrorCode.ABORTED, f"the {self.config.role.value} daemon shut down (drain timeout {self.config.drain_timeout:g}s)")
        if failed:
            log.warning("drain timeout: failed %d rooms still live", failed)
            # Give their cancelled writes a moment to settle, so peers hear "fenced"
            # rather than waiting out the lease; then let the failures go out.
            settle = time.monotonic() + DRAIN_SETTLE
            while self.pump.depths()["writes_in_flight"] and time.monotonic() < settle:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop(self) -> None:
        if self._name_lock is None:  # refused before anything started
            return
        if self.yielding is not None:  # shut down at the normal policy, and leave the process as it was
            cpu_yield.take_back()
            self.yielding = None
        # The tasks go first: a lease renewal that found its lease lapsed registers
        # again, and one doing so while we deregister would leave a record behind.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.registry is not None:
            try:  # go from the registry at once, rather than when the lease lapses
                await asyncio.wait_for(self.registry.deregister(), 2)
            except (PdxferError, asyncio.TimeoutError) as exc:
                log.warning("could not deregister from etcd: %s", exc)
        if self.pump is not None:
            self.pump.stop()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
            if self.service is not None:
                self.side.transport_closed()  # before the bootstrap sockets close
        if self.side is not None:
            self.side.close()  # its copies still reading the staging buffer finish first (milliseconds)
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self._http is not None:
            self._http.close()
        for sock in (self._engine, self._admin):
            if sock is not None:
                sock.close()
        for identity in list(self.engine_watch.pidfds):
            self._unwatch(identity)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.service is not None:
            for mapping in self.service.lanes.held_mappings():
                mapping.close()
        if self._name_lock is not None:  # only now that our sockets are gone may a successor take the name
            self._name_lock.release()
        log.info("pdxfer %s daemon %s stopped", self.config.role.value, self.config.instance)

    # --- supervised tasks

    def _spawn(self, name: str, body: Callable[[], Awaitable[None]]) -> asyncio.Task:
        task = asyncio.create_task(self._supervise(name, body), name=f"pdxfer-{name}")
        self._tasks.append(task)
        return task

    async def _supervise(self, name: str, body: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await body()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                self.task_failures += 1
                self.count_failure(f"task:{name}")
                log.exception("background task %s failed; restarting it", name)
                await asyncio.sleep(0.1)

    def _on_engine(self, frames: list[bytes]) -> None:
        """One ZMQ message from an engine: its identity, then 1 to MAX_BATCH engine
        messages, each decoded and handed to the role; its reply (or, for a
        registration, an awaitable of it) goes back."""
        identity, frames = frames[0], frames[1:]
        if not 1 <= len(frames) <= MAX_BATCH:
            self.post_engine(identity, Error(req=0, code=ErrorCode.BAD_MESSAGE, message=f"an engine message carries 1 to {MAX_BATCH} frames, not {len(frames)}"))
            return
        self._engine_calls_in_window += len(frames)
        limit, decode, on_engine = self.config.max_message_bytes, self.codec.engine_requests.decode, self.service.on_engine
        for raw in frames:
            if len(raw) > limit:
                reply = Error(req=0, code=ErrorCode.BAD_MESSAGE, message=f"message of {len(raw)} bytes exceeds the {limit}-byte limit")
            else:
                try:
                    reply = on_engine(identity, decode(raw))
                except UNDECODABLE as exc:
                    reply = Error(req=loose_req(raw), code=ErrorCode.BAD_MESSAGE, message=f"cannot decode engine message: {exc}")
            if reply is None:
                continue
            if isinstance(reply, Message):
                self.post_engine(identity, reply)
            else:
                self.oneshot(self._reply_later(identity, reply))

    async def _reply_later(self, identity: bytes, reply: Awaitable[Message]) -> None:
        """A registration's reply: it maps and registers memory off the loop."""
        self.post_engine(identity, await reply)

    def _on_admin(self, frames: list[bytes]) -> None:
        identity, frames = frames[0], frames[1:]
        try:
            _, payloads = self.seal.open(frames)
        except PdxferError as exc:
            self.count_failure(f"{exc.code.value}:admin-message")
            self._admin_refusals.refused(exc.code, f"refused an admin request on {self.admin_endpoint}: {exc.message}")
            self._admin.post(identity, self.codec.encode(Error(req=0, code=exc.code, message=exc.message)))
            return
        for payload in payloads:
            try:
                reply = admin.handle(self, self.codec.admin_requests.decode(payload))
            except PdxferError as exc:
                reply = Error(req=0, code=exc.code, message=exc.message)
            except UNDECODABLE as exc:
                reply = Error(req=0, code=ErrorCode.BAD_MESSAGE, message=f"cannot decode admin request: {exc}")
            if asyncio.iscoroutine(reply):  # an action that takes a while answers when done
                self.oneshot(self._answer_admin_later(identity, reply))
                continue
            self._admin.post(identity, self.codec.encode(reply))

    async def _answer_admin_later(self, identity: bytes, pending) -> None:
        try:
            reply = await pending
        except PdxferError as exc:
            reply = Error(req=0, code=exc.code, message=exc.message)
        self._admin.post(identity, self.codec.encode(reply))

    def cut(self, msg: AdminPeers):
        """Operator cut (``pdxfer peer P --cut``, decode side): a rotation of this daemon's
        transfer sessions (DecodeService.cut); answered once the old ones ended and the
        rooms that waited for them were fenced. Checked now; returns the coroutine that
        answers."""
        if self.config.role is not Role.DECODE:
            raise Unsupported("a cut runs on the decode daemon: it owns the memory that writes land in; a prefill's memory is only read")
        return self._cut(msg, self.side.cut(msg.cut))

    async def _cut(self, msg: AdminPeers, cutting: Awaitable[int]) -> Message:
        fenced = await cutting
        return PeersReply(req=msg.req, peers=self.service.peer_infos(time.monotonic(), time.time()), fenced=fenced)

    def _engine_process_lost(self, sessions: Peer, current: bool) -> None:
        """A transfer engine process died (isolated.py): nothing sent to its sessions can
        land any more, which a decode daemon's rooms waiting for that proof hear at once.
        The current one's writes in flight are lost: once the pump holds none, a new
        process takes over with new sessions."""
        self.side.transport_lost(sessions, current)
        if current:
            self.engine_process_restarts += 1
            self.oneshot(self._replace_lost_engine())

    async def _replace_lost_engine(self) -> None:
        sessions = await asyncio.wrap_future(self.pump.when_idle(lambda transport: transport.rotate()))
        self.sessions_changed(sessions)
        self.side.replaced(sessions)

    @staticmethod
    def _observe(room, left, now: float) -> None:
        """The room table's observer with debug logging: one line per transition."""
        log.debug("room %s %s -> %s peer=%s%s", key_label(room.id), left.value if left else "new", room.state.value, room.peer or "-",
                  f" [{room.code.value}] {room.reason}" if room.code else "", extra={"room": room_of(room.id), "peer": room.peer or None})

    def _metrics_page(self) -> tuple[int, str, bytes]:
        return 200, "text/plain; version=0.0.4; charset=utf-8", self.metrics.render()

    def _healthz(self) -> tuple[int, str, bytes]:
        return 200, "text/plain", b"ok\n"

    def _readyz(self) -> tuple[int, str, bytes]:
        waiting = admin.not_ready(self)
        body = json.dumps({"ready": not waiting, "waiting_for": waiting}).encode() + b"\n"
        return (503 if waiting else 200), "application/json", body

    def _engine_exited(self, identity: bytes) -> None:
        """An engine's pidfd became readable: its process exited (A10)."""
        pid = self._unwatch(identity)
        self.service.desk.engine_gone(identity, f"the engine process (pid {pid}) exited")

    def _unwatch(self, identity: bytes) -> int:
        asyncio.get_running_loop().remove_reader(self.engine_watch.pidfd(identity))
        return self.engine_watch.forget(identity)

    async def _ticker(self) -> None:
        window = cpu_yield.sample() if self.yielding is not None else None  # yielding is decided before the ticker starts
        while True:
            await asyncio.sleep(TICK_SECONDS)
            for identity, pid in self.engine_watch.gone():
                self.service.desk.engine_gone(identity, f"the engine process (pid {pid}) exited")
            self.service.tick()
            self.metrics.fold()
            if self.yielding is not None and time.monotonic() - window[0] >= cpu_yield.WINDOW:
                start, window = window, cpu_yield.sample()
                self._cpu_window(*(now - then for now, then in zip(window, start)))

    # --- what ports ask of the daemon (ports.EngineHost)

    def post_engine(self, identity: bytes, message: Message) -> None:
        self._engine.post(identity, self.codec.encode(message))

    async def register_memory(self, address: int, size: int) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.transport.register, address, size)

    def unregister_memory(self, address: int) -> Awaitable[None]:
        return asyncio.get_running_loop().run_in_executor(None, self.transport.unregister, address)

    def watch_engine(self, identity: bytes, pid: int, pid_namespace: int) -> None:
        """Fail an engine connection's rooms at once when its process exits, where this host sees it."""
        watch = self.engine_watch
        if watch.pidfd(identity) is not None:  # the connection said hello again
            self._unwatch(identity)
        if not watch.add(identity, pid, pid_namespace):
            log.info("engine connection %s: its process (pid %d) is not visible here; a killed engine's rooms fail at their timeouts", identity.hex(), pid)
            return
        fd = watch.pidfd(identity)
        if fd is not None:
            asyncio.get_running_loop().add_reader(fd, self._engine_exited, identity)

    def oneshot(self, coro) -> None:
        """Run a one-off step in the background; its failure is logged and counted."""
        task = asyncio.create_task(coro)
        self._oneshots.add(task)
        task.add_done_callback(self._oneshot_done)

    def _oneshot_done(self, task: asyncio.Task) -> None:
        self._oneshots.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.count_failure("task:one-shot")
            log.error("background step failed: %r", task.exception())

    def sessions_changed(self, sessions: Peer) -> None:
        self.sessions = sessions

    def resolve(self, name: str) -> str | None:
        return None if self.registry is None else self.registry.resolve(name).bootstrap

    def incarnation_of(self, name: str) -> str:
        record = self.registry.peers.get(name) if self.registry is not None else None
        return record.incarnation if record is not None else ""

    def count_failure(self, reason: str, n: int = 1) -> None:
        """A failure of the daemon's own (its tasks, its sockets), counted with the role's."""
        if self.service is not None:
            self.service.book.count_failure(reason, n)
        else:
            self.early_failures[reason] = self.early_failures.get(reason, 0) + n

    def engine_connections(self) -> int:
        return self._engine.connections if self._engine is not None else 0

    def _transport_reset(self, sessions: Peer) -> None:
        """The pump re-created the transport after a stall or a failed probe."""
        self.sessions = sessions
        self.side.transport_reset(sessions)
