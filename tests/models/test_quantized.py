"""int8 weight-only models (``QUANTIZATION=int8``, ``architectures/quantized.py``): which layers become int8, the
loader quantizing as it loads (dummy and real checkpoints), the fused projections over int8 weights, and the
forward of every architecture against its float model."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tests.models.conftest import GEMMA3, load_hf_folder
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch
from torch import nn

from inference_server.kernels.reference_int8 import dequantize_int8, int8_linear_reference, quantize_int8_per_channel
from inference_server.models.architectures import ops
from inference_server.models.architectures.blocks import FusedExperts, GatedMLP, SelfAttention
from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.architectures.gemma4 import Gemma4Router
from inference_server.models.architectures.quantized import (
    Int8Embedding,
    Int8Linear,
    QuantizedWeight,
    is_quantized,
    logical_tensors,
    quantize_model_int8_,
)
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config, preset_names
from inference_server.models.spec import ModelSpec, parse_model_spec

CONFIGS = {name: preset_config(name) for name in preset_names() if name.endswith("-tiny")}
CONFIGS["gemma3-tiny"] = dict(GEMMA3, model_type="gemma3_text")


def _spec(name: str) -> ModelSpec:
    return parse_model_spec(CONFIGS[name])


def _float_model(spec: ModelSpec, seed: int = 1) -> CausalLM:
    model = build_model(spec, torch.float32, "cpu")
    init_dummy_weights(model, seed=seed)
    return model


def _logits(model: CausalLM, spec: ModelSpec, tokens: int = 12) -> torch.Tensor:
    """Logits of a prefill then two decode steps through the reference (contiguous) KV cache."""
    cache = ContiguousKVCache(spec)
    rows = []
    with torch.no_grad():
        ids = torch.arange(3, 3 + tokens)
        rows.append(model.compute_logits(model(ids, cache.context(ForwardBatch((0,), (0,), (tokens,)), "cpu"))))
        for step in range(2):
            batch = ForwardBatch((0,), (tokens + step,), (1,))
            rows.append(model.compute_logits(model(torch.tensor([7 + step]), cache.context(batch, "cpu"))))
    return torch.cat(rows)


def _fake_quantized(model: CausalLM, embeddings: bool) -> CausalLM:
    """A float copy of ``model`` whose weights are the int8 weights dequantized: what the int8 model computes,
    up to the order of the scale multiplication."""
    fake = copy.deepcopy(model)
    int8 = quantize_model_int8_(copy.deepcopy(model), embeddings=embeddings)
    fake_tensors = logical_tensors(fake)
    for name, target in logical_tensors(int8).items():
        if isinstance(target, QuantizedWeight):
            weight = fake_tensors[name]
            assert isinstance(weight, torch.Tensor)
            weight.copy_(dequantize_int8(target.qweight, target.scale, weight.dtype))
    return fake


def test_int8_linear_is_the_reference_matmul() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(40, 24, bias=False)
    layer = Int8Linear.from_linear(linear)
    q, scale = quantize_int8_per_channel(linear.weight.detach())
    assert torch.equal(layer.qweight, q) and torch.equal(layer.scale, scale) and layer.qweight.dtype == torch.int8
    x = torch.randn(2, 5, 40)
    assert torch.equal(layer(x), int8_linear_reference(x.reshape(10, 40), q, scale).reshape(2, 5, 24))
    with pytest.raises(ValueError, match="bias"):
        Int8Linear.from_linear(nn.Linear(4, 4))


def test_an_int8_layer_computes_through_its_bound_tables_int8_linear() -> None:
    calls = []

    def recording(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(qweight.shape))
        return int8_linear_reference(x, qweight, scale)

    layer, other = (Int8Linear(*quantize_int8_per_channel(torch.randn(6, 8))) for _ in range(2))
    ops.bind_ops(layer, dataclasses.replace(ops.REFERENCE_OPS, int8_linear=recording))
    layer(torch.randn(3, 8))
    other(torch.randn(3, 8))  # unbound: the reference
    assert calls == [(6, 8)] and other.ops is ops.REFERENCE_OPS


def test_int8_embedding_dequantizes_the_gathered_rows_and_is_the_tied_head() -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(50, 16)
    int8 = Int8Embedding.from_embedding(embedding)
    ids = torch.tensor([3, 49, 3, 0])
    assert torch.equal(int8(ids), dequantize_int8(int8.qweight, int8.scale, torch.float32)[ids])
    hidden = torch.randn(2, 16)
    assert torch.equal(int8.as_lm_head(hidden), int8_linear_reference(hidden, int8.qweight, int8.scale))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("embeddings", [False, True])
def test_every_linear_but_the_routers_becomes_int8(name: str, embeddings: bool) -> None:
    model = quantize_model_int8_(_float_model(_spec(name)), embeddings=embeddings)
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            is_head = module_name == "lm_head"
            assert module_name.endswith("router.proj") or (is_head and not embeddings), module_name
        if isinstance(module, nn.Embedding):
            assert not embeddings, module_name
        if isinstance(module, FusedExperts):
            assert module.gate_up_proj.dtype == module.down_proj.dtype == torch.int8
            assert module.gate_up_proj_scale is not None and module.down_proj_scale is not None
            assert module.gate_up_proj_scale.shape == module.gate_up_proj.shape[:2]
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    assert isinstance(model.model.embed_tokens, Int8Embedding) == embeddings
    floats = [n for n, p in model.named_parameters()
              if p.dim() >= 2 and p.dtype != torch.int8 and not n.endswith("_scale")]
    assert all("router" in n or n.endswith("mlp.gate.weight") or (not embeddings and ("embed" in n or "lm_head" in n))
               for n in floats), floats


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_int8_model_computes_its_dequantized_weights_and_stays_near_the_float_model(name: str) -> None:
    spec = _spec(name)
    model = _float_model(spec)
    reference = _logits(model, spec)
    fake = _logits(_fake_quantized(model, embeddings=True), spec)
    int8 = _logits(quantize_model_int8_(copy.deepcopy(model), embeddings=True), spec)
    scale = reference.abs().max()
    # the int8 forward is the forward of the dequantized weights (same routing), to fp32 rounding ...
    torch.testing.assert_close(int8, fake, atol=1e-4 * float(scale), rtol=0)
    # ... and on dense models quantization moves the logits by a few percent (relative norm; 4-7 % on these
    # random 64-wide models, whose logits are far more fragile than a trained model's). (In a random tiny MoE the
    # router's top-k has near-ties that an int8 rounding upstream can flip, moving a row by O(1): there the
    # check above, same routing as the dequantized weights, is the meaningful one.)
    if not spec.num_experts:
        without_embeddings = _logits(quantize_model_int8_(copy.deepcopy(model)), spec)
        assert float((without_embeddings - reference).norm() / reference.norm()) < 0.1


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_int8_dummy_weights_are_the_quantized_float_dummy_weights(name: str) -> None:
    spec = _spec(name)
    loaded = build_model(spec, torch.float32, "cpu", "int8")  # the CPU: embeddings too
    init_dummy_weights(loaded, seed=4)
    assert is_quantized(loaded) and isinstance(loaded.model.embed_tokens, Int8Embedding)
    converted = quantize_model_int8_(_float_model(spec, seed=4), embeddings=True)
    _assert_same_weights(loaded, converted)


@pytest.mark.parametrize(("device", "mode", "int8_head"), [("cpu", "auto", True), ("meta", "auto", False),
                                                        ("cpu", "off", False), ("meta", "on", True),
                                                        ("cpu", "on", True), ("meta", "off", False)])
@pytest.mark.parametrize("name", ["gemma-4-31b-tiny", "qwen3-30b-a3b-tiny"])  # tied / untied head
def test_int8_embeddings_mode_decides_the_embeddings_and_head(name: str, device: str, mode: str,
                                                              int8_head: bool) -> None:
    """``build_model(..., "int8", int8_embeddings)``: ``auto`` quantizes the embeddings and lm_head on the CPU only
    (``meta`` stands in for a GPU: no CPU), ``on`` / ``off`` everywhere; the decoder's linear layers are int8 in
    every case, and ``head_weight`` / ``int8_head`` give the head in its form."""
    spec = _spec(name)
    model = build_model(spec, torch.float32, device, "int8", mode)
    assert isinstance(model.model.embed_tokens, Int8Embedding) == int8_head
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int8Linear)
    if not spec.tie_word_embeddings:
        assert isinstance(model.lm_head, Int8Linear) == int8_head
    assert (model.head_weight() is None) == int8_head
    head = model.int8_head()
    assert (head is not None) == int8_head
    if head is not None:
        qweight, scale = head
        assert qweight.dtype == torch.int8 and qweight.shape == (spec.vocab_size, spec.hidden_size)
        assert scale.dtype == torch.float32 and scale.shape == (spec.vocab_size,)


def test_unknown_int8_embeddings_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown INT8_EMBEDDINGS mode 'yes'"):
        build_model(_spec("gemma-4-31b-tiny"), torch.float32, "meta", "int8", "yes")


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    tensors_a, tensors_b = logical_tensors(a), logical_tensors(b)
    assert tensors_a.keys() == tensors_b.keys()
    for name, x in tensors_a.items():
        y = tensors_b[name]
        if isinstance(x, QuantizedWeight):
            assert isinstance(y, QuantizedWeight), name
            assert torch.equal(x.qweight, y.qweight) and torch.equal(x.scale, y.scale), name
        else:
            assert isinstance(y, torch.Tensor) and torch.equal(x, y), name


@pytest.mark.parametrize("kind", ["qwen3_moe_hubformat", "gemma4_dense_ple_cg", "gemma4_moe"])
def test_loading_a_checkpoint_as_int8_quantizes_each_tensor_as_it_is_read(
        kind: str, hf_fixture: Callable[[str], tuple[nn.Module, Path]]) -> None:
    """Per-expert Qwen tensors land in their rows of the int8 fused experts; the result equals loading the float
    model and converting it."""
    _, folder = hf_fixture(kind)
    int8, _ = load_hf_folder(folder, torch.float32, "cpu", "int8")
    float_model, _ = load_hf_folder(folder, torch.float32, "cpu")
    _assert_same_weights(int8, quantize_model_int8_(float_model, embeddings=True))


@pytest.mark.parametrize("name", ["gemma-4-e2b-tiny", "gemma-4-26b-a4b-tiny", "qwen3-30b-a3b-tiny"])
def test_fused_projections_over_int8_weights(name: str) -> None:
    spec = _spec(name)
    model = quantize_model_int8_(_float_model(spec))
    separate = _logits(model, spec)
    keys = set(model.state_dict())
    fused_attention = 0
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.fuse_qkv()
            if module.qkv_weight is not None:
                fused_attention += 1
                assert module.qkv_weight.dtype == torch.int8 and module.qkv_scale is not None
                assert isinstance(module.q_proj, Int8Linear)
                assert module.q_proj.qweight.untyped_storage().data_ptr() == \
                    module.qkv_weight.untyped_storage().data_ptr()
                assert torch.equal(module.qkv_scale[:module.qkv_rows[0]], module.q_proj.scale)
        elif isinstance(module, GatedMLP):
            module.fuse_gate_up()
            assert module.gate_up_weight is not None and module.gate_up_weight.dtype == torch.int8
        elif isinstance(module, Gemma4Router):
            module.fold_scale()
    assert fused_attention > 0
    assert set(model.state_dict()) == keys  # the fused matrices are views, not new entries
    ops.bind_ops(model, dataclasses.replace(ops.REFERENCE_OPS, fused_weights=True))
    fused = _logits(model, spec)
    torch.testing.assert_close(fused, separate, atol=1e-4 * float(separate.abs().max()), rtol=0)


def test_fusing_a_mix_of_float_and_int8_projections_is_refused() -> None:
    from inference_server.models.architectures.blocks import fuse_projections

    with pytest.raises(TypeError, match="mix"):
        fuse_projections([nn.Linear(4, 4, bias=False), Int8Linear.from_linear(nn.Linear(4, 4, bias=False))])


def test_quantizing_twice_changes_nothing() -> None:
    spec = _spec("gemma-4-26b-a4b-tiny")
    once = quantize_model_int8_(_float_model(spec))
    twice = quantize_model_int8_(copy.deepcopy(once))
    _assert_same_weights(once, twice)


def test_int8_weights_take_a_quarter_of_the_fp32_bytes() -> None:
    spec = _spec("qwen3-30b-a3b-tiny")
    model = _float_model(spec)
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    quantize_model_int8_(model, embeddings=True)
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    assert after < 0.3 * before
