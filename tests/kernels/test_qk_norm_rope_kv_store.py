"""The q/k norm + RoPE kernel writing the layer's K/V into the paged cache in its own launch (``cache=``) vs the
unfused path: the same kernel without the store, then ``kernels.kv_store.store_kv`` of its outputs.

The fused store must be *bit-identical* to the unfused one (the cache holds the same roped k and the same value,
normed or raw) and must leave rows with a negative slot alone (padding rows of CUDA-graph buckets). On CPU under
TRITON_INTERPRET=1 at small shapes; the ``gpu`` tests at Qwen3-30B-A3B's and Gemma 4's real head counts and dims in
bf16, where the compiled kernels must agree bitwise as well.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.kernels.kv_store import store_kv
from inference_server.kernels.qk_norm_rope import PagedKVWrite, qk_norm_rope

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SENTINEL = 7.0  # what the cache holds before the step: rows the step must not write keep it


def _layer(T: int, nH: int, nKV: int, D: int, dtype: torch.dtype, seed: int, kind: str):
    """Raw q, k, v as strided views of one fused projection (``kind``: "qwen" has a v projection and no value
    norm, "gemma" a v projection and the value norm, "gemma-k=v" no v projection and the value norm), norm
    weights, rope tables and the value the layer stores before its norm."""
    gen = torch.Generator().manual_seed(seed)
    with_v = kind != "gemma-k=v"
    widths = [nH * D, nKV * D] + ([nKV * D] if with_v else [])
    fused = (torch.randn(T, sum(widths), generator=gen) * 2).to(DEV, dtype)
    parts = [p.unflatten(-1, (-1, D)) for p in fused.split(widths, dim=-1)]
    q, k = parts[0], parts[1]
    v = parts[2] if with_v else None
    q_w = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV, dtype)
    k_w = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV, dtype)
    freqs = torch.arange(5, 5 + T).float()[:, None] / 10000 ** (torch.arange(0, D, 2).float() / D)
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, v, q_w, k_w, emb.cos().to(DEV, dtype), emb.sin().to(DEV, dtype)


def _slots(T: int, blocks: int, page: int, seed: int) -> torch.Tensor:
    """Distinct slots in random order, every third row from the second on padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(blocks * page, generator=gen)[:T]
    slots[1::3] = -1
    return slots.to(DEV)


def _fused_and_unfused(kind: str, T: int, nH: int, nKV: int, D: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                       mode: str, seed: int, blocks: int = 6, page: int = 4):
    """Both paths on the same inputs: ((outputs, k_cache, v_cache) fused, (...) unfused)."""
    q, k, v, q_w, k_w, cos, sin = _layer(T, nH, nKV, D, dtype, seed, kind)
    value = v if v is not None else k  # the layer's value before any value norm
    norm_v = kind != "qwen"
    v_in = value if norm_v else None
    slots = _slots(T, blocks, page, seed)
    results = []
    for fused in (True, False):
        k_cache = torch.full((blocks, page, nKV, D), SENTINEL, dtype=cache_dtype, device=DEV)
        v_cache = torch.full_like(k_cache, SENTINEL)
        if fused:
            write = PagedKVWrite(k_cache, v_cache, slots, value=None if norm_v else value)
            out = qk_norm_rope(q, k, v_in, q_w, k_w, 1e-6, mode, cos, sin, cache=write)  # type: ignore[arg-type]
        else:
            out = qk_norm_rope(q, k, v_in, q_w, k_w, 1e-6, mode, cos, sin)  # type: ignore[arg-type]
            assert out[1] is not None
            store_kv(out[1], out[2] if norm_v else value, k_cache, v_cache, slots)
        results.append((out, k_cache, v_cache))
    return results, slots


def _assert_bitwise_equal(fused, unfused, slots: torch.Tensor) -> None:
    (f_out, f_kc, f_vc), (u_out, u_kc, u_vc) = fused, unfused
    for f, u in zip(f_out, u_out, strict=True):
        assert (f is None) == (u is None)
        if f is not None:
            assert torch.equal(f, u)
    assert torch.equal(f_kc, u_kc) and torch.equal(f_vc, u_vc)
    written = int((slots >= 0).sum())
    page = f_kc.shape[1]
    for cache in (f_kc, f_vc):  # the rows of the real slots were written, every other row is untouched
        assert int((cache != SENTINEL).any(dim=-1).any(dim=-1).sum()) == written
        assert int((cache == SENTINEL).all(dim=-1).all(dim=-1).sum()) == cache.shape[0] * page - written


@pytest.mark.parametrize("kind", ["qwen", "gemma", "gemma-k=v"])
@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float32)])
def test_fused_store_is_bitwise_the_unfused_store(kind: str, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Qwen stores the raw v (copied), Gemma the normed v, K = V layers the normed raw k; a cache of another dtype
    gets the same cast as store_kv's."""
    mode = "qwen" if kind == "qwen" else "gemma"
    (fused, unfused), slots = _fused_and_unfused(kind, 7, 4, 2, 16, dtype, cache_dtype, mode, seed=3)
    _assert_bitwise_equal(fused, unfused, slots)


def test_a_step_whose_rows_are_all_padding_writes_nothing_and_an_empty_step_launches_nothing() -> None:
    q, k, v, q_w, k_w, cos, sin = _layer(2, 2, 1, 8, torch.float32, 1, "qwen")
    k_cache = torch.full((2, 4, 1, 8), SENTINEL, device=DEV)
    v_cache = torch.full_like(k_cache, SENTINEL)
    write = PagedKVWrite(k_cache, v_cache, torch.full((2,), -1, device=DEV), value=v)
    qk_norm_rope(q, k, None, q_w, k_w, 1e-6, "qwen", cos, sin, cache=write)
    assert bool((k_cache == SENTINEL).all()) and bool((v_cache == SENTINEL).all())
    empty = PagedKVWrite(k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEV), value=v[:0])
    q0, k0, v0 = qk_norm_rope(q[:0], k[:0], None, q_w, k_w, 1e-6, "qwen", cos[:0], sin[:0], cache=empty)
    assert q0.shape == (0, 2, 8) and k0 is not None and k0.shape == (0, 1, 8) and v0 is None


def test_rejects_a_store_it_cannot_make() -> None:
    q, k, v, q_w, k_w, cos, sin = _layer(2, 2, 1, 8, torch.float32, 1, "qwen")
    k_cache = torch.zeros(2, 4, 1, 8, device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="value"):  # no value norm and no raw value to copy
        qk_norm_rope(q, k, None, q_w, k_w, 1e-6, "qwen", cos, sin, cache=PagedKVWrite(k_cache, k_cache.clone(), slots))
    with pytest.raises(ValueError, match="value"):  # a q-only layer has nothing to store
        qk_norm_rope(q, None, None, q_w, None, 1e-6, "qwen", cos, sin,
                     cache=PagedKVWrite(k_cache, k_cache.clone(), slots, value=v))
    with pytest.raises(ValueError, match="k_cache"):  # head_dim of the cache differs
        qk_norm_rope(q, k, None, q_w, k_w, 1e-6, "qwen", cos, sin,
                     cache=PagedKVWrite(k_cache[..., :4], k_cache[..., :4].clone(), slots, value=v))
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope(q, k, None, q_w, k_w, 1e-6, "qwen", cos, sin,
                     cache=PagedKVWrite(k_cache, k_cache.clone(), slots[:1], value=v))


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16, 64, 2048])
@pytest.mark.parametrize(("kind", "nH", "nKV", "D"), [
    ("qwen", 32, 4, 128),  # Qwen3-30B-A3B
    ("gemma", 16, 8, 256),  # Gemma-4-26B-A4B sliding layers
    ("gemma-k=v", 16, 2, 512),  # Gemma-4-26B-A4B full layers (K = V)
    ("gemma", 32, 16, 256),  # Gemma-4-31B sliding layers
    ("gemma-k=v", 32, 4, 512),  # Gemma-4-31B full layers (K = V)
])
def test_real_shapes_bf16_on_gpu_bitwise_equal_to_the_unfused_kernels(T: int, kind: str, nH: int, nKV: int,
                                                                       D: int) -> None:
    """Compiled, with the runner's page size (16) and a pool larger than the step."""
    mode = "qwen" if kind == "qwen" else "gemma"
    (fused, unfused), slots = _fused_and_unfused(kind, T, nH, nKV, D, torch.bfloat16, torch.bfloat16, mode, seed=T,
                                                 blocks=T // 16 + 8, page=16)
    _assert_bitwise_equal(fused, unfused, slots)
