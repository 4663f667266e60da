"""vLLM without a model for PdxferConnector's tests (ENGINES.md §4 last bullet, §5 E2):
the tiny Llama configuration both the scheduler tests and the real engines use, vLLM's
real ``Scheduler`` over a fake one-head KV spec, requests, and a stand-in for the model
runner's output. Imports vLLM: test modules import this after ``importorskip("vllm")``."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 32  # the CPU attention backend's block (E3)
NUM_BLOCKS = 100
EOS = 2
# A 2-layer Llama small enough for a 2-core machine; head_dim 64, as CPU attention wants (E3).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1024,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": EOS, "tie_word_embeddings": False,
}

_ids = itertools.count(1)
init_none_hash(sha256)


def write_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


def vllm_config(model: Path, kv_role: str, policy: str = "fail", extra: dict | None = None) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", seed=0, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=2048, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdxferConnector", kv_connector_module_path="pdxfer.adapters.vllm", kv_role=kv_role,
            engine_id=f"{kv_role}-engine", kv_load_failure_policy=policy,
            kv_connector_extra_config={"daemon": "ipc:///nonexistent/scheduler-tests-need-no-daemon", **(extra or {})},
        ),
        device_config=DeviceConfig("cpu"),
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
