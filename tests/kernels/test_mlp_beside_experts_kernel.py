"""The dense MLP beside the routed experts (``kernels.mlp_beside_experts``) against the standalone launches whose
programs it runs: the gated gate/up GEMV (``gated_gemv``), the router (``router.linear_route``), the experts' decode
GEMVs (``moe_decode.fused_moe_decode``) and the dense down GEMV (``dense_linear`` / ``int8_linear``) at the same
configs, and against PyTorch.

Under the interpreter (CI) every output equals the standalone path's bit for bit. On the GPU the dense GEMVs and the
experts do too; the router runs at the GEMV's warps instead of its own, so its fp32 logits may differ in summation
order: the tests there allow the logits' rounding and check the expert choice against a margin. ``gpu`` tests use
Gemma-4-26B-A4B's real shapes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_fused import reference_linear_route
from tests.kernels.reference_moe import fused_moe_reference

from inference_server.kernels.dense_linear import dense_linear
from inference_server.kernels.gated_gemv import gated_gemv
from inference_server.kernels.int8_linear import int8_linear
from inference_server.kernels.int8_linear_configs import Int8LinearConfig
from inference_server.kernels.mlp_beside_experts import expert_gate_up_beside_gemv, gated_gemv_and_route, shares_warps
from inference_server.kernels.moe_decode import fused_moe_decode, moe_decode_config
from inference_server.kernels.reference_int8 import quantize_int8_per_channel
from inference_server.kernels.router import linear_route

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weights(rows: int, cols: int, gen: torch.Generator, dtype: torch.dtype, int8: bool):
    w = (torch.randn(rows, cols, generator=gen) * 2 / cols**0.5).to(dtype)
    if not int8:
        return w.to(DEV), None
    q, s = quantize_int8_per_channel(w)
    return q.to(DEV), s.to(DEV)


def _experts(E: int, H: int, inter: int, gen: torch.Generator, dtype: torch.dtype, int8: bool):
    gate_up = (torch.randn(E, 2 * inter, H, generator=gen) * 2 / H**0.5).to(dtype)
    down = (torch.randn(E, H, inter, generator=gen) * 2 / inter**0.5).to(dtype)
    if not int8:
        return gate_up.to(DEV), down.to(DEV), None, None
    parts = [quantize_int8_per_channel(gate_up[e]) for e in range(E)]
    dparts = [quantize_int8_per_channel(down[e]) for e in range(E)]
    return (torch.stack([q for q, _ in parts]).to(DEV), torch.stack([q for q, _ in dparts]).to(DEV),
            torch.stack([s for _, s in parts]).to(DEV), torch.stack([s for _, s in dparts]).to(DEV))


def _gemv_config(T: int, K: int, block_n: int, warps: int, stages: int = 1) -> Int8LinearConfig:
    block_k = 256 * warps if K % (256 * warps) == 0 else 64
    return Int8LinearConfig(block_n, min(T, 4), block_k, 1, warps, stages)


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("dtype,int8", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_gated_gemv_and_route_equals_the_two_launches(T: int, dtype: torch.dtype, int8: bool, act: str) -> None:
    gen = torch.Generator().manual_seed(T * 7 + int8)
    H, inter, E, top_k = 256, 48, 16, 4
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    router_x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    gate_up, gate_up_scale = _weights(2 * inter, H, gen, dtype, int8)
    router_w = (torch.randn(E, H, generator=gen) / H**0.5).to(DEV, dtype)
    per_expert = (torch.rand(E, generator=gen) + 0.5).to(DEV)
    config = _gemv_config(T, H, 8, 1)
    a, weights, ids = gated_gemv_and_route(x, gate_up, gate_up_scale, act, config, router_x, router_w, top_k, True,
                                           per_expert)
    want_a = gated_gemv(x, gate_up, gate_up_scale, act, config)
    want_w, want_ids = linear_route(router_x, router_w, top_k, True, per_expert, num_warps=config.num_warps)
    assert torch.equal(a, want_a)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    ref_w, ref_ids = reference_linear_route(router_x, router_w, top_k, True, per_expert)
    assert torch.equal(ids, ref_ids)
    # the logits are rounded to the activation dtype, where the fp32 summation order can move them by an ulp
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(weights, ref_w, rtol=tolerance, atol=tolerance)


# The invalid id's pair: its gate/up program writes nothing, so the down program reads an uninitialised row of the
# intermediate buffer (and discards the product, as its epilogue gives the pair zeros): numpy may warn on that garbage.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("dtype,int8", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)])
def test_expert_gate_up_beside_gemv_equals_the_standalone_launches(T: int, dtype: torch.dtype, int8: bool) -> None:
    gen = torch.Generator().manual_seed(11 * T + int8)
    H, I_dense, inter, E, top_k = 128, 96, 32, 8, 2
    expert_x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    dense_x = torch.randn(T, I_dense, generator=gen).to(DEV, dtype)
    w_gate_up, w_down, gu_scale, dn_scale = _experts(E, H, inter, gen, dtype, int8)
    dense_w, dense_scale = _weights(H, I_dense, gen, dtype, int8)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).to(DEV)
    ids[-1, -1] = E  # an id outside [0, E): its pair contributes zeros (fused_moe's rule for invalid ids)
    weights = torch.rand(T, top_k, generator=gen).to(DEV)
    moe_cfg = moe_decode_config(H, inter, expert_x.element_size(), int8=int8)
    config = _gemv_config(T, I_dense, 8, moe_cfg.gate_up_warps)
    assert shares_warps(config, H, inter, expert_x.element_size(), int8_experts=int8)
    moe, m = expert_gate_up_beside_gemv(expert_x, w_gate_up, w_down, weights, ids, "gelu_tanh", dense_x, dense_w,
                                        dense_scale, config, w_gate_up_scale=gu_scale, w_down_scale=dn_scale)
    want_moe = fused_moe_decode(expert_x, w_gate_up, w_down, weights, ids, "gelu_tanh", w_gate_up_scale=gu_scale,
                                w_down_scale=dn_scale)
    if dense_scale is None:
        want_m = dense_linear(dense_x, dense_w, config=config)
    else:
        want_m = int8_linear(dense_x, dense_w, dense_scale, config=config)
    assert torch.equal(moe, want_moe)
    assert torch.equal(m, want_m)
    if dtype == torch.float32:  # against PyTorch's experts, the invalid pair weighted by zero (bf16 and int8 equal
        # the standalone launches above, whose own tests hold them to PyTorch)
        valid = ids < E
        ref = fused_moe_reference(expert_x, w_gate_up, w_down, weights * valid, ids.clamp(max=E - 1), "gelu_tanh")
        torch.testing.assert_close(moe, ref, rtol=2e-5, atol=2e-5)


def test_launches_reject_configs_that_would_change_the_bits() -> None:
    gen = torch.Generator().manual_seed(3)
    H, inter, E = 128, 32, 8
    x = torch.randn(1, H, generator=gen).to(DEV, torch.bfloat16)
    gate_up, _ = _weights(2 * inter, H, gen, torch.bfloat16, False)
    router_w = torch.randn(E, H, generator=gen).to(DEV, torch.bfloat16)
    split = Int8LinearConfig(8, 1, 64, 2, 1, 1)  # two K splits: partial sums, not one GEMV
    with pytest.raises(ValueError, match="one-split"):
        gated_gemv_and_route(x, gate_up, None, "silu", split, x, router_w, 2, True)
    dot = Int8LinearConfig(64, 16, 64, 1, 4, 3)  # the tensor-core kernel
    with pytest.raises(ValueError, match="one-split"):
        gated_gemv_and_route(x, gate_up, None, "silu", dot, x, router_w, 2, True)
    w_gate_up, w_down, _, _ = _experts(E, H, inter, gen, torch.bfloat16, False)
    ids = torch.zeros(1, 2, dtype=torch.int64, device=DEV)
    weights = torch.ones(1, 2, device=DEV)
    dense_w, _ = _weights(H, 2 * inter, gen, torch.bfloat16, False)
    warps = moe_decode_config(H, inter, 2).gate_up_warps
    other = Int8LinearConfig(8, 1, 64, 1, 8 if warps != 8 else 4, 1)
    assert not shares_warps(other, H, inter, 2, int8_experts=False)
    with pytest.raises(ValueError, match="warps"):
        expert_gate_up_beside_gemv(x, w_gate_up, w_down, weights, ids, "silu",
                                   torch.randn(1, 2 * inter).to(DEV, x.dtype), dense_w, None, other)


def test_zero_tokens_launch_nothing() -> None:
    H, inter, E = 64, 16, 4
    x = torch.empty(0, H, dtype=torch.bfloat16, device=DEV)
    gen = torch.Generator().manual_seed(0)
    gate_up, _ = _weights(2 * inter, H, gen, torch.bfloat16, False)
    router_w = torch.randn(E, H, generator=gen).to(DEV, torch.bfloat16)
    a, weights, ids = gated_gemv_and_route(x, gate_up, None, "silu", _gemv_config(1, H, 8, 1), x, router_w, 2, True)
    assert a.shape == (0, inter) and weights.shape == (0, 2) and ids.shape == (0, 2)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("int8", [False, True])
def test_real_gemma4_26b_shapes_on_the_gpu(T: int, int8: bool) -> None:
    """Gemma-4-26B-A4B: H 2816, dense I 2112, 128 experts of I 704, top 8. The dense GEMVs and the experts equal
    the standalone launches bit for bit; the router's weights agree to fp32 rounding and its ids wherever the
    k-th and (k+1)-th probabilities are apart."""
    gen = torch.Generator().manual_seed(26 + T + int8)
    H, I_dense, inter, E, top_k = 2816, 2112, 704, 128, 8
    dtype = torch.bfloat16
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    router_x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    gate_up, gate_up_scale = _weights(2 * I_dense, H, gen, dtype, int8)
    router_w = (torch.randn(E, H, generator=gen) / H**0.5).to(DEV, dtype)
    per_expert = (torch.rand(E, generator=gen) + 0.5).to(DEV)
    config = Int8LinearConfig(8, T, 1024, 1, 4, 1)
    a, weights, ids = gated_gemv_and_route(x, gate_up, gate_up_scale, "gelu_tanh", config, router_x, router_w,
                                           top_k, True, per_expert)
    assert torch.equal(a, gated_gemv(x, gate_up, gate_up_scale, "gelu_tanh", config))
    want_w, want_ids = linear_route(router_x, router_w, top_k, True, per_expert)
    same = (ids == want_ids).all(dim=1)
    assert same.any()
    torch.testing.assert_close(weights[same], want_w[same], rtol=1e-5, atol=1e-6)
    torch.cuda.synchronize()

    w_gate_up, w_down, gu_scale, dn_scale = _experts(E, H, inter, gen, dtype, int8)
    dense_w, dense_scale = _weights(H, I_dense, gen, dtype, int8)
    moe_cfg = moe_decode_config(H, inter, 2, int8=int8)
    down_config = Int8LinearConfig(8, T, 1024 if not int8 else 256, 1, moe_cfg.gate_up_warps, 1)
    down_config = Int8LinearConfig(8, T, 64 if I_dense % 1024 else 1024, 1, moe_cfg.gate_up_warps, 1) \
        if not int8 else down_config
    moe, m = expert_gate_up_beside_gemv(x, w_gate_up, w_down, want_w, want_ids, "gelu_tanh", a, dense_w,
                                        dense_scale, down_config, w_gate_up_scale=gu_scale, w_down_scale=dn_scale)
    assert torch.equal(moe, fused_moe_decode(x, w_gate_up, w_down, want_w, want_ids, "gelu_tanh",
                                             w_gate_up_scale=gu_scale, w_down_scale=dn_scale))
    want_m = dense_linear(a, dense_w, config=down_config) if dense_scale is None \
        else int8_linear(a, dense_w, dense_scale, config=down_config)
    assert torch.equal(m, want_m)
