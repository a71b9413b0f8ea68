"""Triton rotary embedding for q and k in one launch, in place.

The PyTorch reference (``architectures.layers.apply_rope``: ``x * cos + rotate_half(x) * sin``) costs five kernels per
tensor (neg, cat, mul, mul, add), ten per attention layer; at batch 1 those launches are a large share of a
decode step. This kernel does both tensors in one launch. It asks for the reference's rounding points (each
product, then the sum, in the input dtype), but on the GPU the compiler contracts multiply-adds, so results
differ from the reference by at most one rounding of the larger term: measured on the H200, at most 4.8e-7 in
fp32 (about a quarter of the elements off by one ulp) and one bf16 ulp (0.03125 at magnitudes 4-8). Under the
CPU interpreter it is bitwise equal in fp32.

Contract: ``q [T, nH, D]`` and ``k [T, nKV, D] | None`` (last dim contiguous, any token/head strides), ``cos``
and ``sin`` ``[T, D]`` in the same dtype as q (NeoX half-split layout: the first and second halves of each
row hold the same angles). q and k are rotated in place and returned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, cs_stride_t,
    NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): q and k are rotated in place and cos/sin come from earlier launches, so wait before the first
    # load and store; a short kernel, so release the next launch at once (its CTAs get resident and wait while this one
    # runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    if head < NUM_Q_HEADS:
        base = q_ptr + token * q_stride_t + head * q_stride_h
    else:
        base = k_ptr + token * k_stride_t + (head - NUM_Q_HEADS) * k_stride_h
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    cos1 = tl.load(cos_ptr + token * cs_stride_t + offs, mask=mask, other=0.0)
    cos2 = tl.load(cos_ptr + token * cs_stride_t + HALF + offs, mask=mask, other=0.0)
    sin1 = tl.load(sin_ptr + token * cs_stride_t + offs, mask=mask, other=0.0)
    sin2 = tl.load(sin_ptr + token * cs_stride_t + HALF + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    # out1 = x1 * cos1 + (-x2) * sin1 ; out2 = x2 * cos2 + x1 * sin2, each product and sum rounded to dtype
    a1 = (x1.to(tl.float32) * cos1.to(tl.float32)).to(dtype)
    b1 = ((-x2).to(tl.float32) * sin1.to(tl.float32)).to(dtype)
    a2 = (x2.to(tl.float32) * cos2.to(tl.float32)).to(dtype)
    b2 = (x1.to(tl.float32) * sin2.to(tl.float32)).to(dtype)
    tl.store(base + offs, (a1.to(tl.float32) + b1.to(tl.float32)).to(dtype), mask=mask)
    tl.store(base + HALF + offs, (a2.to(tl.float32) + b2.to(tl.float32)).to(dtype), mask=mask)


def rope_qk_(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q (and k) in place; see the module docstring."""
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = 0 if k is None else k.shape[1]
    assert q.stride(-1) == 1 and (k is None or k.stride(-1) == 1)
    assert cos.shape == sin.shape == (tokens, head_dim) and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    if tokens == 0:
        return q, k
    half = head_dim // 2
    k_arg = q if k is None else k
    _rope_kernel[(tokens, num_q_heads + num_k_heads)](
        q, k_arg, cos, sin,
        q.stride(0), q.stride(1), k_arg.stride(0), k_arg.stride(1), cos.stride(0),
        NUM_Q_HEADS=num_q_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), **pdl_launch(),
    )
    return q, k
