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

The daemon session is the adapters' one (adapters/session.py): a daemon that goes away
fails what was in flight, settled at once as nothing of it can land; the worker connects
again at the start of a step, and registers the same memory, once a daemon answers at
the endpoint (A10). A room the daemon refused settles failed the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
from vllm.model_executor.models.utils import extract_layer_index

from ...client import settled
from ...core import errors
from ...core.protocol import Rank, RoomState, RoomStatus
from ..session import Session, Timeouts
from .metadata import PdxferMetadata
from .registration import Registration, register

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .settings import Settings

log = logging.getLogger(__name__)

IDLE_WAIT = 0.005  # seconds an idle step waits for a room to settle, rather than let the engine spin
# Seconds registration may take at start-up (the daemon maps the whole KV cache) and when
# connecting again (the engine's step waits for it); calls after it take settings.timeout.
REGISTER_TIMEOUT, RECONNECT_TIMEOUT = 120.0, 10.0


@dataclass
class Room:
    room: int
    pages: tuple[int, ...] = ()  # a receive's blocks: what a failure invalidates
    cancelled: bool = False  # its request ended first: nobody needs its blocks
    failed: bool = False  # its blocks were reported as load errors


def attention_caches(forward_context: dict) -> list[torch.Tensor]:
    """The KV cache tensors the attention layers compute with (``layer.kv_cache``: a
    tensor, or one per virtual engine)."""
    out = []
    for layer in forward_context.values():
        cache = getattr(layer, "kv_cache", None)
        out += [t for t in (cache if isinstance(cache, (list, tuple)) else [cache]) if isinstance(t, torch.Tensor)]
    return out


class WorkerHalf:
    def __init__(self, settings: Settings, vllm_config: VllmConfig) -> None:
        model = vllm_config.model_config
        self.settings = settings
        # An MLA model's head size is its latent's width (kv_lora_rank + qk_rope_head_dim), one "head" on every rank.
        self.mla = model.use_mla
        self.forward_context = vllm_config.compilation_config.static_forward_context  # the attention layers, by name
        self.shape = (model.get_total_num_hidden_layers(), 1 if self.mla else model.get_total_num_kv_heads(), model.get_head_size())
        # vLLM set up its parallel groups before it made the connector
        self.rank = Rank(tp=get_tensor_model_parallel_rank(), pp=get_pp_group().rank_in_group)
        self.sizes = Rank(tp=settings.sizes.tp, pp=settings.sizes.pp)
        self.session: Session | None = None
        self.registration: Registration | None = None
        self._sending: dict[str, Room] = {}
        self._receiving: dict[str, Room] = {}
        self._sent: set[str] = set()  # settled since the last report
        self._received: set[str] = set()
        self._load_errors: set[int] = set()

    # --- memory and connection

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the KV cache and a stamp-only aux buffer (vLLM recomputes the last
        prompt token: no aux record, C4) with the daemon."""
        num_layers, kv_heads, head_dim = self.shape
        reg = self.registration = register(kv_caches, extract_layer_index, num_layers, kv_heads, head_dim, self.mla,
                                           bound=attention_caches(self.forward_context))
        self.session = Session(self.settings.daemon, engine_id=self.settings.engine_id, role=self.settings.role, rank=self.rank,
                               sizes=self.sizes, device=reg.device, kv=reg, aux_slots=self.settings.aux_slots, aux_bytes=0,
                               timeouts=Timeouts(register=REGISTER_TIMEOUT, reconnect=RECONNECT_TIMEOUT, call=self.settings.timeout))
        self.session.open()
        log.info("pdxfer: %s TP rank %d of %d registered %d layers in %d buffers (%s) with the daemon at %s", self.settings.engine_id,
                 self.rank.tp, self.sizes.tp, len(reg.regions), len(reg.buffers), reg.device, self.settings.daemon)

    # --- each step

    def start(self, meta: PdxferMetadata) -> None:
        """Post what the scheduler half handed over, none of it waiting for the daemon.
        A daemon lost midway fails what is in flight (``finished`` reports it), and what
        follows fails at once."""
        self.session.keep_connected()
        for room in meta.aborts:
            self.session.abort(room, "the prefill request ended without computing its prompt")
        for req_id in meta.cancels:
            r = self._receiving.get(req_id)
            if r is not None and not r.cancelled:
                r.cancelled = True
                self.session.abort(r.room, "the decode request ended")
        for receive in meta.receives:
            self._receiving[receive.req_id] = Room(receive.room, receive.pages)
            prefill = receive.prefill_sizes
            try:
                self.session.expect(receive.room, receive.bootstrap, receive.pages, skip_pages=receive.skip_pages,
                                    prefill_sizes=Rank(tp=prefill.tp, pp=prefill.pp))
            except errors.PdxferError as exc:
                self._settle(receive.req_id, True, None, f"not expected from prefill {receive.engine} at {receive.bootstrap}: {exc}")
        for send in meta.sends:
            self._sending[send.req_id] = Room(send.room)
            try:  # the daemon releases the room once it settled
                self.session.send(send.room, send.pages, num_tokens=send.num_tokens, release_when_settled=True)
            except errors.PdxferError as exc:
                self._settle(send.req_id, False, None, f"not sent: {exc}")
        if meta.idle and (self._sending or self._receiving):
            self.session.wait(next(iter(self._receiving.values() or self._sending.values())).room, IDLE_WAIT)

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose send or receive settled since the last call."""
        for receiving, table in ((False, self._sending), (True, self._receiving)):
            for req_id, r in list(table.items()):
                self._check(req_id, r, receiving)
        sent, received, self._sent, self._received = self._sent, self._received, set(), set()
        return sent or None, received or None

    def _check(self, req_id: str, r: Room, receiving: bool) -> None:
        """Settle the room if it settled: the daemon's word, or the session's when the
        daemon refused it or went away. A receive that failed reports its blocks at once,
        fenced or not: vLLM ends the request (or readies its recomputation) now, and holds
        the blocks until the room settled."""
        status = self.session.status(r.room)
        if status is None:  # the daemon did not answer in time: asked again next step
            return
        if receiving and status.state is RoomState.FAILED:
            self._failed(r, status.reason)
        if settled(status):
            self._settle(req_id, receiving, status)

    def _settle(self, req_id: str, receiving: bool, status: RoomStatus | None, why: str = "") -> None:
        """Report the request's room settled: ``status`` once it succeeded or failed and
        is fenced, None when it was never posted (``why``). The daemon recycles the room
        (and its slot); a failed receive's blocks are load errors."""
        table, done = (self._receiving, self._received) if receiving else (self._sending, self._sent)
        r = table.pop(req_id)
        done.add(req_id)
        self.session.release(r.room)
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

    def load_errors(self) -> set[int]:
        """The blocks of receives that failed since the last call: only the blocks each
        room was to write, never the request's prefix-cache hit (C4)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        for shm in self.registration.shared if self.registration else ():
            shm.close()
