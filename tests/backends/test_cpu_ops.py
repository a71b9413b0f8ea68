"""The CPU engine's attention and KV store (``backends.cpu_ops``) give the reference's values, and its table computes
the int8 model's reference tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.kernels.reference_attention import ref_paged_decode_attention
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

from inference_server.backends.cpu_ops import (
    CpuPagedAttention,
    CpuRmsNorm,
    QkNormRope,
    cpu_int8_ops,
    fuse_weights,
)
from inference_server.kernels.cpu_int8 import cpu_int8_linear
from inference_server.kernels.reference_attention import ref_store_kv
from inference_server.models.architectures.layers import rms_norm, rope_cos_sin
from inference_server.models.architectures.ops import REFERENCE_OPS, RMSNorm, bind_ops
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import NormStyle, parse_model_spec

BLOCK = 4


def _caches(num_blocks: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK, kv_heads, dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


@pytest.mark.parametrize("window", [None, 3, 5, 64])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (4, 2), (2, 2)])
def test_decode_attention_is_the_reference_bit_for_bit(window: int | None, heads: int, kv_heads: int) -> None:
    k_cache, v_cache = _caches(16, kv_heads, 8, seed=heads * 10 + kv_heads)
    q = torch.randn(4, heads, 8, generator=torch.Generator().manual_seed(1))
    # scattered blocks, one padded slot (context 0), a context inside one block, one spanning several
    tables = torch.tensor([[5, 2, 9, 0], [7, 0, 0, 0], [0, 0, 0, 0], [3, 11, 1, 14]], dtype=torch.int32)
    context_lens = torch.tensor([10, 3, 0, 16], dtype=torch.int32)
    want = ref_paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.3, window)
    paged = CpuPagedAttention()
    for _ in range(2):  # the second call reads the gathers kept for the step
        got = paged.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.3, window)
        assert torch.equal(got, want)  # bit for bit: a decode row of a mixed step takes the reference
    assert torch.count_nonzero(got[2]) == 0  # the padded slot
    one = CpuPagedAttention().decode_attention(q[:1], k_cache, v_cache, tables[:1], context_lens[:1], 0.3, window)
    assert torch.equal(one, want[:1])


def test_decode_attention_keeps_a_step_per_table_and_window() -> None:
    """The embedded model's shapes (16-token blocks, 256-wide heads, 4 query heads on one KV head): layers of two
    block groups and windows interleaved within a step, then a next step with other lengths, each bit for bit the
    reference."""
    k_cache, v_cache = torch.randn(12, 16, 1, 256), torch.randn(12, 16, 1, 256)
    paged = CpuPagedAttention()
    for lens in ([40, 17], [41, 18]):
        full = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0]], dtype=torch.int32)
        sliding = torch.tensor([[9, 4, 11, 0], [6, 8, 0, 0]], dtype=torch.int32)
        context_lens = torch.tensor(lens, dtype=torch.int32)
        for layer in range(4):
            q = torch.randn(2, 4, 256)
            tables, window = (full, None) if layer % 2 else (sliding, 20)
            got = paged.decode_attention(q, k_cache, v_cache, tables, context_lens, 0.0625, window)
            want = ref_paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.0625, window)
            assert torch.equal(got, want)


@pytest.mark.parametrize("slots", [[5, 17, 2], [5, -1, 30]])
def test_store_matches_the_reference(slots: list[int]) -> None:
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    got_k, got_v = _caches(8, 2, 8, seed=3)
    want_k, want_v = got_k.clone(), got_v.clone()
    CpuPagedAttention().store(k, v, got_k, got_v, slot_mapping)
    ref_store_kv(k, v, want_k, want_v, slot_mapping)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    paged = CpuPagedAttention()
    for _ in range(2):  # the second store reads the kept slot check
        k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
        paged.store(k, v, got_k, got_v, slot_mapping)
        ref_store_kv(k, v, want_k, want_v, slot_mapping)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


GEMMA3_TINY = dict(  # tests/models/conftest.py's GEMMA3
    model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
    layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=256,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, tie_word_embeddings=True, final_logit_softcapping=None,
    attn_logit_softcapping=None)


@pytest.mark.parametrize("style", ["gemma3", "gemma4", "qwen"])
@pytest.mark.parametrize("with_weight", [True, False])
def test_cpu_norm_is_the_reference_bit_for_bit(style: NormStyle, with_weight: bool) -> None:
    x = torch.randn(3, 5, 64) * 4
    weight = torch.randn(64) if with_weight else None
    norm = CpuRmsNorm()
    for eps in (1e-6, 1e-5, 1e-6):  # the second 1e-6 reads the kept scalars
        assert torch.equal(norm(x, weight, eps, style), rms_norm(x, weight, eps, style))


@pytest.mark.parametrize("tokens", [1, 7])
def test_qk_norm_rope_is_the_composition_bit_for_bit(tokens: int) -> None:
    q_norm, k_norm = RMSNorm(16, 1e-6, "gemma3"), RMSNorm(16, 1e-6, "gemma3")
    with torch.no_grad():
        q_norm.weight.normal_()
        k_norm.weight.normal_()
    qkv = torch.randn(tokens, 6 * 16) * 3  # a fused projection's output: q, k and v are strided views of it
    q_raw, k_raw, v_raw = (part.unflatten(-1, (-1, 16)) for part in qkv.split([64, 16, 16], dim=-1))
    cos, sin = rope_cos_sin(torch.rand(8), torch.arange(3, 3 + tokens), torch.float32)
    fused = QkNormRope(CpuRmsNorm())
    apart = q_raw.clone(), k_raw.clone(), v_raw.clone()  # q and k not adjacent in memory: concatenated
    before = qkv.clone()
    for q, k, v in (apart, (q_raw, k_raw, v_raw), (q_raw, k_raw, v_raw)):  # the last reads the kept weights
        got = fused(q, k, v, q_norm, k_norm, None, cos, sin)
        want = REFERENCE_OPS.qk_norm_rope(q, k, v, q_norm, k_norm, None, cos, sin)
        assert got is not None and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(qkv, before)  # the raw projection (q and k read through one view) is not written
    assert fused(q_raw, k_raw, v_raw, q_norm, k_norm, RMSNorm(16, 1e-6, "gemma3", with_weight=False), cos,
                 sin) is None  # a value norm: the composition


@pytest.mark.parametrize("config", [GEMMA3_TINY, "gemma-4-31b-tiny", "qwen3-30b-a3b-tiny"])
def test_the_cpu_table_gives_the_int8_models_reference_logits(config: dict | str) -> None:
    """A tiny int8 model through the CPU table (fused weights) and through the reference table with the same int8
    matmul and the weights apart: the same logits over the contiguous reference cache (up to summation order)."""
    spec = parse_model_spec(preset_config(config) if isinstance(config, str) else config)
    model = build_model(spec, torch.float32, "cpu", "int8")
    init_dummy_weights(model, seed=0)
    ids = torch.tensor([2, 15, 7, 99, 3, 42])
    logits = {}
    for name in ("reference", "cpu"):
        if name == "cpu":
            fuse_weights(model)
            bind_ops(model, cpu_int8_ops())
        else:
            bind_ops(model, dataclasses.replace(REFERENCE_OPS, int8_linear=cpu_int8_linear))
        cache = ContiguousKVCache(spec)
        batch = ForwardBatch(seq_ids=(0,), cached_lens=(0,), query_lens=(len(ids),))
        with torch.inference_mode():
            hidden = model(ids, cache.context(batch, "cpu"))
            logits[name] = model.compute_logits(hidden)
    torch.testing.assert_close(logits["cpu"], logits["reference"], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits["cpu"].argmax(-1), logits["reference"].argmax(-1))
