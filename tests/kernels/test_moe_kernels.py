"""Fused MoE: Triton kernels vs the PyTorch reference, the reference vs a naive loop.

On CPU the kernels run under TRITON_INTERPRET=1 at tiny shapes (the interpreter rounds fp32 -> bf16 by
truncation, so bf16 tolerances are loose); the ``gpu`` tests use the real Qwen3-30B-A3B and
Gemma-4-26B-A4B expert shapes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_moe import apply_activation, fused_moe_reference

from inference_server.kernels.fused_moe import (
    MoeGemmConfig,
    MoeKernelConfig,
    fused_moe,
    moe_align_block_size,
    moe_kernel_config,
    moe_max_blocks,
)
from inference_server.kernels.reference_moe import route_softmax_topk

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _experts(
    E: int, H: int, inter: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    w_gu = torch.randn(E, 2 * inter, H, generator=gen) / H**0.5  # [E, 2I, H]
    w_dn = torch.randn(E, H, inter, generator=gen) / inter**0.5  # [E, H, I]
    return w_gu.to(DEV, dtype), w_dn.to(DEV, dtype)


def _routing(T: int, E: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(T, E, generator=gen) * 2
    w, ids = route_softmax_topk(logits, K, renormalize=True)
    return w.to(DEV), ids.to(DEV)


def _naive_moe(x, w_gu, w_dn, w, ids, activation) -> torch.Tensor:  # fp64, per token and k
    x, w_gu, w_dn, w = x.double(), w_gu.double(), w_dn.double(), w.double()
    inter = w_gu.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = w_gu[e] @ x[t]
            out[t] += w[t, k] * (w_dn[e] @ (apply_activation(gu[:inter], activation) * gu[inter:]))
    return out


# ------------------------------------------------------------------ references


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("T", "E", "K"), [(1, 4, 1), (3, 4, 2), (17, 8, 2), (64, 8, 8)])
def test_route_softmax_topk_matches_naive_loop(T: int, E: int, K: int, renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(T * 100 + E * 10 + K)
    logits = torch.randn(T, E, generator=gen).bfloat16()
    w, ids = route_softmax_topk(logits, K, renormalize)
    assert w.dtype == torch.float32 and ids.shape == (T, K)
    for t in range(T):
        row = [float(v) for v in logits[t].float()]
        m = max(row)
        z = sum(pow(2.718281828459045, v - m) for v in row)
        probs = [pow(2.718281828459045, v - m) / z for v in row]
        top = sorted(range(E), key=lambda e: -probs[e])[:K]
        vals = [probs[e] for e in top]
        if renormalize:
            s = sum(vals)
            vals = [v / s for v in vals]
        assert sorted(ids[t].tolist()) == sorted(top)
        got = dict(zip(ids[t].tolist(), w[t].tolist(), strict=True))
        for e, v in zip(top, vals, strict=True):
            assert got[e] == pytest.approx(v, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("accumulate", ["pairs", "index_add"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("T", "E", "K"), [(1, 4, 2), (17, 8, 2), (9, 8, 8)])
def test_reference_matches_naive_loop(T: int, E: int, K: int, activation: str, accumulate: str) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, 32, generator=gen).to(DEV)
    w_gu, w_dn = _experts(E, 32, 24, torch.float32, gen)
    w, ids = _routing(T, E, K, gen)
    ref = fused_moe_reference(x, w_gu, w_dn, w, ids, activation, accumulate=accumulate)
    torch.testing.assert_close(
        ref.double(), _naive_moe(x, w_gu, w_dn, w, ids, activation), atol=1e-5, rtol=1e-5
    )


def test_reference_weight_dtype_sets_weighting_precision() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=gen).bfloat16()
    w_gu, w_dn = _experts(4, 32, 24, torch.bfloat16, gen)
    w, ids = _routing(5, 4, 2, gen)
    qwen = fused_moe_reference(x, w_gu, w_dn, w.bfloat16(), ids, "silu")
    gemma = fused_moe_reference(x, w_gu, w_dn, w, ids, "silu")
    assert qwen.dtype == gemma.dtype == torch.bfloat16
    exact = _naive_moe(x, w_gu, w_dn, w, ids, "silu")
    assert (gemma.double() - exact).abs().max() < 0.05
    assert (qwen.double() - exact).abs().max() < 0.05


@pytest.mark.parametrize(("impl", "accumulate"), [("grouped_mm", "pairs"), ("eager", "index_add")])
@pytest.mark.parametrize("model", ["qwen3_moe", "gemma4"])
def test_reference_is_bitwise_hf_experts(model: str, impl: str, accumulate: str) -> None:
    """Each accumulate mode reproduces one HF experts_implementation bit for bit (CPU, bf16)."""
    pytest.importorskip("transformers")  # heavy import (~10 s): only here
    if model == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        cfg = Qwen3MoeConfig(
            hidden_size=64, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=8,
            experts_implementation=impl,
        )  # fmt: skip
        experts, activation, weights_dtype = Qwen3MoeExperts(cfg), "silu", torch.bfloat16
    else:
        from transformers import Gemma4TextConfig
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

        cfg = Gemma4TextConfig(
            hidden_size=64, moe_intermediate_size=24, num_experts=8, top_k_experts=8, enable_moe_block=True,
            experts_implementation=impl,
        )  # fmt: skip
        experts, activation, weights_dtype = Gemma4TextExperts(cfg), "gelu_tanh", torch.float32
    gen = torch.Generator().manual_seed(0)
    experts = experts.to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * 0.1)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * 0.2)
        x = torch.randn(33, 64, generator=gen).bfloat16()
        w, ids = route_softmax_topk(torch.randn(33, 8, generator=gen), 8, renormalize=True)
        w = w.to(weights_dtype)
        hf = experts(x, ids, w)
        ours = fused_moe_reference(
            x, experts.gate_up_proj, experts.down_proj, w, ids, activation, accumulate=accumulate
        )
    assert torch.equal(ours, hf)


# ------------------------------------------------------------------ alignment


@pytest.mark.parametrize(
    ("T", "E", "K", "block_m"),
    # the last three span several alignment chunks (256 pairs at E=8, 128 at E=128)
    [
        (1, 8, 1, 16),
        (3, 4, 2, 16),
        (17, 8, 8, 16),
        (64, 8, 2, 32),
        (64, 8, 8, 16),
        (200, 8, 4, 64),
        (40, 128, 8, 16),
    ],
)
def test_align_groups_pairs_by_expert(T: int, E: int, K: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(T + E + K)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])  # [T, K]
    ids[ids == 1] = 0  # expert 1 gets no token
    n = T * K
    a = moe_align_block_size(ids.to(DEV), E, block_m)
    sorted_ids, block_expert = a.sorted_pair_ids.cpu(), a.block_expert.cpu()
    max_blocks = moe_max_blocks(n, E, block_m)
    assert sorted_ids.shape == (max_blocks * block_m,) and block_expert.shape == (max_blocks,)
    flat = ids.reshape(-1)
    slot = 0
    for e in range(E):
        mine = torch.nonzero(flat == e).flatten().tolist()  # ascending pair ids
        if not mine:
            continue
        nblk = -(-len(mine) // block_m)
        assert sorted_ids[slot : slot + len(mine)].tolist() == mine
        assert (sorted_ids[slot + len(mine) : slot + nblk * block_m] == n).all()
        assert (block_expert[slot // block_m : slot // block_m + nblk] == e).all()
        slot += nblk * block_m
    assert int(a.num_padded) == slot
    assert (sorted_ids[slot:] == n).all()
    assert (block_expert[slot // block_m :] == -1).all()


def test_max_blocks_bound_is_tight() -> None:
    for n in range(1, 40):
        for E in (1, 3, 8):
            for bm in (16, 32):
                # worst case: min(n, E) - 1 experts with 1 pair, the rest on one expert
                a = min(n, E)
                worst = -(-(n - (a - 1)) // bm) + (a - 1)
                assert moe_max_blocks(n, E, bm) >= worst


# ------------------------------------------------------------------ fused kernel vs reference

_FP32_CASES = [(T, E, K) for T in (1, 3, 17, 64) for E, K in ((4, 1), (4, 2), (8, 1), (8, 2), (8, 8))]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("T", "E", "K"), _FP32_CASES)
def test_fused_moe_fp32(T: int, E: int, K: int, activation: str) -> None:
    gen = torch.Generator().manual_seed(T * 31 + E * 7 + K)
    x = torch.randn(T, 32, generator=gen).to(DEV)
    w_gu, w_dn = _experts(E, 32, 24, torch.float32, gen)
    w, ids = _routing(T, E, K, gen)
    out = fused_moe(x, w_gu, w_dn, w, ids, activation)
    ref = fused_moe_reference(x, w_gu, w_dn, w, ids, activation)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])  # Qwen-style, Gemma-style
def test_the_k_sum_weights_each_pair_rounded_as_stored_weighted(weights_dtype: torch.dtype,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The down kernel stores each pair's output unweighted in the activation dtype; the k-sum weights it, rounds
    the product to ``promote(act, weights)`` (the dtype the pair used to be stored in, weighted) and adds in fp32,
    k ascending: bitwise that arithmetic in torch, on the pairs the sum kernel was given. Its launch turns off
    multiply-add contraction (the compiler would otherwise fold fp32 product and add into one FMA)."""
    from inference_server.kernels import fused_moe as module

    launches: list[tuple[tuple, dict]] = []
    kernel = module._moe_sum_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), kwargs))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_moe_sum_kernel", Recording())
    gen = torch.Generator().manual_seed(5)
    T, E, K = 5, 8, 4
    x = torch.randn(T, 32, generator=gen).to(DEV, torch.bfloat16)
    w_gu, w_dn = _experts(E, 32, 24, torch.bfloat16, gen)
    w, ids = _routing(T, E, K, gen)
    w = w.to(weights_dtype)
    out = fused_moe(x, w_gu, w_dn, w, ids, "silu")
    ((pairs, weights, *_), kwargs), = launches
    assert kwargs["enable_fp_fusion"] is False
    assert pairs.dtype == torch.bfloat16 and pairs.shape == (T * K, 32)
    def to_bf16(t: torch.Tensor) -> torch.Tensor:  # fp32 -> bf16 as the kernel rounds (interpreter: truncation)
        if DEV == "cuda":
            return t.to(torch.bfloat16)
        return (t.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

    expected = torch.zeros(T, 32, dtype=torch.float32, device=DEV)
    for k in range(K):
        product = pairs[k::K].float() * weights.view(T, K)[:, k:k + 1].float()
        expected += (to_bf16(product).float() if weights_dtype == torch.bfloat16 else product)
    assert torch.equal(out, to_bf16(expected))


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])  # Qwen-style, Gemma-style
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize(("T", "E", "K"), [(1, 8, 8), (3, 4, 2), (17, 8, 2), (64, 8, 8)])
def test_fused_moe_bf16(T: int, E: int, K: int, activation: str, weights_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(T * 31 + E * 7 + K + 1)
    x = torch.randn(T, 32, generator=gen).to(DEV, torch.bfloat16)
    w_gu, w_dn = _experts(E, 32, 24, torch.bfloat16, gen)
    w, ids = _routing(T, E, K, gen)
    w = w.to(weights_dtype)
    out = fused_moe(x, w_gu, w_dn, w, ids, activation)
    ref = fused_moe_reference(x, w_gu, w_dn, w, ids, activation)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=6e-2, rtol=4e-2)


def test_fused_moe_fp16() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(17, 32, generator=gen).to(DEV, torch.float16)
    w_gu, w_dn = _experts(8, 32, 24, torch.float16, gen)
    w, ids = _routing(17, 8, 2, gen)
    out = fused_moe(x, w_gu, w_dn, w.half(), ids, "gelu_tanh")
    ref = fused_moe_reference(x, w_gu, w_dn, w.half(), ids, "gelu_tanh")
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=5e-3)


def test_fused_moe_reads_only_routed_experts() -> None:
    """Unrouted experts hold NaN: any read of them into a computed tile would poison the output."""
    gen = torch.Generator().manual_seed(11)
    T, E, K = 3, 8, 2
    x = torch.randn(T, 32, generator=gen).to(DEV)
    w_gu, w_dn = _experts(E, 32, 24, torch.float32, gen)
    ids = torch.tensor([[2, 5], [5, 2], [6, 2]], device=DEV)  # experts 0, 1, 3, 4, 7 get no token
    w = torch.rand(T, K, generator=gen).to(DEV)
    for e in (0, 1, 3, 4, 7):
        w_gu[e] = float("nan")
        w_dn[e] = float("nan")
    out = fused_moe(x, w_gu, w_dn, w, ids, "silu")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, fused_moe_reference(x, w_gu, w_dn, w, ids, "silu"), atol=2e-5, rtol=2e-5)


def test_fused_moe_skewed_routing_many_blocks_per_expert() -> None:
    """Nearly every token on experts 0 and 3: several BLOCK_M blocks per expert, idle experts between."""
    gen = torch.Generator().manual_seed(17)
    T, E, K = 64, 8, 2
    x = torch.randn(T, 32, generator=gen).to(DEV)
    w_gu, w_dn = _experts(E, 32, 24, torch.float32, gen)
    ids = torch.tensor([[0, 3]] * T)
    ids[5] = torch.tensor([7, 0])
    w = torch.rand(T, K, generator=gen).to(DEV)
    ids = ids.to(DEV)
    config = MoeKernelConfig(16, MoeGemmConfig(32, 32, 1), MoeGemmConfig(32, 32, 1))
    out = fused_moe(x, w_gu, w_dn, w, ids, "silu", config=config)
    ref = fused_moe_reference(x, w_gu, w_dn, w, ids, "silu")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "config",
    [
        MoeKernelConfig(16, MoeGemmConfig(16, 16, 1), MoeGemmConfig(16, 16, 1)),  # many N tiles, K loop
        MoeKernelConfig(32, MoeGemmConfig(16, 32, 2), MoeGemmConfig(32, 16, 3)),  # ragged K, grouped order
        MoeKernelConfig(64, MoeGemmConfig(32, 64, 1), MoeGemmConfig(64, 32, 1)),  # K tile > H: masked
        MoeKernelConfig(128, MoeGemmConfig(32, 16, 4), MoeGemmConfig(16, 32, 1)),  # prefill-sized blocks
    ],
)
def test_fused_moe_explicit_configs_ragged_shapes(config: MoeKernelConfig) -> None:
    gen = torch.Generator().manual_seed(13)
    T, H, inter, E, K = 17, 40, 24, 8, 2  # H not a multiple of 16 or 32, I not of 16
    x_big = torch.randn(T, H + 8, generator=gen).to(DEV)
    x = x_big[:, 4 : 4 + H]  # strided rows
    w_gu, w_dn = _experts(E, H, inter, torch.float32, gen)
    w, ids = _routing(T, E, K, gen)
    out = torch.full((T, H), float("nan"), device=DEV)
    res = fused_moe(x, w_gu, w_dn, w, ids.int(), "gelu_tanh", config=config, out=out)
    assert res is out
    torch.testing.assert_close(
        out, fused_moe_reference(x, w_gu, w_dn, w, ids, "gelu_tanh"), atol=2e-5, rtol=2e-5
    )


def test_fused_moe_empty_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    w_gu, w_dn = _experts(4, 32, 24, torch.float32, gen)
    x = torch.empty(0, 32, device=DEV)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEV)
    assert fused_moe(x, w_gu, w_dn, torch.empty(0, 2, device=DEV), ids, "silu").shape == (0, 32)


def test_config_heuristic_is_sane() -> None:
    for H, inter in ((2048, 768), (2816, 704), (5376, 2112), (32, 24)):
        for T in (1, 16, 64, 256, 2048, 8192):
            cfg = moe_kernel_config(T, H, inter, 128, 8)
            assert cfg.block_m in (16, 32, 64, 128)
            for g in (cfg.gate_up, cfg.down):
                assert g.block_n >= 16 and g.block_k >= 16
                assert g.block_n & (g.block_n - 1) == 0 and g.block_k & (g.block_k - 1) == 0
    assert moe_kernel_config(1, 2048, 768, 128, 8).block_m == 16
    assert moe_kernel_config(4096, 2048, 768, 128, 8).block_m >= 64


# ------------------------------------------------------------------ GPU, real shapes

_REAL = {
    "qwen3-30b-a3b": dict(H=2048, I=768, E=128, K=8, activation="silu", weights_dtype=torch.bfloat16),
    "gemma4-26b-a4b": dict(H=2816, I=704, E=128, K=8, activation="gelu_tanh", weights_dtype=torch.float32),
}


def _real_case(model: str, T: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """Random experts, activations and routing at a model's real expert shape (fp32: fp32 routing weights too)."""
    p = _REAL[model]
    gen = torch.Generator("cuda").manual_seed(seed)
    kw = dict(generator=gen, device="cuda", dtype=dtype)
    x = torch.randn(T, p["H"], **kw)
    w_gu = torch.randn(p["E"], 2 * p["I"], p["H"], **kw) / p["H"] ** 0.5  # [E, 2I, H]
    w_dn = torch.randn(p["E"], p["H"], p["I"], **kw) / p["I"] ** 0.5  # [E, H, I]
    logits = torch.randn(T, p["E"], generator=gen, device="cuda") * 2
    w, ids = route_softmax_topk(logits, p["K"], renormalize=True)
    return x, w_gu, w_dn, w.to(p["weights_dtype"] if dtype != torch.float32 else dtype), ids, p["activation"]


def assert_bf16_moe_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The bf16 yardstick at real shapes: every output within 2 % of the largest, and the mean error within 0.2 %."""
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 * scale, rtol=2e-2)
    assert (out.float() - ref.float()).abs().mean() < 2e-3 * scale


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 16, 64, 256, 2048])
@pytest.mark.parametrize("model", sorted(_REAL))
def test_fused_moe_gpu_real_shapes(model: str, T: int) -> None:
    x, w_gu, w_dn, w, ids, act = _real_case(model, T)
    assert_bf16_moe_close(fused_moe(x, w_gu, w_dn, w, ids, act), fused_moe_reference(x, w_gu, w_dn, w, ids, act))


@gpu
@needs_cuda
def test_fused_moe_gpu_fp32_tight() -> None:
    x, w_gu, w_dn, w, ids, act = _real_case("qwen3-30b-a3b", 64)
    x, w_gu, w_dn = x.float(), w_gu.float(), w_dn.float()
    out = fused_moe(x, w_gu, w_dn, w.float(), ids, act)
    ref = fused_moe_reference(x, w_gu, w_dn, w.float(), ids, act)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@gpu
@needs_cuda
def test_fused_moe_gpu_deterministic_and_graph_capturable() -> None:
    x, w_gu, w_dn, w, ids, act = _real_case("gemma4-26b-a4b", 16)
    first = fused_moe(x, w_gu, w_dn, w, ids, act)
    assert torch.equal(first, fused_moe(x, w_gu, w_dn, w, ids, act))
    out = torch.empty_like(first)
    fused_moe(x, w_gu, w_dn, w, ids, act, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w_gu, w_dn, w, ids, act, out=out)
    x2, _, _, w2, ids2, _ = _real_case("gemma4-26b-a4b", 16, seed=1)
    x.copy_(x2)
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(x, w_gu, w_dn, w, ids, act))
