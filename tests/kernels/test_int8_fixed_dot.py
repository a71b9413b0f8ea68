"""The CUDA-core int8 GEMV's integer dot (``kernels/int8_fixed_dot.py``): bf16 activations as 16-bit fixed point
per word of four columns, ``dp2a`` products, against ``int8_gemv_fixed_point_reference`` and, within its bound,
against the float contract of ``int8_linear_reference``.

On CPU the kernel runs under TRITON_INTERPRET=1, where shifts and int32 products stand in for the PTX (the same
integers); the ``gpu`` tests run the PTX at Gemma-4-31B's shapes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from hypothesis import example, given, settings
from hypothesis import strategies as st
from tests.kernels.reference_fixed_point import fixed_point_activations, int8_gemv_fixed_point_reference

from inference_server.kernels.int8_dequant import int8_words_view
from inference_server.kernels.int8_linear import Int8LinearConfig, int8_linear
from inference_server.kernels.reference_int8 import int8_linear_reference, quantize_int8_per_channel

from .rounding import assert_gpu_close, assert_within_rounding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _quantized(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_int8_per_channel(torch.randn(n, k, generator=gen) / k**0.5, torch.bfloat16)
    return q.to(DEV), scale.to(DEV)


def _wide_range(T: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 activations whose magnitudes span 2**-20 .. 2**12 inside single words: values far below their word's
    largest are the ones the fixed point rounds."""
    mantissa = torch.randn(T, K, generator=gen)
    exponent = torch.randint(-20, 13, (T, K), generator=gen).float()
    return (mantissa * torch.exp2(exponent)).to(DEV, torch.bfloat16)


# ------------------------------------------------------------------ the fixed point (PyTorch reference)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=-3e38, max_value=3e38, allow_nan=False, allow_subnormal=False),
                          st.floats(min_value=-1e-36, max_value=1e-36, allow_subnormal=False)), min_size=4, max_size=4))
@example([0.0, 0.0, 1.0, 1e-4])  # a power-of-two largest: 1e-4 moves by 0.36 of a step, 2.2e-5 > 2**-16
def test_fixed_point_is_exact_near_the_word_max_and_bounded_below(values: list[float]) -> None:
    """Each bf16 value within 2**7 of its word's largest magnitude is kept exactly; any other moves by at most half
    the grid step 2**(E - 141), and the largest is at least 2**(E - 127), so by at most 2**-15 of its magnitude
    (reached where the largest is a power of two). Words whose largest magnitude is below 2**-112 sit on the floor's
    grid, 2**-126: they move by at most 2**-127."""
    x = torch.tensor([values], dtype=torch.float32).to(torch.bfloat16)
    if not torch.isfinite(x).all():
        return  # bf16 rounding of a value near fp32's max: the NaN test covers non-finite words
    fixed = fixed_point_activations(x)
    exact = x.double()
    largest = exact.abs().max()
    if largest >= 2**-112:
        near = exact.abs() * 2**7 >= largest
        assert torch.equal(fixed[near], exact[near])
    assert bool(((fixed - exact).abs() <= torch.clamp(2**-15 * largest, min=2**-127)).all())


def test_fixed_point_marks_words_with_inf_or_nan() -> None:
    x = torch.tensor([[1.0, float("inf"), 2.0, 3.0, 1.0, 2.0, 3.0, 4.0, float("nan"), 0.0, 0.0, 0.0]],
                     dtype=torch.bfloat16)
    fixed = fixed_point_activations(x)
    assert fixed[0, :4].isnan().all() and fixed[0, 8:].isnan().all()
    assert torch.equal(fixed[0, 4:8], x[0, 4:8].double())


def test_fixed_point_of_zeros_and_tiny_values() -> None:
    """An all-zero word stays zero; values below 2**-126 (the smallest step) round to the grid of the floor."""
    x = torch.tensor([[0.0, 0.0, -0.0, 0.0, 1e-38, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    fixed = fixed_point_activations(x)
    assert torch.equal(fixed[0, :4], torch.zeros(4, dtype=torch.float64))
    assert abs(float(fixed[0, 4]) - float(x[0, 4])) <= 2.0**-127


# ------------------------------------------------------------------ the kernel against the references


@pytest.mark.parametrize(
    "config",
    [
        Int8LinearConfig(16, 1, 64),  # one token, whole tiles
        Int8LinearConfig(8, 1, 32, num_stages=2),  # tiles two ahead
        Int8LinearConfig(8, 2, 32, split_k=2),  # two tokens a program, split-K partial sums
        Int8LinearConfig(4, 4, 16, split_k=3),  # four tokens, narrow tiles
    ],
)
@pytest.mark.parametrize("K", [96, 104])  # 104: a ragged K tail on the word path
@pytest.mark.parametrize("T", [1, 3])
def test_gemv_word_path_computes_the_fixed_point(config: Int8LinearConfig, K: int, T: int) -> None:
    """int8 words and bf16 activations: the kernel's results are the fixed-point reference's, up to fp32
    summation order, with activations across 32 binary orders of magnitude."""
    gen = torch.Generator().manual_seed(K * 7 + T + config.block_k)
    q, scale = _quantized(21, K, gen)
    assert int8_words_view(q) is not None
    x = _wide_range(T, K, gen)
    out = int8_linear(x, q, scale, config=config)
    assert_within_rounding(out, int8_gemv_fixed_point_reference(x, q, scale))


def test_fixed_point_reference_stays_within_its_bound_of_the_float_contract() -> None:
    """What the fixed point costs against exact products: at most 2**-15 of each word's largest activation times
    the weight, summed; on normal activations (N(0, 1)) the results agree to bf16 rounding almost everywhere."""
    gen = torch.Generator().manual_seed(3)
    q, scale = _quantized(64, 256, gen)
    q, scale = q.cpu(), scale.cpu()
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    fixed = fixed_point_activations(x)
    word_max = x.double().abs().reshape(4, 64, 4).amax(-1).repeat_interleave(4, -1)
    bound = (2**-15 * word_max) @ q.double().abs().t()
    exact = x.double() @ q.double().t()
    assert bool(((fixed @ q.double().t() - exact).abs() <= bound).all())
    got = int8_gemv_fixed_point_reference(x, q, scale).float()
    ref = int8_linear_reference(x, q, scale).float()
    assert (got != ref).float().mean() < 0.02


# inf times 0 = NaN, what the test checks, warns in the interpreter's numpy
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_gemv_nan_and_inf_activations_reach_the_outputs() -> None:
    """A non-finite activation makes its token's outputs NaN (as float products would make them NaN or inf); the
    other tokens are untouched."""
    gen = torch.Generator().manual_seed(5)
    q, scale = _quantized(16, 64, gen)
    x = torch.randn(3, 64, generator=gen).to(DEV, torch.bfloat16)
    x[0, 9] = float("nan")
    x[2, 40] = float("inf")
    out = int8_linear(x, q, scale, config=Int8LinearConfig(8, 4, 32))
    assert out[0].isnan().all() and out[2].isnan().all()
    assert torch.isfinite(out[1]).all()
    assert_within_rounding(out[1:2], int8_gemv_fixed_point_reference(x[1:2], q, scale))


def test_fp32_activations_keep_the_float_products() -> None:
    """fp32 activations (the CPU-sized models' dtype) take the exact float products, not the fixed point."""
    gen = torch.Generator().manual_seed(6)
    q, scale = quantize_int8_per_channel(torch.randn(16, 64, generator=gen) / 8, torch.float32)
    q, scale = q.to(DEV), scale.to(DEV)
    x = _wide_range(2, 64, gen).float()
    assert_within_rounding(int8_linear(x, q, scale, config=Int8LinearConfig(8, 2, 32)),
                           int8_linear_reference(x, q, scale))


# ------------------------------------------------------------------ on the GPU: the PTX at real shapes


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k"), [(43008, 5376), (5376, 21504), (16384, 5376), (5376, 8192)])
@pytest.mark.parametrize("T", [1, 2])
def test_gpu_fixed_point_gemv_at_gemma_4_31b_shapes(n: int, k: int, T: int) -> None:
    gen = torch.Generator(DEV).manual_seed(n + T)
    w = torch.randn(n, k, generator=gen, device=DEV, dtype=torch.bfloat16) * k**-0.5
    q, scale = quantize_int8_per_channel(w)
    x = torch.randn(T, k, generator=gen, device=DEV, dtype=torch.bfloat16)
    for config in (Int8LinearConfig(8, 1 if T == 1 else 2, 256, num_warps=1),
                   Int8LinearConfig(8, 1 if T == 1 else 2, 1024, num_warps=4, num_stages=2)):
        out = int8_linear(x, q, scale, config=config)
        assert_gpu_close(out, int8_gemv_fixed_point_reference(x, q, scale), noise=1e-4)
        assert_gpu_close(out, int8_linear_reference(x, q, scale))
