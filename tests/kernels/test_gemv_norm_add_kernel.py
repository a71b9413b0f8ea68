"""The projection with the sandwich norm in its last program (``kernels.gemv_norm_add``) against the two launches it
replaces: the same GEMV config's projection (``dense_linear`` / ``int8_linear``), then ``norm_add``; and against
PyTorch (``F.linear`` or the int8 reference, then ``norm_add_reference``) within the bf16 yardstick.

The projection's output is the unfused GEMV's bit for bit everywhere. Under the interpreter the norm chain's
reductions run in one fixed order whatever the warps, so there the whole result is the two launches' bit for bit;
on the GPU the row reductions run over the GEMV's warps, so they agree to bf16 rounding. CPU runs use
TRITON_INTERPRET=1 at small shapes; the ``gpu`` tests use Gemma 4's real projection shapes.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.kernels.arrival_counters import arrival_counters
from inference_server.kernels.dense_linear import dense_linear
from inference_server.kernels.gemv_norm_add import MAX_TOKENS, gemv_norm_add, gemv_norm_add_config
from inference_server.kernels.int8_linear import int8_linear
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.norm_add import norm_add, norm_add_reference
from inference_server.kernels.reference_int8 import int8_linear_reference, quantize_int8_per_channel

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEV == "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODES = {
    # Gemma 4 after attention (o_proj): the residual add and the FFN's input norms (26B-A4B: three)
    "post_attention": dict(residual=True, out_norms=3),
    # a MoE layer's end (the dense MLP's down_proj): both branches' norms, their sum's norm, residual, scalar, next
    "moe_end": dict(b=True, sum_norm=True, residual=True, scale=True, out_norms=1),
    # the per-layer input's add (per_layer_projection): norm, residual, scalar, next norm
    "ple_end": dict(residual=True, scale=True, out_norms=1),
    # a dense layer's end before a PLE block: norm and residual add only
    "dense_end": dict(residual=True),
}


def _norm_kwargs(mode: str, T: int, N: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    spec = MODES[mode]

    def weight() -> torch.Tensor:
        return (1.0 + 0.3 * torch.randn(N, generator=gen)).to(DEV, dtype)

    kwargs: dict = {}
    if spec.get("b"):
        kwargs.update(b=torch.randn(T, N, generator=gen).to(DEV, dtype), wb=weight(), eps_b=1e-6)
    if spec.get("sum_norm"):
        kwargs.update(ws=weight(), eps_s=1e-6)
    if spec.get("residual"):
        kwargs.update(residual=(3 * torch.randn(T, N, generator=gen)).to(DEV, dtype))
    if spec.get("scale"):
        kwargs.update(scale=torch.tensor([0.75], dtype=dtype).to(DEV))
    kwargs["out_norms"] = [(weight(), 1e-6) for _ in range(spec.get("out_norms", 0))]
    return kwargs


def _case(T: int, N: int, K: int, dtype: torch.dtype, int8: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(DEV, dtype)
    weight = (torch.randn(N, K, generator=gen) * 2 / K**0.5).to(DEV, dtype)
    wa = (1.0 + 0.3 * torch.randn(N, generator=gen)).to(DEV, dtype)
    if not int8:
        return gen, x, weight, None, wa
    qweight, scale = quantize_int8_per_channel(weight)
    return gen, x, qweight, scale, wa


def _fused(x, weight, scale, config, wa, kwargs):
    fused_kwargs = dict(kwargs)
    fused_kwargs["layer_scale"] = fused_kwargs.pop("scale", None)
    return gemv_norm_add(x, weight, scale, config, wa, 1e-6, **fused_kwargs)


def _projection(x, weight, scale, config):
    return dense_linear(x, weight, config=config) if scale is None else int8_linear(x, weight, scale, config=config)


CONFIGS = [
    Int8LinearConfig(block_n=8, block_k=32, block_t=1, split_k=1, num_warps=4, num_stages=1),
    Int8LinearConfig(block_n=16, block_k=64, block_t=2, split_k=1, num_warps=4, num_stages=2),
]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("config", CONFIGS, ids=["bn8-bt1", "bn16-bt2-deep"])
def test_gemv_norm_add_matches_the_two_launches(mode: str, T: int, int8: bool, config: Int8LinearConfig) -> None:
    N, K, dtype = 48, 128, torch.bfloat16  # several programs along N (and along T at block_t 1), whole K tiles
    gen, x, weight, scale, wa = _case(T, N, K, dtype, int8, seed=T * 10 + int8)
    kwargs = _norm_kwargs(mode, T, N, dtype, gen)
    y, zs = _fused(x, weight, scale, config, wa, kwargs)
    a = _projection(x, weight, scale, config)
    y_ref, zs_ref = norm_add(a, wa, 1e-6, **kwargs)
    assert len(zs) == len(zs_ref) == MODES[mode].get("out_norms", 0)
    for got, want in zip((y, *zs), (y_ref, *zs_ref), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        if INTERPRETED:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2)
    # against PyTorch: the projection (F.linear or the int8 reference) then the op-by-op norm chain
    a_torch = F.linear(x, weight) if scale is None else int8_linear_reference(x, weight, scale)
    y_torch, zs_torch = norm_add_reference(a_torch, wa, 1e-6, **kwargs)
    for got, want in zip((y, *zs), (y_torch, *zs_torch), strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)
    assert int(arrival_counters("gemv_norm_add", 1, x.device)[0]) == 0  # left zeroed for the next launch


def test_gemv_norm_add_twice_in_a_row_gives_the_same_result_and_fp32_rounds_like_the_two_launches() -> None:
    T, N, K, dtype = 2, 40, 96, torch.float32  # N not a multiple of block_n: a masked tail program
    config = Int8LinearConfig(block_n=16, block_k=32, block_t=1, split_k=1, num_warps=4, num_stages=1)
    gen, x, weight, _, wa = _case(T, N, K, dtype, False, seed=7)
    kwargs = _norm_kwargs("moe_end", T, N, dtype, gen)
    first = _fused(x, weight, None, config, wa, kwargs)
    second = _fused(x, weight, None, config, wa, kwargs)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1][0], second[1][0])
    y_ref, zs_ref = norm_add(_projection(x, weight, None, config), wa, 1e-6, **kwargs)
    torch.testing.assert_close(first[0], y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first[1][0], zs_ref[0], rtol=1e-5, atol=1e-5)


def test_gemv_norm_add_config_takes_only_few_token_one_split_gemvs() -> None:
    weight = torch.zeros(64, 256, dtype=torch.bfloat16, device=DEV)
    for tokens in range(1, MAX_TOKENS + 1):
        config = gemv_norm_add_config(torch.zeros(tokens, 256, dtype=torch.bfloat16, device=DEV), weight, None)
        assert config is None or (config.block_t < 16 and config.split_k >= 1)
    assert gemv_norm_add_config(torch.zeros(MAX_TOKENS + 1, 256, dtype=torch.bfloat16, device=DEV), weight,
                                None) is None
    with pytest.raises(ValueError, match="rows"):
        gemv_norm_add(torch.zeros(MAX_TOKENS + 1, 256, dtype=torch.bfloat16, device=DEV), weight, None, CONFIGS[0],
                      torch.ones(64, dtype=torch.bfloat16, device=DEV), 1e-6)
    split = Int8LinearConfig(block_n=8, block_k=32, block_t=1, split_k=4, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="one split"):
        gemv_norm_add(torch.zeros(1, 256, dtype=torch.bfloat16, device=DEV), weight, None, split,
                      torch.ones(64, dtype=torch.bfloat16, device=DEV), 1e-6)


# Gemma 4's projections that end a block: (name, N, K), at 26B-A4B / E4B / 31B sizes
REAL_SHAPES = [
    ("26b o_proj", 2816, 4096), ("26b down_proj", 2816, 2112), ("e4b down_proj", 2560, 10240),
    ("e4b per_layer_projection", 2560, 256), ("31b o_proj", 5376, 8192),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("name,N,K", REAL_SHAPES)
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("mode", ["post_attention", "moe_end"])
def test_gemv_norm_add_real_shapes_on_gpu(name: str, N: int, K: int, int8: bool, mode: str) -> None:
    for T in range(1, MAX_TOKENS + 1):
        gen, x, weight, scale, wa = _case(T, N, K, torch.bfloat16, int8, seed=N + K + T)
        config = gemv_norm_add_config(x, weight, scale)
        if config is None:
            config = Int8LinearConfig(block_n=16, block_k=512, block_t=T, split_k=1, num_warps=4, num_stages=1)
        kwargs = _norm_kwargs(mode, T, N, torch.bfloat16, gen)
        y, zs = _fused(x, weight, scale, config, wa, kwargs)
        a = _projection(x, weight, scale, config)
        y_ref, zs_ref = norm_add(a, wa, 1e-6, **kwargs)
        for got, want in zip((y, *zs), (y_ref, *zs_ref), strict=True):
            torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2)
            # a differently rounded sum of squares moves few elements, and those by one bf16 step
            assert (got != want).float().mean().item() < 0.05
