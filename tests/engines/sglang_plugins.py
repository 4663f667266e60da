"""Test-only SGLang plugins, loaded in every SGLang process through the
``sglang.srt.plugins`` entry point group (the harness puts a ``.dist-info`` naming
them on the workers' PYTHONPATH, see `sglang_pd.plugin_path`). Nothing in SGLang is
patched on disk.

- ``mooncake_cpu``: SGLang's Mooncake sender takes page indices as pinned host
  tensors plus a ``torch.cuda.Event`` when it says ``supports_host_tensor_indices``;
  on CPU that path fails, so the sender says it does not (docs/engines.md §E4).
- ``kvargs_dump``: with ``PDXFER_TEST_KVARGS_DIR`` set, every KV manager writes the
  ``KVArgs`` it was built with to ``<dir>/<role>-<engine_rank>.json``: what a
  transfer backend is handed at start.
- ``transfer_log``: with ``PDXFER_TEST_TRANSFER_LOG_DIR`` set, the calls the
  schedulers make on senders and receivers (`LOGGED`), one JSON line each, in
  ``<dir>/<pid>.jsonl``: which rooms were sent in chunks, what prefix the decode
  skipped, and when (``t``, wall clock) and by which process (``pid``: a server with
  several ranks has a scheduler process per rank). It hooks SGLang's ``Common*`` classes, so a
  backend's method that does not call ``super()`` is not seen; `log_calls` hooks other
  targets.
- ``decode_log``: with the same directory set, what the decode scheduler does with a
  room after its transfer (`DECODE_LOGGED`): when its first token went out
  (``first_token``), when a failed room's pages began to be held for deferred release
  (``hold``) and when they went back to the pool (``release_pages``), with the
  backend's ``is_abort_release_safe`` at that moment.
- ``mla_torch_native``: lets SGLang's CPU attention (``torch_native``) run a DeepSeek
  model's MLA. SGLang picks how a DeepSeek layer attends from a registry of attention
  backends that has no ``torch_native`` entry; the fallback it takes computes an
  extend without prefix as plain multi-head attention over K and V it hands the
  backend (192 and 128 wide), but ``torch_native`` always reads K and V back from the
  pool, which holds the 576-wide latent, and the prefill fails on the shapes. The
  plugin registers ``torch_native`` with the absorbed MLA path for every forward (the
  query projected into the latent space, attention over the pool's latent rows), which
  is what ``torch_native`` computes. A test-only setting of the engine: the KV a
  transfer backend moves (the pool's latent rows) is the same either way."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import time

KVARGS_DIR_ENV = "PDXFER_TEST_KVARGS_DIR"
TRANSFER_LOG_DIR_ENV = "PDXFER_TEST_TRANSFER_LOG_DIR"

_COMMON = "sglang.srt.disaggregation.common.conn."
# target -> the record of one call: (self, positional args, keyword args, result)
LOGGED = {
    _COMMON + "CommonKVSender.init": lambda s, a, k, r: {
        "num_pages": int(_arg(a, k, 0, "num_kv_indices")),
        "aux_index": _arg(a, k, 1, "aux_index"),
    },
    _COMMON + "CommonKVSender.send": lambda s, a, k, r: {
        "pages": len(_arg(a, k, 0, "kv_indices")),
        "num_kv_tokens": _arg(a, k, 2, "num_kv_tokens"),
        "with_state": _arg(a, k, 1, "state_indices") is not None,
    },
    _COMMON + "CommonKVSender.pop_decode_prefix_len": lambda s, a, k, r: {"prefix_len": r},
    _COMMON + "CommonKVReceiver.send_metadata": lambda s, a, k, r: {
        "pages": len(_arg(a, k, 0, "kv_indices")),
        "aux_index": _arg(a, k, 1, "aux_index"),
        "decode_prefix_len": _arg(a, k, 3, "decode_prefix_len"),
    },
}

_DECODE = "sglang.srt.disaggregation.decode.DecodeTransferQueue."
_PROCESSOR = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."


def _release_record(queue, args, kwargs, result) -> dict:
    decode_req = _arg(args, kwargs, 0, "decode_req")
    receiver = decode_req.kv_receiver
    room = int(decode_req.req.bootstrap_room)
    acks = len(getattr(receiver, "bootstrap_infos", None) or ()) if receiver is not None else 0
    safe = receiver.kv_mgr.is_abort_release_safe(room, acks) if receiver is not None else None
    return {"call": "release_pages", "room": room, "safe": safe}


DECODE_LOGGED = {
    # The prebuilt batch streams each request's first token (the prefill's, from aux).
    _PROCESSOR + "process_batch_result_prebuilt": lambda s, a, k, r: [
        {"call": "first_token", "room": int(req.bootstrap_room)} for req in _arg(a, k, 0, "batch").reqs
    ],
    _DECODE + "_defer_release": lambda s, a, k, r: {"call": "hold", "room": int(_arg(a, k, 0, "decode_req").req.bootstrap_room)},
    _DECODE + "_release_request": _release_record,
}


def mla_torch_native() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)


def mooncake_cpu() -> None:
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    MooncakeKVSender.supports_host_tensor_indices = False


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def kvargs_record(manager, kv_args, disaggregation_mode, server_args) -> dict:
    """The KVArgs fields (and the manager facts beside them) as plain JSON values."""
    fields = (
        dataclasses.asdict(kv_args)
        if dataclasses.is_dataclass(kv_args)
        else {k: v for k, v in vars(kv_args).items() if not k.startswith("_")}
    )
    record = {k: _plain(v) for k, v in fields.items()}
    record["manager"] = type(manager).__name__
    record["disaggregation_mode"] = _plain(disaggregation_mode)
    record["is_mla_backend"] = bool(getattr(manager, "is_mla_backend", False))
    record["server_page_size"] = server_args.page_size
    return record


def kvargs_dump() -> None:
    directory = os.environ.get(KVARGS_DIR_ENV)
    if not directory:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_init(result, manager, kv_args, disaggregation_mode, server_args, *args, **kwargs):
        record = kvargs_record(manager, kv_args, disaggregation_mode, server_args)
        name = f"{record['disaggregation_mode'].lower()}-{kv_args.engine_rank}.json"
        with open(os.path.join(directory, name), "w") as f:
            json.dump(record, f, indent=1)

    HookRegistry.register(
        "sglang.srt.disaggregation.common.conn.CommonKVManager.__init__",
        after_init,
        HookType.AFTER,
    )


def _arg(args, kwargs, index, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else default


def log_calls(directory: str, logged: dict) -> None:
    """Register AFTER hooks writing one JSON line per call of each target in
    ``logged`` (dotted method path -> record function) to ``<directory>/<pid>.jsonl``,
    stamped with the wall clock. A record is a dict or a list of them (one line each);
    its ``room`` defaults to the object's ``bootstrap_room``, its ``call`` to the method."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    path = os.path.join(directory, f"{os.getpid()}.jsonl")
    for target, record in logged.items():
        method = target.rsplit(".", 1)[1]

        def after(result, obj, *args, _record=record, _method=method, **kwargs):
            t = time.time()
            records = _record(obj, args, kwargs, result)
            with open(path, "a") as f:
                for rec in records if isinstance(records, list) else [records]:
                    entry = {"call": _method, "class": type(obj).__name__, "t": t, "pid": os.getpid(), **rec}
                    if "room" not in entry:
                        entry["room"] = int(obj.bootstrap_room)
                    f.write(json.dumps(_plain(entry)) + "\n")

        HookRegistry.register(target, after, HookType.AFTER)


def transfer_log() -> None:
    directory = os.environ.get(TRANSFER_LOG_DIR_ENV)
    if directory:
        log_calls(directory, LOGGED)


def decode_log() -> None:
    directory = os.environ.get(TRANSFER_LOG_DIR_ENV)
    if directory:
        log_calls(directory, DECODE_LOGGED)
