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


def write_model_dir(path: str, seed: int = 0, **changes) -> str:
    """Write config.json and model.safetensors into ``path`` (created if missing);
    ``path``. ``changes`` replace CONFIG entries (a variant with more layers or KV
    heads has more KV per token). Needs numpy and safetensors (both in the engine
    environment)."""
    from safetensors.numpy import save_file

    config = {**CONFIG, **changes}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(weights(seed, config), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


if __name__ == "__main__":
    # `python -m tests.engines.model DIR`: the model directory the README's SGLang and vLLM
    # lines load on CPU (in the engine environment, which has numpy and safetensors).
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.engines.model DIR")
    print(write_model_dir(sys.argv[1]))
