"""vLLM without an engine for PdxferConnector's scheduler tests (docs/engines.md §V1
and E2): vLLM's real ``Scheduler`` over the tiny model's config and a fake
one-head KV spec, requests, and a stand-in for the model runner's output. Imports
vLLM: tests reach it through the ``kit`` fixture, after ``needs_vllm``."""

from __future__ import annotations

import itertools

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason  # noqa: F401 (for the tests)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus  # noqa: F401 (RequestStatus for the tests)
from vllm.v1.structured_output import StructuredOutputManager

from pdxfer.adapters.vllm.metadata import Receive, Transmit  # noqa: F401 (for the tests)
from tests.engines.model import CONFIG
from tests.engines.vllm_engines import BLOCK_SIZE

NUM_BLOCKS = 100
EOS = CONFIG["eos_token_id"]

_ids = itertools.count(1)
init_none_hash(sha256)


def vllm_config(model: str, kv_role: str, policy: str = "fail", extra: dict | None = None, tp: int = 1, pp: int = 1) -> VllmConfig:
    """An engine's config with PdxferConnector, of ``tp`` x ``pp`` ranks (the scheduler
    half is one however many ranks there are)."""
    return VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=1024, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdxferConnector", kv_connector_module_path="pdxfer.adapters.vllm", kv_role=kv_role,
            engine_id=f"{kv_role}-engine", kv_load_failure_policy=policy,
            kv_connector_extra_config={"daemon": "ipc:///nonexistent/scheduler-tests-need-no-daemon", **(extra or {})},
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
    )


def scheduler(config: VllmConfig) -> Scheduler:
    """vLLM's real Scheduler, with the connector's scheduler half, over NUM_BLOCKS fake blocks."""
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE)


def request(tokens: list[int], kv_transfer_params: dict | None = None, max_tokens: int = 8) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)
    sampling.update_from_generation_config({}, EOS)
    return Request(request_id=f"req-{next(_ids)}", prompt_token_ids=list(tokens), sampling_params=sampling, pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def runner_output(scheduled, token: int = 7, finished_sending=(), finished_recving=(), invalid_block_ids=()) -> ModelRunnerOutput:
    """What the model runner would return for ``scheduled`` (a SchedulerOutput): one
    ``token`` for every request it scheduled, plus the worker half's report."""
    ids = list(scheduled.num_scheduled_tokens)
    connector = KVConnectorOutput(finished_sending=set(finished_sending), finished_recving=set(finished_recving),
                                  invalid_block_ids=set(invalid_block_ids))
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] for _ in ids], kv_connector_output=connector)
