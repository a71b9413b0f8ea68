"""``kernels.moe_decode_one_launch``: the routed experts' gate/up and down programs in one launch.

On CPU under ``TRITON_INTERPRET=1`` (programs run one after another, so the tickets equal the program ids and no
spin waits) against ``fused_moe_reference`` and ``moe_decode``'s two launches; on the GPU (marked ``gpu``) at the
real expert shapes, where the down programs really wait for gate/up's, in CUDA graphs with launches back to back.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.kernels import moe_decode_one_launch as one
from inference_server.kernels.moe_decode import fused_moe_decode
from inference_server.kernels.moe_decode_one_launch import (
    OneLaunchConfig,
    fits_one_launch,
    moe_decode_one_launch,
    one_launch_config,
)
from inference_server.kernels.reference_moe import fused_moe_reference

from .test_moe_decode_kernel import _case
from .test_moe_kernels import _REAL, _real_case, assert_bf16_moe_close

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SMALL = OneLaunchConfig(gate_up_block_n=16, gate_up_block_k=32, down_block_n=16, warps=4)
"""Tiles that give the tiny shapes several gate/up row tiles and K tiles, and several down row tiles (each holding
its whole row block in registers)."""
STREAMED = OneLaunchConfig(gate_up_block_n=16, gate_up_block_k=32, down_block_n=16, warps=4, down_stream_k=16)
"""The same with the down rows streamed after the wait in 16-column K tiles (I = 40 and 48 leave a masked tail)."""


def _counters_zeroed(device: torch.device) -> bool:
    return int(one._counters(device).count_nonzero()) == 0


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("T", "E", "K", "H", "inter"), [(1, 8, 8, 64, 48), (3, 8, 2, 64, 32), (5, 6, 3, 96, 40)])
@pytest.mark.parametrize("config", [SMALL, STREAMED], ids=["whole-rows", "streamed"])
def test_fp32_matches_the_reference_and_the_two_launches(T: int, E: int, K: int, H: int, inter: int,
                                                         activation: str, config: OneLaunchConfig) -> None:
    """fp32: the reference's products, summed in another order; I = 48 and 40 are not powers of two (masked down
    rows), I = 32 is (no mask); H = 96 leaves gate/up a masked K tail."""
    x, w_gu, w_dn, w, ids = _case(T, E, K, H, inter, torch.float32, T * 31 + E)
    out = moe_decode_one_launch(x, w_gu, w_dn, w, ids, activation, config=config)
    torch.testing.assert_close(out, fused_moe_reference(x, w_gu, w_dn, w, ids, activation), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, fused_moe_decode(x, w_gu, w_dn, w, ids, activation), atol=2e-5, rtol=2e-5)
    assert _counters_zeroed(x.device)


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])  # Qwen-style, Gemma-style
@pytest.mark.parametrize(("T", "K"), [(1, 8), (4, 2)])
def test_bf16_follows_the_two_launches(T: int, K: int, weights_dtype: torch.dtype) -> None:
    """bf16: the two launches' rounding points, so the outputs agree to within a rounding of the down dot (its fp32
    sum runs in another order) and both follow the reference."""
    x, w_gu, w_dn, w, ids = _case(T, 8, K, 64, 48, torch.bfloat16, T * 7 + K, weights_dtype)
    out = moe_decode_one_launch(x, w_gu, w_dn, w, ids, "silu", config=SMALL)
    two = fused_moe_decode(x, w_gu, w_dn, w, ids, "silu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), two.float(), atol=1e-2, rtol=1.6e-2)
    torch.testing.assert_close(out.float(), fused_moe_reference(x, w_gu, w_dn, w, ids, "silu").float(),
                               atol=6e-2, rtol=4e-2)


def test_default_config_and_repeated_calls_leave_the_counters_zeroed() -> None:
    """Every launch leaves its ticket, ready, consumed and k-sum counters at zero, so the next call (in a CUDA
    graph: the next replay, or the next layer) gives the same result."""
    x, w_gu, w_dn, w, ids = _case(2, 8, 4, 64, 48, torch.float32, 3)
    first = moe_decode_one_launch(x, w_gu, w_dn, w, ids, "silu")
    torch.testing.assert_close(first, fused_moe_reference(x, w_gu, w_dn, w, ids, "silu"), atol=2e-5, rtol=2e-5)
    assert _counters_zeroed(x.device)
    assert torch.equal(first, moe_decode_one_launch(x, w_gu, w_dn, w, ids, "silu"))
    assert _counters_zeroed(x.device)


def test_pairs_with_out_of_range_experts_add_nothing_and_release_their_down_programs() -> None:
    """A pair whose expert id is outside [0, E) stores no act * up row but still counts its gate/up programs in,
    so its down programs pass their wait, contribute zeros and zero the pair's counters."""
    x, w_gu, w_dn, w, ids = _case(2, 8, 3, 64, 48, torch.float32, 4)
    bad = ids.clone()
    bad[0, 1] = 8  # no such expert
    bad[1, 2] = -1
    kept = w.clone()
    kept[0, 1] = 0.0
    kept[1, 2] = 0.0
    for config in (SMALL, STREAMED):
        out = moe_decode_one_launch(x, w_gu, w_dn, w, bad, "silu", config=config)
        torch.testing.assert_close(out, fused_moe_reference(x, w_gu, w_dn, kept, ids, "silu"), atol=2e-5,
                                   rtol=2e-5)
        assert _counters_zeroed(x.device)


def test_zero_tokens_launch_nothing() -> None:
    x, w_gu, w_dn, w, ids = _case(1, 8, 2, 64, 48, torch.float32, 5)
    out = moe_decode_one_launch(x[:0], w_gu, w_dn, w[:0], ids[:0], "silu")
    assert out.shape == (0, 64)


def test_which_calls_fit_and_the_default_config() -> None:
    assert fits_one_launch(1, 8, 2048, 768, int8=False)  # Qwen3-30B-A3B at one token
    assert fits_one_launch(2, 8, 2816, 704, int8=False)  # Gemma-4-26B-A4B at two
    assert not fits_one_launch(1, 8, 2048, 768, int8=True)  # int8 experts: moe_decode's two launches
    assert not fits_one_launch(0, 8, 2048, 768, int8=False)
    assert not fits_one_launch(33, 8, 2048, 768, int8=False)  # 264 pairs: over MAX_PAIRS
    assert not fits_one_launch(1, 8, 64 * 2048 + 64, 768, int8=False)  # more row tiles than the k-sum counters
    qwen = one_launch_config(2048, 768, 2)  # the H200 sweep's best: 64 down rows streamed in 128-column tiles
    assert (qwen.gate_up_block_n, qwen.gate_up_block_k, qwen.down_block_n, qwen.warps, qwen.down_stream_k) == \
        (16, 256, 64, 4, 128)
    assert 704 % one_launch_config(2816, 704, 2).down_stream_k == 0  # Gemma-4-26B-A4B: a K tile dividing I
    assert one_launch_config(2048, 768, 4).down_stream_k == 64  # fp32: the same bytes per tile


def test_bad_arguments_are_rejected() -> None:
    x, w_gu, w_dn, w, ids = _case(2, 8, 2, 64, 48, torch.float32, 6)
    with pytest.raises(ValueError, match="does not take"):  # 400 pairs
        moe_decode_one_launch(x, w_gu, w_dn, w.new_zeros(2, 200), ids.new_zeros(2, 200), "silu")
    with pytest.raises(ValueError, match="over"):
        moe_decode_one_launch(x, w_gu, w_dn, w, ids, "silu", config=OneLaunchConfig(16, 32, 512, 4))
    with pytest.raises(ValueError, match="contiguous"):
        moe_decode_one_launch(x, w_gu.transpose(1, 2).contiguous().transpose(1, 2), w_dn, w, ids, "silu")
    with pytest.raises(ValueError, match="activation"):
        moe_decode_one_launch(x, w_gu, w_dn, w, ids, "relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):  # int8 experts (no scales taken here)
        moe_decode_one_launch(x, w_gu.to(torch.int8), w_dn.to(torch.int8), w, ids, "silu")


# ------------------------------------------------------------------ GPU, real shapes

@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2, 16])
@pytest.mark.parametrize("model", sorted(_REAL))
def test_gpu_real_shapes_match_the_reference_and_the_two_launches(model: str, T: int) -> None:
    x, w_gu, w_dn, w, ids, act = _real_case(model, T)
    out = moe_decode_one_launch(x, w_gu, w_dn, w, ids, act)
    assert_bf16_moe_close(out, fused_moe_reference(x, w_gu, w_dn, w, ids, act))
    two = fused_moe_decode(x, w_gu, w_dn, w, ids, act)
    scale = two.float().abs().max().item()
    assert (out.float() - two.float()).abs().mean() < 1e-3 * scale
    assert _counters_zeroed(x.device)


@gpu
@needs_cuda
@pytest.mark.parametrize("model", sorted(_REAL))
def test_gpu_fp32_tight(model: str) -> None:
    x, w_gu, w_dn, w, ids, act = _real_case(model, 2, dtype=torch.float32)
    torch.testing.assert_close(moe_decode_one_launch(x, w_gu, w_dn, w, ids, act),
                               fused_moe_reference(x, w_gu, w_dn, w, ids, act), atol=1e-4, rtol=1e-4)


@gpu
@needs_cuda
def test_gpu_deterministic_and_graph_capturable_back_to_back() -> None:
    """Bitwise the same result on every call; 8 launches captured back to back (each layer's launch right after
    the previous one's, as in the model's graph) reuse the counters and all give the eager result."""
    x, w_gu, w_dn, w, ids, act = _real_case("qwen3-30b-a3b", 1)
    first = moe_decode_one_launch(x, w_gu, w_dn, w, ids, act)
    for _ in range(20):
        assert torch.equal(first, moe_decode_one_launch(x, w_gu, w_dn, w, ids, act))
    outs = [torch.empty_like(first) for _ in range(8)]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            moe_decode_one_launch(x, w_gu, w_dn, w, ids, act, out=out)
    x2, _, _, w2, ids2, _ = _real_case("qwen3-30b-a3b", 1, seed=1)
    x.copy_(x2)
    w.copy_(w2)
    ids.copy_(ids2)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    expected = moe_decode_one_launch(x, w_gu, w_dn, w, ids, act)
    assert all(torch.equal(out, expected) for out in outs)
    assert _counters_zeroed(x.device)
