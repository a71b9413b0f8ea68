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
field in the config builders of ``gguf_architectures``): Gemma 3 ``rope.scaling.*`` (4B and larger) and Qwen3-MoE
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

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import torch

from inference_server.models.loading.gguf_architectures import (
    ARCHITECTURES,
    SUPPORTEDARCHITECTURES,
    ArchSpec,
    GGUFLoadError,
    Metadata,
    TensorTransform,
)
from inference_server.models.loading.gguf_header import GGUFHeader, read_gguf_header
from inference_server.startup import phase

__all__ = [
    "SUPPORTEDARCHITECTURES",
    "GGUFCheckpoint",
    "GGUFLoadError",
    "open_gguf",
]

_CHUNK_ELEMENTS = 1 << 22  # float32 scratch per dequantisation step: 16 MiB


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
    spec: ArchSpec, config: dict[str, Any], tensors: Mapping[str, gguf.ReaderTensor], path: Path
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
    spec: ArchSpec,
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
        """``tensors``: GGUF name -> ``gguf.ReaderTensor`` or ``gguf_header.GGUFTensor`` (same fields)."""
        self.path = path
        self.architecture = architecture
        self._spec = ARCHITECTURES[architecture]
        self._tensors = dict(tensors)
        self.config: dict[str, Any] = config
        self._placements, self._targets = _build_plan(self._spec, self.config, self._tensors, path)

    @classmethod
    def from_header(cls, path: Path, header: GGUFHeader) -> GGUFCheckpoint:
        """Parse the metadata of a read header (``gguf_header.read_gguf_header``) into the HF config."""
        architecture, spec = _architecture(path, header.metadata)
        meta = Metadata(path, architecture, header.metadata, header.array_lengths)
        return cls(path, architecture, spec.build_config(meta, frozenset(header.tensors)), header.tensors)

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """HF names of every tensor ``iter_tensors`` yields (order not guaranteed to match)."""
        return tuple(self._targets)

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


def _architecture(path: Path, metadata: Mapping[str, Any]) -> tuple[str, ArchSpec]:
    architecture = metadata.get("general.architecture")
    if architecture is None:
        raise GGUFLoadError(path, "metadata key 'general.architecture' is missing")
    spec = ARCHITECTURES.get(str(architecture))
    if spec is None:
        supported = ", ".join(sorted(SUPPORTEDARCHITECTURES))
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


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Parse ``path`` (metadata and tensor table; no tensor data is read) and check it is loadable.

    Raises ``GGUFLoadError`` for a missing/corrupt file, an unsupported architecture, missing metadata, or a
    tensor set that does not match the architecture.
    """
    resolved = Path(path)
    with phase("reading the GGUF header"):
        return GGUFCheckpoint.from_header(resolved, _read_header(resolved))
