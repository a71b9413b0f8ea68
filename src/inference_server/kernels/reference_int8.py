"""Pure-PyTorch reference of int8 weight-only quantization: the format, the quantizer and the matmuls.

The format (every quantized weight in the engine uses it):

* ``qweight``: int8, the float weight's shape (``[N, K]`` for a linear layer, ``[E, N, K]`` for MoE experts),
  values in ``[-127, 127]`` (symmetric: -128 is never produced, so negation is exact).
* ``scale``: one per output channel, shape ``qweight.shape[:-1]`` (``[N]`` or ``[E, N]``), in the activation
  dtype the model runs in (bf16 on CUDA, fp32 on the CPU). ``weight ≈ qweight * scale[..., None]``.

The matmul contract (what every int8 kernel must reproduce within fp32-accumulation rounding): the int8 values
are exact in any float type, so ``x @ qweight.T`` is accumulated in fp32 and the scale is applied once per
output channel *after* the reduction, then the result is rounded to the activation dtype. This is the oracle
for the Triton kernels (``kernels/int8_linear.py``, the int8 path of ``kernels/fused_moe.py``).

One exception, bounded: the CUDA-core GEMV with bf16 activations (``kernels/int8_fixed_dot.py``) takes each word
of four activations as 16-bit fixed point first; ``int8_gemv_fixed_point_reference`` computes its numbers.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_int8", "fixed_point_activations", "int8_gemv_fixed_point_reference", "int8_linear_reference",
           "quantize_int8_per_channel"]

INT8_MAX = 127


def quantize_int8_per_channel(
    weight: torch.Tensor,  # [..., N, K] float
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # qweight [..., N, K] int8, scale [..., N]
    """Symmetric per-output-channel quantization: ``scale = max|w| / 127`` over each row (computed in fp32,
    then cast to ``scale_dtype``, default the weight's dtype), ``q = round(w / scale)`` clamped to ±127 using
    the *cast* scale, so ``q * scale`` is the value the kernels reconstruct. An all-zero row gets scale 1
    (any scale reconstructs zeros; 1 avoids dividing by zero). A ``meta`` weight gives ``meta`` results of
    these shapes and dtypes without computing anything (computing on ``meta`` imports torch._dynamo for the
    reference kernels' meta functions: seconds of every int8 start-up)."""
    if weight.is_meta:
        return (torch.empty(weight.shape, dtype=torch.int8, device="meta"),
                torch.empty(weight.shape[:-1], dtype=scale_dtype or weight.dtype, device="meta"))
    w = weight.float()
    amax = w.abs().amax(dim=-1)  # [..., N]
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(scale_dtype or weight.dtype)
    q = torch.round(w / scale.float().unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``qweight * scale[..., None]`` in fp32, rounded once to ``dtype``."""
    return (qweight.float() * scale.float().unsqueeze(-1)).to(dtype)


def int8_linear_reference(
    x: torch.Tensor,  # [T, K] activation dtype
    qweight: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N]
) -> torch.Tensor:  # [T, N] x.dtype
    """``(x @ qweight.T)`` accumulated in fp32, times ``scale`` per output channel, rounded to ``x.dtype``."""
    return ((x.float() @ qweight.float().t()) * scale.float()).to(x.dtype)


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
