"""How a decode daemon ends its transfer sessions (core/generations.py; proto/PROTOCOL.md,
"Fencing"): new engines beside the current ones, a hello on every link with the legs
each prefill may move to them, and the old engines ended once every prefill still heard
from said it drained them, or at the rotation's deadline; then every failed room no
live generation can receive a write for is fenced.

A rotation starts when a room waiting for proof has a prefill silent past the heartbeat
bound, or has waited half the fence bound (the tick's), or when an operator cuts; one
runs at a time, and one asked for meanwhile follows it."""

from __future__ import annotations

import logging
import math
from typing import Callable

from ...core.config import Config
from ...core.generations import Generations, Rotation, fence_due
from ...core.rooms import Room
from ...transport import Peer, label
from ..book import RoomBook
from ..ports import DecodePort
from .state import DecodeState, PrefillLink

log = logging.getLogger("pdxfer.decode")

# A rotation gives live prefills at least this long to move off the old sessions, and
# ends them this long before the first waiting room's fence is due.
MIN_DRAIN = 0.2
END_MARGIN = 0.5
RETRY = 1.0  # seconds between tries when new transfer engines fail to start


class SessionRotation:
    def __init__(self, config: Config, port: DecodePort, book: RoomBook, state: DecodeState, sessions: Peer,
                 hello_all: Callable[[], None]) -> None:
        self.bound = config.fence_seconds
        self.heartbeats = config.heartbeats
        self.port = port
        self.book = book
        self.state = state
        self.hello_all = hello_all  # tells every prefill our sessions and the legs it may write through them
        self.generations = Generations.starting(sessions)
        self.rotation: Rotation | None = None  # the retirement of the generation before the current one, while it runs
        self.asked = ""  # why a rotation was asked for and has not begun ("": none asked)
        self.retry_at = 0.0  # after a rotation failed to start: not asked again before this
        # Operator cuts, answered with the rooms fenced once the rotation after them ended:
        # those whose rotation has not begun, and those of the rotation running.
        self.cuts_asked: list[Callable[[int], None]] = []
        self.cut_waiters: list[Callable[[int], None]] = []
        self.rotations = 0  # generations retired by a rotation
        self.cuts = 0  # of them, asked for by an operator
        self.fenced = 0  # failed rooms fenced because every generation they could be written into ended

    @property
    def sessions(self) -> Peer:
        return self.generations.sessions

    def cut(self, reason: str, answer: Callable[[int], None]) -> None:
        self.cuts_asked.append(answer)
        self.ask(reason)

    def ask(self, reason: str) -> None:
        """Start a rotation, or one more after the one running: it covers only rooms whose
        generations it ends."""
        if self.asked:
            return
        self.asked = reason
        if self.rotation is None:
            log.warning("replacing this daemon's transfer sessions: %s", reason)
            self.port.rotate_sessions()

    def failed(self, reason: str) -> None:
        """New transfer engines could not start: the tick asks again a while later."""
        log.error("could not start new transfer sessions (%s): %s; trying again in %gs", self.asked, reason, RETRY)
        self.book.count_failure("rotation_failed")
        self.asked = ""
        self.retry_at = self.port.clock() + RETRY

    def rotated(self, sessions: Peer) -> None:
        """New transfer engines took over at ``sessions`` (a rotation, or a new engine
        process after the last one died): every prefill hears of them with the legs it may
        move there, and the generation before them ends once every prefill live now said
        it drained, or at the deadline."""
        old, old_sessions = self.generations.current, self.generations.sessions
        self.generations.rotated(sessions)
        reason, self.asked = self.asked or "the transfer engine process ended", ""
        self.cut_waiters, self.cuts_asked = self.cut_waiters + self.cuts_asked, []  # this rotation covers every room failed before it
        self.hello_all()
        if old not in self.generations.live:  # ended already (its process died): nothing to wait for
            self._finish(0)
            return
        now = self.port.clock()
        waiting = {link.endpoint for link in self.state.links.values()
                   if link.ready and link.connected and not self.heartbeats.dead(link.last_word, now)}
        dues = [due for _, due in self._waiting_for_proof()]
        deadline = max(now + MIN_DRAIN, min(dues, default=now + self.bound) - END_MARGIN)
        self.rotation = Rotation(old, old_sessions, reason, now, deadline, waiting)
        log.warning("transfer sessions %s replace %s (%s); %d prefill(s) to move off them within %.1fs",
                    label(sessions), label(old_sessions), reason, len(waiting), deadline - now)
        self._end_if_due(now)

    def drained(self, link: PrefillLink, sessions: Peer) -> None:
        rotation = self.rotation
        if rotation is not None and rotation.sessions == sessions and rotation.drained(link.endpoint):
            self._end_if_due(self.port.clock())

    def _end_if_due(self, now: float) -> None:
        rotation = self.rotation
        if rotation is None or not rotation.due(now):
            return
        rotation.ending = True
        if rotation.waiting:
            log.warning("ending transfer sessions %s although %s did not say they drained within %.1fs: their writes still in "
                        "flight there fail", label(rotation.sessions), ", ".join(sorted(rotation.waiting)), now - rotation.started)
        self.port.end_sessions(rotation.sessions)

    def ended(self, sessions: Peer) -> None:
        """The engines at ``sessions`` ended (we ended them, or their process died): every
        failed room that could be written into no live generation is fenced."""
        if self.generations.ended(sessions) is None:
            return
        fenced = 0
        for room, _ in self._waiting_for_proof():
            if self.generations.all_ended(self.state.work[room.id].span):
                self.book.writers_gone(room)
                fenced += 1
        self.fenced += fenced
        rotation = self.rotation
        if rotation is not None and rotation.sessions == sessions:
            self.rotation = None
            self.rotations += 1
            log.warning("transfer sessions %s ended after %.1fs (%s): %d room(s) waiting for proof fenced",
                        label(sessions), self.port.clock() - rotation.started, rotation.reason, fenced)
            self._finish(fenced)
        elif fenced:
            log.warning("transfer sessions %s ended: %d room(s) waiting for proof fenced", label(sessions), fenced)

    def _finish(self, fenced: int) -> None:
        waiters, self.cut_waiters = self.cut_waiters, []
        self.cuts += len(waiters)
        for answer in waiters:
            answer(fenced)
        if self.asked:  # asked for while this one ran
            self.port.rotate_sessions()

    def _waiting_for_proof(self) -> list[tuple[Room, float]]:
        """Every failed room still waiting for proof, with when it must be fenced at the latest."""
        out = []
        for room in self.book.fence_pending():
            link = self.state.links.get(room.peer)
            out.append((room, fence_due(room.entered, link.last_word if link is not None else room.entered, self.bound)))
        return out

    def fence_in(self, now: float) -> dict[str, float]:
        """Per prefill link, seconds until its waiting rooms must be fenced at the latest."""
        dues: dict[str, float] = {}
        for room, due in self._waiting_for_proof():
            dues[room.peer] = min(max(0.0, due - now), dues.get(room.peer, math.inf))  # overdue reads 0: -1 means none wait
        return dues

    def tick(self, now: float) -> None:
        """End a rotation's old sessions once no live prefill is left to drain them, or at
        its deadline; start a rotation for a room waiting for proof whose prefill went
        silent, or that waited half the fence bound, unless the one running ends its
        sessions already."""
        rotation = self.rotation
        if rotation is not None:
            for endpoint in list(rotation.waiting):  # a prefill that went away drains nothing: its writes end with the sessions
                link = self.state.links.get(endpoint)
                if link is None or not link.connected or self.heartbeats.dead(link.last_word, now):
                    rotation.drained(endpoint)
        self._end_if_due(now)
        if now < self.retry_at:
            return
        if self.cuts_asked and not self.asked and rotation is None:  # its new sessions failed to start: the operator still waits
            self.ask(f"an operator cut, {len(self.cuts_asked)} waiting, tried again")
            return
        for room, _ in self._waiting_for_proof():
            link = self.state.links.get(room.peer)
            silent = link is None or self.heartbeats.dead(link.last_word, now)
            if not (silent or now - room.entered >= self.bound / 2):
                continue
            if rotation is not None and self.state.work[room.id].span.last <= rotation.old:
                continue  # the running rotation ends its sessions
            why = f"prefill {room.peer} silent for {now - link.last_word:.1f}s" if link is not None and silent else \
                f"a room of prefill {room.peer} waited {now - room.entered:.1f}s for its writes to drain"
            self.ask(f"{why}, with rooms waiting for proof that nothing of theirs can land")
            return
