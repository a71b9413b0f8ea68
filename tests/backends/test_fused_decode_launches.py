"""Fused decode launches in the runner: the KV store folded into the q/k norm + RoPE launch, through the attention
context, on whole tiny models.

A runner whose context has ``norm_rope_store`` must leave the paged caches bit for bit as the unfused path does
(``triton_qk_norm_rope`` then the store), calling the separate store for no layer; KV-shared layers (Gemma-4-E2B),
K = V layers (Gemma-4-26B-A4B's full layers) and Qwen's raw values included. On CPU the Triton kernels run in the
interpreter (fp32); on a GPU compiled. Also: the CUDA runner's table has the fused paths (KV store, router GEMV, the
residual add and norm before the router, ...), and each fused launch gives the values of the launches it replaces
(a runner whose table has that fusion off, ``separate``).
"""

from __future__ import annotations

import dataclasses
import os

import attrs
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.backends.cuda.attention_ops import triton_qk_norm_rope, triton_qk_norm_rope_store
from inference_server.backends.cuda.moe_ops import triton_add_norm_linear_route, triton_linear_route
from inference_server.backends.cuda.options import CudaRunnerOptions
from inference_server.backends.cuda.runner import CudaModelRunner
from inference_server.backends.model_runner import ModelRunner
from inference_server.backends.paged_kv import PagedKVStorage, group_of
from inference_server.kernels.kv_store import store_kv
from inference_server.models.architectures.ops import REFERENCE_OPS, Fusions, Ops, RMSNorm, bind_ops
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import ModelSpec, parse_model_spec
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _build(name: str) -> tuple[ModelSpec, torch.nn.Module, PagedKVStorage]:
    spec = parse_model_spec(preset_config(name))
    model = build_model(spec, torch.float32, DEV)
    init_dummy_weights(model, seed=1)
    groups = {group_of(layer) for layer in spec.cache_layers}
    return spec, model, PagedKVStorage(spec.cache_layers, dict.fromkeys(groups, 8), BLOCK, torch.float32, DEV)


def _runner(spec: ModelSpec, model: torch.nn.Module, storage: PagedKVStorage, *separate: str,
            max_model_len: int = 32) -> CudaModelRunner:
    """A CUDA runner (no graphs) whose table has the fusions named in ``separate`` (``ops.Fusions`` fields, e.g.
    ``gated_projection``) off, so that ``Ops`` composes the launches they fuse; ``norm_rope_decode``: no q norm and
    RoPE in the decode attention."""
    runner = CudaModelRunner(model, spec, storage, torch.device(DEV),
                             CudaRunnerOptions(max_model_len=max_model_len, max_batch_size=2, cuda_graphs=False))
    if "norm_rope_decode" in separate:
        runner.attention_kwargs["norm_rope_decode"] = None
    off = dict.fromkeys(name for name in separate if name != "norm_rope_decode")
    runner.ops = dataclasses.replace(runner.ops, fusions=dataclasses.replace(runner.ops.fusions, **off))
    bind_ops(model, runner.ops)
    return runner


@pytest.fixture
def gemv_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float projections of small steps on the Triton GEMV at every shape, as if this device's sweep had timed it
    faster everywhere (no tuned file matches the CPU), so that the GEMV fusions run."""
    from inference_server.backends.cuda import projection_ops

    monkeypatch.setattr(projection_ops, "triton_is_faster", lambda *args: True)


def _plans(spec: ModelSpec) -> list[StepPlan]:
    """Two prompts prefilled together (9 and 20 tokens, the second over two blocks), then one decode step."""
    groups = max(group_of(layer) for layer in spec.cache_layers) + 1
    tables = [((0, 1),) * groups, ((2, 3),) * groups]
    prompts = [tuple(range(3, 12)), tuple(range(40, 60))]
    prefill = tuple(ScheduledSequence(request_id=i, token_ids=p, cached_len=0, block_tables=tables[i], sample=True,
                                      sampling=GREEDY, reset=True, prompt_len=len(p)) for i, p in enumerate(prompts))
    decode = tuple(ScheduledSequence(request_id=i, token_ids=(5 + i,), cached_len=len(p), block_tables=tables[i],
                                     sample=True, sampling=GREEDY, reset=False, prompt_len=len(p))
                   for i, p in enumerate(prompts))
    return [StepPlan(step_id=0, sequences=prefill), StepPlan(step_id=1, sequences=decode)]


def _count_rows(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Wrap ``projection_ops``' launch ``name`` (a GEMV kernel) so that each call records its first argument's row
    count; returns the list it appends to."""
    from inference_server.backends.cuda import projection_ops

    rows: list[int] = []
    launch = getattr(projection_ops, name)

    def counting(x: torch.Tensor, *args: object, **kwargs: object) -> object:
        rows.append(x.shape[0])
        return launch(x, *args, **kwargs)

    monkeypatch.setattr(projection_ops, name, counting)
    return rows


def _assert_same_tokens_close_logprobs(got: list[list[tuple[int, float]]],
                                       want: list[list[tuple[int, float]]]) -> None:
    """Per step, the same sampled tokens and their logprobs within fp32 rounding (1e-4)."""
    assert [[t for t, _ in step] for step in got] == [[t for t, _ in step] for step in want]
    for step, want_step in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor([p for _, p in step]), torch.tensor([p for _, p in want_step]),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-tiny", "gemma-4-26b-a4b-tiny", "gemma-4-e2b-tiny"])
def test_fused_store_leaves_the_caches_as_the_separate_store_and_skips_it(name: str) -> None:
    torch.set_num_threads(1)
    spec, model, _ = _build(name)
    table = Ops(fusions=Fusions(qk_norm_rope=triton_qk_norm_rope))  # the unfused path: the same kernel, no store
    caches, store_calls, tokens = [], [], []
    for fused in (False, True):
        _, _, storage = _build(name)
        calls: list[int] = []

        def counting_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, calls: list[int] = calls) -> None:
            calls.append(k.shape[0])
            store_kv(k, v, k_cache, v_cache, slots)

        runner = ModelRunner(model, spec, storage, torch.device(DEV), ops=table, attention_kwargs=dict(
            store=counting_store, norm_rope_store=triton_qk_norm_rope_store if fused else None))
        tokens.append([[t.token_id for t in runner.execute(plan).tokens] for plan in _plans(spec)])
        caches.append([t.clone() for t in storage.keys + storage.values])
        store_calls.append(len(calls))
    computing_layers = sum(layer.computes_kv for layer in spec.layers)
    assert store_calls == [2 * computing_layers, 0]  # two steps
    assert tokens[0] == tokens[1]
    assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))
    assert any(bool(c.abs().sum() > 0) for c in caches[1])


@pytest.mark.parametrize("reference", [False, True])
def test_runner_binds_the_fused_paths_unless_reference_ops(reference: bool) -> None:
    spec, model, storage = _build("qwen3-30b-a3b-tiny")
    runner = CudaModelRunner(model, spec, storage, torch.device(DEV), CudaRunnerOptions(
        max_model_len=32, max_batch_size=2, cuda_graphs=False, reference_ops=reference))
    assert runner.attention_kwargs["norm_rope_store"] is (None if reference else triton_qk_norm_rope_store)
    assert (runner.attention_kwargs["norm_rope_decode"] is None) == reference
    table = runner.ops
    assert all(module.ops is table for module in model.modules() if hasattr(module, "ops"))
    fusions = table.fusions
    fused = [(fusions.linear_route, triton_linear_route), (fusions.add_norm_linear_route, triton_add_norm_linear_route),
             (fusions.qk_norm_rope, triton_qk_norm_rope)]
    assert all((got is want) != reference for got, want in fused)
    for field in dataclasses.fields(Fusions):
        assert (getattr(fusions, field.name) is None) == reference, field.name
    for name in ("route", "gated_activation", "linear", "rope_cos_sin"):
        assert (getattr(table, name) is getattr(REFERENCE_OPS, name)) == reference, name
    assert table.fused_weights != reference
    assert REFERENCE_OPS.fusions == Fusions()  # the reference table is left as it was


def test_qwen_decode_runs_the_post_attention_norm_in_the_router_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3-MoE: each MoE layer of a decode step calls the fused add + norm + router kernel once (a prefill
    step of more than FUSED_ROUTER_MAX_TOKENS tokens takes the unfused path), and the tokens are those of a runner
    with the fusion off."""
    from inference_server.backends.cuda import moe_ops

    fused_rows: list[int] = []
    real = moe_ops.add_norm_linear_route

    def recording(x: torch.Tensor, *args: object) -> tuple[torch.Tensor, ...]:
        fused_rows.append(x.shape[0])
        return real(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(moe_ops, "add_norm_linear_route", recording)
    torch.set_num_threads(1)
    tokens = []
    for fused in (True, False):
        spec, model, storage = _build("qwen3-30b-a3b-tiny")
        runner = _runner(spec, model, storage, *(() if fused else ("add_norm_linear_route",)), max_model_len=64)
        tokens.append([[t.token_id for t in runner.execute(plan).tokens] for plan in _plans(spec)])
        if fused:
            moe_layers = sum(layer.is_moe for layer in spec.layers)
            assert fused_rows == [2] * moe_layers  # the decode step's two rows, once per MoE layer
    assert tokens[0] == tokens[1]


def test_router_gemv_is_fused_at_decode_sizes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to FUSED_ROUTER_MAX_TOKENS rows the fused kernel runs; past it, or for a weight of another dtype, the fusion
    declines and the table composes the router GEMM and its routing (the reference's values)."""
    from inference_server.backends.cuda import moe_ops

    fused_rows: list[int] = []
    real = moe_ops.linear_route

    def recording(x: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        fused_rows.append(x.shape[0])
        return real(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(moe_ops, "linear_route", recording)
    gen = torch.Generator().manual_seed(0)
    w = (0.1 * torch.randn(16, 32, generator=gen)).to(DEV)
    limit = moe_ops.FUSED_ROUTER_MAX_TOKENS
    table = Ops(fusions=Fusions(linear_route=triton_linear_route))
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 32, generator=gen).to(DEV)
        assert (triton_linear_route(x, w, 4, True, None, None) is None) == (rows > limit)
        weights, ids = table.linear_route(x, w, 4, True, None, None)
        ref_weights, ref_ids = REFERENCE_OPS.linear_route(x, w, 4, True, None, None)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_weights, atol=2e-6, rtol=2e-6)
    assert fused_rows == [1, 1, limit, limit]
    with pytest.raises(RuntimeError):  # another dtype: the GEMM path, which rejects the mix as F.linear does
        table.linear_route(x[:2], w.double(), 4, True, None, None)
    assert fused_rows == [1, 1, limit, limit]


# E2B in CI: its dense MLPs and its per-layer-input gates both take the fused launch; 26B-A4B's dense MLP beside the
# experts is the same launch on one more model
@pytest.mark.parametrize("name", [pytest.param("gemma-4-26b-a4b-tiny", marks=pytest.mark.slow), "gemma-4-e2b-tiny"])
def test_gated_gemv_gives_the_two_launches_bits(name: str, monkeypatch: pytest.MonkeyPatch,
                                                gemv_everywhere: None) -> None:
    """The dense MLP's gate/up GEMV (and E2B's per-layer-input gate) with the activation in its epilogue
    (``triton_gated_projection``) against the GEMV and the activation kernel apart: same tokens and logprobs, bit
    for bit, and the fused launch taken at decode."""
    torch.set_num_threads(1)
    calls = _count_rows(monkeypatch, "gated_gemv")
    results = []
    for fused in (False, True):
        spec, model, storage = _build(name)
        unfused = ("mlp_beside_experts", "norm_add_gated_projection") + (() if fused else ("gated_projection",))
        runner = _runner(spec, model, storage, *unfused)
        results.append([[(t.token_id, t.logprob) for t in runner.execute(plan).tokens] for plan in _plans(spec)])
        assert (len(calls) > 0) == fused
    assert results[0] == results[1]
    # every Gemma 4 layer has a dense MLP, and E2B's a per-layer-input gate too; only the decode step's two rows
    # take the GEMV (the prefill's 29 tokens run the tensor-core GEMM, then the activation kernel)
    assert calls == [2] * len(spec.layers) * (2 if spec.ple_hidden_size else 1)


def test_mlp_beside_experts_gives_the_separate_launches_bits(monkeypatch: pytest.MonkeyPatch,
                                                             gemv_everywhere: None) -> None:
    """Gemma-4-26B-A4B's dense MLP beside its routed experts (``triton_mlp_beside_experts``: the gate/up GEMV with
    the router, the down GEMV with the experts' gate/up) against the same runner with the branches' launches
    apart: same tokens and logprobs, bit for bit (the interpreter has no warps; on the GPU the router's logits may
    differ in fp32 summation order), and both paired launches taken once per MoE layer at decode only."""
    from inference_server.backends.cuda import moe_ops

    torch.set_num_threads(1)
    calls: dict[str, list[int]] = {"route": [], "experts": []}
    pair_route, pair_experts = moe_ops.gated_gemv_and_route, moe_ops.expert_gate_up_beside_gemv

    def counting_route(x: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        calls["route"].append(x.shape[0])
        return pair_route(x, *args, **kwargs)  # type: ignore[arg-type]

    def counting_experts(x: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        calls["experts"].append(x.shape[0])
        return pair_experts(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(moe_ops, "gated_gemv_and_route", counting_route)
    monkeypatch.setattr(moe_ops, "expert_gate_up_beside_gemv", counting_experts)
    results = []
    for fused in (False, True):
        spec, model, storage = _build("gemma-4-26b-a4b-tiny")
        runner = _runner(spec, model, storage, *(() if fused else ("mlp_beside_experts",)))
        assert (runner.ops.fusions.mlp_beside_experts is None) == (not fused)
        results.append([[(t.token_id, t.logprob) for t in runner.execute(plan).tokens] for plan in _plans(spec)])
    assert results[0] == results[1]
    moe_layers = sum(layer.is_moe for layer in spec.layers)
    assert moe_layers > 0
    # the decode step's two rows, once per MoE layer; the prefill's 29 tokens take the separate launches. The tiny
    # model's down GEMV takes one warp (K tiles of 64 columns) and its experts' gate/up four: not paired
    # (shares_warps), the next test pairs them at shapes where the warps agree
    assert calls == {"route": [2] * moe_layers, "experts": []}


# 2 tokens in CI: the most rows the paired launches take (decode_max_tokens=2); 1 is the same path on fewer rows
@pytest.mark.parametrize("tokens", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_mlp_beside_experts_pairs_both_launches_where_the_warps_agree(tokens: int, monkeypatch: pytest.MonkeyPatch,
                                                                      gemv_everywhere: None) -> None:
    """``triton_mlp_beside_experts`` on a Gemma 4 MoE FFN whose down GEMV takes four warps (K = 1024) as the
    experts' gate/up does: both paired launches, and the separate launches' bits (a CUDA table's primitives and
    fusions, called as ``Ops.mlp_beside_experts`` composes them)."""
    import functools

    from inference_server.backends.cuda import moe_ops, projection_ops
    from inference_server.models.architectures.blocks import FusedExperts, GatedMLP
    from inference_server.models.architectures.gemma4 import Gemma4Router

    torch.set_num_threads(1)
    calls: list[str] = []
    pair_route, pair_experts = moe_ops.gated_gemv_and_route, moe_ops.expert_gate_up_beside_gemv
    monkeypatch.setattr(moe_ops, "gated_gemv_and_route",
                        lambda *a, **k: calls.append("route") or pair_route(*a, **k))
    monkeypatch.setattr(moe_ops, "expert_gate_up_beside_gemv",
                        lambda *a, **k: calls.append("experts") or pair_experts(*a, **k))
    spec = parse_model_spec(preset_config("gemma-4-26b-a4b-tiny"))
    hidden, dense, experts_n, inter = 256, 1024, 8, 32
    spec = attrs.evolve(spec, hidden_size=hidden, num_experts=experts_n, moe_intermediate_size=inter,
                        experts_top_k=2)
    gen = torch.Generator().manual_seed(tokens)
    mlp, router = GatedMLP(hidden, dense, "gelu_pytorch_tanh"), Gemma4Router(spec)
    experts = FusedExperts(experts_n, hidden, inter, "gelu_pytorch_tanh")
    for module in (mlp, router, experts):
        for p in module.parameters():
            p.data = (torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5).to(DEV)
    mlp.fuse_gate_up()
    router.fold_scale()
    table = Ops(linear=functools.partial(projection_ops.triton_dense_linear, max_tokens=16),
                gated_activation=projection_ops.triton_gated_activation,
                fused_moe=functools.partial(moe_ops.triton_fused_moe, decode_max_tokens=2), fused_weights=True,
                fusions=Fusions(gated_projection=functools.partial(projection_ops.triton_gated_projection,
                                                                   dense_max_tokens=16),
                                linear_route=moe_ops.triton_linear_route))
    for module in (mlp, router, experts):
        bind_ops(module, table)
    x, residual, router_in, expert_in = (torch.randn(tokens, hidden, generator=gen).to(DEV) for _ in range(4))
    want = table.mlp_beside_experts(mlp, router, experts, x, residual, router_in, expert_in)
    assert calls == []
    got = moe_ops.triton_mlp_beside_experts(mlp, router, experts, x, residual, router_in, expert_in,
                                            decode_max_tokens=2, dense_max_tokens=16)
    assert calls == ["route", "experts"] and got is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _fused_against_separate(preset: str, op: str) -> ModelSpec:
    """Run ``_plans`` on the tiny ``preset`` with the runner's fusion ``op`` off, then as the runner's table has it
    (the float projections on the Triton GEMV, ``gemv_everywhere``): the two runs give
    the same tokens and logprobs (bit for bit under the interpreter, whose sums of squares run in the same order; on
    the GPU within fp32 rounding). Returns the model's spec."""
    torch.set_num_threads(1)
    results = []
    for fused in (False, True):
        spec, model, storage = _build(preset)
        runner = _runner(spec, model, storage, *(() if fused else (op,)))
        assert (getattr(runner.ops.fusions, op) is None) == (not fused)
        results.append([[(t.token_id, t.logprob) for t in runner.execute(plan).tokens] for plan in _plans(spec)])
    if DEV == "cpu":
        assert results[0] == results[1]
    else:
        _assert_same_tokens_close_logprobs(results[1], results[0])
    return spec


def test_norm_add_gemv_gives_the_two_launches_values(monkeypatch: pytest.MonkeyPatch, gemv_everywhere: None) -> None:
    """Gemma-4-E2B's post-FFN norm add inside the per-layer-input gate's GEMV against the
    ``norm_add`` launch and the gated GEMV apart (``_fused_against_separate``), the fused launch taken once a layer
    at decode only."""
    calls = _count_rows(monkeypatch, "norm_add_gemv")
    spec = _fused_against_separate("gemma-4-e2b-tiny", "norm_add_gated_projection")
    # the decode step's two rows, once per layer (every E2B layer has a per-layer input); the prefill's 29 tokens
    # run the norm_add launch and the tensor-core GEMM
    assert calls == [2] * len(spec.layers)


def test_add_norm_gemv_gives_the_two_launches_values(monkeypatch: pytest.MonkeyPatch, gemv_everywhere: None) -> None:
    """Qwen3-MoE's input add + norm inside the fused q/k/v projection's GEMV against the
    ``fused_add_rmsnorm`` launch and the GEMV apart (``_fused_against_separate``), the fused launch taken once a layer
    after the first (whose input is the embedding, with no residual to add) at decode only."""
    calls = _count_rows(monkeypatch, "add_norm_gemv")
    spec = _fused_against_separate("qwen3-30b-a3b-tiny", "add_norm_projection")
    # the decode step's two rows; the prefill's 29 tokens run the norm launch and the tensor-core GEMM
    assert calls == [2] * (len(spec.layers) - 1)


def test_add_norm_projection_takes_the_fused_launch_for_float_weights_only(monkeypatch: pytest.MonkeyPatch,
                                                                           gemv_everywhere: None) -> None:
    """``triton_add_norm_projection`` runs one launch for a float projection at one token and declines int8 weights,
    which keep the two launches (measured faster for them), each with the unfused composition's values."""
    import functools

    from inference_server.backends.cuda import norm_ops, projection_ops
    from inference_server.kernels.int8_linear import int8_linear
    from inference_server.kernels.reference_int8 import quantize_int8_per_channel

    calls = _count_rows(monkeypatch, "add_norm_gemv")
    separate = Ops(int8_linear=int8_linear, linear=functools.partial(projection_ops.triton_dense_linear, max_tokens=16),
                   fusions=Fusions(add_rms_norm=norm_ops.triton_add_rms_norm))
    fused_table = dataclasses.replace(separate, fusions=dataclasses.replace(
        separate.fusions, add_norm_projection=functools.partial(projection_ops.triton_add_norm_projection,
                                                                dense_max_tokens=16)))
    gen = torch.Generator().manual_seed(7)
    x, residual = ((torch.randn(1, 64, generator=gen) * 3).to(DEV) for _ in range(2))
    norm = RMSNorm(64, 1e-6, "qwen").to(DEV)
    weight = (torch.randn(32, 64, generator=gen) / 8).to(DEV)
    for w, scale, fused in ((weight, None, True), (*quantize_int8_per_channel(weight), False)):
        calls.clear()
        declined = projection_ops.triton_add_norm_projection(x, residual, norm, w, scale, dense_max_tokens=16) is None
        assert declined != fused
        calls.clear()
        got = fused_table.add_norm_projection(x, residual, norm, w, scale)
        want = separate.add_norm_projection(x, residual, norm, w, scale)
        assert calls == ([1] if fused else [])
        assert torch.equal(got[1], want[1])
        if DEV == "cpu":  # the interpreter sums the row as the norm kernel does
            assert torch.equal(got[0], want[0])
        else:
            torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


def test_q_norm_rope_in_the_attention_launch_gives_the_separate_launches_values(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma-4-E2B's KV-shared layers with their q norm and RoPE inside the decode attention launch
    (``TritonNormRopeDecode``) against ``qk_norm_rope``'s launch and the attention apart: the same tokens, and
    logprobs within fp32 rounding (the norm's sum of squares runs over the whole row, not two halves), taken once
    per KV-shared layer at the decode step only."""
    from inference_server.backends.cuda import attention_ops

    torch.set_num_threads(1)
    calls: list[int] = []
    attention = attention_ops.paged_decode_attention

    def counting(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.get("q_norm_rope") is not None:
            calls.append(q.shape[0])
        return attention(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_ops, "paged_decode_attention", counting)
    results = []
    for fused in (False, True):
        spec, model, storage = _build("gemma-4-e2b-tiny")
        runner = _runner(spec, model, storage, *(() if fused else ("norm_rope_decode",)))
        results.append([[(t.token_id, t.logprob) for t in runner.execute(plan).tokens] for plan in _plans(spec)])
        assert (len(calls) > 0) == fused
    _assert_same_tokens_close_logprobs(results[1], results[0])
    shared = sum(not layer.computes_kv for layer in spec.layers)
    assert shared > 0 and calls == [2] * shared


@pytest.mark.parametrize("decode_only", [True, False])
def test_context_hands_back_a_raw_q_only_to_its_own_attention(decode_only: bool) -> None:
    """``PagedAttentionContext`` with ``norm_rope_decode``: at a decode-only step a layer without K/V gets q back raw
    and ``attend`` of that q calls the fused decode once, with the norm and the RoPE tables; a layer with K/V, a
    prefill-carrying step and inputs the fused decode does not accept take ``qk_norm_rope``'s normed q."""
    from inference_server.backends.paged_kv import PagedAttentionContext, StepTensors

    spec, _, storage = _build("gemma-4-e2b-tiny")
    shared = next(layer for layer in spec.layers if not layer.computes_kv)
    owner = next(layer for layer in spec.layers if layer.computes_kv and layer.head_dim == shared.head_dim)
    calls: list[tuple[torch.Tensor, RMSNorm]] = []
    fused_out = torch.full((1, spec.num_attention_heads, shared.head_dim), 7.0, device=DEV)

    class FakeNormRopeDecode:
        accepted = True

        def accepts(self, q_raw: torch.Tensor, q_norm: RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> bool:
            return self.accepted

        def __call__(self, q_raw: torch.Tensor, q_norm: RMSNorm, *args: object) -> torch.Tensor:
            calls.append((q_raw, q_norm))
            return fused_out

    fake = FakeNormRopeDecode()
    groups = {group_of(layer) for layer in spec.cache_layers}
    step = StepTensors(positions=torch.tensor([4], device=DEV), cu_seqlens_q=torch.tensor([0, 1], device=DEV),
                       context_lens=torch.tensor([5], dtype=torch.int32, device=DEV),
                       block_tables={g: torch.zeros(1, 2, dtype=torch.int32, device=DEV) for g in groups},
                       slot_mappings={g: torch.tensor([4], device=DEV) for g in groups}, is_decode_only=decode_only)
    ctx = PagedAttentionContext(storage, step, decode_attention=lambda *args: torch.zeros_like(args[0]),
                                norm_rope_decode=fake)
    d = shared.head_dim
    q_raw = torch.randn(1, spec.num_attention_heads, d, device=DEV)
    norm = RMSNorm(d, spec.rms_norm_eps, spec.norm_style).to(DEV)
    cos, sin = torch.ones(1, d, device=DEV), torch.zeros(1, d, device=DEV)
    q, k, v = ctx.qk_norm_rope(REFERENCE_OPS, shared, q_raw, None, None, norm, None, None, cos, sin)
    assert k is None and v is None and (q is q_raw) == decode_only
    out = ctx.attend(shared, q, None, None, 1.0, None)
    assert [(c[0] is q_raw, c[1] is norm) for c in calls] == ([(True, True)] if decode_only else [])
    assert (out is fused_out) == decode_only
    # a layer with its own K/V, and a q the fused decode does not accept: the normed q, the plain attention
    k_raw = torch.randn(1, owner.num_kv_heads, d, device=DEV)
    q, k, _ = ctx.qk_norm_rope(REFERENCE_OPS, owner, q_raw, k_raw, k_raw, norm, norm, None, cos, sin)
    assert q is not q_raw and k is not None
    fake.accepted = False
    q, _, _ = ctx.qk_norm_rope(REFERENCE_OPS, shared, q_raw, None, None, norm, None, None, cos, sin)
    assert q is not q_raw and ctx.attend(shared, q, None, None, 1.0, None) is not fused_out
    assert len(calls) == (1 if decode_only else 0)
