"""The tiny hand-written model every engine test loads.

A 2-layer Llama with GQA (4 query heads, 2 KV heads of 64: vLLM's CPU attention
refuses head_dim 16) and a 1,024-token vocabulary, with random weights written as a
safetensors file (7 MB). No tokenizer: engines start with
``skip_tokenizer_init=True`` and requests carry token ids.

Why not ``load_format="dummy"`` (docs/engines.md §E3, E4): both engines fill every
weight from one fixed seed by element count, layer norms included, uniform in
±1e-3. The residual stream is then the current token's embedding and nothing else,
so the next token depends on the last token only (measured: prompts of 1, 11, 51
and 201 tokens ending in the same id generate the same ids). A decode engine given
garbage KV would still match. These weights are scaled so attention is sharp and
its output as large as the embedding: tokens depend on the whole prompt, which
`test_sglang_baseline` checks."""

from __future__ import annotations

import json
import os

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 64
VOCAB_SIZE = 1024
CONTEXT_LEN = 1024

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": CONTEXT_LEN,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def weights(seed: int = 0, config: dict = CONFIG) -> dict:
    """HF Llama tensor names → float32 numpy arrays ([out, in] for projections)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    unit = 1.0 / hidden**0.5  # a unit-RMS input gives unit-RMS outputs
    out = {"model.embed_tokens.weight": normal((vocab, hidden), 1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal((q_out, hidden), 2 * unit)  # sharp attention
        out[p + "self_attn.k_proj.weight"] = normal((kv_out, hidden), 2 * unit)
        out[p + "self_attn.v_proj.weight"] = normal((kv_out, hidden), unit)
        out[p + "self_attn.o_proj.weight"] = normal((hidden, q_out), 2 * unit)
        out[p + "mlp.gate_proj.weight"] = normal((inter, hidden), unit)
        out[p + "mlp.up_proj.weight"] = normal((inter, hidden), unit)
        out[p + "mlp.down_proj.weight"] = normal((hidden, inter), 1.0 / inter**0.5)
        out[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        out[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    out["model.norm.weight"] = np.ones(hidden, np.float32)
    out["lm_head.weight"] = normal((vocab, hidden), unit)
    return out


# The MLA model: a 2-layer DeepSeek-V2, both layers dense (first_k_dense_replace), with
# the latent sizes vLLM's CPU MLA accepts (kv_lora_rank 512 + qk_rope_head_dim 64: a
# 576-wide latent per token; it refuses other head sizes). Its KV is one latent row per
# token and layer, the same on every TP rank.
MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "first_k_dense_replace": NUM_LAYERS,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": CONTEXT_LEN,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": CONTEXT_LEN,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
MLA_LATENT = MLA_CONFIG["kv_lora_rank"] + MLA_CONFIG["qk_rope_head_dim"]  # elements per token and layer


def mla_weights(seed: int = 0, config: dict = MLA_CONFIG) -> dict:
    """HF DeepSeek-V2 tensor names (no q LoRA, dense MLPs) → float32 numpy arrays,
    scaled as `weights` scales Llama's: the projections into attention sharp, so
    tokens depend on the whole prompt through the latent KV."""
    import numpy as np

    rng = np.random.default_rng(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, rank, rope = config["num_attention_heads"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]

    def normal(shape, gain=1.0):
        return (rng.standard_normal(shape) * gain / shape[1] ** 0.5).astype(np.float32)

    out = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal((heads * (nope + rope), hidden), 2.0)
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = normal((rank + rope, hidden), 2.0)
        out[p + "self_attn.kv_a_layernorm.weight"] = np.ones(rank, np.float32)
        out[p + "self_attn.kv_b_proj.weight"] = normal((heads * (nope + v_dim), rank), 2.0)
        out[p + "self_attn.o_proj.weight"] = normal((hidden, heads * v_dim), 2.0)
        out[p + "mlp.gate_proj.weight"] = normal((inter, hidden))
        out[p + "mlp.up_proj.weight"] = normal((inter, hidden))
        out[p + "mlp.down_proj.weight"] = normal((hidden, inter))
        out[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        out[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    out["model.norm.weight"] = np.ones(hidden, np.float32)
    out["lm_head.weight"] = normal((vocab, hidden))
    return out


def write_model_dir(path: str, seed: int = 0, mla: bool = False, **changes) -> str:
    """Write config.json and model.safetensors into ``path`` (created if missing);
    ``path``. ``mla``: the DeepSeek-V2 model (MLA_CONFIG) instead of the Llama one.
    ``changes`` replace config entries (a variant with more layers or KV heads has more
    KV per token). Needs numpy and safetensors (both in the engine environment)."""
    from safetensors.numpy import save_file

    config = {**(MLA_CONFIG if mla else CONFIG), **changes}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = mla_weights(seed, config) if mla else weights(seed, config)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


if __name__ == "__main__":
    # `python -m tests.engines.model DIR`: the model directory the README's SGLang and vLLM
    # lines load on CPU (in the engine environment, which has numpy and safetensors).
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.engines.model DIR")
    print(write_model_dir(sys.argv[1]))
