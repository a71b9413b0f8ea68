"""Released model configs (text decoders) for dummy-weight runs, plus a tiny variant of each for tests.

Values are the hub ``config.json`` fields gathered in models.md §3 and §4; ``--dummy-weights`` builds these
at their real size with random weights directly on the target device (vLLM's ``load_format=dummy``).
"""

from __future__ import annotations

from typing import Any

S, F = "sliding_attention", "full_attention"
_GEMMA4_ROPE = {S: {"rope_type": "default", "rope_theta": 10_000.0},
                F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
_GEMMA4_COMMON: dict[str, Any] = dict(
    model_type="gemma4_text", vocab_size=262144, head_dim=256, global_head_dim=512, final_logit_softcapping=30.0,
    rope_parameters=_GEMMA4_ROPE, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, num_kv_shared_layers=0,
    hidden_size_per_layer_input=0, attention_k_eq_v=False, enable_moe_block=False, use_double_wide_mlp=False,
)

PRESETS: dict[str, dict[str, Any]] = {
    "gemma-4-e2b": dict(_GEMMA4_COMMON, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
                        num_attention_heads=8, num_key_value_heads=1, layer_types=([S] * 4 + [F]) * 7,
                        sliding_window=512, num_kv_shared_layers=20, hidden_size_per_layer_input=256,
                        vocab_size_per_layer_input=262144, use_double_wide_mlp=True,
                        max_position_embeddings=131072),
    "gemma-4-e4b": dict(_GEMMA4_COMMON, hidden_size=2560, intermediate_size=10240, num_hidden_layers=42,
                        num_attention_heads=8, num_key_value_heads=2, layer_types=([S] * 5 + [F]) * 7,
                        sliding_window=512, num_kv_shared_layers=18, hidden_size_per_layer_input=256,
                        vocab_size_per_layer_input=262144, max_position_embeddings=131072),
    "gemma-4-26b-a4b": dict(_GEMMA4_COMMON, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                            num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                            layer_types=([S] * 5 + [F]) * 5, sliding_window=1024, attention_k_eq_v=True,
                            enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                            max_position_embeddings=262144),
    "gemma-4-31b": dict(_GEMMA4_COMMON, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                        num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
                        layer_types=([S] * 5 + [F]) * 10, sliding_window=1024, attention_k_eq_v=True,
                        max_position_embeddings=262144),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, hidden_act="silu", bos_token_id=151643,
                          eos_token_id=151645),
}

_TINY_GEMMA = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16,
                   global_head_dim=32, sliding_window=8, max_position_embeddings=1024, vocab_size_per_layer_input=512)
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma-4-e2b": dict(_TINY_GEMMA, num_hidden_layers=5, num_key_value_heads=1, layer_types=[S, S, F, S, F],
                        num_kv_shared_layers=2, hidden_size_per_layer_input=8),
    "gemma-4-e4b": dict(_TINY_GEMMA, num_hidden_layers=6, num_key_value_heads=2, layer_types=[S, S, F, S, S, F],
                        num_kv_shared_layers=2, hidden_size_per_layer_input=8),
    "gemma-4-26b-a4b": dict(_TINY_GEMMA, num_hidden_layers=6, num_key_value_heads=2, num_global_key_value_heads=1,
                            layer_types=[S] * 5 + [F], num_experts=8, top_k_experts=2, moe_intermediate_size=24),
    "gemma-4-31b": dict(_TINY_GEMMA, num_hidden_layers=6, num_key_value_heads=2, num_global_key_value_heads=1,
                        layer_types=[S] * 5 + [F]),
    "qwen3-30b-a3b": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=24, max_position_embeddings=1024,
                          eos_token_id=1, bos_token_id=2),
}


def preset_names() -> list[str]:
    """Every accepted preset name: the released configs and their ``-tiny`` variants."""
    return sorted(PRESETS) + sorted(f"{name}-tiny" for name in PRESETS)


def preset_config(name: str) -> dict[str, Any]:
    """The HF-style config dict of a preset (``<name>`` or ``<name>-tiny``)."""
    base = name.removesuffix("-tiny")
    if base not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")
    config = dict(PRESETS[base])
    if name.endswith("-tiny"):
        config.update(TINY_OVERRIDES[base])
    return config
