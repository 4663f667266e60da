"""The worker half of PdxferConnector (docs/engines.md §C4): in the process that owns the KV
cache, the only part that talks to the pdxfer daemon. An engine of several TP ranks has
one per rank, each naming its rank to the node's daemon, which works out the legs
between the prefill's ranks and the decode's (core/topology.py).

Each step it posts what the scheduler half handed over (receives, sends, aborts) without
waiting, then polls the rooms in flight from the statuses the daemon pushed. A room is
reported finished once it settled: succeeded, or failed with no write still able to
land (fenced), so vLLM reuses no block a write may reach. A failed receive reports its
own blocks, those after the request's prefix hit, as load errors, and vLLM fails or
recomputes the request (kv_load_failure_policy).

A daemon that goes away fails what was in flight; the worker connects again, and
registers the same memory, once a daemon answers at the endpoint (A10).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
from vllm.model_executor.models.utils import extract_layer_index

from ...client import Client, Slot, settled
from ...core import errors
from ...core.protocol import Rank, RoomState, RoomStatus
from .metadata import PdxferMetadata, Receive, Transmit
from .registration import Registration, register

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

    from .settings import Settings

log = logging.getLogger(__name__)

IDLE_WAIT = 0.005  # seconds an idle step waits for a room to settle, rather than let the engine spin
RECONNECT_EVERY = 1.0  # seconds between attempts to reach a daemon that went away
# Seconds registration may take at start-up (the daemon maps the whole KV cache) and when
# connecting again (the engine's step waits for it); calls after it take settings.timeout.
REGISTER_TIMEOUT, RECONNECT_TIMEOUT = 120.0, 10.0
SLOT_BATCH = 16


@dataclass
class Room:
    room: int
    slot: Slot | None
    pages: tuple[int, ...] = ()  # a receive's blocks: what a failure invalidates
    cancelled: bool = False  # its request ended first: nobody needs its blocks
    failed: bool = False  # its blocks were reported as load errors


class WorkerHalf:
    def __init__(self, settings: Settings, vllm_config: VllmConfig) -> None:
        model = vllm_config.model_config
        self.settings = settings
        self.shape = (model.get_total_num_hidden_layers(), model.get_total_num_kv_heads(), model.get_head_size())
        # vLLM set up its parallel groups before it made the connector
        self.rank = Rank(tp=get_tensor_model_parallel_rank(), pp=get_pp_group().rank_in_group)
        self.sizes = Rank(tp=settings.sizes.tp, pp=settings.sizes.pp)
        self.client: Client | None = None
        self.registration: Registration | None = None
        self._retry_at = 0.0
        self._sending: dict[str, Room] = {}
        self._receiving: dict[str, Room] = {}
        self._sent: set[str] = set()  # settled since the last report
        self._received: set[str] = set()
        self._load_errors: set[int] = set()

    # --- memory and connection

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_layers, kv_heads, head_dim = self.shape
        self.registration = register(kv_caches, extract_layer_index, num_layers, kv_heads, head_dim)
        self.client = self._connect(REGISTER_TIMEOUT)
        log.info("pdxfer: %s TP rank %d of %d registered %d layers in %d buffers (%s) with the daemon at %s", self.settings.engine_id,
                 self.rank.tp, self.sizes.tp, len(self.registration.regions), len(self.registration.buffers), self.registration.device,
                 self.settings.daemon)

    def _connect(self, timeout: float) -> Client:
        """A connection to the daemon holding this engine's registration and a stamp-only
        aux buffer (vLLM recomputes the last prompt token: no aux record, C4)."""
        reg = self.registration
        client = Client(self.settings.daemon, timeout=timeout, engine_id=self.settings.engine_id, slot_batch=SLOT_BATCH,
                        role=self.settings.role, rank=self.rank, sizes=self.sizes, device=reg.device)
        try:
            client.connect()
            client.register_kv(reg.buffers, reg.spec, reg.regions)
            client.create_aux_buffer(self.settings.aux_slots, payload_bytes=0)
        except BaseException:
            client.close()
            raise
        client.timeout = self.settings.timeout
        return client

    def _connected(self) -> Client | None:
        """The daemon connection, made again (at most every RECONNECT_EVERY) after one went away."""
        if self.client is None and time.monotonic() >= self._retry_at:
            self._retry_at = time.monotonic() + RECONNECT_EVERY
            try:
                self.client = self._connect(RECONNECT_TIMEOUT)
                log.info("pdxfer: %s connected again to the daemon at %s", self.settings.engine_id, self.settings.daemon)
            except errors.PdxferError as exc:
                log.warning("pdxfer: no daemon at %s yet: %s", self.settings.daemon, exc)
        return self.client

    def _lost(self, exc: errors.PdxferError) -> None:
        """The daemon went away: nothing it held can still be written, so every room in
        flight is settled, failed."""
        log.error("pdxfer: %s; %d sends and %d receives in flight fail", exc, len(self._sending), len(self._receiving))
        self.client.close()
        self.client = None
        self._retry_at = time.monotonic() + RECONNECT_EVERY
        for req_id in list(self._sending):
            self._settle(req_id, False, None, "the daemon went away")
        for req_id in list(self._receiving):
            self._settle(req_id, True, None, "the daemon went away")

    # --- each step

    def start(self, meta: PdxferMetadata) -> None:
        """Post what the scheduler half handed over, none of it waiting for the daemon.
        A daemon lost midway fails what is in flight, and what follows fails at once."""
        self._connected()
        for room in meta.aborts:
            self._guarded(self._abort, room, "the prefill request ended without computing its prompt")
        for req_id in meta.cancels:
            r = self._receiving.get(req_id)
            if r is not None and not r.cancelled:
                r.cancelled = True
                self._guarded(self._abort, r.room, "the decode request ended")
        for receive in meta.receives:
            self._receiving[receive.req_id] = Room(receive.room, None, receive.pages)
            self._guarded(self._expect, receive)
        for send in meta.sends:
            self._sending[send.req_id] = Room(send.room, None)
            self._guarded(self._send, send)
        if meta.idle and (self._sending or self._receiving):
            self._guarded(self._idle_wait, next(iter(self._receiving.values() or self._sending.values())).room)

    def _guarded(self, call, *args) -> None:
        try:
            call(*args)
        except errors.DaemonGone as exc:
            self._lost(exc)

    def _expect(self, receive: Receive) -> None:
        why = f"not expected from prefill {receive.engine} at {receive.bootstrap}"
        if self.client is None:
            self._settle(receive.req_id, True, None, f"{why}: no daemon at {self.settings.daemon}")
            return
        r = self._receiving[receive.req_id]
        try:
            r.slot = self.client.alloc_slot()
            prefill = receive.prefill_sizes
            self.client.expect(receive.room, receive.bootstrap, receive.pages, r.slot, skip_pages=receive.skip_pages,
                               prefill_sizes=Rank(tp=prefill.tp, pp=prefill.pp), wait=False)
        except errors.DaemonGone:
            raise
        except errors.PdxferError as exc:
            self._settle(receive.req_id, True, None, f"{why}: {exc}")

    def _send(self, send: Transmit) -> None:
        if self.client is None:
            self._settle(send.req_id, False, None, f"not sent: no daemon at {self.settings.daemon}")
            return
        r = self._sending[send.req_id]
        try:
            r.slot = self.client.alloc_slot()
            self.client.send(send.room, send.pages, send.num_tokens, r.slot, aux_bytes=0, wait=False, release_when_settled=True)
        except errors.DaemonGone:
            raise
        except errors.PdxferError as exc:
            self._settle(send.req_id, False, None, f"not sent: {exc}")

    def _idle_wait(self, room: int) -> None:
        """Wait a moment for ``room`` to settle (statuses of others are taken meanwhile)."""
        try:
            self.client.wait(room, timeout=IDLE_WAIT)
        except errors.DaemonGone:
            raise
        except errors.PdxferError:  # not settled yet, or refused: finished() polls it
            pass

    def _abort(self, room: int, reason: str) -> None:
        if self.client is None:
            return
        try:
            self.client.abort(room, reason)
        except errors.DaemonGone:
            raise
        except errors.PdxferError as exc:
            log.warning("pdxfer: room %d not aborted: %s", room, exc)

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose send or receive settled since the last call."""
        try:
            for receiving, table in ((False, self._sending), (True, self._receiving)):
                for req_id, r in list(table.items()):
                    self._check(req_id, r, receiving)
        except errors.DaemonGone as exc:
            self._lost(exc)
        sent, received, self._sent, self._received = self._sent, self._received, set(), set()
        return sent or None, received or None

    def _check(self, req_id: str, r: Room, receiving: bool) -> None:
        """Settle the room if it settled. A refusal of what was posted for it settles it
        too: the daemon never took it, so nothing of it is in flight. A receive that
        failed reports its blocks at once, fenced or not: vLLM ends the request (or
        readies its recomputation) now, and holds the blocks until the room settled."""
        try:
            status = self.client.poll(r.room)
        except errors.DaemonGone:
            raise
        except errors.PdxferError as exc:
            self._settle(req_id, receiving, None, f"refused: {exc}")
            return
        if receiving and status.state is RoomState.FAILED:
            self._failed(r, status.reason)
        if settled(status):
            self._settle(req_id, receiving, status)

    def _settle(self, req_id: str, receiving: bool, status: RoomStatus | None, why: str = "") -> None:
        """Report the request's room settled: ``status`` once it succeeded or failed and
        is fenced, None when the daemon never took the room (``why``). A failed receive's
        blocks are load errors; a send the daemon never took is aborted, so that its
        decode learns now rather than at its timeout."""
        table, done = (self._receiving, self._received) if receiving else (self._sending, self._sent)
        r = table.pop(req_id)
        done.add(req_id)
        if self.client is not None:
            if status is not None and receiving:
                self.client.release(r.room, wait=False)  # the room, and its slot with it
            elif status is None:
                self._give_back(r, receiving)
        if status is not None and status.state is RoomState.SUCCESS:
            return
        reason = status.reason if status is not None else why
        if receiving:
            self._failed(r, reason)
        else:
            log.warning("pdxfer: room %d's send failed: %s", r.room, reason)

    def _failed(self, r: Room, reason: str) -> None:
        if not r.failed and not r.cancelled:
            r.failed = True
            log.warning("pdxfer: room %d failed, its %d blocks are load errors: %s", r.room, len(r.pages), reason)
            self._load_errors.update(r.pages)

    def _give_back(self, r: Room, receiving: bool) -> None:
        """A room the daemon never took: its slot back, and (prefill) the room aborted."""
        if r.slot is not None:
            try:
                self.client.free_slot(r.slot)
            except errors.DaemonGone:
                raise
            except errors.PdxferError:  # bound after all: it goes with the room
                pass
        if not receiving:
            self._abort(r.room, "the prefill could not send it")

    def load_errors(self) -> set[int]:
        """The blocks of receives that failed since the last call: only the blocks each
        room was to write, never the request's prefix-cache hit (C4)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        for shm in self.registration.shared if self.registration else ():
            shm.close()
