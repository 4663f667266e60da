"""pdxfer's SGLang transfer backend: the manager, sender, receiver and bootstrap server
SGLang's schedulers create for ``--disaggregation-transfer-backend pdxfer`` (docs/engines.md
§G2, B2, B3).

They subclass SGLang's ``Common*`` classes, so the schedulers' reach into those keeps
working: the HTTP ``/route`` registry, rank mapping, DP-rank queries, ``/health``
heartbeat, the forward-only status table and the timeouts. Only the data plane is
pdxfer's: each rank's ``/route`` row names its pdxfer daemon's bootstrap endpoint
instead of a ZMQ socket; the prefill announces a room when its sender is made, learns the
decode's prefix from the pushed status and sends each chunk as SGLang hands it over; the
decode expects the room into its pages and its aux slot. Every status SGLang polls comes
from those the daemon pushed. A failed room reads as failed once no write for it can land;
on the decode, with SGLang's deferred release on (its default), at once, SGLang then
holding the room's pages until pdxfer fences it.

SGLang's metadata rows travel as the room's aux record (B5 v1): the prefill copies the
room's row of every metadata buffer into its aux slot with the last chunk, the decode
copies the record back into its rows before it reports Success, so SGLang's metadata
gate opens only on a complete record.
"""

from __future__ import annotations

import logging
import time

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_device, get_disagg, get_parallel, get_serving

from ...core import errors
from ...core.protocol import Rank, Role, RoomState, RoomStatus
from ...core.topology import local_heads
from ..cuda import event_after
from .layout import registration
from .link import Link, Rows, daemon_endpoint, prefill_daemon, release_timeout_refusal, unsupported_ranks
from .places import locate

log = logging.getLogger("pdxfer.sglang")

AUX_SLOTS_PER_ROW = 2  # aux slots per metadata row: a failed room's slot stays quarantined until it is fenced


def unsupported(args: KVArgs, parallel, mla_hybrid: bool) -> list[str]:
    """What this backend cannot carry yet, as a user would name it."""
    found = []
    if args.state_types:
        found.append(f"state components ({', '.join(t.value for t in args.state_types)}: mamba, SWA, DSA and other hybrid models)")
    if mla_hybrid:
        found.append("hybrid MLA KV pools")
    if args.num_draft_entries:
        found.append("speculative decoding (the draft model's KV)")
    if args.kv_layout is not None:
        found.append(f"the {args.kv_layout!r} KV layout")
    if envs.SGLANG_DISAGG_STAGING_BUFFER.get():
        found.append("staging buffers (SGLANG_DISAGG_STAGING_BUFFER)")
    if parallel.attn_dcp_size > 1:
        found.append("decode context parallelism (DCP)")
    if get_disagg().disaggregation_decode_allocation_policy != "early":
        found.append(f"the {get_disagg().disaggregation_decode_allocation_policy!r} decode allocation policy")
    found += unsupported_ranks(Rank(dp=parallel.attn_dp_size, pp=parallel.pp_size, tp=parallel.attn_tp_size, cp=parallel.attn_cp_size))
    return found


def _model_facts(args: KVArgs, server_args, attn_tp_size: int, mla: bool) -> tuple[str, int, int]:
    """(KV dtype, KV heads on this rank, in the model), from the model's config on both
    sides alike: the decode's KVArgs carry no heads, and a dtype of "auto" means the
    model's, which compat must compare."""
    from sglang.srt.configs.model_config import ModelConfig

    model = ModelConfig.from_server_args(server_args)
    dtype = args.kv_cache_dtype_str
    if dtype == "auto":
        dtype = str(model.dtype).removeprefix("torch.")
    if mla:
        return dtype, 1, 1
    total = model.get_total_num_kv_heads()
    return dtype, local_heads(total, attn_tp_size), total


def _failure(status: RoomStatus) -> str:
    code = status.code.value if status.code is not None else "failed"
    return f"pdxfer [{code}] {status.reason}"


class PdxferKVManager(CommonKVManager):
    supports_deferred_decode_kv_release = True  # a held room is released when pdxfer says it is fenced
    supports_host_destination = False
    reports_transfer_latency = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args, is_mla_backend: bool = False):
        parallel = get_parallel()
        refused = unsupported(args, parallel, getattr(args, "is_hybrid_mla_backend", False))
        if refused:
            raise ValueError(
                "--disaggregation-transfer-backend pdxfer does not support " + "; ".join(refused)
                + " yet; use the mooncake or nixl backend for this setup"
            )
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        if not prefill and not envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get():
            raise ValueError(
                "--disaggregation-transfer-backend pdxfer needs SGLang's deferred decode KV release: with "
                "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE off, SGLang frees an aborted request's decode pages "
                "while the prefill daemon may still be writing them; unset it (it is on by default)"
            )
        role = Role.PREFILL if prefill else Role.DECODE
        dtype, heads_local, heads_total = _model_facts(args, server_args, parallel.attn_tp_size, bool(is_mla_backend))
        first_layer = getattr(args, "prefill_start_layer", 0) or 0
        per_layer = 1 if is_mla_backend else 2
        kv = registration(
            args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, page_size=args.page_size, dtype=dtype,
            first_layer=first_layer, num_layers_total=first_layer + len(args.kv_data_ptrs) // per_layer,
            heads_local=heads_local, heads_total=heads_total, mla=bool(is_mla_backend), locate=locate,
        )
        device = get_device().device
        serving = get_serving()
        self.link = Link(
            daemon_endpoint(role.value), engine_id=f"sglang-{role.value}@{serving.host}:{serving.port}", role=role,
            rank=Rank(dp=parallel.attn_dp_rank, pp=parallel.pp_rank, tp=parallel.attn_tp_rank, cp=parallel.attn_cp_rank),
            sizes=Rank(dp=parallel.attn_dp_size, pp=parallel.pp_size, tp=parallel.attn_tp_size, cp=parallel.attn_cp_size),
            device=device if device == "cpu" else f"{device}:{args.gpu_id}", kv=kv,
            rows=Rows(args.aux_data_ptrs, args.aux_item_lens), aux_slots=AUX_SLOTS_PER_ROW * args.aux_data_lens[0] // args.aux_item_lens[0],
        )
        self.link.open()
        refusal = "" if prefill else release_timeout_refusal(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get(), self.link.fence_bound)
        if refusal:
            self.link.close()
            raise ValueError(f"--disaggregation-transfer-backend pdxfer: {refusal}")
        self.skip_pages: dict[int, int] = {}  # prefill: room -> pages of it the decode already holds
        self.sent_tokens: dict[int, int] = {}  # prefill: room -> tokens sent so far
        self.cuda = device == "cuda"
        self.events: dict[int, list] = {}  # prefill: room -> the CUDA events the daemon may wait on (A11)
        self.retired_events: list = []  # those of rooms SGLang is done with, kept until they completed
        self._event_stream = None  # prefill on GPU: where those events are recorded
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if not prefill:
            self._start_heartbeat_checker_thread()

    def register_to_bootstrap(self) -> None:
        """This rank's /route row names its daemon's bootstrap endpoint: what the decode
        rank hands its own daemon as the room's source (B2)."""
        self.local_ip, self.rank_port = self.link.bootstrap
        super().register_to_bootstrap()

    def add_transfer_request(self, bootstrap_room: int, kv_indices, index_slice, is_last_chunk: bool, aux_index=None,
                             state_indices=None, num_kv_tokens=None, wait_event=None, indices_event=None, trace_ctx=None) -> None:
        """One chunk from CommonKVSender.send: its pages go to the daemon at once. Page
        positions count the room's prompt from 0; SGLang counts them after the decode's
        prefix, which the daemon drops anyway.

        No chunk needs an event but ``wait_event``'s (A11): SGLang sends a chunk once the
        forward that wrote it has been waited for, and its mooncake backend reads the
        pages on that alone. ``process_batch_result_disagg_prefill`` synchronizes the
        result copy, which the copy stream orders after the forward, before it sends the
        last chunk and, under the overlap scheduler, the middle ones; without overlap a
        middle chunk goes in the next step, after that synchronize. Only the early send
        of a cached prefix may run ahead of a forward still writing those pages, and it
        carries that forward's event."""
        room = bootstrap_room
        cuda_event = self._after(room, wait_event) if wait_event is not None else b""
        skip = self.skip_pages.get(room, 0)
        tokens = self.sent_tokens.get(room, 0) + (num_kv_tokens or 0)
        self.sent_tokens[room] = tokens
        try:
            self.link.send(room, kv_indices, skip + index_slice.start, last=is_last_chunk,
                           num_tokens=skip * self.kv_args.page_size + tokens, row=aux_index if is_last_chunk else -1,
                           cuda_event=cuda_event)
        except errors.PdxferError as exc:  # the link aborted the room
            self.record_failure(room, f"pdxfer [{exc.code.value}] {exc.message}")
            self.update_status(room, KVPoll.Failed)

    def _after(self, room: int, wait_event) -> bytes:
        """The IPC handle of an event that completes after ``wait_event``, for the daemon to
        wait on before it reads the chunk (A11), so the scheduler does not block on the
        forward. Recorded on a stream of its own: the scheduler's current stream made to
        wait would hold back the work SGLang overlaps with that forward. On CPU there is
        no such event to export: wait here."""
        if not self.cuda:
            wait_event.synchronize()
            return b""
        import torch

        self.retired_events = [e for e in self.retired_events if not e.query()]
        if self._event_stream is None:
            self._event_stream = torch.cuda.Stream()
        event, handle = event_after(wait_event, self._event_stream)
        self.events.setdefault(room, []).append(event)
        return handle

    def retire(self, room: int) -> None:
        """SGLang is done with ``room``: its prefill-side state goes, but an event the
        daemon may still be waiting on lives until it completed."""
        self.skip_pages.pop(room, None)
        self.sent_tokens.pop(room, None)
        self.retired_events += self.events.pop(room, [])

    def absorb_prefill(self, room: int) -> None:
        """The daemon's news of a prefill room, into SGLang's status table."""
        self.link.tidy()
        status = self.link.status(room)
        if status is None:
            return
        if status.state is RoomState.WAITING_FOR_INPUT and room not in self.skip_pages:
            self.skip_pages[room] = status.skip_pages
            self.req_to_decode_prefix_len[room] = status.skip_pages * self.kv_args.page_size
            self.update_status(room, KVPoll.WaitingForInput)
        elif status.state is RoomState.SUCCESS:
            self.update_status(room, KVPoll.Success)
        elif status.state is RoomState.FAILED and status.fenced:
            self.record_failure(room, _failure(status))
            self.update_status(room, KVPoll.Failed)

    def forget(self, room: int) -> None:
        """SGLang is done with the room: stop it if it is still live, let the daemon
        recycle it once no write for it can land (Link.release)."""
        if not self.link.quiet(room):
            self.link.abort(room, "SGLang dropped the request")
        self.link.release(room)
        self.retire(room)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """A held decode room's pages may be reused once pdxfer says no write can land."""
        self.link.tidy()
        return self.link.quiet(bootstrap_room)


class PdxferKVSender(CommonKVSender):
    supports_host_tensor_indices = False  # page indices as a numpy array, on every device

    def __init__(self, mgr: PdxferKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False):
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        if self.conclude_state is not None or mgr.request_status.get(bootstrap_room) == KVPoll.Failed:
            return
        try:
            mgr.link.announce(bootstrap_room)
        except errors.PdxferError as exc:
            mgr.record_failure(bootstrap_room, f"pdxfer [{exc.code.value}] {exc.message}")
            mgr.update_status(bootstrap_room, KVPoll.Failed)

    def poll(self) -> KVPoll:
        if self.conclude_state is None:
            self.kv_mgr.absorb_prefill(self.bootstrap_room)
        return super().poll()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)

    def abort(self) -> None:
        """SGLang retires an aborted prefill request without clear(): the room goes once it settled."""
        super().abort()
        mgr, room = self.kv_mgr, self.bootstrap_room
        mgr.link.abort(room, "aborted by SGLang")
        mgr.link.drop(room)
        mgr.retire(room)


class PdxferKVReceiver(CommonKVReceiver):
    aux_index: int | None = None
    _record_in: bool = False  # the aux record is in the metadata rows

    def _register_kv_args(self) -> bool:
        """The prefill's rows name pdxfer daemons, which learn of this rank from its own daemon."""
        return self.bootstrap_infos is not None

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination=KVTransferDestination.DEVICE, device_kv_indices=None) -> None:
        mgr = self.kv_mgr
        room = self.bootstrap_room
        if self.bootstrap_infos is None:
            mgr.record_failure(room, f"could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}")
            mgr.update_status(room, KVPoll.Failed)
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("Host KV destinations are not supported")
        prefix = decode_prefix_len or 0
        page_size = mgr.kv_args.page_size
        info = self.prefill_info
        try:
            if prefix % page_size:
                raise errors.BadMessage(f"a decode prefix of {prefix} tokens is not a whole number of {page_size}-token pages")
            # The daemon works out from both sides' sizes which prefill ranks write which heads here.
            source = prefill_daemon([(row["rank_ip"], row["rank_port"]) for row in self.bootstrap_infos])
            mgr.link.expect(room, source, kv_indices, prefix // page_size, prefill_sizes=Rank(tp=info.attn_tp_size, pp=info.pp_size))
        except errors.PdxferError as exc:
            mgr.record_failure(room, f"pdxfer [{exc.code.value}] {exc.message}")
            mgr.update_status(room, KVPoll.Failed)
            return
        self.aux_index = aux_index
        self.init_time = time.time()

    def _poll(self) -> KVPoll:
        self.kv_mgr.link.tidy()
        if self.conclude_state is None and self.aux_index is not None:
            self._absorb()
        return super()._poll()

    def _absorb(self) -> None:
        mgr, room = self.kv_mgr, self.bootstrap_room
        status = mgr.link.status(room)
        if status is None:
            return
        if status.state is RoomState.SUCCESS and not self._record_in:
            try:
                mgr.link.rows.scatter(self.aux_index, mgr.link.record(room))
            except errors.PdxferError as exc:
                mgr.record_failure(room, f"pdxfer [{exc.code.value}] {exc.message}")
                mgr.update_status(room, KVPoll.Failed)
                return
            self._record_in = True
            mgr.update_status(room, KVPoll.Success)
        elif status.state is RoomState.FAILED and (status.fenced or mgr.enable_deferred_decode_kv_release):
            # Unfenced, the request fails now all the same: SGLang holds its pages and
            # row (deferred release) until is_abort_release_safe says pdxfer fenced it.
            mgr.record_failure(room, _failure(status))
            mgr.update_status(room, KVPoll.Failed)

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        """The prefill learns of an abort from the daemons; this rank's pages are
        released when pdxfer fences the room (is_abort_release_safe)."""
        self.kv_mgr.link.abort(self.bootstrap_room, "aborted by SGLang")

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.forget(self.bootstrap_room)


class PdxferKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's own /route registry (the Rust server may stand in for it)."""


CLASSES = {
    "manager": PdxferKVManager,
    "sender": PdxferKVSender,
    "receiver": PdxferKVReceiver,
    "bootstrap_server": PdxferKVBootstrapServer,
}
