"""The sandwich norm's residual add inside the GEMV that reads it (``kernels.norm_add_gemv``) against the two launches
it replaces: ``norm_add`` (``y = residual + norm(a) [* scale]``), then the same GEMV config's projection of y
(``gated_gemv``, ``dense_linear`` or ``int8_linear``).

Under the interpreter the two agree bit for bit (both reduce the same zero-padded row with numpy); on the GPU the
norm's fp32 sum of squares runs over other warps, so y may move by a bf16 rounding where that sum's last bit does.
Against PyTorch within the bf16 yardstick. CPU runs use TRITON_INTERPRET=1 at small shapes; the ``gpu`` tests use
Gemma-4-E2B/E4B's per-layer-input gate.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_fused import norm_add_gemv_reference

from inference_server.kernels.dense_linear import dense_linear
from inference_server.kernels.gated_gemv import gated_gemv, gated_gemv_config
from inference_server.kernels.int8_linear import int8_linear
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.norm_add import norm_add
from inference_server.kernels.norm_add_gemv import MAX_NORM_COLUMNS, norm_add_gemv
from inference_server.kernels.reference_int8 import quantize_int8_per_channel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EPS = 1e-6


def _case(T: int, K: int, N: int, dtype: torch.dtype, int8: bool, scaled: bool, seed: int):
    """A block output and a residual [T, K] at decoder scales, a norm weight [K], a layer scale, a weight [N, K]."""
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(T, K, generator=gen) * 3).to(DEV, dtype)
    residual = (torch.randn(T, K, generator=gen) * 8).to(DEV, dtype)
    wa = (1 + torch.randn(K, generator=gen) / 4).to(DEV, dtype)
    scale = torch.tensor([0.625]).to(DEV, dtype) if scaled else None
    weight = (torch.randn(N, K, generator=gen) * 2 / K**0.5).to(DEV, dtype)
    if not int8:
        return a, residual, wa, scale, weight, None
    qweight, w_scale = quantize_int8_per_channel(weight)
    return a, residual, wa, scale, qweight, w_scale


def _assert_within_one_rounding(got: torch.Tensor, want: torch.Tensor, residual: torch.Tensor) -> None:
    """Each element of ``got`` (``y = residual + n``) within a rounding of ``n`` and one of the sum: the sum of
    squares in another order moves the fp32 inverse root by a few bits, so ``n`` by a few fp32 ulps or one bf16
    rounding, which the residual add may not absorb."""
    mantissa, ulps = {torch.float32: (23, 4), torch.bfloat16: (7, 1)}[want.dtype]
    normed = (want.float() - residual.float()).abs()
    bound = (want.float().abs() + normed).clamp_min(2**-100) * 2.0**-mantissa * ulps
    assert ((got.float() - want.float()).abs() <= bound).all()


def _two_launches(a, residual, wa, scale, weight, w_scale, config, gated, up):
    y, _ = norm_add(a, wa, EPS, residual=residual, scale=scale)
    if gated is not None:
        return y, gated_gemv(y, weight, w_scale, gated, config, up)
    if w_scale is None:
        return y, dense_linear(y, weight, config=config)
    return y, int8_linear(y, weight, w_scale, config=config)


@pytest.mark.parametrize("form", ["up_in_memory", "paired", "plain"])
@pytest.mark.parametrize(("dtype", "int8"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize(("T", "K", "N", "block_n", "block_t", "block_k", "scaled"), [
    (1, 96, 24, 8, 1, 32, False),  # whole K tiles, no scale (Gemma 4's post-FFN add)
    (2, 72, 20, 8, 2, 32, True),  # a ragged K tail, ragged outputs, the layer scale
    (3, 64, 16, 4, 4, 64, False),  # three tokens in a four-token program, one K tile
])
def test_same_bits_as_the_two_launches(T: int, K: int, N: int, block_n: int, block_t: int, block_k: int,
                                       scaled: bool, dtype: torch.dtype, int8: bool, form: str) -> None:
    a, residual, wa, scale, weight, w_scale = _case(T, K, N, dtype, int8, scaled, seed=T * 100 + K + N)
    gated = None if form == "plain" else "gelu_tanh" if T != 2 else "silu"
    up = (torch.randn(T, 3, N, generator=torch.Generator().manual_seed(5)) * 2).to(DEV, dtype)[:, 1] \
        if form == "up_in_memory" else None  # [T, N] with row stride 3N, as Gemma 4's per-layer inputs
    config = Int8LinearConfig(block_n, block_t, block_k, 1, 1, 1)
    y, out = norm_add_gemv(a, wa, EPS, residual, scale, weight, w_scale, config, gated=gated, up=up)
    want_y, want_out = _two_launches(a, residual, wa, scale, weight, w_scale, config, gated, up)
    assert y.shape == (T, K) and out.shape == want_out.shape and out.dtype == dtype
    if DEV == "cpu":
        assert torch.equal(y, want_y) and torch.equal(out, want_out)
    else:  # the sums of squares in another order: y within one rounding of the dtype, carried through the GEMV
        _assert_within_one_rounding(y, want_y, residual)
        torch.testing.assert_close(out, want_out, atol=2**-6 * want_out.abs().max().item(), rtol=2**-6)
    ref_y, ref_out = norm_add_gemv_reference(a, wa, EPS, residual, scale, weight, w_scale, gated=gated, up=up)
    # bf16: a few roundings (the interpreter truncates its casts), carried through the projection's sums
    for got, ref in ((y, ref_y), (out, ref_out)):
        scale_of = ref.float().abs().max().item()
        tol = dict(atol=1e-4 * scale_of, rtol=1e-4) if dtype == torch.float32 else dict(atol=2**-6 * scale_of,
                                                                                        rtol=2**-5)
        torch.testing.assert_close(got.float(), ref.float(), **tol)


def test_rejects_what_it_does_not_compute() -> None:
    a, residual, wa, scale, weight, w_scale = _case(1, 64, 16, torch.float32, False, False, seed=3)
    one_split = Int8LinearConfig(8, 1, 32, 1, 1, 1)
    with pytest.raises(ValueError, match="one split"):
        norm_add_gemv(a, wa, EPS, residual, scale, weight, w_scale, Int8LinearConfig(8, 1, 16, 2, 1, 1))
    with pytest.raises(ValueError, match="one split"):  # the tensor-core kernel's token tile
        norm_add_gemv(a, wa, EPS, residual, scale, weight, w_scale, Int8LinearConfig(64, 16, 32, 1, 4, 2))
    with pytest.raises(ValueError, match="residual"):
        norm_add_gemv(a, wa, EPS, residual[:, :32], scale, weight, w_scale, one_split)
    with pytest.raises(ValueError, match="norm weight"):
        norm_add_gemv(a, wa[:32], EPS, residual, scale, weight, w_scale, one_split)
    with pytest.raises(ValueError, match="scale"):
        norm_add_gemv(a, wa, EPS, residual, torch.ones(2, device=DEV), weight, w_scale, one_split)
    with pytest.raises(ValueError, match="gated"):
        norm_add_gemv(a, wa, EPS, residual, scale, weight, w_scale, one_split, gated="relu")
    wide = torch.zeros(1, MAX_NORM_COLUMNS + 8, device=DEV)
    with pytest.raises(ValueError, match="at most"):
        norm_add_gemv(wide, torch.ones(wide.shape[1], device=DEV), EPS, wide, None,
                      torch.zeros(8, wide.shape[1], device=DEV), None, one_split)


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 2])  # from 3 tokens the projection takes the tensor-core kernel
@pytest.mark.parametrize(("hidden", "int8"), [(2560, False), (1536, False), (2560, True)])
def test_per_layer_input_gate_at_real_shapes(hidden: int, int8: bool, tokens: int) -> None:
    """Gemma-4-E4B / E2B's post-FFN add feeding the per-layer-input gate ([256, H], gelu_tanh, up from memory) at
    the config the runner takes: y within one bf16 rounding of the two launches' (the fp32 sum of squares in
    another order), the gated output within the bf16 yardstick, and both against PyTorch."""
    a, residual, wa, _, weight, w_scale = _case(tokens, hidden, 256, torch.bfloat16, int8, False, seed=hidden)
    up = torch.randn(tokens, 256, device=DEV, dtype=torch.bfloat16)
    config = gated_gemv_config(a, weight, w_scale, paired=False)
    assert config is not None
    y, out = norm_add_gemv(a, wa, EPS, residual, None, weight, w_scale, config, gated="gelu_tanh", up=up)
    want_y, want_out = _two_launches(a, residual, wa, None, weight, w_scale, config, "gelu_tanh", up)
    _assert_within_one_rounding(y, want_y, residual)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2**-6)
    ref_y, ref_out = norm_add_gemv_reference(a, wa, EPS, residual, None, weight, w_scale, gated="gelu_tanh", up=up)
    torch.testing.assert_close(y.float(), ref_y.float(), atol=6e-2, rtol=2**-6)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=3e-2, rtol=2**-5)
