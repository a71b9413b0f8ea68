"""Tolerances of the linear kernels' tests (``int8_linear``, ``dense_linear``): results that differ from the
reference only by the order of fp32 sums and the final rounding to the activation dtype."""

from __future__ import annotations

import torch

BF16_ULP = 2.0**-7  # relative spacing of bf16 values (8 significant bits)
ULP = {torch.bfloat16: BF16_ULP, torch.float16: 2.0**-10}


def assert_within_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: the same sums in another order. bf16/fp16: at most one ulp of the result apart (fp32 sums that land
    near a rounding boundary, and the interpreter's truncating casts), plus a floor for results near zero."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    floor = 1e-6 * max(1.0, float(ref.float().abs().max()))
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=floor * 10, rtol=1e-5)
    else:
        err = (out.float() - ref.float()).abs()
        assert bool((err <= ULP[ref.dtype] * ref.float().abs() + floor).all()), float(err.max())


def assert_gpu_close(out: torch.Tensor, ref: torch.Tensor, noise: float = 1e-3) -> None:
    """One bf16 ulp of each result, plus summation-order noise relative to the largest result."""
    err = (out.float() - ref.float()).abs()
    bound = BF16_ULP * ref.float().abs() + noise * ref.float().abs().max()
    assert bool((err <= bound).all()), float(err.max())
