"""``bench/roofline.py``'s Gemma 4 entries against the model the engine builds (meta device: no memory).

What a decode step must read whole (``always_read``) is every parameter but the gathered per-layer embedding
table (the tied embedding is read whole, as the lm_head); KV bytes per token come from the cache layers (layers
that reuse another layer's KV store none), split into full-attention and sliding-window layers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from inference_server.models.loading.loader import build_model
from inference_server.models.loading.presets import preset_config
from inference_server.models.spec import parse_model_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import roofline


@pytest.mark.parametrize("name", ["gemma-4-e2b", "gemma-4-e4b", "gemma-4-26b-a4b"])
def test_gemma4_entries_match_the_built_model(name: str) -> None:
    spec = parse_model_spec(preset_config(name))
    model = build_model(spec, torch.bfloat16, "meta")
    cost = roofline.MODELS[name]
    gathered = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens_per_layer" in n)
    total = sum(p.numel() for p in model.parameters())
    # 26B-A4B's entry leaves out the norm weights (0.6 M of 25.2 B parameters); the small models count all.
    assert abs(cost.total_params - (total - gathered)) <= 1_000_000
    full = sum(c.bytes_per_token(2) for c in spec.cache_layers if c.window is None)
    sliding = {c.window for c in spec.cache_layers if c.window is not None}
    assert (cost.kv_full, cost.kv_sliding) == (full, sum(c.bytes_per_token(2) for c in spec.cache_layers
                                                          if c.window is not None))
    assert sliding == {cost.window}


@pytest.mark.parametrize("name", sorted(roofline.MODELS))
def test_attention_widths_match_the_layers(name: str) -> None:
    """The prefill floor's attention FLOPs: query heads x head_dim over the full and the sliding layers (KV-sharing
    layers too: they compute their own queries), and a prompt's visible keys in closed form."""
    spec = parse_model_spec(preset_config(name))
    cost = roofline.MODELS[name]
    widths = [(spec.num_attention_heads * layer.head_dim, layer.window) for layer in spec.layers]
    assert cost.attn_full == sum(w for w, window in widths if window is None)
    assert cost.attn_sliding == sum(w for w, window in widths if window is not None)
    for n in (1, 5, cost.window or 7, (cost.window or 7) + 3):
        keys = [(i + 1, min(i + 1, cost.window or n)) for i in range(n)]
        want = 4.0 * sum(cost.attn_full * full + cost.attn_sliding * sliding for full, sliding in keys)
        assert cost.attention_flops(n) == want


@pytest.mark.parametrize("name", sorted(roofline.MODELS))
def test_decode_kv_reads_count_every_attention_layer(name: str) -> None:
    """A decode step's KV reads: every attention layer reads its cache layer (``kv_slot``), so a KV-shared layer
    (E2B's last 20, E4B's last 18) reads its source layer's cache again; ``rereads=False`` counts each cache layer
    once (the limit before the re-reads were counted)."""
    spec = parse_model_spec(preset_config(name))
    cost = roofline.MODELS[name]
    reads = [(spec.cache_layers[layer.kv_slot].bytes_per_token(2), layer.window) for layer in spec.layers]
    full = sum(b for b, window in reads if window is None)
    sliding = sum(b for b, window in reads if window is not None)
    for context in (100, cost.window or 700, 3000):
        visible = min(context, cost.window) if cost.window else context
        assert cost.kv_bytes(context) == full * context + sliding * visible
        assert cost.kv_bytes(context, rereads=False) == cost.kv_full * context + cost.kv_sliding * visible
    shared = any(not layer.computes_kv for layer in spec.layers)
    assert (cost.kv_bytes(3000) > cost.kv_bytes(3000, rereads=False)) == shared
    floor = roofline.decode_step_floor(cost, [3000] * 64)
    unique = roofline.decode_step_floor(cost, [3000] * 64, rereads=False)
    assert floor.bytes - unique.bytes == 64 * (cost.kv_bytes(3000) - cost.kv_bytes(3000, rereads=False))
