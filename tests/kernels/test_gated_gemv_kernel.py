"""The gate/up GEMV with the gated activation in its epilogue (``kernels.gated_gemv``) against the two launches it
replaces: the same GEMV config's projection (``dense_linear`` / ``int8_linear``), then ``gated_activation``.

The two must agree bit for bit (a row's sums do not depend on which rows share its program, and the epilogue rounds
as the projection's store and the activation kernel do); against PyTorch (``F.linear`` or the int8 reference, then
the activation) within the bf16 yardstick. CPU runs use TRITON_INTERPRET=1 at small shapes; the ``gpu`` tests use
Gemma 4's real gate/up shapes.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.kernels.dense_linear import dense_linear
from inference_server.kernels.gated_activation import gated_activation
from inference_server.kernels.gated_gemv import gated_gemv, gated_gemv_config
from inference_server.kernels.int8_linear import int8_linear
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.reference_int8 import int8_linear_reference, quantize_int8_per_channel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(T: int, half: int, K: int, dtype: torch.dtype, int8: bool, seed: int):
    """x [T, K], a fused [gate; up] weight [2I, K] (int8 with its scales, or float of x's dtype) at MLP scales."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(DEV, dtype)
    weight = (torch.randn(2 * half, K, generator=gen) * 2 / K**0.5).to(DEV, dtype)
    if not int8:
        return x, weight, None
    qweight, scale = quantize_int8_per_channel(weight)
    return x, qweight, scale


def _unfused(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act: str,
             config: Int8LinearConfig, up: torch.Tensor | None = None) -> torch.Tensor:
    """The two launches the fused kernel replaces, with the same projection config (``up`` given: the weight is
    the gate's alone)."""
    if scale is None:
        projected = dense_linear(x, weight, config=config)
    else:
        projected = int8_linear(x, weight, scale, config=config)
    if up is None:
        gate, up = projected.chunk(2, dim=-1)
        return gated_activation(gate, up, act)
    return gated_activation(projected, up, act)


def _pytorch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act: str) -> torch.Tensor:
    projected = F.linear(x, weight) if scale is None else int8_linear_reference(x, weight, scale)
    gate, up = projected.chunk(2, dim=-1)
    activated = F.gelu(gate, approximate="tanh") if act == "gelu_tanh" else F.silu(gate)
    return activated * up


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
@pytest.mark.parametrize(("dtype", "int8"), [(torch.float32, False), (torch.bfloat16, False),
                                             (torch.float32, True), (torch.bfloat16, True)])
@pytest.mark.parametrize(("T", "half", "K", "block_n", "block_t", "block_k"), [
    (1, 24, 64, 8, 1, 32),  # whole tiles
    (2, 22, 72, 8, 2, 32),  # ragged outputs (the last program's rows past I) and a ragged K tail
    (3, 12, 64, 4, 4, 64),  # three tokens in a four-token program, two outputs a program
])
def test_same_bits_as_the_two_launches(T: int, half: int, K: int, block_n: int, block_t: int, block_k: int,
                                       dtype: torch.dtype, int8: bool, act: str) -> None:
    x, weight, scale = _case(T, half, K, dtype, int8, seed=T * 100 + half + K)
    config = Int8LinearConfig(block_n, block_t, block_k, 1, 1, 1)
    out = gated_gemv(x, weight, scale, act, config)
    assert out.shape == (T, half) and out.dtype == dtype
    assert torch.equal(out, _unfused(x, weight, scale, act, config))
    ref = _pytorch(x, weight, scale, act)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:  # a few bf16 roundings (the interpreter truncates its casts)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2**-5)


@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
@pytest.mark.parametrize(("dtype", "int8"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize(("T", "N", "K", "block_n", "block_t", "block_k"), [
    (1, 24, 64, 8, 1, 32),
    (3, 20, 72, 8, 4, 32),  # ragged outputs, a ragged K tail, three tokens in a four-token program
])
def test_up_from_memory_same_bits_as_the_two_launches(T: int, N: int, K: int, block_n: int, block_t: int,
                                                      block_k: int, dtype: torch.dtype, int8: bool, act: str) -> None:
    """``act(x @ W.T) * up`` with ``up`` a strided slice of a wider tensor (Gemma 4's per-layer inputs)."""
    x, weight, scale = _case(T, N // 2, K, dtype, int8, seed=T + N + K)
    gen = torch.Generator().manual_seed(7)
    up = (torch.randn(T, 3, N, generator=gen) * 2).to(DEV, dtype)[:, 1]  # [T, N], row stride 3N
    config = Int8LinearConfig(block_n, block_t, block_k, 1, 1, 1)
    out = gated_gemv(x, weight, scale, act, config, up)
    assert out.shape == (T, N) and out.dtype == dtype
    assert torch.equal(out, _unfused(x, weight, scale, act, config, up))
    full = F.linear(x, weight) if scale is None else int8_linear_reference(x, weight, scale)
    ref = (F.gelu(full, approximate="tanh") if act == "gelu_tanh" else F.silu(full)) * up
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2**-5)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_config_is_the_projections_when_it_is_a_one_split_gemv() -> None:
    x, weight, scale = _case(1, 32, 2048, torch.bfloat16, True, seed=1)
    config = gated_gemv_config(x, weight, scale)
    assert config is not None and config.block_t < 16 and config.split_k == 1  # the heuristic GEMV at one token
    x16 = torch.zeros(16, 2048, dtype=torch.bfloat16, device=DEV)
    assert gated_gemv_config(x16, weight, scale) is None  # 16 tokens: the tensor-core kernel
    assert gated_gemv_config(x, weight[:-1], scale[:-1]) is None  # an odd row count has no [gate; up] halves
    assert gated_gemv_config(x, weight[:-1], scale[:-1], paired=False) is not None  # a gate alone needs none


def test_rejects_what_it_does_not_compute() -> None:
    x, weight, scale = _case(1, 8, 64, torch.float32, True, seed=2)
    config = Int8LinearConfig(8, 1, 32, 1, 1, 1)
    with pytest.raises(ValueError, match="supports"):
        gated_gemv(x, weight, scale, "relu", config)
    with pytest.raises(ValueError, match="one split"):
        gated_gemv(x, weight, scale, "silu", Int8LinearConfig(8, 1, 32, 2, 1, 1))


@gpu
@needs_cuda
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize(("T", "half", "K"), [(1, 21504, 5376), (2, 21504, 5376), (1, 10240, 2560),
                                              (1, 2112, 2816)])
def test_real_shapes_on_the_gpu(T: int, half: int, K: int, int8: bool) -> None:
    """Gemma-4-31B, E4B and 26B-A4B dense MLPs in bf16: the tuned (or heuristic) config, same bits as unfused."""
    x, weight, scale = _case(T, half, K, torch.bfloat16, int8, seed=T + half)
    config = gated_gemv_config(x, weight, scale)
    if config is None:
        pytest.skip("this shape's projection is not a one-split GEMV here")
    out = gated_gemv(x, weight, scale, "gelu_tanh", config)
    assert torch.equal(out, _unfused(x, weight, scale, "gelu_tanh", config))
    ref = _pytorch(x, weight, scale, "gelu_tanh")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2**-6)
