"""Fused MoE routing: the Triton kernel vs ``ops.torch_route`` (softmax, top-k, renormalise, scale, cast).

On CPU the kernel runs under TRITON_INTERPRET=1 at small shapes; the ``gpu`` tests use the real ones
(Qwen3-30B-A3B: 128 experts, top-8, bf16 weights out; Gemma-4-26B-A4B: 128 experts, top-8, per-expert scale,
fp32 weights out) up to the largest decode bucket. Router logits are random permutations of a grid spaced
wider than a bf16 ulp, so no two experts tie and the expert ids must match exactly; exact ties (common in bf16
logits) are covered apart: torch.topk leaves their order unspecified, the kernel takes the lowest id first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.kernels.router import triton_route
from inference_server.models.architectures.ops import torch_route

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _logits(T: int, E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, E] distinct values in [-4, 4) per row (exact in bf16), in random order."""
    gen = torch.Generator().manual_seed(seed)
    rows = [(torch.randperm(E, generator=gen) - E // 2).float() * (8.0 / E) for _ in range(T)]
    return (torch.stack(rows) if rows else torch.empty(0, E)).to(DEV, dtype)


def _scale(E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return (1 + 0.5 * torch.rand(E, generator=gen)).to(DEV, dtype)


def _check(logits: torch.Tensor, top_k: int, renormalize: bool, scale: torch.Tensor | None,
           out_dtype: torch.dtype | None) -> None:
    weights, ids = triton_route(logits, top_k, renormalize, scale, out_dtype)
    ref_weights, ref_ids = torch_route(logits, top_k, renormalize, scale, out_dtype)
    assert ids.dtype == ref_ids.dtype == torch.int64 and weights.dtype == ref_weights.dtype
    assert weights.shape == ref_weights.shape == ids.shape
    assert torch.equal(ids, ref_ids)
    if weights.dtype == torch.float32:
        torch.testing.assert_close(weights, ref_weights, atol=2e-6, rtol=2e-6)
    else:  # one rounding of nearly equal fp32 values: at most one ulp of the narrow type apart
        torch.testing.assert_close(weights.float(), ref_weights.float(), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "E", "top_k"), [(1, 8, 2), (5, 16, 4), (3, 128, 8), (2, 12, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_qwen_style_routing_matches_reference(T: int, E: int, top_k: int, renormalize: bool,
                                              logit_dtype: torch.dtype) -> None:
    """Qwen3-MoE: weights cast to the activation dtype (E = 12 is not a power of two: padded experts)."""
    _check(_logits(T, E, logit_dtype, seed=T * E + top_k), top_k, renormalize, None, logit_dtype)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "E", "top_k"), [(1, 8, 2), (4, 128, 8)])
def test_gemma_style_routing_with_per_expert_scale_matches_reference(T: int, E: int, top_k: int,
                                                                     scale_dtype: torch.dtype) -> None:
    """Gemma 4: renormalised, times ``per_expert_scale[ids]``, fp32 weights out."""
    _check(_logits(T, E, scale_dtype, seed=7 + T), top_k, True, _scale(E, scale_dtype, seed=T), None)


def test_strided_logits_and_an_empty_step() -> None:
    """A column slice of a wider tensor (row stride != E) routes like its copy; zero rows give empty outputs."""
    wide = _logits(3, 24, torch.float32, seed=3)
    _check(wide[:, :16], 4, True, None, None)
    weights, ids = triton_route(wide[:0, :16], 4, True)
    assert weights.shape == ids.shape == (0, 4)


def test_ties_take_the_lowest_expert_id_first_and_weigh_the_same() -> None:
    """Equal logits: the kernel orders them by id (torch.topk may not); the weights, sorted, are the same."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0]], device=DEV, dtype=torch.bfloat16)
    weights, ids = triton_route(logits, 4, True, None, torch.float32)
    assert ids.tolist() == [[1, 2, 4, 5]]
    ref_weights, _ = torch_route(logits, 4, True, None, torch.float32)
    torch.testing.assert_close(weights, ref_weights, atol=2e-6, rtol=2e-6)


def test_rejects_more_picks_than_experts() -> None:
    with pytest.raises(ValueError, match="top_k"):
        triton_route(_logits(1, 4, torch.float32, seed=0), 5, True)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16, 112, 256, 2048])
@pytest.mark.parametrize("style", ["qwen", "gemma"])
def test_real_shapes_on_gpu(T: int, style: str) -> None:
    logits = _logits(T, 128, torch.bfloat16, seed=T)
    if style == "qwen":
        _check(logits, 8, True, None, torch.bfloat16)
    else:
        _check(logits, 8, True, _scale(128, torch.bfloat16, seed=T), None)
