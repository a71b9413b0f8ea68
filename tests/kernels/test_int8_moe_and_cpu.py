"""int8 experts in the MoE references (``kernels/reference_moe.py``, ``ops.torch_fused_moe``) and the CPU engine's
int8 matmul (``kernels/cpu_int8.py``) against the weight-only reference."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.reference_moe import fused_moe_reference

from inference_server.kernels import cpu_int8
from inference_server.kernels.reference_int8 import dequantize_int8, int8_linear_reference, quantize_int8_per_channel
from inference_server.kernels.reference_moe import route_softmax_topk
from inference_server.models.architectures import ops


def _moe_case(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, experts, top_k = 7, 32, 16, 6, 2
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 5] = -1e4  # expert 5 never runs: its int8 weights must not be needed
    weights, ids = route_softmax_topk(logits, top_k, renormalize=True)
    return x, w_gate_up, w_down, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_experts_follow_the_int8_matmul_contract(dtype: torch.dtype) -> None:
    x, w_gate_up, w_down, weights, ids = _moe_case(dtype)
    q_gu, s_gu = quantize_int8_per_channel(w_gate_up)
    q_down, s_down = quantize_int8_per_channel(w_down)
    q_gu[5] = 127  # garbage in the idle expert: not read
    int8 = fused_moe_reference(x, q_gu, q_down, weights, ids, "silu", w_gate_up_scale=s_gu, w_down_scale=s_down)
    # by hand: each expert's two matmuls are int8_linear_reference, the rest as in the float reference
    expected = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = int8_linear_reference(x[t:t + 1], q_gu[e], s_gu[e])
            h = torch.nn.functional.silu(gu[:, :16]) * gu[:, 16:]
            expected[t] += (int8_linear_reference(h, q_down[e], s_down[e]) * weights[t, k]).float()[0]
    torch.testing.assert_close(int8, expected.to(dtype), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    # and the ops reference (HF eager order) agrees with it
    eager = ops.torch_fused_moe(x, q_gu, q_down, weights, ids, "silu", w_gate_up_scale=s_gu, w_down_scale=s_down)
    torch.testing.assert_close(eager, int8, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    # close to the float experts they quantize
    full = fused_moe_reference(x, w_gate_up, w_down, weights, ids, "silu")
    assert float((int8.float() - full.float()).norm() / full.float().norm()) < 0.03


def test_int8_experts_equal_their_dequantized_weights_in_fp32() -> None:
    x, w_gate_up, w_down, weights, ids = _moe_case(torch.float32, seed=3)
    q_gu, s_gu = quantize_int8_per_channel(w_gate_up)
    q_down, s_down = quantize_int8_per_channel(w_down)
    int8 = fused_moe_reference(x, q_gu, q_down, weights, ids, "gelu_tanh", w_gate_up_scale=s_gu, w_down_scale=s_down)
    dequantized = fused_moe_reference(x, dequantize_int8(q_gu, s_gu, torch.float32),
                                      dequantize_int8(q_down, s_down, torch.float32), weights, ids, "gelu_tanh")
    torch.testing.assert_close(int8, dequantized, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5])
def test_cpu_int8pack_path_matches_the_reference_to_bf16_activation_rounding(rows: int) -> None:
    torch.manual_seed(0)
    q, scale = quantize_int8_per_channel(torch.randn(48, 64))
    x = torch.randn(rows, 64)
    out = cpu_int8.cpu_int8_linear(x, q, scale)
    reference = int8_linear_reference(x, q, scale)
    assert out.dtype == torch.float32 and out.shape == (rows, 48)
    # x is rounded to bf16 (relative 2^-9 per element): the error is that of the rounded activations
    bound = int8_linear_reference(x - x.bfloat16().float(), q, scale).abs() \
        + int8_linear_reference(x.abs(), q.abs(), scale.abs()) * 2 ** -8
    assert bool(((out - reference).abs() <= bound + 1e-5).all())


@pytest.mark.parametrize("rows", [1, 3, cpu_int8.SCRATCH_MAX_ROWS + 1])
def test_int8pack_rounds_decode_rows_into_a_kept_buffer_as_a_fresh_rounding(rows: int) -> None:
    """Decode-sized activations go through a bf16 buffer kept per shape: each call gives the bits of a fresh
    rounding of its own x (no value of the previous call's), in and out of inference mode."""
    q, scale = quantize_int8_per_channel(torch.randn(48, 64))
    for inference in (False, True, False):
        with torch.inference_mode(inference):
            for _ in range(2):
                x = torch.randn(rows, 64)
                want = torch._weight_int8pack_mm(x.to(torch.bfloat16), q, scale.to(torch.bfloat16)).float()
                assert torch.equal(cpu_int8.int8pack_linear(x, q, scale), want)


@pytest.mark.skipif(not cpu_int8._fbgemm_8bit_safe(), reason="needs fbgemm and a VNNI CPU")
def test_cpu_large_matrix_path_quantizes_each_row_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_int8, "LARGE_WEIGHT_ELEMENTS", 1)
    torch.manual_seed(1)
    q, scale = quantize_int8_per_channel(torch.randn(300, 64))
    x = torch.randn(4, 64)
    x[2] *= 1000.0  # a row with a far larger range must not coarsen the others
    batched = cpu_int8.cpu_int8_linear(x, q, scale)
    reference = int8_linear_reference(x, q, scale)
    relative = (batched - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert float(relative.max()) < 0.01  # 8-bit activations, each row at its own resolution: ~0.3 % here
    # per-tensor activation quantization (fbgemm's own) would lose the small rows to the large one
    plain = torch.ops.quantized.linear_dynamic(x, cpu_int8._pack(q, scale), False)
    assert float(((plain - reference).norm(dim=-1) / reference.norm(dim=-1)).max()) > 0.1


def test_prepack_packs_the_large_weights_for_the_path_the_matmul_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    from inference_server.models.architectures.quantized import Int8Linear

    monkeypatch.setattr(cpu_int8, "LARGE_WEIGHT_ELEMENTS", 300 * 64)
    torch.manual_seed(3)
    large = Int8Linear(*quantize_int8_per_channel(torch.randn(300, 64)))
    small = Int8Linear(*quantize_int8_per_channel(torch.randn(32, 64)))
    model = torch.nn.Sequential(large, small)
    expected = 1 if cpu_int8._fbgemm_8bit_safe() else 0  # only fbgemm's 8-bit path packs
    assert cpu_int8.prepack_large_weights(model) == expected
    assert hasattr(large.qweight, "_fbgemm_packed") == bool(expected)
    assert not hasattr(small.qweight, "_fbgemm_packed")


def test_cpu_int8_linear_falls_back_to_the_reference_off_its_paths() -> None:
    q, scale = quantize_int8_per_channel(torch.randn(8, 16, dtype=torch.bfloat16))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(cpu_int8.cpu_int8_linear(x, q, scale), int8_linear_reference(x, q, scale))
