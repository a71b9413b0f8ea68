"""The router GEMV fused into the routing launch (``kernels.router.linear_route``) vs its PyTorch formula and vs
the unfused path (cuBLAS logits in the activation dtype, then ``triton_route``).

The fused kernel accumulates each logit in fp32 and rounds it to the activation dtype before the fp32 softmax, as
the unfused path's GEMM output is rounded. Only the fp32 summation order differs, so in bf16 a logit can round to
the neighbouring value now and then; where two experts' logits are that close at the k-th place, the two paths may
pick different experts. The expert choice is therefore checked for equality except on such near-ties (the exact
logits within a few bf16 ulps of the k-th), and the weights of rows with the same choice for closeness.

On CPU the kernel runs under TRITON_INTERPRET=1 at small shapes (the interpreter truncates to bf16 instead of
rounding, so bf16 there is a looser check; fp32 must choose identically); the ``gpu`` tests use Qwen3-30B-A3B's
(H=2048, E=128, top-8, bf16 weights out) and Gemma-4-26B-A4B's (H=2816, E=128, top-8, per-expert scale, fp32
weights out) router shapes at decode sizes, and replay the kernel in a CUDA graph.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_fused import reference_add_norm_linear_route, reference_linear_route

from inference_server.kernels import router
from inference_server.kernels.rmsnorm import fused_add_rmsnorm
from inference_server.kernels.router import add_norm_linear_route, linear_route, triton_route

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _router(T: int, H: int, E: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A normed-looking hidden row per token and a router weight of std 0.02 (logits of order 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    w = (0.02 * torch.randn(E, H, generator=gen) * (2048 / H) ** 0.5).to(DEV, dtype)
    return x, w


def _scale(E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return (1 + 0.5 * torch.rand(E, generator=gen)).to(DEV, dtype)


def assert_same_experts_except_near_ties(ids: torch.Tensor, ref_ids: torch.Tensor, x: torch.Tensor,
                                         w: torch.Tensor, tol_ulps: float) -> list[int]:
    """Each row picks the reference's experts, except experts whose exact logit lies within ``tol_ulps`` bf16 ulps
    of the reference's k-th logit (a near-tie either path may break either way). Returns the rows that agree."""
    exact = (x.double() @ w.double().T).cpu()  # [T, E]
    agree = []
    for row in range(ids.shape[0]):
        got, want = set(ids[row].tolist()), set(ref_ids[row].tolist())
        if got == want:
            agree.append(row)
            continue
        kth = exact[row, ref_ids[row].cpu()].min().item()
        tol = tol_ulps * 2.0 ** -8 * max(abs(kth), 2.0 ** -6)
        for expert in got ^ want:
            gap = abs(exact[row, expert].item() - kth)
            assert gap <= tol, f"row {row}: expert {expert} chosen by one path only, {gap:.3g} from the k-th logit"
    return agree


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Weights reordered by expert id (ties may order equal weights differently)."""
    return weights.float().gather(1, ids.argsort(dim=1))


def _check_against_reference(T: int, H: int, E: int, top_k: int, dtype: torch.dtype, renormalize: bool,
                             with_scale: bool, out_dtype: torch.dtype | None, seed: int, **launch: int) -> None:
    x, w = _router(T, H, E, dtype, seed)
    scale = _scale(E, dtype, seed) if with_scale else None
    weights, ids = linear_route(x, w, top_k, renormalize, scale, out_dtype, **launch)
    ref_weights, ref_ids = reference_linear_route(x, w, top_k, renormalize, scale, out_dtype)
    assert weights.dtype == ref_weights.dtype and ids.dtype == torch.int64 and ids.shape == ref_ids.shape == (T, top_k)
    if dtype == torch.float32:  # no rounding to a narrow type: the same choice, weights within fp32 ulps
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights.float(), ref_weights.float(), atol=2e-6, rtol=2e-6 if out_dtype is None
                                   or out_dtype == torch.float32 else 2 ** -7)
    else:
        agree = assert_same_experts_except_near_ties(ids, ref_ids, x, w, tol_ulps=2)
        torch.testing.assert_close(_by_id(weights[agree], ids[agree]), _by_id(ref_weights[agree], ref_ids[agree]),
                                   atol=1e-3, rtol=2 ** -5)
    assert int(router._arrival_counter(x.device).item()) == 0  # the last program put the arrival counter back


@pytest.mark.parametrize(("T", "H", "E", "top_k"), [(1, 64, 8, 2), (3, 72, 12, 4), (16, 48, 32, 8)])
@pytest.mark.parametrize(("renormalize", "with_scale", "out_dtype"), [
    (True, False, None),  # Qwen3-MoE with norm_topk_prob (weights cast to the activation dtype below)
    (False, False, None),
    (True, True, None),  # Gemma 4: per-expert scale, fp32 weights
])
def test_fp32_matches_the_formula(T: int, H: int, E: int, top_k: int, renormalize: bool, with_scale: bool,
                                  out_dtype: torch.dtype | None) -> None:
    """E = 12 is not a power of two (padded experts); H = 72 and 48 are not multiples of the H block."""
    _check_against_reference(T, H, E, top_k, torch.float32, renormalize, with_scale, out_dtype, seed=T * E,
                             block_h=32)


@pytest.mark.parametrize("experts_per_program", [1, 4, 32])
def test_launch_parameters_do_not_change_the_result(experts_per_program: int) -> None:
    """Experts per program from one to all of them (a single program per row)."""
    x, w = _router(5, 40, 32, torch.float32, seed=9)
    base = linear_route(x, w, 4, True, experts_per_program=2)
    other = linear_route(x, w, 4, True, experts_per_program=experts_per_program, block_h=16)
    assert torch.equal(base[1], other[1])
    torch.testing.assert_close(base[0], other[0], atol=2e-7, rtol=2e-7)


@pytest.mark.parametrize(("with_scale", "out_dtype"), [(False, torch.bfloat16), (True, None)])
def test_bf16_within_rounding_of_the_formula(with_scale: bool, out_dtype: torch.dtype | None) -> None:
    _check_against_reference(16, 96, 64, 8, torch.bfloat16, True, with_scale, out_dtype, seed=5)


def test_repeated_launches_reuse_the_counter_and_an_empty_step_launches_nothing() -> None:
    x, w = _router(4, 32, 16, torch.float32, seed=2)
    first = linear_route(x, w, 2, True)
    for _ in range(3):
        again = linear_route(x, w, 2, True)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    weights, ids = linear_route(x[:0], w, 2, True)
    assert weights.shape == ids.shape == (0, 2)


def test_rejects_what_it_cannot_take() -> None:
    x, w = _router(2, 32, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="top_k"):
        linear_route(x, w, 9, True)
    with pytest.raises(ValueError, match="weight"):
        linear_route(x, w.to(torch.bfloat16), 2, True)
    with pytest.raises(ValueError, match="weight"):
        linear_route(x, w[:, :16], 2, True)
    with pytest.raises(ValueError, match="rows"):
        linear_route(torch.zeros(router.MAX_FUSED_ROWS + 1, 32, device=DEV), w, 2, True)
    with pytest.raises(ValueError, match="power of two"):
        linear_route(x, w, 2, True, experts_per_program=3)


# ------------------------------------------------------------------------------------------------ GPU

QWEN = dict(H=2048, renormalize=True, with_scale=False, out_dtype=torch.bfloat16)  # Qwen3-30B-A3B
GEMMA = dict(H=2816, renormalize=True, with_scale=True, out_dtype=None)  # Gemma-4-26B-A4B


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 16])
@pytest.mark.parametrize("model", [QWEN, GEMMA], ids=["qwen3-30b-a3b", "gemma-4-26b-a4b"])
def test_real_shapes_match_the_formula_and_the_unfused_path(T: int, model: dict) -> None:
    """Over several routings per shape: the formula's choice except on near-ties (its weights close), and the
    unfused path's (cuBLAS logits, triton_route) except on near-ties."""
    H, renormalize, out_dtype = model["H"], model["renormalize"], model["out_dtype"]
    for seed in range(8):
        _check_against_reference(T, H, 128, 8, torch.bfloat16, renormalize, model["with_scale"], out_dtype,
                                 seed=100 * T + seed)
        x, w = _router(T, H, 128, torch.bfloat16, seed=100 * T + seed)
        scale = _scale(128, torch.bfloat16, seed) if model["with_scale"] else None
        weights, ids = linear_route(x, w, 8, renormalize, scale, out_dtype)
        unfused_weights, unfused_ids = triton_route(torch.nn.functional.linear(x, w), 8, renormalize, scale,
                                                    out_dtype)
        # cuBLAS may add split-K partials in bf16 (torch's allow_bf16_reduced_precision_reduction): a wider band
        agree = assert_same_experts_except_near_ties(ids, unfused_ids, x, w, tol_ulps=4)
        torch.testing.assert_close(_by_id(weights[agree], ids[agree]),
                                   _by_id(unfused_weights[agree], unfused_ids[agree]), atol=1e-3, rtol=2 ** -5)


@gpu
@needs_cuda
def test_replays_in_a_cuda_graph_as_it_runs_eagerly() -> None:
    """Three launches captured back to back (each resets the shared arrival counter for the next), replayed
    twice: every replay gives the eager results."""
    inputs = [_router(T, 2048, 128, torch.bfloat16, seed=T) for T in (1, 4, 16)]
    eager = [linear_route(x, w, 8, True, None, torch.bfloat16) for x, w in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear_route(*inputs[0], 8, True, None, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [linear_route(x, w, 8, True, None, torch.bfloat16) for x, w in inputs]
    for _ in range(2):
        for out in captured:
            out[0].zero_()
            out[1].zero_()
        graph.replay()
        torch.cuda.synchronize()
        for (weights, ids), (ref_weights, ref_ids) in zip(captured, eager, strict=True):
            assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    assert int(router._arrival_counter(inputs[0][0].device).item()) == 0


# -- the residual add and RMSNorm before the router, in the same launch (Qwen3-MoE's post-attention norm) ---------


def _add_norm_inputs(T: int, H: int, E: int, dtype: torch.dtype,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention output, a residual stream, a norm weight near 1 and a router weight."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    residual = (4 * torch.randn(T, H, generator=gen)).to(DEV, dtype)
    norm_weight = (1 + 0.2 * torch.randn(H, generator=gen)).to(DEV, dtype)
    w = (0.02 * torch.randn(E, H, generator=gen) * (2048 / H) ** 0.5).to(DEV, dtype)
    return x, residual, norm_weight, w


@pytest.mark.parametrize(("T", "H", "E", "top_k", "block_h"), [(1, 64, 8, 2, None), (3, 72, 12, 4, 32),
                                                               (16, 48, 32, 8, None)])
@pytest.mark.parametrize("mode", ["qwen", "gemma"])
def test_add_norm_fp32_matches_the_formula(T: int, H: int, E: int, top_k: int, block_h: int | None,
                                           mode: str) -> None:
    """fp32: the residual sum exactly, the normed rows within fp32 ulps (the sum of squares runs in tiles), the
    same experts and close weights; both outputs are new tensors."""
    x, residual, norm_weight, w = _add_norm_inputs(T, H, E, torch.float32, seed=T)
    normed, summed, weights, ids = add_norm_linear_route(x, residual, norm_weight, 1e-6, mode, w, top_k, True,  # type: ignore[arg-type]
                                                         None, None, block_h=block_h)
    ref = reference_add_norm_linear_route(x, residual, norm_weight, 1e-6, mode, w, top_k, True)  # type: ignore[arg-type]
    assert torch.equal(summed, ref[1]) and summed.data_ptr() not in (x.data_ptr(), residual.data_ptr())
    torch.testing.assert_close(normed, ref[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(ids, ref[3])
    torch.testing.assert_close(weights, ref[2], atol=2e-6, rtol=2e-6)
    assert int(router._arrival_counter(x.device).item()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5])
def test_add_norm_gives_the_unfused_launches_results(dtype: torch.dtype, T: int) -> None:
    """With the row in one tile (the default up to 8,192 columns) the launch is the two it replaces:
    ``fused_add_rmsnorm`` then ``linear_route`` of its output. Bit for bit under the interpreter and in bf16. On the
    GPU an fp32 row's sum of squares is reduced in another order than ``fused_add_rmsnorm``'s (each kernel's own
    warps and layout), so fp32 ``normed`` may differ in the last ulp there (seen on the H200), and the routing
    downstream of it by as little."""
    x, residual, norm_weight, w = _add_norm_inputs(T, 96, 16, dtype, seed=7)
    normed, summed, weights, ids = add_norm_linear_route(x, residual, norm_weight, 1e-6, "qwen", w, 4, True, None,
                                                         dtype)
    ref_normed, ref_summed = fused_add_rmsnorm(x, residual, norm_weight, 1e-6, "qwen")
    ref_weights, ref_ids = linear_route(ref_normed, w, 4, True, None, dtype)
    assert torch.equal(summed, ref_summed) and torch.equal(ids, ref_ids)
    if os.environ.get("TRITON_INTERPRET") == "1" or dtype == torch.bfloat16:
        assert torch.equal(normed, ref_normed) and torch.equal(weights, ref_weights)
    else:
        torch.testing.assert_close(normed, ref_normed, rtol=2.4e-7, atol=1e-7)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)


def test_add_norm_rejects_what_it_cannot_take() -> None:
    x, residual, norm_weight, w = _add_norm_inputs(2, 32, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="residual"):
        add_norm_linear_route(x, residual[:1], norm_weight, 1e-6, "qwen", w, 2, True)
    with pytest.raises(ValueError, match="norm_weight"):
        add_norm_linear_route(x, residual, norm_weight[:16], 1e-6, "qwen", w, 2, True)
    with pytest.raises(ValueError, match="norm mode"):
        add_norm_linear_route(x, residual, norm_weight, 1e-6, "gemma3", w, 2, True)  # type: ignore[arg-type]


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 4, 16])
def test_add_norm_at_qwen_shapes_matches_the_unfused_launches(T: int) -> None:
    """Qwen3-30B-A3B (H=2048, E=128, top-8, bf16): the residual sum exactly; the normed rows equal the unfused
    ``fused_add_rmsnorm``'s or an ulp apart (its fp32 sum of squares reduces in another order); the experts of
    ``linear_route`` on those rows except near-ties, weights close; replayed in a CUDA graph as run eagerly."""
    for seed in range(4):
        x, residual, norm_weight, w = _add_norm_inputs(T, 2048, 128, torch.bfloat16, seed=100 * T + seed)
        normed, summed, weights, ids = add_norm_linear_route(x, residual, norm_weight, 1e-6, "qwen", w, 8, True,
                                                             None, torch.bfloat16)
        ref_normed, ref_summed = fused_add_rmsnorm(x, residual, norm_weight, 1e-6, "qwen")
        assert torch.equal(summed, ref_summed)
        torch.testing.assert_close(normed.float(), ref_normed.float(), atol=0, rtol=2 ** -7)
        ref_weights, ref_ids = linear_route(normed, w, 8, True, None, torch.bfloat16)
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)  # same rows in: same routing
        unfused_weights, unfused_ids = linear_route(ref_normed, w, 8, True, None, torch.bfloat16)
        agree = assert_same_experts_except_near_ties(ids, unfused_ids, ref_normed, w, tol_ulps=4)
        torch.testing.assert_close(_by_id(weights[agree], ids[agree]),
                                   _by_id(unfused_weights[agree], unfused_ids[agree]), atol=1e-3, rtol=2 ** -5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = add_norm_linear_route(x, residual, norm_weight, 1e-6, "qwen", w, 8, True, None, torch.bfloat16)
    for out in captured:
        out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    eager = add_norm_linear_route(x, residual, norm_weight, 1e-6, "qwen", w, 8, True, None, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(captured, eager, strict=True))
