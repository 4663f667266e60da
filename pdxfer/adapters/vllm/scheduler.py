"""The scheduler half of PdxferConnector (docs/engines.md §C3).

Decode: a request whose params name a prefill loads every prompt token after its local
prefix-cache hit, asynchronously; its blocks for those tokens, and only those, go to the
worker half with the hit as ``skip_pages``. Prefill: a request that finished by itself
hands its prompt's blocks to the worker half for a send and keeps them until the send
settled; one that did not (an abort) aborts its room, so the decode learns at once.

One instance per engine core, driven by vLLM's scheduler on one thread. It never talks
to a daemon: the worker half does, one per rank, each posting the same rooms for its
own rank, and vLLM counts a request finished once every rank reported it
(get_finished).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from . import params
from .metadata import PdxferMetadata, Receive, Transmit
from .params import FromPrefill, ToDecode

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

# A request that finished by itself has computed its whole prompt, whichever token it
# stopped on: its KV is sent. Any other end (aborted, ignored, failed) aborts the room.
SENDABLE = frozenset({RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_REPETITION})


def pages_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class SchedulerHalf:
    def __init__(self, block_size: int, engine_id: str, bootstrap: str | None, sizes: params.Sizes) -> None:
        self.block_size = block_size
        self.engine_id = engine_id
        self.bootstrap = bootstrap  # this engine's daemon, named in the prefill's answer
        self.sizes = sizes  # this engine's, named in the prefill's answer
        self._asks: dict[str, ToDecode | FromPrefill] = {}  # disaggregated requests by id, until they finish
        self._loaded: set[str] = set()  # decode requests that had their one remote load
        self._receiving: dict[str, int] = {}  # decode: room of each receive the worker runs, until it reports it
        self._sending: dict[str, int] = {}  # prefill: room of each send whose blocks are held, until it settled
        self._meta = PdxferMetadata()  # what the next step's worker half is told

    def on_new_request(self, request: Request) -> None:
        try:
            ask = params.read(request.kv_transfer_params)
        except ValueError as exc:
            log.warning("request %s runs without pdxfer: %s", request.request_id, exc)
            return
        if ask is not None:
            self._asks[request.request_id] = ask

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Side-effect free: vLLM may ask again before it allocates."""
        if not isinstance(self._asks.get(request.request_id), FromPrefill) or request.request_id in self._loaded:
            return 0, False
        missing = request.num_prompt_tokens - num_computed_tokens
        return (missing, True) if missing > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        ask = self._asks.get(req_id)
        if not isinstance(ask, FromPrefill) or req_id in self._loaded:
            return
        self._loaded.add(req_id)  # one load per request: after a preemption it recomputes
        if num_external_tokens == 0:  # vLLM chose to compute it (prompt logprobs, say)
            log.warning("request %s computes its prompt here; room %d's prefill holds its blocks until its bootstrap timeout", req_id, ask.room)
            return
        local = request.num_prompt_tokens - num_external_tokens
        # vLLM drops a partial local block when a longer remote hit exists (scheduler.py,
        # "Remote strictly exceeds the full local hit"), so the hit is whole blocks.
        assert local % self.block_size == 0, f"local prefix of {local} tokens is not whole {self.block_size}-token blocks"
        skip = local // self.block_size
        (block_ids,) = blocks.get_block_ids()
        pages = tuple(block_ids[skip : pages_for(request.num_prompt_tokens, self.block_size)])
        self._meta.receives.append(Receive(req_id=req_id, room=ask.room, bootstrap=ask.bootstrap, engine=ask.engine, pages=pages, skip_pages=skip,
                                          prefill_sizes=ask.sizes))
        self._receiving[req_id] = ask.room

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PdxferMetadata:
        meta, self._meta = self._meta, PdxferMetadata()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving or ():
            self._receiving.pop(req_id, None)
        for req_id in output.finished_sending or ():
            self._sending.pop(req_id, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        ask = self._asks.pop(req_id, None)
        self._loaded.discard(req_id)
        if isinstance(ask, FromPrefill):
            if req_id in self._receiving:  # vLLM holds its blocks until the worker reports the room settled
                self._meta.cancels.append(req_id)
            return False, None
        if ask is None:
            return False, None
        if request.status not in SENDABLE or not block_ids:
            if ask.room is not None:
                self._meta.aborts.append(ask.room)
            return False, None
        room = ask.room or params.new_room()
        pages = tuple(block_ids[: pages_for(request.num_prompt_tokens, self.block_size)])
        self._meta.sends.append(Transmit(req_id=req_id, room=room, pages=pages, num_tokens=request.num_prompt_tokens))
        self._sending[req_id] = room
        return True, params.answer(room, self.bootstrap, self.engine_id, self.sizes)

    def has_pending_push_work(self) -> bool:
        return bool(self._sending)
