"""Read a GGUF checkpoint as a Hugging Face config dict plus HF-named, dequantised torch tensors.

Contract: for a supported architecture, ``open_gguf(path).config`` equals (key by key) what
``transformers.AutoConfig.from_pretrained(dir, gguf_file=name).to_dict()`` holds for the model-describing
keys, and ``iter_tensors(dtype)`` yields exactly the values of
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint(path, return_tensors=True, ...)["tensors"]``
under the same names, including transformers' conversions:

* Gemma 2/3 GGUF norms hold ``1 + w`` (llama.cpp adds 1 when converting); every ``*norm.weight`` gets 1
  subtracted, in float32, before the cast to ``dtype``.
* No q/k row permutation is undone for ``gemma3`` or ``qwen3moe``: llama.cpp only permutes ``llama``-arch
  files, and transformers only un-permutes those.
* Qwen3-MoE experts stored per projection (``ffn_gate_exps`` ``[E, I, H]``, ``ffn_up_exps``,
  ``ffn_down_exps`` ``[E, H, I]``) become ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and
  ``mlp.experts.down_proj [E, H, I]``.
* A tied model (no ``output.weight`` in the file) yields no ``lm_head.weight``.

Where transformers' legacy GGUF reader ignores metadata the file does state, we read it (documented per
field in the config builders): Gemma 3 ``rope.scaling.*`` (4B and larger) and Qwen3-MoE
``expert_feed_forward_length``. For the embedded Gemma 3 270M file the result is identical to transformers.

Names are derived from the ``gguf`` package's own tensor-name maps (``gguf.get_tensor_name_map``) applied
to the HF parameter names of each architecture, exactly as transformers derives them.

Memory: tensors are dequantised one at a time, in row chunks, straight into a tensor of the target dtype,
so the peak beyond the result is one chunk of float32 scratch (``_CHUNK_ELEMENTS``).
Header: read by ``gguf_header.read_gguf_header`` (``gguf.GGUFReader``'s fields and tensor views, without
materialising the vocabulary's string arrays, which ``GGUFReader`` takes tens of seconds over on a busy 2-core
machine); tensor data stays in the file's memory map until dequantised.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import torch

from inference_server.models.loading import gguf_index
from inference_server.models.loading.gguf_header import GGUFHeader, read_gguf_header
from inference_server.startup import phase

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GGUFCheckpoint",
    "GGUFLoadError",
    "load_gguf",
    "open_gguf",
    "read_gguf_config",
]

_CHUNK_ELEMENTS = 1 << 22  # float32 scratch per dequantisation step: 16 MiB
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
class _Metadata:
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


def _gemma3_config(meta: _Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
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


def _gemma3_global_rope(meta: _Metadata) -> dict[str, Any]:
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


def _qwen3moe_config(meta: _Metadata, tensor_names: frozenset[str]) -> dict[str, Any]:
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
class _FusedParameter:
    """An HF parameter built by concatenating GGUF tensors along ``dim``, in ``parts`` order.

    ``parts`` are HF-style names the gguf name map knows (``...experts.gate_proj``); ``{bid}`` is the layer.
    """

    hf_template: str
    parts: tuple[str, ...]
    dim: int


@attrs.frozen
class _ArchSpec:
    """Everything architecture-specific: the gguf arch, the config builder, and the HF parameter names.

    ``global_parameters``/``layer_parameters`` are HF state-dict names (``{bid}`` = layer index) whose GGUF
    names come from ``gguf.get_tensor_name_map``; ``lm_head.weight`` is added when the file is untied.
    """

    gguf_arch: gguf.MODEL_ARCH
    build_config: Callable[[_Metadata, frozenset[str]], dict[str, Any]]
    global_parameters: tuple[str, ...]
    layer_parameters: tuple[str, ...]
    fused_layer_parameters: tuple[_FusedParameter, ...] = ()
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


_GEMMA3 = _ArchSpec(
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

_QWEN3MOE = _ArchSpec(
    gguf_arch=gguf.MODEL_ARCH.QWEN3MOE,
    build_config=_qwen3moe_config,
    global_parameters=("model.embed_tokens.weight", "model.norm.weight"),
    layer_parameters=(
        *_layer_weights(*_ATTENTION_BLOCK, "mlp.gate"),
        "model.layers.{bid}.mlp.experts.down_proj",
    ),
    fused_layer_parameters=(
        _FusedParameter(
            hf_template="model.layers.{bid}.mlp.experts.gate_up_proj",
            parts=("model.layers.{bid}.mlp.experts.gate_proj", "model.layers.{bid}.mlp.experts.up_proj"),
            dim=1,
        ),
    ),
)

# gguf `general.architecture` -> spec. Gemma 4 would go here: its HF names (PLE, fused experts, router
# scales) and a config builder covering layer types, KV sharing and the two head dims.
_ARCHITECTURES: dict[str, _ArchSpec] = {"gemma3": _GEMMA3, "qwen3moe": _QWEN3MOE}
SUPPORTED_ARCHITECTURES = frozenset(_ARCHITECTURES)


# ---------------------------------------------------------------------------------------- the plan


@attrs.frozen
class _Placement:
    """Where one GGUF tensor goes: HF parameter ``hf_name``, at ``offset`` along ``dim`` (0/0 if whole)."""

    hf_name: str
    offset: int = 0
    dim: int = 0


@attrs.frozen
class _Target:
    """One HF parameter: its shape and how many GGUF tensors fill it."""

    shape: tuple[int, ...]
    part_count: int


def _hf_to_gguf_name(name_map: gguf.TensorNameMap, hf_name: str) -> str:
    """``model.layers.3.mlp.gate_proj.weight`` -> ``blk.3.ffn_gate.weight`` via the gguf package's map.

    HF parameters without a ``.weight`` suffix (fused experts) map to GGUF ``.weight`` tensors as well.
    """
    gguf_base = name_map.get_name(hf_name.removesuffix(".weight"))
    if gguf_base is None:
        raise RuntimeError(f"gguf's tensor-name map has no entry for HF parameter {hf_name!r}")
    return gguf_base + ".weight"


def _logical_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """The tensor's shape in torch order (GGUF lists dimensions fastest-first)."""
    return tuple(int(d) for d in reversed(list(tensor.shape)))


def _build_plan(
    spec: _ArchSpec, config: dict[str, Any], tensors: Mapping[str, gguf.ReaderTensor], path: Path
) -> tuple[dict[str, _Placement], dict[str, _Target]]:
    """Map every GGUF tensor to its HF parameter and check that nothing is missing or left over."""
    num_layers = int(config["num_hidden_layers"])
    name_map = gguf.get_tensor_name_map(spec.gguf_arch, num_layers)
    placements: dict[str, _Placement] = {}
    globals_ = [*spec.global_parameters, *(["lm_head.weight"] if not config["tie_word_embeddings"] else [])]
    layer_names = [t.format(bid=bid) for bid in range(num_layers) for t in spec.layer_parameters]
    for hf_name in (*globals_, *layer_names):
        placements[_hf_to_gguf_name(name_map, hf_name)] = _Placement(hf_name)
    fused_targets = _place_fused_parameters(spec, num_layers, name_map, tensors, placements, path)
    _check_tensor_sets(placements, tensors, path)
    targets = {
        placement.hf_name: _Target(_logical_shape(tensors[gguf_name]), part_count=1)
        for gguf_name, placement in placements.items()
        if placement.hf_name not in fused_targets
    }
    return placements, targets | fused_targets


def _place_fused_parameters(
    spec: _ArchSpec,
    num_layers: int,
    name_map: gguf.TensorNameMap,
    tensors: Mapping[str, gguf.ReaderTensor],
    placements: dict[str, _Placement],
    path: Path,
) -> dict[str, _Target]:
    """Add placements for the parts of fused parameters; return the fused targets' shapes."""
    targets: dict[str, _Target] = {}
    for fused in spec.fused_layer_parameters:
        for bid in range(num_layers):
            hf_name = fused.hf_template.format(bid=bid)
            gguf_names = [_hf_to_gguf_name(name_map, part.format(bid=bid)) for part in fused.parts]
            missing = [name for name in gguf_names if name not in tensors]
            if missing:
                raise GGUFLoadError(path, f"tensors {missing} (for {hf_name}) are missing")
            shapes = [_logical_shape(tensors[name]) for name in gguf_names]
            targets[hf_name] = _Target(_concatenated_shape(shapes, fused.dim, hf_name, path), len(shapes))
            offset = 0
            for name, shape in zip(gguf_names, shapes, strict=True):
                placements[name] = _Placement(hf_name, offset, fused.dim)
                offset += shape[fused.dim]
    return targets


def _concatenated_shape(shapes: list[tuple[int, ...]], dim: int, hf_name: str, path: Path) -> tuple[int, ...]:
    """The shape of ``cat(parts, dim)``; the parts must agree on every other dimension."""
    others = {shape[:dim] + shape[dim + 1 :] for shape in shapes}
    if len(others) != 1:
        raise GGUFLoadError(path, f"the parts of {hf_name} have incompatible shapes {shapes}")
    first = shapes[0]
    return (*first[:dim], sum(shape[dim] for shape in shapes), *first[dim + 1 :])


def _check_tensor_sets(placements: Mapping[str, _Placement], tensors: Mapping[str, Any], path: Path) -> None:
    """Every expected tensor is in the file and every tensor in the file is expected."""
    missing = sorted(set(placements) - set(tensors))
    unexpected = sorted(set(tensors) - set(placements))
    if missing:
        raise GGUFLoadError(path, f"{len(missing)} expected tensors are missing, e.g. {missing[:5]}")
    if unexpected:
        raise GGUFLoadError(path, f"{len(unexpected)} tensors have no known mapping, e.g. {unexpected[:5]}")


# ------------------------------------------------------------------------------------ dequantisation


def _writable(values: np.ndarray) -> np.ndarray:
    """A writable array (torch.from_numpy warns on the read-only memory map views F32 tensors give)."""
    return values if values.flags.writeable else values.copy()


def _dequantize_into(tensor: gguf.ReaderTensor, target: torch.Tensor, transform: TensorTransform) -> None:
    """Dequantise ``tensor`` to float32 in chunks of leading-dimension slices, transform, cast into
    ``target`` (same logical shape). Chunking changes nothing: dequantisation is block-local."""
    data = tensor.data
    rows = data.shape[0]
    per_row = math.prod(target.shape[1:])
    step = max(1, _CHUNK_ELEMENTS // max(1, per_row))
    for start in range(0, rows, step):
        values = gguf.quants.dequantize(data[start : start + step], tensor.tensor_type)
        values = transform(tensor.name, values.astype(np.float32, copy=False))
        target[start : start + step].copy_(torch.from_numpy(_writable(values)))


# -------------------------------------------------------------------------------------- public API


class GGUFCheckpoint:
    """An opened GGUF file: its architecture, HF config dict and a tensor iterator.

    Holds the file's read-only memory map until garbage collected.
    """

    def __init__(self, path: Path, architecture: str, config: dict[str, Any], tensors: Mapping[str, Any]) -> None:
        """``tensors``: GGUF name -> ``gguf.ReaderTensor`` or ``gguf_index.IndexedTensor`` (same fields)."""
        self.path = path
        self.architecture = architecture
        self._spec = _ARCHITECTURES[architecture]
        self._tensors = dict(tensors)
        self.config: dict[str, Any] = config
        self._placements, self._targets = _build_plan(self._spec, self.config, self._tensors, path)

    @classmethod
    def from_header(cls, path: Path, header: GGUFHeader) -> GGUFCheckpoint:
        """Parse the metadata of a read header (``gguf_header.read_gguf_header``) into the HF config."""
        architecture, spec = _architecture(path, header.metadata)
        meta = _Metadata(path, architecture, header.metadata, header.array_lengths)
        return cls(path, architecture, spec.build_config(meta, frozenset(header.tensors)), header.tensors)

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """HF names of every tensor ``iter_tensors`` yields (order not guaranteed to match)."""
        return tuple(self._targets)

    def parameter_shape(self, hf_name: str) -> tuple[int, ...]:
        """The torch shape of HF parameter ``hf_name``."""
        return self._targets[hf_name].shape

    def quantization_types(self) -> dict[str, str]:
        """GGUF tensor name -> its storage type (``Q4_K``, ``F32``, ...); for logs and reports."""
        return {name: tensor.tensor_type.name for name, tensor in self._tensors.items()}

    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every parameter, dequantised to ``dtype`` on the CPU, one at a time.

        A fused parameter is yielded once all its parts are filled. Raises ``GGUFLoadError`` if a tensor
        uses a quantisation type the gguf package cannot dequantise.
        """
        pending: dict[str, tuple[torch.Tensor, int]] = {}  # fused parameters still missing parts
        for gguf_name, reader_tensor in self._tensors.items():
            placement = self._placements[gguf_name]
            parts = self._targets[placement.hf_name].part_count
            started = pending.pop(placement.hf_name, None)
            target, filled = started or (self._allocate(placement.hf_name, dtype), 0)
            self._dequantize(reader_tensor, _destination(target, placement, reader_tensor, parts))
            if filled + 1 < parts:
                pending[placement.hf_name] = (target, filled + 1)
            else:
                yield placement.hf_name, target

    def load_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """All parameters as a dict (``iter_tensors`` collected)."""
        return dict(self.iter_tensors(dtype))

    def _allocate(self, hf_name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self._targets[hf_name].shape, dtype=dtype)

    def _dequantize(self, reader_tensor: gguf.ReaderTensor, destination: torch.Tensor) -> None:
        try:
            _dequantize_into(reader_tensor, destination, self._spec.transform)
        except NotImplementedError as error:
            raise GGUFLoadError(self.path, f"tensor {reader_tensor.name}: {error}") from error


def _destination(
    target: torch.Tensor, placement: _Placement, reader_tensor: gguf.ReaderTensor, parts: int
) -> torch.Tensor:
    """The view of ``target`` that ``reader_tensor`` fills: all of it, or its slice of a fused parameter."""
    if parts == 1:
        return target
    size = _logical_shape(reader_tensor)[placement.dim]
    return target.narrow(placement.dim, placement.offset, size)


def _architecture(path: Path, metadata: Mapping[str, Any]) -> tuple[str, _ArchSpec]:
    architecture = metadata.get("general.architecture")
    if architecture is None:
        raise GGUFLoadError(path, "metadata key 'general.architecture' is missing")
    spec = _ARCHITECTURES.get(str(architecture))
    if spec is None:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise GGUFLoadError(path, f"architecture {architecture!r} is not supported (supported: {supported})")
    return str(architecture), spec


def _read_header(path: Path) -> GGUFHeader:
    """``read_gguf_header(path)`` with every failure turned into a ``GGUFLoadError`` naming the file."""
    if not path.exists():
        raise GGUFLoadError(path, "no such file")
    if not path.is_file():
        raise GGUFLoadError(path, "not a regular file")
    try:
        return read_gguf_header(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as error:
        raise GGUFLoadError(path, f"not a valid GGUF file ({type(error).__name__}: {error})") from error


def open_gguf(path: str | Path, cache_dir: str | Path | None = None) -> GGUFCheckpoint:
    """Parse ``path`` (metadata and tensor table; no tensor data is read) and check it is loadable.

    With ``cache_dir``, the parsed header is kept in an index there (``gguf_index``) and later opens of the
    unchanged file read the index instead of parsing the whole header again. Raises ``GGUFLoadError`` for a
    missing/corrupt file, an unsupported architecture, missing metadata, or a tensor set that does not match
    the architecture.
    """
    resolved = Path(path)
    index = None
    if cache_dir is not None and resolved.is_file():
        index = gguf_index.index_path(resolved, Path(cache_dir))
        cached = gguf_index.read_index(index, resolved)
        if cached is not None and cached[0] in _ARCHITECTURES:
            return GGUFCheckpoint(resolved, *cached)
    with phase("reading the GGUF header (first start only: indexed for later starts)"):
        checkpoint = GGUFCheckpoint.from_header(resolved, _read_header(resolved))
    if index is not None:
        with contextlib.suppress(OSError, TypeError, ValueError):  # no index only costs the speed-up
            gguf_index.write_index(index, checkpoint.architecture, checkpoint.config, checkpoint._tensors)
    return checkpoint


def read_gguf_config(path: str | Path) -> dict[str, Any]:
    """The HF config dict of a GGUF file (see ``open_gguf``)."""
    return open_gguf(path).config


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config, state_dict)`` of a GGUF file, every tensor dequantised to ``dtype``."""
    checkpoint = open_gguf(path)
    return checkpoint.config, checkpoint.load_state_dict(dtype)
