"""int8 weight-only kernels: ``int8_linear`` and the int8 path of ``fused_moe`` against their PyTorch references.

On CPU the kernels run under TRITON_INTERPRET=1 at small, odd shapes (the interpreter rounds fp32 -> bf16 by
truncation, so bf16 results may sit one bf16 ulp from the reference); the ``gpu`` tests use the real shapes:
Gemma-4-31B's dense projections, Qwen3-30B-A3B's and Gemma-4-26B-A4B's experts.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

import triton
import triton.language as tl
from tests.kernels.reference_fixed_point import int8_gemv_fixed_point_reference
from tests.kernels.reference_moe import fused_moe_int8_reference, fused_moe_reference

from inference_server.kernels.dense_linear import dense_linear
from inference_server.kernels.fused_moe import MoeGemmConfig, MoeKernelConfig, fused_moe
from inference_server.kernels.int8_dequant import int8_to_fp32_exact, int8_words_view, words_to_fp32_exact
from inference_server.kernels.int8_linear import Int8LinearConfig, int8_linear, int8_linear_config
from inference_server.kernels.reference_int8 import dequantize_int8, int8_linear_reference, quantize_int8_per_channel
from inference_server.kernels.reference_moe import route_softmax_topk
from inference_server.kernels.streamed_linear import wave_split_k

from .rounding import assert_gpu_close, assert_within_rounding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _quantized(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
    q, scale = quantize_int8_per_channel(w, dtype)
    return q.to(DEV), scale.to(DEV)


# ------------------------------------------------------------------ int8_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_int8_linear_matches_reference(T: int, dtype: torch.dtype) -> None:
    """Default (heuristic) config at odd N and K: ragged weight-row tiles and a masked K tail."""
    gen = torch.Generator().manual_seed(T)
    q, scale = _quantized((37, 100), dtype, gen)
    x = torch.randn(T, 100, generator=gen).to(DEV, dtype)
    assert_within_rounding(int8_linear(x, q, scale), int8_linear_reference(x, q, scale))


@pytest.mark.parametrize(
    "config",
    [
        Int8LinearConfig(16, 16, 32, split_k=3, num_stages=2),  # split-K with a ragged last split
        Int8LinearConfig(16, 16, 16, split_k=2),  # even K (96 = 6 tiles): no masks
        Int8LinearConfig(32, 32, 64, split_k=8),  # more splits than K tiles: clamped, none empty
        Int8LinearConfig(64, 16, 128),  # tiles wider and deeper than the whole weight
        Int8LinearConfig(16, 16, 32, split_k=2, magic_dequant=1),  # bytes to floats by the exponent trick
        Int8LinearConfig(16, 1, 32),  # the CUDA-core GEMV: one token per program, masked K tail
        Int8LinearConfig(8, 4, 16, split_k=3),  # GEMV: 4 tokens per program (the last tile ragged), split-K
        Int8LinearConfig(32, 4, 128, num_warps=2),  # GEMV: tiles wider and deeper than the whole weight
        Int8LinearConfig(1, 1, 64, split_k=2),  # GEMV: one weight row per program
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_explicit_configs(config: Int8LinearConfig, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(config.block_k + config.split_k)
    K = 96 if config.block_k == 16 else 100
    q, scale = _quantized((37, K), dtype, gen)
    x_big = torch.randn(17, K + 8, generator=gen).to(DEV, dtype)
    x = x_big[:, 3 : 3 + K]  # strided rows
    out = torch.full((17, 37), float("nan"), dtype=dtype, device=DEV)
    assert int8_linear(x, q, scale, config=config, out=out) is out
    assert_within_rounding(out, int8_linear_reference(x, q, scale))


@pytest.mark.parametrize("config", [Int8LinearConfig(16, 1, 32), Int8LinearConfig(8, 4, 16, split_k=3),
                                    Int8LinearConfig(8, 2, 64, split_k=2)])
@pytest.mark.parametrize("K", [99, 100])  # 99: single bytes; 100 with a row stride of 102: single bytes too
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_int8_gemv_byte_path(config: Int8LinearConfig, K: int, T: int) -> None:
    """The CUDA-core GEMV where the weight cannot be read as 32-bit words (K not a multiple of 8, or rows not
    4-byte aligned): it reads single bytes, with the same results."""
    gen = torch.Generator().manual_seed(K + T)
    q_big, scale = _quantized((37, 102), torch.bfloat16, gen)
    q = q_big[:, :K]
    assert int8_words_view(q) is None
    x = torch.randn(T, K, generator=gen).to(DEV, torch.bfloat16)
    assert_within_rounding(int8_linear(x, q, scale, config=config), int8_linear_reference(x, q, scale))


@pytest.mark.parametrize("config", [Int8LinearConfig(16, 1, 64), Int8LinearConfig(8, 2, 32, split_k=2),
                                    Int8LinearConfig(4, 4, 8, split_k=3)])
@pytest.mark.parametrize("K", [96, 104])  # 104: a K tail of 40 columns (five word pairs) on the word path
@pytest.mark.parametrize("T", [1, 3, 6])
def test_int8_gemv_word_path(config: Int8LinearConfig, K: int, T: int) -> None:
    """The CUDA-core GEMV reading int8 weights as words, whole and ragged K tiles, tokens past a program's tile
    (bf16 activations: the integer dot's fixed point, ``tests/kernels/test_int8_fixed_dot.py``)."""
    gen = torch.Generator().manual_seed(K * T)
    q, scale = _quantized((21, K), torch.bfloat16, gen)
    assert int8_words_view(q) is not None
    x = torch.randn(T, K, generator=gen).to(DEV, torch.bfloat16)
    assert_within_rounding(int8_linear(x, q, scale, config=config), int8_gemv_fixed_point_reference(x, q, scale))


def test_int8_words_view_is_little_endian_words() -> None:
    """Column 4j + i of an int8 weight is byte i of word j: the kernel's word path reads it so."""
    q = torch.arange(-8, 8, dtype=torch.int8).reshape(2, 8)
    words = int8_words_view(q)
    assert words is not None and words.shape == (2, 2)
    assert words[0, 0].item() == int.from_bytes(bytes([248, 249, 250, 251]), "little", signed=True)
    assert int8_words_view(q[:, 1:5]) is None  # start not 4-byte aligned


@triton.jit
def _convert_words(w_ptr, out_ptr):
    offs = tl.arange(0, 64)
    b0, b1, b2, b3 = words_to_fp32_exact(tl.load(w_ptr + offs), False)
    tl.store(out_ptr + 4 * offs, b0)
    tl.store(out_ptr + 4 * offs + 1, b1)
    tl.store(out_ptr + 4 * offs + 2, b2)
    tl.store(out_ptr + 4 * offs + 3, b3)


def test_words_to_fp32_exact_is_the_conversion() -> None:
    """Every int8 value packed four to a word comes out exactly (the shift-and-mask form the interpreter runs;
    the PRMT form is compiled only: the GPU tests cover it)."""
    w = torch.arange(-128, 128, dtype=torch.int8, device=DEV)
    out = torch.empty(256, device=DEV)
    _convert_words[(1,)](w.view(torch.int32), out)
    assert torch.equal(out, w.float())


@triton.jit
def _convert_int8(w_ptr, out_ptr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, int8_to_fp32_exact(tl.load(w_ptr + offs)))


def test_int8_to_fp32_exact_is_the_conversion() -> None:
    """The exponent trick gives every int8 value exactly, as the conversion instruction does."""
    w = torch.arange(-128, 128, dtype=torch.int8, device=DEV)
    out = torch.empty(256, device=DEV)
    _convert_int8[(1,)](w, out)
    assert torch.equal(out, w.float())


def test_int8_linear_fp16_and_strided_weight() -> None:
    gen = torch.Generator().manual_seed(9)
    q_big, scale = _quantized((24, 80), torch.float16, gen)
    q = q_big[:, :72]  # row stride 80: a view of a wider weight
    x = torch.randn(5, 72, generator=gen).to(DEV, torch.float16)
    assert_within_rounding(int8_linear(x, q, scale), int8_linear_reference(x, q, scale))


def test_int8_linear_approximates_the_float_layer() -> None:
    """The scale sits where the format says: the int8 layer is the float layer up to quantization error."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 64, generator=gen)
    q, scale = quantize_int8_per_channel(w)
    x = torch.randn(6, 64, generator=gen)
    out = int8_linear(x.to(DEV), q.to(DEV), scale.to(DEV)).cpu()
    torch.testing.assert_close(out, x @ dequantize_int8(q, scale, torch.float32).T, atol=1e-4, rtol=1e-4)
    assert float((out - x @ w.T).abs().max()) < 0.02 * float((x @ w.T).abs().max())


def test_int8_linear_empty_and_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    q, scale = _quantized((8, 32), torch.float32, gen)
    assert int8_linear(torch.empty(0, 32, device=DEV), q, scale).shape == (0, 8)
    x = torch.randn(2, 32, device=DEV)
    with pytest.raises(ValueError, match="int8"):
        int8_linear(x, q.float(), scale)
    with pytest.raises(ValueError, match="disagree"):
        int8_linear(x[:, :16], q, scale)
    with pytest.raises(ValueError, match="out must be"):
        int8_linear(x, q, scale, out=torch.empty(2, 8, dtype=torch.bfloat16, device=DEV))


def test_int8_linear_config_heuristic() -> None:
    for bucket in ((3, 16), (17, 32), (33, 64), (65, 128)):  # one config per bucket: shared compiled variants
        assert len({int8_linear_config(t, 5376, 21504) for t in range(bucket[0], bucket[1] + 1)}) == 1
    for N, K in ((16384, 5376), (18432, 5376), (5376, 8192), (5376, 16384), (43008, 5376), (5376, 21504),
                 (5120, 2048), (2048, 4096), (2816, 2112), (37, 100)):
        for T in (3, 16, 17, 64, 100, 256, 2048, 8192):
            cfg = int8_linear_config(T, N, K)
            for size in (cfg.block_n, cfg.block_t, cfg.block_k):
                assert size >= 16 and size & (size - 1) == 0
            assert cfg.split_k == 1 or K // cfg.split_k >= 512
            if T > 128:
                assert cfg.split_k == 1  # several token tiles: a split would vary with T
        for T in (1, 2):  # the CUDA-core GEMV: T tokens a program, tiles of 256 columns a warp, whole where K allows
            cfg = int8_linear_config(T, N, K)
            assert cfg.block_t == T and cfg.split_k == 1 and cfg.block_k % 4 == 0
            assert cfg.num_warps == max(1, min(4, cfg.block_k // 256))
            assert K % cfg.block_k == 0 or cfg.block_k > K or K % 32
    # Gemma-4-31B at one token: the configs the H200 sweep chose (bench/results/2026-12-01-h200/issue13)
    assert int8_linear_config(1, 5376, 21504) == Int8LinearConfig(8, 1, 1024, 1, 4, 1)
    assert int8_linear_config(1, 43008, 5376) == Int8LinearConfig(8, 1, 256, 1, 1, 1)
    assert int8_linear_config(2, 5376, 8192) == Int8LinearConfig(16, 2, 1024, 1, 4, 1)
    # Gemma-4-31B down_proj at 16 tokens: 84 tiles of 64 rows, split over K to cover every SM
    down = int8_linear_config(16, 5376, 21504)
    assert down.split_k * (5376 // down.block_n) >= 132
    assert int8_linear_config(16, 5376, 21504, element_size=4).block_k == down.block_k // 2


def test_split_k_wave_model() -> None:
    weight = dict(n=16384, k=16384, tokens=16, block_k=128)
    assert wave_split_k(tiles=660, slots=660, **weight) == 1  # one full wave: nothing to gain
    assert wave_split_k(tiles=1320, slots=660, **weight) == 1
    assert wave_split_k(tiles=300, slots=660, **weight) == 1  # a partial wave that saturates HBM
    assert wave_split_k(tiles=84, slots=660, **weight) >= 4  # too few programs for the loads HBM needs in flight
    assert wave_split_k(tiles=84, slots=660, n=84, k=16384, tokens=16, block_k=128) == 1  # a tiny weight: the
    # reduce launch costs more than the whole read
    assert wave_split_k(tiles=84, slots=660, n=16384, k=1000, tokens=16, block_k=128) == 1  # K too short to split


# ------------------------------------------------------------------ int8 fused MoE


def _int8_experts(E: int, H: int, inter: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q_gu, s_gu = _quantized((E, 2 * inter, H), dtype, gen)  # [E, 2I, H], [E, 2I]
    q_dn, s_dn = _quantized((E, H, inter), dtype, gen)  # [E, H, I], [E, H]
    return q_gu, s_gu, q_dn, s_dn


def _routing(T: int, E: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = route_softmax_topk(torch.randn(T, E, generator=gen) * 2, K, renormalize=True)
    return w.to(DEV), ids.to(DEV)


def test_int8_moe_reference_is_the_dequantized_moe_in_fp32() -> None:
    """In fp32, scaling after the reduction equals multiplying by the dequantized weight (up to fp32 rounding)."""
    gen = torch.Generator().manual_seed(1)
    q_gu, s_gu, q_dn, s_dn = (t.cpu() for t in _int8_experts(8, 32, 24, torch.float32, gen))
    x = torch.randn(9, 32, generator=gen)
    w, ids = route_softmax_topk(torch.randn(9, 8, generator=gen), 2, renormalize=True)
    ref = fused_moe_int8_reference(x, q_gu, s_gu, q_dn, s_dn, w, ids, "silu")
    dequant = fused_moe_reference(x, dequantize_int8(q_gu, s_gu, torch.float32),
                                  dequantize_int8(q_dn, s_dn, torch.float32), w, ids, "silu")
    torch.testing.assert_close(ref, dequant, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("T", "E", "K"), [(1, 8, 8), (3, 4, 2), (17, 8, 2)])
def test_fused_moe_int8_fp32(T: int, E: int, K: int, activation: str) -> None:
    gen = torch.Generator().manual_seed(T * 31 + E * 7 + K)
    q_gu, s_gu, q_dn, s_dn = _int8_experts(E, 40, 24, torch.float32, gen)  # H = 40: a masked K tail
    x = torch.randn(T, 40, generator=gen).to(DEV)
    w, ids = _routing(T, E, K, gen)
    out = fused_moe(x, q_gu, q_dn, w, ids, activation, w_gate_up_scale=s_gu, w_down_scale=s_dn)
    ref = fused_moe_int8_reference(x, q_gu, s_gu, q_dn, s_dn, w, ids, activation)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])  # Qwen-style, Gemma-style
@pytest.mark.parametrize(("T", "E", "K", "activation"), [(1, 8, 8, "silu"), (3, 4, 2, "gelu_tanh"),
                                                         (17, 8, 2, "silu")])
def test_fused_moe_int8_bf16(T: int, E: int, K: int, activation: str, weights_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(T * 31 + E * 7 + K + 1)
    q_gu, s_gu, q_dn, s_dn = _int8_experts(E, 40, 24, torch.bfloat16, gen)
    x = torch.randn(T, 40, generator=gen).to(DEV, torch.bfloat16)
    w, ids = _routing(T, E, K, gen)
    w = w.to(weights_dtype)
    out = fused_moe(x, q_gu, q_dn, w, ids, activation, w_gate_up_scale=s_gu, w_down_scale=s_dn)
    ref = fused_moe_int8_reference(x, q_gu, s_gu, q_dn, s_dn, w, ids, activation)
    assert out.dtype == torch.bfloat16
    # bf16 roundings inside the block (GEMM outputs, activation, product) may each land one ulp apart
    torch.testing.assert_close(out.float(), ref.float(), atol=6e-2, rtol=4e-2)


def test_fused_moe_int8_reads_only_routed_experts_and_strided_scales() -> None:
    """Unrouted experts' scales are NaN (int8 weights cannot be): any use of them would poison the output.
    The scales are strided views, the config ragged (I = 24 in 16-row tiles, H = 40 in 32-deep tiles)."""
    gen = torch.Generator().manual_seed(11)
    T, E, K = 3, 8, 2
    q_gu, s_gu, q_dn, s_dn = _int8_experts(E, 40, 24, torch.float32, gen)
    s_gu = torch.cat([s_gu, s_gu], dim=1)[:, ::2]  # stride 2 along rows
    s_dn = s_dn.t().contiguous().t()  # column-major
    ids = torch.tensor([[2, 5], [5, 2], [6, 2]], device=DEV)  # experts 0, 1, 3, 4, 7 get no token
    for e in (0, 1, 3, 4, 7):
        s_gu[e] = float("nan")
        s_dn[e] = float("nan")
    x = torch.randn(T, 40, generator=gen).to(DEV)
    w = torch.rand(T, K, generator=gen).to(DEV)
    config = MoeKernelConfig(16, MoeGemmConfig(16, 32, 1), MoeGemmConfig(16, 16, 2))
    out = fused_moe(x, q_gu, q_dn, w, ids, "silu", config=config, w_gate_up_scale=s_gu, w_down_scale=s_dn)
    assert torch.isfinite(out).all()
    ref = fused_moe_int8_reference(x, q_gu, s_gu, q_dn, s_dn, w, ids, "silu")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_fused_moe_int8_rejects_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(3)
    q_gu, s_gu, q_dn, s_dn = _int8_experts(4, 32, 24, torch.float32, gen)
    x = torch.randn(2, 32, device=DEV)
    w, ids = _routing(2, 4, 2, gen)
    with pytest.raises(ValueError, match="both"):
        fused_moe(x, q_gu, q_dn, w, ids, "silu", w_gate_up_scale=s_gu)
    with pytest.raises(ValueError, match="int8"):
        fused_moe(x, q_gu.float(), q_dn, w, ids, "silu", w_gate_up_scale=s_gu, w_down_scale=s_dn)
    with pytest.raises(ValueError, match="scales must be"):
        fused_moe(x, q_gu, q_dn, w, ids, "silu", w_gate_up_scale=s_gu[:, :24], w_down_scale=s_dn)
    with pytest.raises(ValueError, match="hidden's dtype"):  # int8 weights without scales
        fused_moe(x, q_gu, q_dn, w, ids, "silu")


# ------------------------------------------------------------------ GPU, real shapes

# Gemma-4-31B (H = 5376, MLP 21504; 32 heads; sliding layers: head 256, 16 KV heads; full layers: head 512, 4 KV
# heads sharing K and V), Qwen3-30B-A3B attention (H = 2048, 32 x 128 q, 4 x 128 KV), fused as the model runs them.
LINEAR_SHAPES = {  # name: (N, K)
    "gemma4-31b.qkv_sliding": (16384, 5376),
    "gemma4-31b.qk_full": (18432, 5376),
    "gemma4-31b.o_sliding": (5376, 8192),
    "gemma4-31b.o_full": (5376, 16384),
    "gemma4-31b.gate_up": (43008, 5376),
    "gemma4-31b.down": (5376, 21504),
    "qwen3-30b-a3b.qkv": (5120, 2048),
    "qwen3-30b-a3b.o": (2048, 4096),
}


def _real_linear(N: int, K: int, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(seed)
    q = torch.randint(-127, 128, (N, K), generator=gen, device="cuda", dtype=torch.int8)
    scale = (torch.rand(N, generator=gen, device="cuda") * 0.02 / K**0.5).bfloat16()
    x = torch.randn(T, K, generator=gen, device="cuda", dtype=torch.bfloat16)
    return x, q, scale


@pytest.mark.parametrize("weights", ["int8", "bf16"])
@pytest.mark.parametrize(("K", "block_k"), [(32, 32), (64, 32), (96, 32), (160, 32), (96, 64)])  # 1, 2, 3, 5 tiles
@pytest.mark.parametrize("T", [1, 2, 3])
def test_gemv_deep_prefetch_gives_the_same_bits(weights: str, K: int, block_k: int, T: int) -> None:
    """``num_stages`` 2 on the CUDA-core GEMV (weight tiles two iterations ahead, ``DEEP``) reads the same tiles in
    the same order: the outputs equal the one-ahead loop's bit for bit, at every tile count (the clamped prefetches
    of the last two iterations included); a ragged K keeps the one-ahead loop."""
    gen = torch.Generator().manual_seed(K * 10 + T)
    q, scale = _quantized((21, K), torch.bfloat16, gen)
    x = torch.randn(T, K, generator=gen).to(DEV, torch.bfloat16)
    block_t = 1 << (T - 1).bit_length()
    one, two = (Int8LinearConfig(8, block_t, block_k, 1, 1, stages) for stages in (1, 2))
    if weights == "int8":
        deep = int8_linear(x, q, scale, config=two)
        assert torch.equal(deep, int8_linear(x, q, scale, config=one))
        assert_within_rounding(deep, int8_gemv_fixed_point_reference(x, q, scale))
    else:
        w = dequantize_int8(q, scale, torch.bfloat16)
        assert torch.equal(dense_linear(x, w, config=two), dense_linear(x, w, config=one))


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 7, 16, 64, 256, 2048])
@pytest.mark.parametrize("name", sorted(LINEAR_SHAPES))
def test_int8_linear_gpu_real_shapes(name: str, T: int) -> None:
    x, q, scale = _real_linear(*LINEAR_SHAPES[name], T)
    assert_gpu_close(int8_linear(x, q, scale), int8_linear_reference(x, q, scale))


@gpu
@needs_cuda
@pytest.mark.parametrize("config", [Int8LinearConfig(16, 1, 256), Int8LinearConfig(32, 4, 512, split_k=2),
                                    Int8LinearConfig(8, 1, 1024), Int8LinearConfig(8, 2, 1024, split_k=3),
                                    Int8LinearConfig(8, 1, 256, num_warps=1, num_stages=2),
                                    Int8LinearConfig(64, 16, 128, magic_dequant=1)])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_int8_linear_gpu_gemv_and_magic_paths(config: Int8LinearConfig, T: int) -> None:
    """The CUDA-core GEMV and the exponent-trick dot at Gemma-4-31B's gate/up shape equal the reference within
    rounding: the paths the tuner may pick."""
    x, q, scale = _real_linear(43008, 5376, T)
    assert_gpu_close(int8_linear(x, q, scale, config=config), int8_linear_reference(x, q, scale))


@gpu
@needs_cuda
def test_int8_linear_gpu_fp32_and_fp16() -> None:
    x, q, scale = _real_linear(5376, 8192, 16)
    out = int8_linear(x.float(), q, scale.float())
    torch.testing.assert_close(out, int8_linear_reference(x.float(), q, scale.float()), atol=1e-3, rtol=1e-4)
    assert_gpu_close(int8_linear(x.half(), q, scale.half()).float(),
                      int8_linear_reference(x.half(), q, scale.half()).float())


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16])
def test_int8_linear_gpu_deterministic_and_graph_capturable(T: int) -> None:
    x, q, scale = _real_linear(5376, 21504, T)  # split-K at decode: partial sums and the reduce kernel
    first = int8_linear(x, q, scale)
    assert torch.equal(first, int8_linear(x, q, scale))
    out = torch.empty_like(first)
    int8_linear(x, q, scale, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        int8_linear(x, q, scale, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, int8_linear(x, q, scale))


_REAL_MOE = {
    "qwen3-30b-a3b": dict(H=2048, I=768, E=128, K=8, activation="silu", weights_dtype=torch.bfloat16),
    "gemma4-26b-a4b": dict(H=2816, I=704, E=128, K=8, activation="gelu_tanh", weights_dtype=torch.float32),
}


def _real_moe(model: str, T: int, seed: int = 0):
    p = _REAL_MOE[model]
    gen = torch.Generator("cuda").manual_seed(seed)
    E, H, inter = p["E"], p["H"], p["I"]
    x = torch.randn(T, H, generator=gen, device="cuda", dtype=torch.bfloat16)
    w_gu = torch.randn(E, 2 * inter, H, generator=gen, device="cuda", dtype=torch.bfloat16) / H**0.5
    w_dn = torch.randn(E, H, inter, generator=gen, device="cuda", dtype=torch.bfloat16) / inter**0.5
    q_gu, s_gu = quantize_int8_per_channel(w_gu)
    q_dn, s_dn = quantize_int8_per_channel(w_dn)
    w, ids = route_softmax_topk(torch.randn(T, E, generator=gen, device="cuda") * 2, p["K"], renormalize=True)
    return x, q_gu, s_gu, q_dn, s_dn, w.to(p["weights_dtype"]), ids, p["activation"]


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16, 64, 256, 2048])
@pytest.mark.parametrize("model", sorted(_REAL_MOE))
def test_fused_moe_int8_gpu_real_shapes(model: str, T: int) -> None:
    x, q_gu, s_gu, q_dn, s_dn, w, ids, act = _real_moe(model, T)
    out = fused_moe(x, q_gu, q_dn, w, ids, act, w_gate_up_scale=s_gu, w_down_scale=s_dn)
    ref = fused_moe_int8_reference(x, q_gu, s_gu, q_dn, s_dn, w, ids, act)
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 * scale, rtol=2e-2)
    assert (out.float() - ref.float()).abs().mean() < 2e-3 * scale


@gpu
@needs_cuda
def test_fused_moe_int8_gpu_deterministic_and_graph_capturable() -> None:
    x, q_gu, s_gu, q_dn, s_dn, w, ids, act = _real_moe("gemma4-26b-a4b", 16)
    kw = dict(w_gate_up_scale=s_gu, w_down_scale=s_dn)
    first = fused_moe(x, q_gu, q_dn, w, ids, act, **kw)
    assert torch.equal(first, fused_moe(x, q_gu, q_dn, w, ids, act, **kw))
    out = torch.empty_like(first)
    fused_moe(x, q_gu, q_dn, w, ids, act, out=out, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, q_gu, q_dn, w, ids, act, out=out, **kw)
    x2, _, _, _, _, w2, ids2, _ = _real_moe("gemma4-26b-a4b", 16, seed=1)
    x.copy_(x2)
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(x, q_gu, q_dn, w, ids, act, **kw))
