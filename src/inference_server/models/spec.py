"""Typed model description parsed once from a Hugging Face ``config.json`` dict.

Everything the forward passes, the KV cache and the loaders need to know about a checkpoint is resolved
here into per-layer descriptors (``LayerSpec``), so model code never re-derives geometry from raw config
keys. Both spellings that transformers writes are accepted (``global_head_dim`` / ``per_layer_config``,
``num_experts`` / ``num_local_experts``), and Gemma 3 text configs are expressed as Gemma 4 with the few
switches the reference spec lists (norm offset and rsqrt, attention scale, no value norm).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs

from inference_server.core.kv_layout import CacheLayerSpec

SLIDING = "sliding_attention"
FULL = "full_attention"

Architecture = Literal["gemma4", "gemma3", "qwen3_moe"]
NormStyle = Literal["gemma4", "gemma3", "qwen"]
KVMode = Literal["own", "store", "reuse"]


class ModelConfigError(ValueError):
    """A config.json that cannot describe a supported model."""


@attrs.frozen
class RopeSpec:
    """Rotary embedding of one layer type.

    ``rotated_pairs`` frequency pairs are real (proportional RoPE keeps only ``partial_factor`` of them, with
    the exponent still using the full head dim); the rest have frequency 0, so cos=1 and sin=0.
    """

    theta: float
    head_dim: int
    partial_factor: float = 1.0
    linear_factor: float = 1.0

    @property
    def rotated_pairs(self) -> int:
        return int(self.partial_factor * self.head_dim // 2)


@attrs.frozen
class LayerSpec:
    """Geometry of one decoder layer.

    ``kv_slot`` is the KV-cache layer this layer reads; for ``kv_mode == "reuse"`` it is the slot of the
    last non-shared layer of the same type, and the layer computes no K/V of its own.
    """

    index: int
    layer_type: str
    head_dim: int
    num_kv_heads: int
    has_v_proj: bool
    kv_mode: KVMode
    kv_slot: int
    intermediate_size: int
    window: int | None
    rope: RopeSpec
    is_moe: bool

    @property
    def computes_kv(self) -> bool:
        return self.kv_mode != "reuse"


@attrs.frozen
class ModelSpec:
    """A model as the engine computes it. ``layers[i]`` describes decoder layer i."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    layers: tuple[LayerSpec, ...]
    cache_layers: tuple[CacheLayerSpec, ...]
    rms_norm_eps: float
    norm_style: NormStyle
    attention_scale: float | None  # None: each layer uses head_dim ** -0.5
    value_norm: bool
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    embed_scale: float | None
    hidden_activation: str
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    ple_hidden_size: int = 0
    ple_vocab_size: int = 0
    num_experts: int = 0
    experts_top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K+V bytes per token over all cache layers when no sliding window has been exceeded."""
        return sum(c.bytes_per_token(dtype_bytes) for c in self.cache_layers)


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def _require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ModelConfigError(f"config.json is missing required key {key!r}")
    return cfg[key]


def _eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config: multimodal wrappers (``text_config``) are unwrapped."""
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        inner = dict(cfg["text_config"])
        for key in ("eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
            if key not in inner and key in cfg:
                inner[key] = cfg[key]
        return inner
    return cfg


def parse_model_spec(raw: dict[str, Any]) -> ModelSpec:
    """Parse a Hugging Face config dict (Gemma 4, Gemma 3 text or Qwen3-MoE) into a ``ModelSpec``."""
    cfg = text_config(raw)
    model_type = cfg.get("model_type", raw.get("model_type"))
    if model_type in ("gemma4", "gemma4_text"):
        return _parse_gemma(cfg, "gemma4")
    if model_type in ("gemma3", "gemma3_text"):
        return _parse_gemma(cfg, "gemma3")
    if model_type == "qwen3_moe":
        return _parse_qwen3_moe(cfg)
    raise ModelConfigError(
        f"unsupported model_type {model_type!r}; supported: gemma4, gemma4_text, gemma3_text, qwen3_moe"
    )


def _gemma_layer_types(cfg: dict[str, Any], arch: Architecture, num_layers: int) -> list[str]:
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        pattern = int(_get(cfg, "sliding_window_pattern", 6))
        layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ModelConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    if arch == "gemma4":
        layer_types[-1] = FULL  # transformers forces the last Gemma 4 layer to full attention
    return layer_types


def _per_layer_overrides(cfg: dict[str, Any], layer_types: list[str], arch: Architecture) -> list[dict]:
    """Per-layer head_dim / num_key_value_heads overrides from either config spelling."""
    overrides: list[dict[str, Any]] = [{} for _ in layer_types]
    if arch != "gemma4":
        return overrides
    per_layer = cfg.get("per_layer_config")
    if per_layer:
        for key, value in per_layer.items():
            if key in (SLIDING, FULL):
                for i, t in enumerate(layer_types):
                    if t == key:
                        overrides[i].update(value)
            else:
                overrides[int(key)].update(value)
        return overrides
    global_head_dim = int(_get(cfg, "global_head_dim", 512))
    global_kv = cfg.get("num_global_key_value_heads")
    for i, t in enumerate(layer_types):
        if t == FULL:
            overrides[i]["head_dim"] = global_head_dim
            if cfg.get("attention_k_eq_v") and global_kv is not None:
                overrides[i]["num_key_value_heads"] = int(global_kv)
    return overrides


def _gemma_rope(cfg: dict[str, Any], arch: Architecture, layer_type: str, head_dim: int) -> RopeSpec:
    params = cfg.get("rope_parameters") or {}
    if layer_type in params:
        params = params[layer_type] or {}
    elif arch == "gemma3" and not params:
        # Old-style Gemma 3 keys: rope_theta (global) and rope_local_base_freq (sliding).
        if layer_type == SLIDING:
            params = {"rope_type": "default", "rope_theta": _get(cfg, "rope_local_base_freq", 10_000.0)}
        else:
            params = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
            params["rope_theta"] = _get(cfg, "rope_theta", 1_000_000.0)
    elif arch == "gemma4" and not params:
        params = (
            {"rope_type": "default", "rope_theta": 10_000.0}
            if layer_type == SLIDING
            else {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}
        )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "proportional", "linear"):
        raise ModelConfigError(f"unsupported rope_type {rope_type!r} for {layer_type}")
    partial = float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    factor = float(params.get("factor", 1.0)) if rope_type in ("linear", "proportional") else 1.0
    return RopeSpec(theta=float(params["rope_theta"]), head_dim=head_dim, partial_factor=partial,
                    linear_factor=factor)


def _parse_gemma(cfg: dict[str, Any], arch: Architecture) -> ModelSpec:
    num_layers = int(_require(cfg, "num_hidden_layers"))
    hidden = int(_require(cfg, "hidden_size"))
    num_heads = int(_require(cfg, "num_attention_heads"))
    num_kv = int(_require(cfg, "num_key_value_heads"))
    head_dim = int(_get(cfg, "head_dim", 256))
    intermediate = int(_require(cfg, "intermediate_size"))
    window = cfg.get("sliding_window")
    layer_types = _gemma_layer_types(cfg, arch, num_layers)
    overrides = _per_layer_overrides(cfg, layer_types, arch)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False)) and arch == "gemma4"
    num_shared = int(_get(cfg, "num_kv_shared_layers", 0)) if arch == "gemma4" else 0
    first_shared = num_layers - num_shared
    double_wide = bool(cfg.get("use_double_wide_mlp", False))
    enable_moe = bool(cfg.get("enable_moe_block", False)) and arch == "gemma4"

    # The producer of each layer type is its last layer before the first KV-shared layer.
    producers = {t: max((i for i in range(first_shared) if layer_types[i] == t), default=None)
                 for t in set(layer_types)}
    layers: list[LayerSpec] = []
    cache_layers: list[CacheLayerSpec] = []
    slot_of_layer: dict[int, int] = {}
    for i, t in enumerate(layer_types):
        d = int(overrides[i].get("head_dim", head_dim))
        kv = int(overrides[i].get("num_key_value_heads", num_kv))
        layer_window = int(window) if (t == SLIDING and window is not None) else None
        if i >= first_shared:
            producer = producers.get(t)
            if producer is None:
                raise ModelConfigError(f"KV-shared layer {i} ({t}) has no producer layer of its type")
            mode: KVMode = "reuse"
            slot = slot_of_layer[producer]
            producer_spec = layers[producer]
            d, kv = producer_spec.head_dim, producer_spec.num_kv_heads
        else:
            mode = "store" if (num_shared and producers.get(t) == i) else "own"
            slot = len(cache_layers)
            slot_of_layer[i] = slot
            cache_layers.append(CacheLayerSpec(num_kv_heads=kv, head_dim=d, window=layer_window))
        wide = double_wide and mode == "reuse"
        layers.append(LayerSpec(
            index=i, layer_type=t, head_dim=d, num_kv_heads=kv,
            has_v_proj=not (k_eq_v and t == FULL), kv_mode=mode, kv_slot=slot,
            intermediate_size=intermediate * (2 if wide else 1), window=layer_window,
            rope=_gemma_rope(cfg, arch, t, d), is_moe=enable_moe,
        ))

    num_experts = int(_get(cfg, "num_experts", _get(cfg, "num_local_experts", 0))) if enable_moe else 0
    if arch == "gemma3":
        attention_scale: float | None = float(_get(cfg, "query_pre_attn_scalar", head_dim)) ** -0.5
    else:
        attention_scale = 1.0
    return ModelSpec(
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_attention_heads=num_heads,
        layers=tuple(layers),
        cache_layers=tuple(cache_layers),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        norm_style="gemma4" if arch == "gemma4" else "gemma3",
        attention_scale=attention_scale,
        value_norm=arch == "gemma4",
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping") if arch == "gemma3" else None,
        embed_scale=math.sqrt(hidden),
        hidden_activation=str(_get(cfg, "hidden_activation", "gelu_pytorch_tanh")),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", True)),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 131072)),
        eos_token_ids=_eos_ids(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        ple_hidden_size=int(_get(cfg, "hidden_size_per_layer_input", 0)) if arch == "gemma4" else 0,
        ple_vocab_size=int(_get(cfg, "vocab_size_per_layer_input", 0)) if arch == "gemma4" else 0,
        num_experts=num_experts,
        experts_top_k=int(_get(cfg, "top_k_experts", 0)) if enable_moe else 0,
        moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", 0)) if enable_moe else 0,
    )


def _parse_qwen3_moe(cfg: dict[str, Any]) -> ModelSpec:
    num_layers = int(_require(cfg, "num_hidden_layers"))
    hidden = int(_require(cfg, "hidden_size"))
    num_heads = int(_require(cfg, "num_attention_heads"))
    num_kv = int(_require(cfg, "num_key_value_heads"))
    head_dim = int(_get(cfg, "head_dim", hidden // num_heads))
    num_experts = int(_get(cfg, "num_experts", _get(cfg, "num_local_experts", 0)))
    sparse_step = int(_get(cfg, "decoder_sparse_step", 1))
    mlp_only = set(_get(cfg, "mlp_only_layers", []))
    rope_params = cfg.get("rope_parameters") or {}
    theta = float(rope_params.get("rope_theta", _get(cfg, "rope_theta", 1_000_000.0)))
    if rope_params.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise ModelConfigError("Qwen3-MoE with rope scaling (e.g. YaRN) is not supported yet")
    if cfg.get("use_sliding_window"):
        raise ModelConfigError("Qwen3-MoE with use_sliding_window=true is not supported")
    rope = RopeSpec(theta=theta, head_dim=head_dim)
    layers = []
    for i in range(num_layers):
        is_moe = i not in mlp_only and num_experts > 0 and (i + 1) % sparse_step == 0
        layers.append(LayerSpec(
            index=i, layer_type=FULL, head_dim=head_dim, num_kv_heads=num_kv, has_v_proj=True,
            kv_mode="own", kv_slot=i, intermediate_size=int(_get(cfg, "intermediate_size", 0)),
            window=None, rope=rope, is_moe=is_moe,
        ))
    return ModelSpec(
        architecture="qwen3_moe",
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_attention_heads=num_heads,
        layers=tuple(layers),
        cache_layers=tuple(CacheLayerSpec(num_kv_heads=num_kv, head_dim=head_dim, window=None)
                           for _ in range(num_layers)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        norm_style="qwen",
        attention_scale=None,
        value_norm=False,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        embed_scale=None,
        hidden_activation=str(_get(cfg, "hidden_act", "silu")),
        tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=int(_get(cfg, "max_position_embeddings", 40960)),
        eos_token_ids=_eos_ids(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        num_experts=num_experts,
        experts_top_k=int(_get(cfg, "num_experts_per_tok", 8)),
        moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", 0)),
        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", False)),
    )
