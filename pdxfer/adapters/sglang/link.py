"""One SGLang rank's connection to its pdxfer daemon, shaped for a scheduler that polls.

The connection is the adapters' daemon session (adapters/session.py): connected and
registered once, a daemon that goes away fails, fenced, every room this rank had on it
and is connected to again after ``RECONNECT_SECONDS``, a refusal settles its room (A10).
SGLang calls its transfer backend from the scheduler thread (and, for the retraction
path's aborts, from a helper thread), which the session serialises; no call waits for
the daemon except registration, slot grants, aborts and giving back what the daemon
refused. Statuses are those the daemon pushed (B6: a poll sends nothing). The link adds
SGLang's metadata rows as the aux record, the prefill daemon's bootstrap endpoint and
the decode daemon's fence bound from each welcome, and the release of a room only once
no write for it can land.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
from typing import Callable, NamedTuple, Sequence

from ...client import settled
from ...core import config, errors
from ...core.protocol import Rank, Role, RoomStatus, Welcome
from ..session import Session
from .layout import Registration

log = logging.getLogger("pdxfer.sglang")


def daemon_endpoint(role: str, env=os.environ) -> str:
    """Where this rank's daemon listens: $PDXFER_ENDPOINT, else where a daemon of this
    role beside it listens, read from the same PDXFER_* settings ``pdxfer serve`` reads."""
    if env.get(config.ENDPOINT_ENV):
        return env[config.ENDPOINT_ENV]
    return config.load({"role": role}, env=env).engine_address


def unsupported_ranks(sizes: Rank) -> list[str]:
    """The parallel sizes of a server this backend cannot carry yet, as a user would
    name them. Attention TP it can: the daemon serves every rank of the server and
    slices heads between prefill and decode ranks (core/topology.py)."""
    found = []
    if sizes.cp > 1:
        found.append(f"attention context parallelism (CP {sizes.cp}): the daemon refuses it")
    if sizes.dp > 1:
        found.append(f"attention data parallelism (DP {sizes.dp}): the daemons match a room's legs to prefill ranks by TP and PP rank only")
    if sizes.pp > 1:
        found.append(f"pipeline parallelism (PP {sizes.pp}): the backend does not yet number a stage's layers within the whole model")
    return found


def release_timeout_refusal(release_timeout: float, fence_bound: float) -> str:
    """Why a decode server cannot run with SGLang's deferred release giving up after
    ``release_timeout`` seconds beside a decode daemon that fences a failed room within
    ``fence_bound``: SGLang would hand the pages of a request whose writes may still land
    to another request. "" when it can."""
    if release_timeout > fence_bound:
        return ""
    return (f"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT is {release_timeout:g}s, but the pdxfer decode daemon "
            f"fences a failed request's pages only within {fence_bound:g}s (its --fence-bound): SGLang would give them to another "
            "request while a write for the failed one may still land. Raise the timeout above the bound, or lower --fence-bound")


def prefill_daemon(rows: Sequence[tuple[str, int]]) -> str:
    """The prefill daemon a decode rank's room comes from: every prefill rank it reads
    (SGLang's /route rows, ``(rank_ip, rank_port)``) must name the same one, which
    serves them all."""
    daemons = sorted(set(rows))
    if len(daemons) != 1:
        raise errors.Unsupported(
            f"the prefill ranks this decode rank reads register {len(daemons)} pdxfer daemons "
            f"({', '.join(f'{h}:{p}' for h, p in daemons)}); one daemon must serve every rank of a prefill server"
        )
    host, port = daemons[0]
    return f"{host}:{port}"


class Rows(NamedTuple):
    """SGLang's metadata buffers: row ``i`` of buffer ``b`` is ``sizes[b]`` bytes at
    ``ptrs[b] + i * sizes[b]`` (host memory). An aux record is a room's row of every
    buffer, end to end."""

    ptrs: Sequence[int]
    sizes: Sequence[int]

    @property
    def record_bytes(self) -> int:
        return sum(self.sizes)

    def gather(self, row: int, into: int) -> None:
        """Copy row ``row`` of every buffer to the address ``into``."""
        for ptr, size in zip(self.ptrs, self.sizes):
            ctypes.memmove(into, ptr + row * size, size)
            into += size

    def scatter(self, row: int, record: bytes) -> None:
        """Copy an aux record (``gather``'s layout) into row ``row`` of every buffer."""
        if len(record) != self.record_bytes:
            raise ValueError(f"an aux record of {len(record)} bytes for metadata rows of {self.record_bytes}")
        at = 0
        for ptr, size in zip(self.ptrs, self.sizes):
            ctypes.memmove(ptr + row * size, record[at : at + size], size)
            at += size


class Link:
    def __init__(self, endpoint: str, *, engine_id: str, role: Role, rank: Rank, sizes: Rank, device: str,
                 kv: Registration, rows: Rows, aux_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rows = rows
        self.session = Session(endpoint, engine_id=engine_id, role=role, rank=rank, sizes=sizes, device=device, kv=kv,
                               aux_slots=aux_slots, aux_bytes=rows.record_bytes, on_welcome=self._welcomed, clock=clock)
        self._lock = threading.Lock()  # _dropping: added to from SGLang's helper thread, taken from its scheduler's
        self._dropping: set[int] = set()  # rooms to release once they settle
        self.bootstrap = ("", 0)  # the prefill daemon's bootstrap endpoint (host, port)
        self.fence_bound = 0.0  # decode: within how long the daemon fences a failed room (Welcome.fence_bound)

    # --- connection

    def open(self) -> None:
        """Connect and register, or raise naming the daemon SGLang could not use."""
        try:
            self.session.open()
        except errors.PdxferError as exc:
            role = self.session.role.value
            raise RuntimeError(
                f"pdxfer: no usable {role} daemon at {self.session.endpoint} ({exc}); start one beside this "
                f"server (pdxfer serve --role {role}) or point {config.ENDPOINT_ENV} at it"
            ) from exc

    def _welcomed(self, welcome: Welcome) -> None:
        self.fence_bound = welcome.fence_bound
        if welcome.bootstrap:
            host, _, port = welcome.bootstrap.rpartition("//")[2].rpartition(":")
            if self.bootstrap[1] and self.bootstrap != (host, int(port)):
                log.error("pdxfer prefill daemon at %s came back with bootstrap %s:%s, not %s:%d as SGLang's /route row says: "
                          "decode servers cannot reach it; restart it with --bootstrap-port %d", self.session.endpoint, host, port,
                          *self.bootstrap, self.bootstrap[1])
            self.bootstrap = (host, int(port))

    def close(self) -> None:
        self.session.close()

    # --- rooms

    def announce(self, room: int) -> None:
        self.session.announce(room)

    def send(self, room: int, pages, first_page: int, *, last: bool, num_tokens: int = 0, row: int = -1, cuda_event: bytes = b"") -> None:
        """A chunk of ``room``; the last one carries metadata row ``row`` as the aux record.
        ``cuda_event``: the IPC handle of an event the daemon waits on before reading it.
        A chunk not handed over aborts the room (Session.send)."""
        self.session.send(room, pages, first_page=first_page, last=last, num_tokens=num_tokens,
                          write_record=functools.partial(self.rows.gather, row) if last else None, cuda_event=cuda_event)

    def expect(self, room: int, bootstrap: str, pages, skip_pages: int, prefill_sizes: Rank | None = None) -> None:
        """A decode room from the prefill daemon at ``bootstrap``, whose server runs
        ``prefill_sizes`` (TP, PP; one rank if None)."""
        self.session.expect(room, bootstrap, pages, skip_pages=skip_pages, prefill_sizes=prefill_sizes)

    def status(self, room: int) -> RoomStatus | None:
        """The room's last status, as pushed (None: nothing heard of it yet)."""
        return self.session.status(room)

    def record(self, room: int) -> bytes:
        """The aux record a room that succeeded delivered, checked against its stamp."""
        return self.session.record(room)

    def quiet(self, room: int) -> bool:
        """Whether no write for ``room`` can land any more: never posted, released, settled, or lost."""
        status = self.status(room)
        return not self.session.posted(room) if status is None else settled(status)

    def drop(self, room: int) -> None:
        """The engine wants nothing more of ``room``: released once no write for it can land."""
        if self.session.posted(room):
            with self._lock:
                self._dropping.add(room)

    def tidy(self) -> None:
        """Release the dropped rooms that settled (called as the engine polls)."""
        with self._lock:
            dropping = list(self._dropping)
        for room in dropping:
            if self.quiet(room):
                self.release(room)

    def abort(self, room: int, reason: str) -> None:
        """Stop a room posted here (one never posted has nothing to stop)."""
        if self.session.posted(room):
            self.session.abort(room, reason)

    def release(self, room: int) -> None:
        """Recycle ``room`` once no write for it can land: now if none can, else when it
        settles (`tidy`). Until then `quiet` says no: SGLang clears a failed decode room
        (failure_exception) before its deferred release asks whether the pages are safe."""
        if not self.quiet(room):
            self.drop(room)
            return
        with self._lock:
            self._dropping.discard(room)
        self.session.release(room)
