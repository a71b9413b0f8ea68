"""``Ops.add_rms_norm`` (residual add folded into the next RMSNorm) and ``Ops.norm_add`` (Gemma's sandwich norms, each
layer ending with the next layer's input norm): the reference op is the plain math, bit for bit, and the decoders
that use them give the hidden states of the unfused layer code they replaced, bit for bit (CPU), with the CUDA
backend's fusion too (``triton_norm_add``, its kernel stood in for by the kernel's PyTorch reference). The table's
mechanics: compositions through the table's primitives, fusions taken where they answer, ``bind_ops``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch
from torch.utils._python_dispatch import TorchDispatchMode

from inference_server.models.architectures import layers, ops
from inference_server.models.architectures.attention import AttentionContext
from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.architectures.gemma4 import Gemma4DecoderLayer, Gemma4Router
from inference_server.models.architectures.layers import rope_cos_sin
from inference_server.models.architectures.ops import REFERENCE_OPS, Fusions, bind_ops
from inference_server.models.architectures.qwen3_moe import Qwen3MoeDecoderLayer
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import ModelSpec, NormStyle, parse_model_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("style", "with_weight"), [("gemma4", True), ("gemma4", False), ("gemma3", True),
                                                     ("qwen", True)])
def test_reference_op_is_add_then_norm(style: NormStyle, with_weight: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(5, 48, generator=gen) * 3).to(dtype), torch.randn(5, 48, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(48, generator=gen)).to(dtype) if with_weight else None
    normed, new_residual = REFERENCE_OPS.add_rms_norm(x, residual, weight, 1e-6, style)
    h = residual + x
    assert new_residual.dtype == dtype and torch.equal(new_residual, h)
    assert torch.equal(normed, layers.rms_norm(h, weight, 1e-6, style))


def test_reference_op_uses_the_tables_norm() -> None:
    """The composition goes through its table's ``norm``, so a backend's norm applies to it too."""
    seen: list[torch.Tensor] = []

    def recording_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: NormStyle) -> torch.Tensor:
        seen.append(x)
        return layers.rms_norm(x, weight, eps, style)

    table = dataclasses.replace(REFERENCE_OPS, norm=recording_norm)
    _, h = table.add_rms_norm(torch.ones(2, 8), torch.full((2, 8), 2.0), None, 1e-6, "gemma4")
    assert len(seen) == 1 and seen[0] is h and torch.equal(h, torch.full((2, 8), 3.0))


def test_a_fusion_answers_where_it_takes_the_inputs_and_the_composition_elsewhere() -> None:
    calls: list[int] = []

    def fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
              style: NormStyle) -> tuple[torch.Tensor, torch.Tensor] | None:
        calls.append(x.shape[0])
        return (x, residual) if x.shape[0] == 1 else None  # "takes" single rows only

    table = dataclasses.replace(REFERENCE_OPS, fusions=Fusions(add_rms_norm=fused))
    one, other = torch.ones(1, 8), torch.full((1, 8), 2.0)
    answer = table.add_rms_norm(one, other, None, 1e-6, "qwen")
    assert answer[0] is one and answer[1] is other  # the fusion's answer
    x, residual = torch.ones(3, 8), torch.full((3, 8), 2.0)
    normed, h = table.add_rms_norm(x, residual, None, 1e-6, "qwen")  # declined: the composition
    assert calls == [1, 3] and torch.equal(h, residual + x) and torch.equal(normed, layers.rms_norm(h, None, 1e-6,
                                                                                                    "qwen"))
    assert REFERENCE_OPS.fusions == Fusions()  # the reference has no fusion


def test_bind_ops_gives_every_module_of_the_model_the_table_and_leaves_other_models_alone() -> None:
    spec = parse_model_spec(preset_config("qwen3-30b-a3b-tiny"))
    bound, other = build_model(spec, torch.float32, "cpu"), build_model(spec, torch.float32, "cpu")
    table = dataclasses.replace(REFERENCE_OPS, fused_weights=True)
    bind_ops(bound, table)
    users = [m for m in bound.modules() if isinstance(m, ops.OpsUser)]
    assert len(users) > spec.num_layers and all(m.ops is table for m in users)
    assert all(m.ops is REFERENCE_OPS for m in other.modules() if isinstance(m, ops.OpsUser))


# ----------------------------------------------------------- decoders against their former, unfused layer code


def unfused_qwen_forward(model: CausalLM, ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """``Qwen3MoeModel.forward`` as it was before ``add_rms_norm``: ``h = h + attn(norm(h))``, ``h + mlp(norm(h))``."""
    decoder = model.model
    h = decoder.embed_tokens(ids)
    cos, sin = rope_cos_sin(decoder.inv_freq, ctx.positions, h.dtype)
    for layer in decoder.layers:
        assert isinstance(layer, Qwen3MoeDecoderLayer)
        h = h + layer.self_attn(layer.input_layernorm(h), cos, sin, ctx)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return decoder.norm(h)


def unfused_gemma4_layer(layer: Gemma4DecoderLayer, h: torch.Tensor, per_layer_input: torch.Tensor | None,
                         cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    """``Gemma4DecoderLayer.forward`` as it was before ``add_rms_norm``."""
    residual = h
    h = layer.post_attention_layernorm(layer.self_attn(layer.input_layernorm(h), cos, sin, ctx))
    h = residual + h
    residual = h
    m = layer.mlp(layer.pre_feedforward_layernorm(h))
    if layer.is_moe:
        dense = layer.post_feedforward_layernorm_1(m)
        weights, ids = layer.router(residual)
        moe = layer.experts(layer.pre_feedforward_layernorm_2(residual), weights, ids)
        m = dense + layer.post_feedforward_layernorm_2(moe)
    h = residual + layer.post_feedforward_layernorm(m)
    if layer.ple_size:
        assert per_layer_input is not None
        gate = layers.activation(layer.act_name)(layer.per_layer_input_gate(h)) * per_layer_input
        h = h + layer.post_per_layer_input_norm(layer.per_layer_projection(gate))
    if layer.has_layer_scalar:
        h = h * layer.layer_scalar
    return h


def unfused_gemma4_forward(model: CausalLM, ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
    decoder, spec = model.model, model.spec
    weight = decoder.embed_tokens.weight
    h = decoder.embed_tokens(ids) * torch.tensor(spec.embed_scale).to(weight.dtype)
    ple = decoder.per_layer_inputs(ids, h) if spec.ple_hidden_size else None
    rope = {t: rope_cos_sin(inv_freq, ctx.positions, h.dtype) for t, inv_freq in decoder.inv_freqs.items()}
    for i, layer in enumerate(decoder.layers):
        cos, sin = rope[spec.layers[i].layer_type]
        h = unfused_gemma4_layer(layer, h, ple[:, i, :] if ple is not None else None, cos, sin, ctx)
    return decoder.norm(h)


def run_steps(model: CausalLM, spec: ModelSpec, ids: torch.Tensor,
              forward: Callable[[CausalLM, torch.Tensor, AttentionContext], torch.Tensor]) -> list[torch.Tensor]:
    """A 7-token prefill of two sequences then three decode steps, on a fresh cache; final hidden states."""
    cache = ContiguousKVCache(spec)
    seqs, outputs = (0, 1), []
    with torch.no_grad():
        for start, length in [(0, 7), (7, 1), (8, 1), (9, 1)]:
            batch = ForwardBatch(seq_ids=seqs, cached_lens=(start,) * 2, query_lens=(length,) * 2)
            outputs.append(forward(model, ids[:, start:start + length].reshape(-1), cache.context(batch, "cpu")))
    return outputs


GEMMA4_TINY = ["gemma-4-26b-a4b-tiny", "gemma-4-31b-tiny", "gemma-4-e2b-tiny", "gemma-4-e4b-tiny"]
"""MoE (26B-A4B), dense (31B) and PLE (E2B, E4B; E2B also shares KV across layers) layers."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b-tiny", *GEMMA4_TINY])
def test_decoder_equals_its_unfused_layer_code(name: str, dtype: torch.dtype) -> None:
    spec = parse_model_spec(preset_config(name))
    model = build_model(spec, dtype, "cpu")
    init_dummy_weights(model, seed=3)
    ids = torch.randint(3, spec.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    unfused = unfused_qwen_forward if spec.architecture == "qwen3_moe" else unfused_gemma4_forward
    ours = run_steps(model, spec, ids, lambda m, t, ctx: m(t, ctx))
    theirs = run_steps(model, spec, ids, unfused)
    for our, their in zip(ours, theirs, strict=True):
        assert our.dtype == dtype and torch.equal(our, their)


def test_qwen_layers_add_the_residual_only_inside_add_rms_norm() -> None:
    """Per Qwen3-MoE layer: two ``add_rms_norm`` calls, no residual add of its own and no other hidden-size
    norm (the first layer's input norm and the final add + norm excepted): two norm launches on CUDA."""
    spec = parse_model_spec(preset_config("qwen3-30b-a3b-tiny"))
    model = build_model(spec, torch.float32, "cpu")
    init_dummy_weights(model, seed=3)
    hidden_size, tokens = spec.hidden_size, 3
    state = dict(inside=False, add_norms=0, adds_outside=0, norms_outside=0)

    def counting_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                          style: NormStyle) -> tuple[torch.Tensor, torch.Tensor]:
        state["add_norms"] += 1
        state["inside"] = True
        try:
            return REFERENCE_OPS.add_rms_norm(x, residual, weight, eps, style)
        finally:
            state["inside"] = False

    def counting_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: NormStyle) -> torch.Tensor:
        if not state["inside"] and x.shape == (tokens, hidden_size):
            state["norms_outside"] += 1
        return layers.rms_norm(x, weight, eps, style)

    class CountAdds(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket is torch.ops.aten.add and not state["inside"] \
                    and tuple(out.shape) == (tokens, hidden_size):
                state["adds_outside"] += 1
            return out

    bind_ops(model, dataclasses.replace(REFERENCE_OPS, norm=counting_norm,
                                        fusions=Fusions(add_rms_norm=counting_add_norm)))
    cache = ContiguousKVCache(spec)
    batch = ForwardBatch(seq_ids=(0,), cached_lens=(0,), query_lens=(tokens,))
    with torch.no_grad(), CountAdds():
        model(torch.tensor([5, 9, 11]), cache.context(batch, "cpu"))
    assert state == dict(inside=False, add_norms=2 * spec.num_layers, adds_outside=0, norms_outside=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", GEMMA4_TINY)
def test_gemma4_norms_take_two_launches_a_layer(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the CUDA runner's ops (folded router scale, ``triton_norm_add``): every hidden-size norm of a Gemma 4
    layer runs inside a ``norm_add`` launch, two a layer (three with PLE), but the first layer's input norm; the
    MoE layer's post-attention launch emits its three norms; the final norm is the last layer's. The hidden states
    are those of the unfused layer code with the folded router norm, bit for bit."""
    from tests.kernels.reference_fused import norm_add_reference

    from inference_server.backends.cuda import norm_ops

    spec = parse_model_spec(preset_config(name))
    model = build_model(spec, dtype, "cpu")
    init_dummy_weights(model, seed=3)
    for module in model.modules():
        if isinstance(module, Gemma4Router):
            module.fold_scale()
    ids = torch.randint(3, spec.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    bind_ops(model, dataclasses.replace(REFERENCE_OPS, fused_weights=True))
    theirs = run_steps(model, spec, ids, unfused_gemma4_forward)

    launches: list[int] = []  # out norms of each norm_add launch
    stray_norms = 0

    def counting_kernel(*args: object, **kwargs: object) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        launches.append(len(kwargs["out_norms"]))  # type: ignore[arg-type]
        return norm_add_reference(*args, **kwargs)  # type: ignore[arg-type]

    def counting_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: NormStyle) -> torch.Tensor:
        nonlocal stray_norms
        stray_norms += x.shape[-1] == spec.hidden_size
        return layers.rms_norm(x, weight, eps, style)

    monkeypatch.setattr(norm_ops, "norm_add", counting_kernel)
    bind_ops(model, dataclasses.replace(REFERENCE_OPS, fused_weights=True, norm=counting_norm,
                                        fusions=Fusions(norm_add=norm_ops.triton_norm_add)))
    ours = run_steps(model, spec, ids, lambda m, t, ctx: m(t, ctx))
    for our, their in zip(ours, theirs, strict=True):
        assert our.dtype == dtype and torch.equal(our, their)

    steps, moe_layers = len(ours), sum(layer.is_moe for layer in spec.layers)
    per_layer = 3 if spec.ple_hidden_size else 2
    assert stray_norms == steps  # the first layer's input norm, once a step
    assert len(launches) == steps * per_layer * spec.num_layers
    assert launches.count(3) == steps * moe_layers  # the MLP's, the experts' and the router's input norms
