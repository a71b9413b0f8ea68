"""The Triton q/k RoPE kernel against ``architectures.layers.apply_rope``: bitwise in the CPU interpreter (fp32); on the
GPU within one rounding of the larger term, because the compiler contracts multiply-adds (see the kernel)."""

from __future__ import annotations

import pytest
import torch

from inference_server.kernels.rope import rope_qk_
from inference_server.models.architectures.layers import apply_rope, rope_cos_sin, rope_inv_freq
from inference_server.models.spec import RopeSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# One rounding of terms of magnitude < 8: fp32 ulp(8) = 9.5e-7; bf16 ulp(4..8) = 2**-5.
TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=2.4e-7), torch.bfloat16: dict(atol=2**-5, rtol=2**-7)}


def assert_rope_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    if DEVICE == "cpu":
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, **TOLERANCE[out.dtype])


def case(tokens: int, num_q: int, num_k: int, head_dim: int, partial: float, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(tokens * 31 + head_dim)
    q = torch.randn(tokens, num_q, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(tokens, num_k, head_dim, generator=gen).to(DEVICE, dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen).to(DEVICE)
    inv_freq = rope_inv_freq(RopeSpec(theta=1e6, head_dim=head_dim, partial_factor=partial))
    cos, sin = rope_cos_sin(inv_freq, positions, dtype)
    return q, k, cos, sin


@pytest.mark.parametrize(("tokens", "num_q", "num_k", "head_dim", "partial"),
                         [(1, 4, 2, 16, 1.0), (5, 4, 1, 32, 0.25), (3, 2, 2, 24, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kernel_equals_reference_bitwise(tokens: int, num_q: int, num_k: int, head_dim: int, partial: float,
                                              dtype: torch.dtype) -> None:
    if dtype is torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the Triton 3.9 interpreter truncates fp32->bf16 casts instead of rounding (GPU covers it)")
    q, k, cos, sin = case(tokens, num_q, num_k, head_dim, partial, dtype)
    expected_q, expected_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out_q, out_k = rope_qk_(q.clone(), k.clone(), cos, sin)
    assert_rope_close(out_q, expected_q)
    assert_rope_close(out_k, expected_k)


def test_rope_kernel_without_k_and_on_strided_views() -> None:
    q, _, cos, sin = case(4, 4, 2, 16, 1.0, torch.float32)
    packed = torch.cat((q, q), dim=1)  # [T, 2 * nH, D]: a view of its first half has a token stride of 8 * D
    view = packed[:, :4]
    expected = apply_rope(q, cos, sin)
    out_q, out_k = rope_qk_(view, None, cos, sin)
    assert out_k is None
    assert_rope_close(out_q, expected)
    assert_rope_close(packed[:, :4], expected)
    assert torch.equal(packed[:, 4:], q)  # the rest of the buffer is untouched


@pytest.mark.gpu
@pytest.mark.parametrize(("num_q", "num_k", "head_dim", "partial"),
                         [(32, 4, 128, 1.0), (16, 8, 256, 1.0), (16, 2, 512, 0.25), (32, 16, 256, 1.0)])
@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_rope_kernel_real_shapes_bf16(tokens: int, num_q: int, num_k: int, head_dim: int, partial: float) -> None:
    q, k, cos, sin = case(tokens, num_q, num_k, head_dim, partial, torch.bfloat16)
    expected_q, expected_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out_q, out_k = rope_qk_(q.clone(), k.clone(), cos, sin)
    assert_rope_close(out_q, expected_q)
    assert_rope_close(out_k, expected_k)
