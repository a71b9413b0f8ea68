"""``kernels.dense_linear`` (the float-weight small-M linear layer) against its PyTorch reference, and the CUDA
backend's ``ops.linear`` wrapper around it.

On CPU the kernel runs under TRITON_INTERPRET=1 at small, odd shapes (the interpreter rounds fp32 -> bf16 by
truncation, so bf16 results may sit one bf16 ulp from the reference); the ``gpu`` tests use the real decode
shapes of the presets and compare with cuBLAS.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_linear import dense_linear_reference

from inference_server.kernels.dense_linear import BUCKETS, _stream_seconds, dense_linear, dense_linear_config
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.models.architectures import ops
from inference_server.models.architectures.linear import Linear

from .rounding import BF16_ULP, assert_gpu_close, assert_within_rounding

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weight(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, dtype)


def test_reference_accumulates_in_fp32_and_rounds_once() -> None:
    x = torch.tensor([[1.0, 2.0**-8, 2.0**-8]], dtype=torch.bfloat16)
    w = torch.ones(1, 3, dtype=torch.bfloat16)
    # bf16 sums would drop each 2^-8 against 1 (a half ulp: ties to even); fp32 keeps 1 + 2^-7, a bf16 value
    assert (x[0, 0] + x[0, 1] + x[0, 2]).item() == 1.0
    assert dense_linear_reference(x, w).item() == 1.0 + 2.0**-7
    assert dense_linear_reference(x.float(), w.float()).item() == 1.0 + 2.0**-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 16, 17])
def test_dense_linear_matches_reference(T: int, dtype: torch.dtype) -> None:
    """Default (heuristic) config at odd N and K: ragged weight-row tiles, a masked K tail, token counts inside
    and past the first bucket."""
    gen = torch.Generator().manual_seed(T)
    w = _weight(37, 100, dtype, gen)
    x = torch.randn(T, 100, generator=gen).to(DEV, dtype)
    assert_within_rounding(dense_linear(x, w), dense_linear_reference(x, w))


@pytest.mark.parametrize(
    "config",
    [
        Int8LinearConfig(16, 16, 32, split_k=3, num_stages=2),  # split-K with a ragged last split
        Int8LinearConfig(16, 16, 16, split_k=2),  # even K (96 = 6 tiles): no masks, two splits
        Int8LinearConfig(32, 32, 64, split_k=8),  # more splits than K tiles: clamped, none empty
        Int8LinearConfig(64, 16, 128),  # tiles wider and deeper than the whole weight, no split
        Int8LinearConfig(16, 16, 32),  # several token tiles (T = 17), masked K tail, no split
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_explicit_configs(config: Int8LinearConfig, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(config.block_k + config.split_k)
    K = 96 if config.block_k == 16 else 100
    w = _weight(37, K, dtype, gen)
    x_big = torch.randn(17, K + 8, generator=gen).to(DEV, dtype)
    x = x_big[:, 3 : 3 + K]  # strided rows
    out = torch.full((17, 37), float("nan"), dtype=dtype, device=DEV)
    assert dense_linear(x, w, config=config, out=out) is out
    assert_within_rounding(out, dense_linear_reference(x, w))


@pytest.mark.parametrize(
    "config",
    [
        Int8LinearConfig(16, 1, 32),  # the CUDA-core GEMV: one token a program, masked K tail (K = 99)
        Int8LinearConfig(8, 4, 16, split_k=3),  # four tokens a program (the last token tile ragged), split-K
        Int8LinearConfig(32, 2, 128, num_warps=2),  # tiles wider and deeper than the whole weight
        Int8LinearConfig(1, 1, 64, split_k=2),  # one weight row a program, two splits
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_dense_linear_cuda_core_gemv(config: Int8LinearConfig, dtype: torch.dtype, T: int) -> None:
    """Float weights on the CUDA-core GEMV (``block_t`` < 16) at odd N and K, strided activation rows."""
    gen = torch.Generator().manual_seed(config.block_k + T)
    K = 99 if config.split_k == 1 else 96
    w = _weight(37, K, dtype, gen)
    x = torch.randn(T, K + 8, generator=gen).to(DEV, dtype)[:, 5 : 5 + K]
    out = torch.full((T, 37), float("nan"), dtype=dtype, device=DEV)
    assert dense_linear(x, w, config=config, out=out) is out
    assert_within_rounding(out, dense_linear_reference(x, w))


def test_dense_linear_fp16_and_strided_weight() -> None:
    gen = torch.Generator().manual_seed(9)
    w = _weight(24, 80, torch.float16, gen)[:, :72]  # row stride 80: a view of a wider weight
    x = torch.randn(5, 72, generator=gen).to(DEV, torch.float16)
    assert_within_rounding(dense_linear(x, w), dense_linear_reference(x, w))


def test_dense_linear_empty_and_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    w = _weight(8, 32, torch.float32, gen)
    assert dense_linear(torch.empty(0, 32, device=DEV), w).shape == (0, 8)
    assert bool((dense_linear(torch.empty(3, 0, device=DEV), w[:, :0]) == 0).all())
    x = torch.randn(2, 32, device=DEV)
    with pytest.raises(ValueError, match="differs"):
        dense_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="disagree"):
        dense_linear(x[:, :16], w)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        dense_linear(x.double(), w.double())
    with pytest.raises(ValueError, match="out must be"):
        dense_linear(x, w, out=torch.empty(2, 8, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match="int8 weights only"):
        dense_linear(x, w, config=Int8LinearConfig(16, 16, 32, magic_dequant=1))
    for bad_gemv in (Int8LinearConfig(16, 8, 32), Int8LinearConfig(16, 1, 30)):  # > 4 tokens; K tile not 4k
        with pytest.raises(ValueError, match="CUDA-core GEMV"):
            dense_linear(x, w, config=bad_gemv)


# Decode shapes of the presets as the CUDA runner runs them (q/k/v and gate/up fused): Qwen3-30B-A3B, Gemma-4-26B-A4B,
# Gemma-4-31B, Gemma-4-E4B (``bench/dense_linear.py`` derives them from the presets' model builds); and the routers,
# whose GEMM takes ``ops.linear`` where the fused routing launch is off.
REAL_SHAPES = {  # name: (N, K)
    "qwen3-30b-a3b.qkv": (5120, 2048),
    "qwen3-30b-a3b.o": (2048, 4096),
    "qwen3-30b-a3b.router": (128, 2048),
    "gemma-4-26b-a4b.qkv_sliding": (8192, 2816),
    "gemma-4-26b-a4b.qk_full": (9216, 2816),
    "gemma-4-26b-a4b.o_full": (2816, 8192),
    "gemma-4-26b-a4b.gate_up": (4224, 2816),
    "gemma-4-26b-a4b.down": (2816, 2112),
    "gemma-4-26b-a4b.router": (128, 2816),
    "gemma-4-31b.qk_full": (18432, 5376),
    "gemma-4-31b.o_sliding": (5376, 8192),
    "gemma-4-31b.gate_up": (43008, 5376),
    "gemma-4-31b.down": (5376, 21504),
    "gemma-4-e4b.qkv_full": (6144, 2560),
    "gemma-4-e4b.ple_gate": (256, 2560),
    "gemma-4-e4b.ple_projection": (2560, 256),
    "gemma-4-e4b.ple_model_projection": (10752, 2560),
}


def test_dense_linear_config_heuristic() -> None:
    for low, high in ((3, 16), (17, 32), (33, 64), (65, 128)):  # one config per bucket: shared compiled variants
        for N, K in REAL_SHAPES.values():
            assert len({dense_linear_config(t, N, K) for t in range(low, high + 1)}) == 1
    assert [b.max_tokens for b in BUCKETS][:4] == [16, 32, 64, 128]
    for N, K in [*REAL_SHAPES.values(), (262144, 2816), (37, 100)]:
        for T in (1, 2):  # the CUDA-core GEMV (streamed_linear.gemv_config): T tokens a program, no split
            cfg = dense_linear_config(T, N, K)
            assert cfg.block_t == T and cfg.split_k == 1 and cfg.block_k % 4 == 0
        for T in (3, 16, 17, 64, 100, 256, 2048):
            for element_size in (2, 4):
                cfg = dense_linear_config(T, N, K, element_size)
                for size in (cfg.block_n, cfg.block_t, cfg.block_k):
                    assert size >= 16 and size & (size - 1) == 0
                assert cfg.split_k == 1 or K // cfg.split_k >= 512
                if T > 128:
                    assert cfg.split_k == 1  # several token tiles: a split would vary with T
                shared = cfg.num_stages * (cfg.block_n + cfg.block_t) * cfg.block_k * element_size
                assert shared <= 227 * 1024, (N, K, T, cfg)
    # the routers' 128 rows at 16 tokens: 16-row programs, and no second launch for a read shorter than it
    router = dense_linear_config(16, 128, 2048)
    assert (router.block_n, router.split_k) == (16, 1)
    # Qwen3-30B-A3B's o_proj at 16 tokens: every SM gets a program (32 tiles of 64 rows would leave 100 idle)
    o_proj = dense_linear_config(16, 2048, 4096)
    assert -(-2048 // o_proj.block_n) * o_proj.split_k >= 128
    # ... and at one token the GEMV the H200 sweep chose for it (bench/results/2026-12-01-h200/issue12)
    assert dense_linear_config(1, 2048, 4096) == Int8LinearConfig(8, 1, 1024, 1, 4, 1)
    # Gemma-4-31B's gate_up has thousands of 64-row tiles: full tiles, no split
    assert dense_linear_config(16, 43008, 5376) == Int8LinearConfig(64, 16, 128, 1, 4, 4)


def test_stream_model_rewards_bytes_in_flight() -> None:
    """More programs in flight (up to the limit) never make a read slower; a tail wave costs extra."""
    weight = 64 << 20
    times = [_stream_seconds(weight, programs, 264, 48 << 10) for programs in (8, 32, 128, 264)]
    assert times == sorted(times, reverse=True)
    assert times[-1] == pytest.approx(weight / 4.3e12)
    assert _stream_seconds(weight, 265, 264, 48 << 10) > _stream_seconds(weight, 264, 264, 48 << 10)


# ------------------------------------------------------------------ ops.linear and the backend's wrapper


def test_linear_module_goes_through_its_tables_linear() -> None:
    layer = Linear(6, 4, bias=False)
    seen = []

    def recording(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return torch.nn.functional.linear(x, weight, bias)

    assert layer.ops.linear is torch.nn.functional.linear  # the reference table until bound
    ops.bind_ops(layer, dataclasses.replace(ops.REFERENCE_OPS, linear=recording))
    layer(torch.randn(2, 3, 6))
    assert seen == [(2, 3, 6)]
    assert ops.REFERENCE_OPS.linear is torch.nn.functional.linear


@pytest.mark.parametrize("shape", [(3, 40), (2, 2, 40)])
def test_backend_wrapper_takes_the_kernel_for_small_steps(shape: tuple[int, ...],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ``max_tokens`` tokens (leading dims flattened), where a tuned sweep timed the kernel faster: the kernel;
    past it, with a bias, a weight of another dtype, where a tuned sweep timed cuBLAS faster or where no sweep timed
    the shape: ``F.linear`` (bitwise: the same call)."""
    from inference_server.backends.cuda import projection_ops

    kernel_calls: list[tuple[int, ...]] = []

    def spy(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        kernel_calls.append(tuple(x.shape))
        return dense_linear(x, weight)

    monkeypatch.setattr(projection_ops, "dense_linear", spy)
    monkeypatch.setattr(projection_ops, "triton_is_faster", lambda *args: True)  # no tuned file matches the CPU
    gen = torch.Generator().manual_seed(5)
    w = _weight(24, 40, torch.bfloat16, gen)
    x = torch.randn(*shape, generator=gen).to(DEV, torch.bfloat16)
    small = projection_ops.triton_dense_linear(x, w, max_tokens=4)
    assert small.shape == (*shape[:-1], 24) and kernel_calls == [(3 if len(shape) == 2 else 4, 40)]
    assert torch.equal(small.reshape(-1, 24), dense_linear(x.reshape(-1, 40), w))
    bias = torch.randn(24, generator=gen).to(DEV, torch.bfloat16)
    assert torch.equal(projection_ops.triton_dense_linear(x, w, max_tokens=2), torch.nn.functional.linear(x, w))
    assert torch.equal(projection_ops.triton_dense_linear(x, w, bias, max_tokens=4),
                       torch.nn.functional.linear(x, w, bias))
    with pytest.raises(RuntimeError):  # mixed dtypes go to F.linear, which rejects them as before
        projection_ops.triton_dense_linear(x.float(), w, max_tokens=4)
    monkeypatch.setattr(projection_ops, "cublas_is_faster", lambda *args: True)  # a tuned sweep's say
    assert torch.equal(projection_ops.triton_dense_linear(x, w, max_tokens=4), torch.nn.functional.linear(x, w))
    monkeypatch.setattr(projection_ops, "cublas_is_faster", lambda *args: False)
    monkeypatch.setattr(projection_ops, "triton_is_faster", lambda *args: False)  # a shape no sweep timed
    assert torch.equal(projection_ops.triton_dense_linear(x, w, max_tokens=4), torch.nn.functional.linear(x, w))
    assert len(kernel_calls) == 1  # only the first call took the kernel


# ------------------------------------------------------------------ GPU, real shapes


def _real(N: int, K: int, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(seed)
    w = torch.randn(N, K, generator=gen, device="cuda", dtype=torch.bfloat16) / K**0.5
    x = torch.randn(T, K, generator=gen, device="cuda", dtype=torch.bfloat16)
    return x, w


def _assert_close_to_cublas(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """cuBLAS may reduce split-K partial sums in bf16 (PyTorch's default
    ``allow_bf16_reduced_precision_reduction``): one bf16 ulp of the largest result beside the per-result ulp."""
    assert_gpu_close(out, torch.nn.functional.linear(x, w), noise=BF16_ULP)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2, 5, 16, 32, 64])
@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_dense_linear_gpu_real_shapes_match_cublas(name: str, T: int) -> None:
    x, w = _real(*REAL_SHAPES[name], T)
    out = dense_linear(x, w)
    _assert_close_to_cublas(out, x, w)  # as the engine ran before
    assert_gpu_close(out, dense_linear_reference(x, w))


@gpu
@needs_cuda
@pytest.mark.parametrize("config", [Int8LinearConfig(8, 1, 1024), Int8LinearConfig(4, 2, 1024, split_k=2),
                                    Int8LinearConfig(8, 4, 1024)])
@pytest.mark.parametrize("T", [1, 3])
def test_dense_linear_gpu_cuda_core_gemv(config: Int8LinearConfig, T: int) -> None:
    """The CUDA-core GEMV with bf16 weights at Qwen3-30B-A3B's q/k/v and o shapes, against the reference."""
    for n, k in ((5120, 2048), (2048, 4096)):
        x, w = _real(n, k, T)
        assert_gpu_close(dense_linear(x, w, config=config), dense_linear_reference(x, w))


@gpu
@needs_cuda
def test_dense_linear_gpu_logits_fp32_and_fp16() -> None:
    """The tied logits at Gemma 4's vocabulary (262,144 x 2,816) and the fp32 / fp16 paths."""
    x, w = _real(262144, 2816, 4)
    out = dense_linear(x, w)
    _assert_close_to_cublas(out, x, w)
    assert_gpu_close(out, dense_linear_reference(x, w))
    x, w = _real(5376, 8192, 16)
    torch.testing.assert_close(dense_linear(x.float(), w.float()), dense_linear_reference(x.float(), w.float()),
                               atol=1e-4, rtol=1e-4)
    assert_gpu_close(dense_linear(x.half(), w.half()).float(), dense_linear_reference(x.half(), w.half()).float())


@gpu
@needs_cuda
@pytest.mark.parametrize(("N", "K", "config"), [
    (5376, 21504, None),  # the heuristic
    (2048, 4096, Int8LinearConfig(64, 16, 128, split_k=4)),  # split-K: partial sums and the reduce kernel
])
def test_dense_linear_gpu_deterministic_and_graph_capturable(N: int, K: int, config: Int8LinearConfig | None) -> None:
    x, w = _real(N, K, 7)
    first = dense_linear(x, w, config=config)
    assert torch.equal(first, dense_linear(x, w, config=config))
    out = torch.empty_like(first)
    dense_linear(x, w, config=config, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dense_linear(x, w, config=config, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, dense_linear(x, w, config=config))


def test_triton_is_faster_only_where_the_sweep_timed_it_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checked-in H200 sweep of Qwen3-30B-A3B: o_proj at one and two tokens and q/k/v at one took the Triton
    GEMV; q/k/v at two tokens is marked cuBLAS-faster; untimed token counts and shapes have no verdict."""
    from inference_server.kernels import dense_linear as module

    monkeypatch.setattr(module, "device_name", lambda device: "NVIDIA H200")
    cpu = torch.device("cpu")
    assert module.triton_is_faster(1, 2048, 4096, torch.bfloat16, cpu)
    assert module.triton_is_faster(2, 2048, 4096, torch.bfloat16, cpu)
    assert module.triton_is_faster(1, 5120, 2048, torch.bfloat16, cpu)
    assert not module.triton_is_faster(2, 5120, 2048, torch.bfloat16, cpu)  # cuBLAS was faster
    assert not module.triton_is_faster(3, 2048, 4096, torch.bfloat16, cpu)  # past the tuned counts
    assert not module.triton_is_faster(1, 2048, 4096, torch.float32, cpu)  # no file for fp32
    assert not module.triton_is_faster(1, 2816, 2112 + 64, torch.bfloat16, cpu)  # a shape the sweep did not time
