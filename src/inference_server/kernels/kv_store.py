"""Triton KV store: scatter new K/V rows into the paged caches.

Contract (reference: ``reference_attention.ref_store_kv``):

* ``k``/``v``: ``[T, nKV, D]`` (any row/head strides, last dim contiguous), already normed and roped;
* ``k_cache``/``v_cache``: ``[num_blocks, block_size, nKV, D]`` (last dim contiguous), written in place;
* ``slot_mapping``: ``int64 [T]``, ``slot = block_id * block_size + offset``; a negative slot skips the row
  (padding). Values are cast to the cache dtype. Duplicate slots are a caller bug (last writer unspecified).
* One program per token writes all of its heads; no host syncs (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, nKV, D]
    v_ptr,  # [T, nKV, D]
    k_cache_ptr,  # [num_blocks, PAGE, nKV, D]
    v_cache_ptr,  # [num_blocks, PAGE, nKV, D]
    slot_mapping_ptr,  # int64 [T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    PAGE: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): k, v and the slot mapping come from earlier launches and the cache rows must not be written
    # before they completed, so wait before the first load and store; a short kernel, so release the next launch at once
    # (its CTAs get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # slot >= 0 as a vector: the interpreter rejects a scalar bool combined with a vector mask.
    d_ok = (offs_d < D) & (offs_d * 0 + slot >= 0)  # [BLOCK_D]
    mask = (offs_h < H)[:, None] & d_ok[None, :]  # [BLOCK_H, BLOCK_D]
    safe = tl.maximum(slot, 0)
    blk = safe // PAGE
    off = safe % PAGE
    src = t.to(tl.int64)
    k = tl.load(k_ptr + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(
        k_cache_ptr + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def store_kv(
    k: torch.Tensor,  # [T, nKV, D]
    v: torch.Tensor,  # [T, nKV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    slot_mapping: torch.Tensor,  # int64 [T]; < 0 = skip
) -> None:
    """Write ``k``/``v`` rows into the caches at ``slot_mapping`` (in place; see the module docstring)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), (k_cache.shape, k.shape)
    assert slot_mapping.shape == (num_tokens,)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        PAGE=k_cache.shape[1],
        H=num_kv_heads,
        D=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
        **pdl_launch(),
    )
