"""The int8 weight-only format and reference matmul (kernels/reference_int8.py)."""

from __future__ import annotations

import torch

from inference_server.kernels.reference_int8 import (
    dequantize_int8,
    int8_linear_reference,
    quantize_int8_per_channel,
)


def test_quantize_is_symmetric_per_row_and_bounded() -> None:
    torch.manual_seed(0)
    w = torch.randn(3, 16, 32)
    w[1, 4] = 0.0  # an all-zero row
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (3, 16)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert float(scale[1, 4]) == 1.0 and not q[1, 4].any()
    # every non-zero row reaches ±127 at its largest magnitude, and the error is at most half a step
    err = (dequantize_int8(q, scale, torch.float32) - w).abs()
    assert bool((err <= scale.unsqueeze(-1) / 2 + 1e-6).all())


def test_reference_matmul_applies_scale_after_the_fp32_reduction() -> None:
    torch.manual_seed(1)
    w = torch.randn(24, 40, dtype=torch.bfloat16)
    q, scale = quantize_int8_per_channel(w)
    assert scale.dtype == torch.bfloat16
    x = torch.randn(5, 40, dtype=torch.bfloat16)
    y = int8_linear_reference(x, q, scale)
    expected = ((x.double() @ q.double().t()) * scale.double()).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected, atol=0, rtol=0.008)
    # and it approximates the unquantized layer
    full = torch.nn.functional.linear(x.float(), w.float())
    assert float((y.float() - full).abs().max()) < 0.05 * float(full.abs().max())
