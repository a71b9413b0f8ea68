"""Triton per-head q/k RMSNorm + RoPE (and Gemma 4's weightless value norm) in one launch.

Every attention layer of Qwen3-MoE and Gemma 4 normalises each q and k head over head_dim, then rotates q and k;
Gemma 4 also normalises v (no weight, no rotation). As separate kernels that is three or four launches per layer
(``_rmsnorm_kernel`` for q, for k, for v, then ``_rope_kernel``), each a few microseconds at decode. This kernel
does one head of a block of tokens per program (``_tokens_per_program``), each (token, head) row alike: load the
row's two halves, one RMS over both, the norm with its rounding
to the activation dtype (``kernels.rmsnorm``'s ``gemma`` or ``qwen`` convention), then the NeoX half-split
rotation with ``kernels.rope``'s rounding points (each product, then the sum); v rows stop after the norm.

The two steps' roundings are kept, so the result is the unfused Triton path's up to the order of the fp32 sum of
squares (one reduction over two halves instead of one over the row) and the compiler's multiply-add contraction
(see ``kernels.rope``): on the CPU interpreter equal to the reference (``tests/kernels/reference_fused.py``) in fp32.

Contract: ``q [T, nH, D]``, ``k [T, nKV, D] | None``, ``v [T, nKV, D] | None`` (last dim contiguous, any
token/head strides, e.g. views of one fused qkv GEMM output; D even), weights ``[D]`` in the activation dtype,
``cos``/``sin`` ``[T, D]`` (half-split layout). Returns new contiguous ``q``, ``k``, ``v`` (the inputs are not
written: under K = V the raw k is also the value).

With ``cache=PagedKVWrite(...)`` the same launch also writes the new k and value rows into the paged KV caches,
exactly as ``kernels.kv_store.store_kv`` would write the returned tensors: the roped k, and the normed v (or,
without a value norm, the raw ``value`` rows, copied), cast to the cache dtype, at ``slot_mapping`` (negative =
skip the row: padding rows of CUDA-graph buckets). The stored values are the registers the outputs are written
from, so the cache holds bit for bit what ``store_kv(k, v, ...)`` of this call's outputs would store.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait
from inference_server.kernels.rmsnorm import NormMode

__all__ = ["PagedKVWrite", "qk_norm_rope"]


@attrs.frozen
class PagedKVWrite:
    """Where ``qk_norm_rope`` also writes the layer's new K/V rows: ``kernels.kv_store``'s cache contract
    (``[num_blocks, block_size, nKV, D]`` caches of one dtype, last dim contiguous; ``slot_mapping`` int ``[T]``,
    ``block_id * block_size + offset``, negative = skip). ``value`` is the raw value ``[T, nKV, D]`` to copy into
    the cache when the layer has no value norm (``v`` is None); with a value norm the normed ``v`` is stored."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    value: torch.Tensor | None = None


@triton.jit(do_not_specialize=["num_tokens"])
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, vo_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
    kc_ptr, vc_ptr, slot_ptr,
    q_st, q_sh, k_st, k_sh, v_st, v_sh, qo_st, ko_st, vo_st, cs_st,
    kc_sb, kc_st, kc_sh, vc_sb, vc_st, vc_sh,
    eps, num_tokens,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
    GEMMA: tl.constexpr, NORM_V: tl.constexpr, NUM_OUT: tl.constexpr, STORE: tl.constexpr, PAGE: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    token_mask = tokens < num_tokens
    mask = offs < HALF
    tile_mask = token_mask[:, None] & mask[None, :]  # [BLOCK_T, BLOCK_HALF]
    rotate = head < NUM_Q + NUM_K
    has_weight = rotate
    if head < NUM_Q:
        src = q_ptr + head * q_sh
        src_st = q_st
        dst = qo_ptr + head * (2 * HALF)
        dst_st = qo_st
        w_ptr = qw_ptr
        cache, c_sb, c_st = kc_ptr, kc_sb, kc_st  # not written: q is not cached
    elif head < NUM_Q + NUM_K:
        src = k_ptr + (head - NUM_Q) * k_sh
        src_st = k_st
        dst = ko_ptr + (head - NUM_Q) * (2 * HALF)
        dst_st = ko_st
        w_ptr = kw_ptr
        cache, c_sb, c_st = kc_ptr + (head - NUM_Q) * kc_sh, kc_sb, kc_st
    else:
        src = v_ptr + (head - NUM_Q - NUM_K) * v_sh
        src_st = v_st
        dst = vo_ptr + (head - NUM_Q - NUM_K) * (2 * HALF)
        dst_st = vo_st
        w_ptr = qw_ptr  # read, never used: v has no weight
        cache, c_sb, c_st = vc_ptr + (head - NUM_Q - NUM_K) * vc_sh, vc_sb, vc_st
    # The norm weights are model weights (never written in a step): loaded before the PDL wait, so their DRAM
    # latency overlaps the predecessor's tail (kernels.pdl's invariant allows weights there, nothing else).
    w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)[None, :]
    # PDL: q/k/v, cos/sin and the slot mapping come from earlier launches, and the outputs and KV-cache rows must not
    # be written before they have completed: wait here. One short program per (token block, head), so release the
    # next launch at once (its CTAs get resident and wait while this one runs). Every read that needs the wait is
    # issued right after it, so the program pays one memory round trip instead of one per dependent load.
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    cs = (tokens * cs_st)[:, None] + offs[None, :]
    cos1 = tl.load(cos_ptr + cs, mask=tile_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + HALF, mask=tile_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs, mask=tile_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + HALF, mask=tile_mask, other=0.0).to(tl.float32)
    if STORE:
        slot = tl.load(slot_ptr + tokens, mask=token_mask, other=-1).to(tl.int64)
    else:
        slot = tokens * 0 - 1  # never read: nothing is stored
    rows = (tokens * src_st)[:, None] + offs[None, :]
    x1 = tl.load(src + rows, mask=tile_mask, other=0.0)
    x2 = tl.load(src + HALF + rows, mask=tile_mask, other=0.0)
    dtype = x1.dtype
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / (2 * HALF) + eps)[:, None]
    y1 = x1f * inv
    y2 = x2f * inv
    if has_weight:
        if not GEMMA:  # Qwen: cast to the input dtype, then times the weight
            y1 = y1.to(dtype).to(tl.float32)
            y2 = y2.to(dtype).to(tl.float32)
        y1 = y1 * w1
        y2 = y2 * w2
    n1 = y1.to(dtype)  # the norm's output, rounded as rmsnorm stores it
    n2 = y2.to(dtype)
    if rotate:
        # out1 = n1 * cos1 + (-n2) * sin1 ; out2 = n2 * cos2 + n1 * sin2, each product and sum rounded to dtype
        a1 = (n1.to(tl.float32) * cos1).to(dtype)
        b1 = (-(n2.to(tl.float32)) * sin1).to(dtype)  # negation is exact; the interpreter cannot negate bf16
        a2 = (n2.to(tl.float32) * cos2).to(dtype)
        b2 = (n1.to(tl.float32) * sin2).to(dtype)
        n1 = (a1.to(tl.float32) + b1.to(tl.float32)).to(dtype)
        n2 = (a2.to(tl.float32) + b2.to(tl.float32)).to(dtype)
    elif not NORM_V:  # a value row without a value norm: the raw value goes to the cache as it is
        n1 = x1
        n2 = x2
    # rows past NUM_OUT (raw value rows, stored only) have no output; scalar conditions as vectors: the
    # interpreter rejects a scalar bool combined with a vector mask
    out_mask = tile_mask & (offs[None, :] * 0 + head < NUM_OUT)
    out_rows = (tokens * dst_st)[:, None] + offs[None, :]
    tl.store(dst + out_rows, n1, mask=out_mask)
    tl.store(dst + HALF + out_rows, n2, mask=out_mask)
    if STORE:  # noqa: SIM102 (a compile-time branch: Triton does not `and` a constexpr with a tensor)
        if head >= NUM_Q:  # k and v rows: kernels.kv_store's write of this row, from the same registers
            cache_mask = tile_mask & (slot >= 0)[:, None]
            safe = tl.maximum(slot, 0)
            cache_rows = ((safe // PAGE) * c_sb + (safe % PAGE) * c_st)[:, None] + offs[None, :]
            tl.store(cache + cache_rows, n1.to(kc_ptr.dtype.element_ty), mask=cache_mask)
            tl.store(cache + HALF + cache_rows, n2.to(kc_ptr.dtype.element_ty), mask=cache_mask)


def qk_norm_rope(
    q: torch.Tensor,  # [T, nH, D]
    k: torch.Tensor | None,  # [T, nKV, D]
    v: torch.Tensor | None,  # [T, nKV, D]: normalised without weight, not rotated
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor | None,  # [D]; needed with k
    eps: float,
    mode: NormMode,
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    cache: PagedKVWrite | None = None,  # also write k and v (or cache.value) into the paged caches
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Normalised and rotated q and k, normalised v, as new contiguous tensors; see the module docstring."""
    if mode not in ("gemma", "qwen"):
        raise ValueError(f"unknown norm mode {mode!r}")
    tokens, num_q, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    stored_v = (v if v is not None else cache.value) if cache is not None else None
    for name, t in (("k", k), ("v", v), ("cache.value", stored_v)):
        if t is not None and (t.dim() != 3 or t.shape[0] != tokens or t.shape[2] != head_dim or t.dtype != q.dtype):
            raise ValueError(f"{name} must be [T, heads, {head_dim}] of q's dtype, got {tuple(t.shape)} {t.dtype}")
    if k is not None and k_weight is None:
        raise ValueError("k needs k_weight")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (tuple(w.shape) != (head_dim,) or w.dtype != q.dtype):
            raise ValueError(f"{name} must be [{head_dim}] of q's dtype, got {tuple(w.shape)} {w.dtype}")
    if any(t is not None and t.stride(-1) != 1 for t in (q, k, v, stored_v)):
        raise ValueError("q, k and v need a contiguous last dim")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"cos and sin must be [{tokens}, {head_dim}] with one layout")
    if cache is not None:
        _check_cache(cache, k, stored_v, tokens)
    q_out = torch.empty((tokens, num_q, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=q.dtype, device=q.device) if k is not None else None
    v_out = torch.empty(v.shape, dtype=q.dtype, device=q.device) if v is not None else None
    num_k = k.shape[1] if k is not None else 0
    num_v = stored_v.shape[1] if stored_v is not None else v.shape[1] if v is not None else 0
    if tokens == 0:
        return q_out, k_out, v_out
    k_arg, v_arg = k if k is not None else q, stored_v if stored_v is not None else v if v is not None else q
    ko_arg, vo_arg = k_out if k_out is not None else q_out, v_out if v_out is not None else q_out
    if cache is not None:
        k_cache, v_cache, slots, page = cache.k_cache, cache.v_cache, cache.slot_mapping, cache.k_cache.shape[1]
    else:  # dummies, never touched
        k_cache, v_cache, slots, page = q_out, q_out, q_out, 1
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_t = _tokens_per_program(block_half)
    _qk_norm_rope_kernel[(triton.cdiv(tokens, block_t), num_q + num_k + num_v)](
        q, k_arg, v_arg, q_out, ko_arg, vo_arg, q_weight, k_weight if k_weight is not None else q_weight, cos, sin,
        k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k_arg.stride(0), k_arg.stride(1), v_arg.stride(0), v_arg.stride(1),
        q_out.stride(0), ko_arg.stride(0), vo_arg.stride(0), cos.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        eps, tokens,
        NUM_Q=num_q, NUM_K=num_k, HALF=half, BLOCK_HALF=block_half, BLOCK_T=block_t, GEMMA=mode == "gemma",
        NORM_V=v is not None, NUM_OUT=num_q + num_k + (num_v if v is not None else 0), STORE=cache is not None,
        PAGE=page, **pdl_launch(),
    )  # fmt: skip
    return q_out, k_out, v_out


def _tokens_per_program(block_half: int) -> int:
    """Rows (tokens) one program takes for one head: enough that its tile holds ``_TILE_ELEMENTS`` elements per
    half, so each thread of the default 4 warps loads 16 bytes at a time and an SM keeps more bytes in flight than
    one row per program did. A function of the head size only, never of the step's token count: a row's
    arithmetic (its reduction's layout) is then the same in every step, which ``DETERMINISTIC`` relies on."""
    return max(1, _TILE_ELEMENTS // block_half)


_TILE_ELEMENTS = 1024


def _check_cache(cache: PagedKVWrite, k: torch.Tensor | None, value: torch.Tensor | None, tokens: int) -> None:
    """``store_kv``'s preconditions for the rows this call writes."""
    if k is None or value is None or value.shape != k.shape:
        raise ValueError("writing the cache needs k and a value (v, or cache.value without a value norm) of k's shape")
    k_cache, v_cache = cache.k_cache, cache.v_cache
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]) \
            or k_cache.dtype != v_cache.dtype or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"k_cache and v_cache must be [blocks, page, {k.shape[1]}, {k.shape[2]}] of one dtype with "
                         f"a contiguous last dim, got {tuple(k_cache.shape)} {k_cache.dtype}, "
                         f"{tuple(v_cache.shape)} {v_cache.dtype}")
    if cache.slot_mapping.shape != (tokens,) or cache.slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int [{tokens}], got {tuple(cache.slot_mapping.shape)}")
