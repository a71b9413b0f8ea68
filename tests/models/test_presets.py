"""Presets build at their real size (on the meta device) with the exact parameter and KV-cache figures."""

from __future__ import annotations

import pytest
import torch

from inference_server.models.loading.loader import build_model, init_dummy_weights
from inference_server.models.loading.presets import preset_config, preset_names
from inference_server.models.spec import parse_model_spec

# name: (exact text parameters, KV-cache layers, KV bytes per token in bf16 below the window)
REAL = {
    "gemma-4-e2b": (None, 15, 18_432),
    "gemma-4-e4b": (None, 24, 57_344),
    "gemma-4-26b-a4b": (25_233_141_760, 30, 225_280),
    "gemma-4-31b": (30_697_345_280, 60, 901_120),
    "qwen3-30b-a3b": (30_532_122_624, 48, 98_304),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_presets_have_the_released_geometry(name: str) -> None:
    params, cache_layers, kv_bytes = REAL[name]
    spec = parse_model_spec(preset_config(name))
    assert len(spec.cache_layers) == cache_layers
    assert spec.kv_bytes_per_token(2) == kv_bytes
    if params is not None:
        with torch.device("meta"):
            model = build_model(spec, torch.bfloat16, "meta")
        assert sum(p.numel() for p in model.parameters()) == params


def test_e2b_param_count_matches_models_md() -> None:
    spec = parse_model_spec(preset_config("gemma-4-e2b"))
    model = build_model(spec, torch.bfloat16, "meta")
    total = sum(p.numel() for p in model.parameters())
    assert round(total / 1e9, 3) == 4.629  # models.md §3: 4.629 B text params (PLE table 2.349 B)
    assert [layer.intermediate_size for layer in spec.layers].count(12288) == 20  # double-wide shared layers


@pytest.mark.parametrize("name", [n for n in preset_names() if n.endswith("-tiny")])
def test_tiny_presets_run_a_forward(name: str) -> None:
    from tests.models.contiguous_kv import ContiguousKVCache, ForwardBatch

    spec = parse_model_spec(preset_config(name))
    model = build_model(spec, torch.float32, "cpu")
    init_dummy_weights(model, seed=0)
    cache = ContiguousKVCache(spec)
    batch = ForwardBatch(seq_ids=(0,), cached_lens=(0,), query_lens=(10,))
    with torch.no_grad():
        logits = model.compute_logits(model(torch.arange(3, 13), cache.context(batch, "cpu")))
    assert logits.shape == (10, spec.vocab_size)
    assert torch.isfinite(logits).all()
