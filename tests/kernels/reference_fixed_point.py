"""Pure-PyTorch oracle of the CUDA-core GEMV's integer dot (``kernels/int8_fixed_dot.py``): int8 words times bf16
activations taken as 16-bit fixed point, per word of four."""

from __future__ import annotations

import torch


def fixed_point_activations(x: torch.Tensor) -> torch.Tensor:  # [T, K] bf16 -> [T, K] fp64
    """``x`` as the integer GEMV's activations (``kernels/int8_fixed_dot.py``): per word of four columns
    (``K % 4 == 0``), each value rounded to nearest-even on the grid ``2**(E - 141)``, ``E`` the fp32 biased
    exponent of the word's largest magnitude clamped to [15, 254]; inf or NaN in a word makes the whole word NaN."""
    T, K = x.shape
    words = x.float().reshape(T, K // 4, 4)
    exponent = (words.abs().amax(dim=-1).view(torch.int32) >> 23).clamp(15, 254).double()
    step = torch.exp2(exponent - 141).unsqueeze(-1)
    q = torch.round(words.double() / step)  # exact: powers of two; round() is half-to-even, as the FMA's rounding
    q = torch.where(torch.isfinite(words).all(dim=-1, keepdim=True), q, torch.nan)
    return (q * step).reshape(T, K)


def int8_gemv_fixed_point_reference(
    x: torch.Tensor,  # [T, K] bf16, K % 4 == 0
    qweight: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N]
) -> torch.Tensor:  # [T, N] x.dtype
    """What the CUDA-core GEMV computes from int8 words and bf16 activations: ``fixed_point_activations(x) @
    qweight.T`` (summed in fp64 here; the kernel's fp32 sums differ by their order and rounding), times ``scale``,
    rounded to ``x.dtype``. Against ``int8_linear_reference`` each activation moves by at most ``2**-15`` of its
    word's largest magnitude (or ``2**-127`` in words below ``2**-112``), and not at all where it lies within
    ``2**7`` of it."""
    dot = fixed_point_activations(x) @ qweight.double().t()
    return (dot.float() * scale.float()).to(x.dtype)
