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
of four activations as 16-bit fixed point first; ``tests/kernels/reference_fixed_point.py`` computes its numbers.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_int8", "int8_linear_reference", "quantize_int8_per_channel"]

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
