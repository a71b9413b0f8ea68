"""A pre-norm's residual add inside the GEMV that reads its output (``kernels.norm_add_gemv.add_norm_gemv``) against
the two launches it replaces: ``fused_add_rmsnorm`` (``h = x + residual``, then the qwen norm of h), then the same
GEMV config's projection of the normed rows (``dense_linear`` or ``int8_linear``).

Under the interpreter the two agree bit for bit (both reduce the same zero-padded row with numpy); on the GPU the
norm's fp32 sum of squares runs over other warps, so a normed element may move by a rounding where that sum's last
bit does (``h`` does not depend on it and stays equal). Against PyTorch within the bf16 yardstick. CPU runs use
TRITON_INTERPRET=1 at small shapes; the ``gpu`` tests use Qwen3-30B-A3B's fused q/k/v projection.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_fused import add_norm_gemv_reference

from inference_server.kernels.dense_linear import dense_linear
from inference_server.kernels.gated_gemv import gated_gemv_config
from inference_server.kernels.int8_linear import int8_linear
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.norm_add_gemv import MAX_NORM_COLUMNS, add_norm_gemv
from inference_server.kernels.reference_int8 import quantize_int8_per_channel
from inference_server.kernels.rmsnorm import fused_add_rmsnorm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EPS = 1e-6


def _case(T: int, K: int, N: int, dtype: torch.dtype, int8: bool, seed: int):
    """A block output and a residual [T, K] at decoder scales, a norm weight [K] of their dtype, a weight [N, K]."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, K, generator=gen) * 3).to(DEV, dtype)
    residual = (torch.randn(T, K, generator=gen) * 8).to(DEV, dtype)
    norm_weight = (1 + torch.randn(K, generator=gen) / 4).to(DEV, dtype)
    weight = (torch.randn(N, K, generator=gen) * 2 / K**0.5).to(DEV, dtype)
    if not int8:
        return x, residual, norm_weight, weight, None
    qweight, w_scale = quantize_int8_per_channel(weight)
    return x, residual, norm_weight, qweight, w_scale


def _two_launches(x, residual, norm_weight, weight, w_scale, config):
    normed, h = fused_add_rmsnorm(x, residual, norm_weight, EPS, "qwen")
    if w_scale is None:
        return h, dense_linear(normed, weight, config=config)
    return h, int8_linear(normed, weight, w_scale, config=config)


@pytest.mark.parametrize(("dtype", "int8"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize(("T", "K", "N", "block_n", "block_t", "block_k"), [
    (1, 96, 24, 8, 1, 32),  # whole K tiles (the decode step)
    (2, 72, 20, 8, 2, 32),  # a ragged K tail, ragged outputs
    (3, 64, 16, 4, 4, 64),  # three tokens in a four-token program, one K tile
])
def test_same_bits_as_the_two_launches(T: int, K: int, N: int, block_n: int, block_t: int, block_k: int,
                                       dtype: torch.dtype, int8: bool) -> None:
    x, residual, norm_weight, weight, w_scale = _case(T, K, N, dtype, int8, seed=T * 100 + K + N)
    config = Int8LinearConfig(block_n, block_t, block_k, 1, 1, 1)
    h, out = add_norm_gemv(x, norm_weight, EPS, residual, weight, w_scale, config)
    want_h, want_out = _two_launches(x, residual, norm_weight, weight, w_scale, config)
    assert h.shape == (T, K) and out.shape == (T, N) and out.dtype == dtype
    assert torch.equal(h, want_h)  # the add does not depend on the sum of squares
    if DEV == "cpu":
        assert torch.equal(out, want_out)
    else:  # the sums of squares in another order: a normed element may move by a rounding
        torch.testing.assert_close(out, want_out, atol=2**-6 * want_out.abs().max().item(), rtol=2**-6)
    ref_h, ref_out = add_norm_gemv_reference(x, norm_weight, EPS, residual, weight, w_scale)
    if DEV == "cpu":  # the interpreter truncates its casts to bf16 where torch rounds to nearest: one rounding apart
        torch.testing.assert_close(h.float(), ref_h.float(), atol=0, rtol=2**-7 if dtype == torch.bfloat16 else 0)
    else:
        assert torch.equal(h, ref_h)
    # bf16: a few roundings (the interpreter truncates), carried through the projection's sums
    for got, ref in ((h, ref_h), (out, ref_out)):
        scale_of = ref.float().abs().max().item()
        tol = dict(atol=1e-4 * scale_of, rtol=1e-4) if dtype == torch.float32 else dict(atol=2**-6 * scale_of,
                                                                                        rtol=2**-5)
        torch.testing.assert_close(got.float(), ref.float(), **tol)


def test_rejects_what_it_does_not_compute() -> None:
    x, residual, norm_weight, weight, w_scale = _case(1, 64, 16, torch.bfloat16, False, seed=3)
    one_split = Int8LinearConfig(8, 1, 32, 1, 1, 1)
    with pytest.raises(ValueError, match="one split"):
        add_norm_gemv(x, norm_weight, EPS, residual, weight, w_scale, Int8LinearConfig(8, 1, 16, 2, 1, 1))
    with pytest.raises(ValueError, match="one split"):  # the tensor-core kernel's token tile
        add_norm_gemv(x, norm_weight, EPS, residual, weight, w_scale, Int8LinearConfig(64, 16, 32, 1, 4, 2))
    with pytest.raises(ValueError, match="residual"):
        add_norm_gemv(x, norm_weight, EPS, residual[:, :32], weight, w_scale, one_split)
    with pytest.raises(ValueError, match="norm weight"):  # the qwen norm's last multiply stays in x's dtype
        add_norm_gemv(x, norm_weight.float(), EPS, residual, weight, w_scale, one_split)
    wide = torch.zeros(1, MAX_NORM_COLUMNS + 8, device=DEV)
    with pytest.raises(ValueError, match="at most"):
        add_norm_gemv(wide, torch.ones(wide.shape[1], device=DEV), EPS, wide, torch.zeros(8, wide.shape[1],
                                                                                         device=DEV), None, one_split)


@gpu
@needs_cuda
@pytest.mark.parametrize("int8", [False, True])
def test_qkv_projection_at_real_shapes(int8: bool) -> None:
    """Qwen3-30B-A3B's input norm feeding its fused q/k/v projection ([5120, 2048]) at one token, the config the
    runner takes: h equal to the two launches', the projection within the bf16 yardstick of theirs and PyTorch's."""
    x, residual, norm_weight, weight, w_scale = _case(1, 2048, 5120, torch.bfloat16, int8, seed=2048)
    config = gated_gemv_config(x, weight, w_scale, paired=False)
    assert config is not None
    h, out = add_norm_gemv(x, norm_weight, EPS, residual, weight, w_scale, config)
    want_h, want_out = _two_launches(x, residual, norm_weight, weight, w_scale, config)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2**-6)
    _, ref_out = add_norm_gemv_reference(x, norm_weight, EPS, residual, weight, w_scale)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=2**-5)
