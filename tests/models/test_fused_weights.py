"""Weights fused or folded at start-up (``ops.fused_weights``): ``SelfAttention.fuse_qkv`` and
``GatedMLP.fuse_gate_up`` (one GEMM for q, k (and v) and one for a dense MLP's gate and up, no second copy of
the weights) and ``Gemma4Router.fold_scale`` (one norm launch); the same forward within fp32 rounding.

The tiny presets cover every layer kind: separate k and v (Qwen3-MoE, Gemma-4-E2B/E4B), K = V (Gemma-4-26B-A4B
and 31B full layers: only q and k fused), layers that reuse another layer's KV (E2B/E4B: q alone, not fused),
dense MLPs (every Gemma 4, beside the experts in 26B-A4B) and none (Qwen3-MoE's layers are all sparse).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

from inference_server.models.architectures import ops
from inference_server.models.architectures.blocks import GatedMLP, SelfAttention
from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.architectures.gemma4 import Gemma4Router
from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config, preset_names
from inference_server.models.spec import ModelSpec, parse_model_spec

TINY = [n for n in preset_names() if n.endswith("-tiny")]


def _logits(model: CausalLM, spec: ModelSpec) -> torch.Tensor:
    cache = ContiguousKVCache(spec)
    batch = ForwardBatch(seq_ids=(0,), cached_lens=(0,), query_lens=(12,))
    with torch.no_grad():
        return model.compute_logits(model(torch.arange(3, 15), cache.context(batch, "cpu")))


@pytest.mark.parametrize("name", TINY)
def test_fused_weights_give_the_unfused_logits(name: str) -> None:
    spec = parse_model_spec(preset_config(name))
    model = build_model(spec, torch.float32, "cpu")
    init_dummy_weights(model, seed=1)
    separate = _logits(model, spec)
    keys = set(model.state_dict())
    attention = [m for m in model.modules() if isinstance(m, SelfAttention)]
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    for module in attention:
        module.fuse_qkv()
        module.fuse_qkv()  # idempotent
    for mlp in mlps:
        mlp.fuse_gate_up()
        mlp.fuse_gate_up()
        assert mlp.gate_up_weight is not None
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
        assert torch.equal(mlp.gate_up_weight[mlp.gate_proj.weight.shape[0]:], mlp.up_proj.weight)
    assert bool(mlps) == name.startswith("gemma")
    routers = [m for m in model.modules() if isinstance(m, Gemma4Router)]
    for router in routers:
        router.fold_scale()
        folded = router.folded_norm
        router.fold_scale()  # idempotent: the same tensor, which captured CUDA graphs read by address
        assert folded is not None and router.folded_norm is folded
    assert bool(routers) == name.startswith("gemma-4-26b")
    fused_layers = [m for m in attention if m.qkv_weight is not None]
    assert fused_layers, "no layer was fused"
    for module in attention:
        if module.qkv_weight is None:
            assert not module.layer.computes_kv
            continue
        assert len(module.qkv_rows) == (3 if module.v_proj is not None else 2)
        # the projections are views of the fused matrix: one copy of the weights, loaders still see them
        assert module.q_proj.weight.untyped_storage().data_ptr() == module.qkv_weight.untyped_storage().data_ptr()
        assert torch.equal(module.qkv_weight[:module.qkv_rows[0]], module.q_proj.weight)
    assert set(model.state_dict()) == keys
    ops.bind_ops(model, dataclasses.replace(ops.REFERENCE_OPS, fused_weights=True))
    fused = _logits(model, spec)
    torch.testing.assert_close(fused, separate, atol=1e-4, rtol=1e-4)
    ops.bind_ops(model, ops.REFERENCE_OPS)  # fused weights in place but not in use: the separate projections' values
    assert not ops.REFERENCE_OPS.fused_weights
    torch.testing.assert_close(_logits(model, spec), separate, atol=0, rtol=0)
