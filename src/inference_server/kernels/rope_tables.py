"""Triton RoPE tables: a step's ``cos`` and ``sin`` ``[T, D]`` for its positions in one launch.

The PyTorch reference (``architectures.layers.rope_cos_sin``) costs seven kernels per table: the positions' float
cast, the product with the inverse frequencies, the half-split ``cat``, ``cos``, ``sin`` and the two casts to the
activation dtype. A decode step builds one table per attention layer type (two on Gemma 4: sliding and full), so
at batch 1 these are 7-14 of the step's launches ahead of the first layer, none of them PDL-launched
(docs/benchmarks.md). This kernel computes them with the reference's arithmetic: ``float(position) * inv_freq`` in
fp32 (one IEEE product), ``cos`` and ``sin`` of it from CUDA's ``cosf`` / ``sinf`` through libdevice (the functions
PyTorch's elementwise kernels call; under the interpreter, which has no libdevice, ``tl.cos`` / ``tl.sin``), each
rounded once to the output dtype, and both halves of a row holding the same angles (NeoX layout).

Contract: ``positions`` ``[T]`` integer (exact in fp32: below ``2**24``), ``inv_freq`` ``[D/2]`` fp32; returns
``cos, sin`` ``[T, D]`` contiguous in ``dtype``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from inference_server.kernels.pdl import pdl_launch, pdl_release, pdl_wait

__all__ = ["rope_tables"]


@triton.jit
def _rope_tables_kernel(
    pos_ptr, inv_ptr, cos_ptr, sin_ptr, half, stride_t,
    BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # False only under the interpreter
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the inverse frequencies are weights-like constants, the positions a step input; the tables
    # may still be read by the previous step's last launches when buffers are recycled: wait first. One short
    # program per token, so release the next launch at once.
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + offs, mask=mask, other=0.0)  # [BLOCK] fp32
    if LIBDEVICE:
        c = libdevice.cos(angle)
        s = libdevice.sin(angle)
    else:
        c = tl.cos(angle)
        s = tl.sin(angle)
    dtype = cos_ptr.dtype.element_ty
    row = t * stride_t
    tl.store(cos_ptr + row + offs, c.to(dtype), mask=mask)
    tl.store(cos_ptr + row + half + offs, c.to(dtype), mask=mask)
    tl.store(sin_ptr + row + offs, s.to(dtype), mask=mask)
    tl.store(sin_ptr + row + half + offs, s.to(dtype), mask=mask)


# TRITON_INTERPRET=1 is read when a kernel is decorated: the kernel is then an interpreter object.
_INTERPRETED = not isinstance(_rope_tables_kernel, triton.runtime.JITFunction)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, 2 * len(inv_freq)]`` in ``dtype`` for ``positions [T]`` (the module docstring's contract)."""
    if positions.dim() != 1 or positions.dtype.is_floating_point:
        raise ValueError(f"positions must be [T] integers, got {tuple(positions.shape)} {positions.dtype}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or inv_freq.device != positions.device:
        raise ValueError(f"inv_freq must be [D/2] float32 on {positions.device}, got {tuple(inv_freq.shape)} "
                         f"{inv_freq.dtype} on {inv_freq.device}")
    tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(tokens, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if tokens == 0 or half == 0:
        return cos, sin
    block = triton.next_power_of_2(half)
    _rope_tables_kernel[(tokens,)](positions, inv_freq.contiguous(), cos, sin, half, cos.stride(0), BLOCK=block,
                                   LIBDEVICE=not _INTERPRETED, num_warps=max(1, min(4, block // 128)),
                                   **pdl_launch())
    return cos, sin
