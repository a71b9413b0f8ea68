"""What each GGUF architecture the loader supports is: the HF config its metadata gives, its HF parameter
names, and the transform its tensors need.

The config builders return, key by key, what ``transformers.AutoConfig`` builds from the same file for the
model-describing keys, except where transformers' legacy GGUF reader ignores metadata the file does state
(documented per builder). A new architecture is one more ``ArchSpec`` in ``ARCHITECTURES``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

__all__ = ["ARCHITECTURES", "SUPPORTEDARCHITECTURES", "ArchSpec", "FusedParameter", "GGUFLoadError", "Metadata",
           "TensorTransform"]

_MISSING = object()

class GGUFLoadError(Exception):
    """A GGUF file is missing, unreadable, corrupt, or describes something this loader cannot load.

    ``path`` names the file; the message always includes it.
    """

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"cannot load GGUF file {self.path}: {reason}")



# --------------------------------------------------------------------------------------------- metadata


@attrs.frozen
class Metadata:
    """Typed access to a header's key/value fields; a missing required key is a ``GGUFLoadError``."""

    path: Path
    architecture: str
    values: Mapping[str, Any]  # every field but string arrays (gguf_header.GGUFHeader.metadata)
    array_lengths: Mapping[str, int]  # every array field's element count

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of ``key`` (a Python scalar, str or list); ``default`` if absent, else an error."""
        if key in self.values:
            return self.values[key]
        if key in self.array_lengths:  # a string array: the header reader steps over those
            raise GGUFLoadError(self.path, f"metadata key {key!r} is a string array, which is not read")
        if default is _MISSING:
            raise GGUFLoadError(self.path, f"metadata key {key!r} is missing")
        return default

    def arch(self, name: str, default: Any = _MISSING) -> Any:
        """The value of ``{architecture}.{name}``."""
        return self.get(f"{self.architecture}.{name}", default)

    def array_length(self, key: str) -> int | None:
        """The element count of array field ``key`` without materialising it; None if absent."""
        return self.array_lengths.get(key)

    def special_token_ids(self) -> dict[str, int]:
        """bos/eos/pad/unk ids the tokenizer section states, under their HF config names."""
        keys = {
            "bos_token_id": "bos_token_id",
            "eos_token_id": "eos_token_id",
            "pad_token_id": "padding_token_id",
            "unk_token_id": "unknown_token_id",
        }
        ids = {hf: self.get(f"tokenizer.ggml.{gguf_key}", None) for hf, gguf_key in keys.items()}
        return {hf: int(value) for hf, value in ids.items() if value is not None}

    def vocab_size(self) -> int:
        """``{arch}.vocab_size`` if stated, else the tokenizer's token count (what transformers does)."""
        stated = self.arch("vocab_size", None)
        if stated is not None:
            return int(stated)
        count = self.array_length("tokenizer.ggml.tokens")
        if count is None:
            raise GGUFLoadError(self.path, "neither a vocab_size nor tokenizer.ggml.tokens is present")
        return count


# ------------------------------------------------------------------------------------ config builders


def _gemma3_config(meta: Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
    """The ``Gemma3TextConfig`` dict transformers builds from a ``gemma3`` GGUF.

    Fields a Gemma 3 GGUF does not state take the values transformers (and llama.cpp) assume: sliding
    pattern 5 local : 1 global, local RoPE base 10000, no soft-capping, GELU-tanh.
    """
    num_layers = int(meta.arch("block_count"))
    num_heads = int(meta.arch("attention.head_count"))
    hidden_size = int(meta.arch("embedding_length"))
    config: dict[str, Any] = {
        "model_type": "gemma3_text",
        "vocab_size": meta.vocab_size(),
        "hidden_size": hidden_size,
        "intermediate_size": int(meta.arch("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.arch("attention.head_count_kv")),
        "head_dim": int(meta.arch("attention.key_length")),
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(meta.arch("context_length")),
        "rms_norm_eps": float(meta.arch("attention.layer_norm_rms_epsilon")),
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": _gemma3_global_rope(meta),
        },
        "attention_bias": False,
        "query_pre_attn_scalar": _gemma3_query_pre_attn_scalar(num_layers, hidden_size, num_heads),
        "sliding_window": int(meta.arch("attention.sliding_window")),
        "layer_types": _periodic_layer_types(num_layers, period=6),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }
    config.update(meta.special_token_ids())
    return config


def _gemma3_global_rope(meta: Metadata) -> dict[str, Any]:
    """Full-attention RoPE. Gemma 3 4B+ files state ``rope.scaling.type = linear`` with factor 8, which
    transformers' legacy GGUF reader drops (we keep it); absent for 270M/1B, where this is the default."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.arch("rope.freq_base", 1e6))}
    scaling_type = meta.arch("rope.scaling.type", None)
    if scaling_type not in (None, "none"):
        rope.update(rope_type=scaling_type, factor=float(meta.arch("rope.scaling.factor")))
    return rope


def _gemma3_query_pre_attn_scalar(num_layers: int, hidden_size: int, num_heads: int) -> int:
    """No GGUF key holds it. llama.cpp uses ``hidden/heads`` for the 27B (62 layers) and ``head_dim`` (256
    on every other release) otherwise; transformers uses the class default 256. Both agree on all releases
    except 27B, where transformers' GGUF path would be wrong."""
    return hidden_size // num_heads if num_layers == 62 else 256


def _periodic_layer_types(num_layers: int, period: int) -> list[str]:
    """Every ``period``-th layer (1-based) is full attention, the rest sliding."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(num_layers)]


def _qwen3moe_config(meta: Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
    """The ``Qwen3MoeConfig`` dict transformers builds from a ``qwen3moe`` GGUF.

    ``moe_intermediate_size`` is read from ``expert_feed_forward_length``; transformers' legacy reader
    ignores that key and silently uses the class default 768 (right only for 30B-A3B).
    """
    config: dict[str, Any] = {
        "model_type": "qwen3_moe",
        "vocab_size": meta.vocab_size(),
        "hidden_size": int(meta.arch("embedding_length")),
        "intermediate_size": int(meta.arch("feed_forward_length")),
        "num_hidden_layers": int(meta.arch("block_count")),
        "num_attention_heads": int(meta.arch("attention.head_count")),
        "num_key_value_heads": int(meta.arch("attention.head_count_kv")),
        "head_dim": int(meta.arch("attention.key_length")),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.arch("context_length")),
        "rms_norm_eps": float(meta.arch("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(meta.arch("rope.freq_base"))},
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": int(meta.arch("expert_feed_forward_length")),
        "num_experts_per_tok": int(meta.arch("expert_used_count")),
        "num_local_experts": int(meta.arch("expert_count")),  # what Qwen3MoeConfig.to_dict() calls num_experts
        "norm_topk_prob": True,
        "mlp_only_layers": [],
    }
    config.update(meta.special_token_ids())
    return config


# ------------------------------------------------------------------------------- architecture specs

TensorTransform = Callable[[str, np.ndarray], np.ndarray]


def _no_transform(gguf_name: str, values: np.ndarray) -> np.ndarray:
    return values


def _subtract_one_from_norms(gguf_name: str, values: np.ndarray) -> np.ndarray:
    """Undo llama.cpp's Gemma ``w + 1`` norm storage (float32 in, float32 out), as transformers does."""
    return values - 1 if "norm.weight" in gguf_name else values


@attrs.frozen
class FusedParameter:
    """An HF parameter built by concatenating GGUF tensors along ``dim``, in ``parts`` order.

    ``parts`` are HF-style names the gguf name map knows (``...experts.gate_proj``); ``{bid}`` is the layer.
    """

    hf_template: str
    parts: tuple[str, ...]
    dim: int


@attrs.frozen
class ArchSpec:
    """Everything architecture-specific: the gguf arch, the config builder, and the HF parameter names.

    ``global_parameters``/``layer_parameters`` are HF state-dict names (``{bid}`` = layer index) whose GGUF
    names come from ``gguf.get_tensor_name_map``; ``lm_head.weight`` is added when the file is untied.
    """

    gguf_arch: gguf.MODEL_ARCH
    build_config: Callable[[Metadata, frozenset[str]], dict[str, Any]]
    global_parameters: tuple[str, ...]
    layer_parameters: tuple[str, ...]
    fused_layer_parameters: tuple[FusedParameter, ...] = ()
    transform: TensorTransform = _no_transform


# Per-layer weights both architectures share: the attention block with its q/k norms, and the norms around it.
_ATTENTION_BLOCK = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "post_attention_layernorm",
)


def _layer_weights(*names: str) -> tuple[str, ...]:
    """HF parameter templates ``model.layers.{bid}.<name>.weight`` (``{bid}`` filled per layer later)."""
    return tuple(f"model.layers.{{bid}}.{name}.weight" for name in names)


_GEMMA3 = ArchSpec(
    gguf_arch=gguf.MODEL_ARCH.GEMMA3,
    build_config=_gemma3_config,
    global_parameters=("model.embed_tokens.weight", "model.norm.weight"),
    layer_parameters=_layer_weights(
        *_ATTENTION_BLOCK,
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ),
    transform=_subtract_one_from_norms,
)

_QWEN3MOE = ArchSpec(
    gguf_arch=gguf.MODEL_ARCH.QWEN3MOE,
    build_config=_qwen3moe_config,
    global_parameters=("model.embed_tokens.weight", "model.norm.weight"),
    layer_parameters=(
        *_layer_weights(*_ATTENTION_BLOCK, "mlp.gate"),
        "model.layers.{bid}.mlp.experts.down_proj",
    ),
    fused_layer_parameters=(
        FusedParameter(
            hf_template="model.layers.{bid}.mlp.experts.gate_up_proj",
            parts=("model.layers.{bid}.mlp.experts.gate_proj", "model.layers.{bid}.mlp.experts.up_proj"),
            dim=1,
        ),
    ),
)

# gguf `general.architecture` -> spec. Gemma 4 would go here: its HF names (PLE, fused experts, router
# scales) and a config builder covering layer types, KV sharing and the two head dims.
ARCHITECTURES: dict[str, ArchSpec] = {"gemma3": _GEMMA3, "qwen3moe": _QWEN3MOE}
SUPPORTEDARCHITECTURES = frozenset(ARCHITECTURES)
