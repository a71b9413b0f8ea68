"""Build a model and fill its weights: Hugging Face folders (safetensors), GGUF files, or dummy weights.

Weights are never held twice: the model is created on the ``meta`` device, materialised empty on the target
device, and each checkpoint tensor is copied into its parameter as it is read (Qwen3-MoE per-expert tensors
are copied straight into their slice of the fused expert tensors). With ``quantization="int8"`` the model is
converted to int8 layers while still on ``meta`` (``quantized.quantize_model_int8_``), so only the int8
weights are ever allocated on the device; each float checkpoint tensor is quantized there as it is read
(``QuantizedWeight.copy_``), the peak beyond the int8 model being one float tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.architectures.quantized import QuantizedWeight, logical_tensors, quantize_model_int8_
from inference_server.models.spec import ModelSpec


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not match its config. The message names the file."""


HUB_PREFIXES = ("model.language_model.",)
IGNORED_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.",
                    "model.multi_modal_projector.")
QWEN_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


INT8_EMBEDDINGS = ("auto", "on", "off")
"""Values of the ``INT8_EMBEDDINGS`` setting (``quantize_embeddings``)."""


def quantize_embeddings(device: torch.device | str, mode: str = "auto") -> bool:
    """Whether ``QUANTIZATION=int8`` also quantizes the embeddings and lm_head on ``device`` (``INT8_EMBEDDINGS``:
    ``mode``). ``on`` / ``off`` decide. ``auto``: on the CPU, where the embedded model's tied 262k x 640 table is
    most of every decode step's reads and the measured quality holds (docs/quantization.md); not on GPUs, where
    they stay in the model dtype (the issue's default until measured there)."""
    if mode not in INT8_EMBEDDINGS:
        raise ValueError(f"unknown INT8_EMBEDDINGS mode {mode!r} (accepted: {', '.join(INT8_EMBEDDINGS)})")
    if mode != "auto":
        return mode == "on"
    return torch.device(device).type == "cpu"


def build_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device | str,
                quantization: str = "none", int8_embeddings: str = "auto") -> CausalLM:
    """An uninitialised model on ``device`` (parameters allocated, contents undefined); int8 layers
    (``quantization="int8"``) hold int8 weights and scales in ``dtype``, the embeddings and lm_head too where
    ``quantize_embeddings(device, int8_embeddings)`` says so."""
    from inference_server.models.architectures.gemma4 import Gemma4ForCausalLM
    from inference_server.models.architectures.qwen3_moe import Qwen3MoeForCausalLM

    cls = Qwen3MoeForCausalLM if spec.architecture == "qwen3_moe" else Gemma4ForCausalLM
    with torch.device("meta"):
        model = cls(spec)
        if quantization == "int8":
            quantize_model_int8_(model, embeddings=quantize_embeddings(device, int8_embeddings))
        elif quantization != "none":
            raise ValueError(f"unknown quantization {quantization!r}")
    model = model.to(dtype=dtype)
    # Module.to_empty, less its cost: its empty_like of a meta tensor runs torch._refs' Python reference, whose
    # first call imports sympy and more (6 s on a busy 2-core machine, at every start); empty() of the same shape
    # and dtype allocates the same thing (every parameter and buffer here is contiguous).
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    return model.eval().requires_grad_(False)


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor to fill, under its checkpoint name (int8 weights as ``QuantizedWeight``)."""
    return logical_tensors(model)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights at the real size, created on the model's device (like vLLM's ``load_format=dummy``).

    Matrices get N(0, 1/fan_in) so activations stay in range; norm weights and scalars are near 1. An int8
    weight is drawn in the model dtype exactly as its float weight would be (same order, same stream) and
    quantized, so an int8 dummy model is the quantized float dummy model of the same seed.
    """
    generator_device = next(model.parameters()).device
    gen = torch.Generator(device=generator_device).manual_seed(seed)
    for name, tensor in _named_tensors(model).items():
        if isinstance(tensor, QuantizedWeight):
            drawn = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            tensor.copy_(drawn.normal_(0.0, tensor.shape[-1] ** -0.5, generator=gen))
            del drawn
        elif tensor.dim() >= 2:
            tensor.normal_(0.0, tensor.shape[-1] ** -0.5, generator=gen)
        elif name.endswith("layer_scalar"):
            tensor.fill_(1.0)
        else:
            tensor.uniform_(0.9, 1.1, generator=gen)


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json in the checkpoint folder")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable config ({err})") from err


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: unreadable shard index ({err})") from err
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file}: shard listed in the index is missing")
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, read lazily one at a time."""
    from safetensors import SafetensorError, safe_open

    for file in _safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, shard.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: corrupt or unreadable safetensors file ({err})") from err


def _canonical_name(name: str) -> str | None:
    """The ``*ForCausalLM`` parameter name for a checkpoint key, or None for keys to skip."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    for prefix in HUB_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name


def _is_unused_shared_kv(spec: ModelSpec, name: str) -> bool:
    """Released E2B/E4B files carry k/v weights for KV-shared layers; transformers ignores them."""
    match = re.match(r"^model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.", name)
    return match is not None and not spec.layers[int(match.group(1))].computes_kv


def load_weights(model: nn.Module, spec: ModelSpec, tensors: Iterator[tuple[str, torch.Tensor]],
                 source: str) -> None:
    """Copy checkpoint tensors into the model; every model tensor must be filled exactly once."""
    targets = _named_tensors(model)
    filled: set[str] = set()
    for raw_name, tensor in tensors:
        name = _canonical_name(raw_name)
        if name is None or _is_unused_shared_kv(spec, name):
            continue
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        expert = QWEN_EXPERT.match(name)
        if expert:
            _copy_expert(targets, filled, expert, tensor, source)
            continue
        target = targets.get(name)
        if target is None:
            raise CheckpointError(f"{source}: unexpected tensor {raw_name!r} for {spec.architecture}")
        if tuple(target.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source}: {raw_name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(target.shape)}")
        target.copy_(tensor)
        filled.add(name)
    expected = {n for n in targets if not n.endswith("layer_scalar")} | \
        {n for n in targets if n.endswith("layer_scalar") and n in filled}
    missing = sorted(expected - filled)
    if missing:
        raise CheckpointError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, scalar in targets.items():  # a checkpoint without layer scalars means scalar 1
        if name.endswith("layer_scalar") and name not in filled and isinstance(scalar, torch.Tensor):
            scalar.fill_(1.0)


def _copy_expert(targets: dict[str, torch.Tensor | QuantizedWeight], filled: set[str], match: re.Match[str],
                 tensor: torch.Tensor, source: str) -> None:
    prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
    fused_name = f"{prefix}.down_proj" if kind == "down_proj" else f"{prefix}.gate_up_proj"
    fused = targets.get(fused_name)
    if fused is None:
        raise CheckpointError(f"{source}: per-expert tensor {match.group(0)!r} has no fused target")
    rows = fused.shape[1] // 2
    dest = {"gate_proj": fused[expert, :rows], "up_proj": fused[expert, rows:], "down_proj": fused[expert]}[kind]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{source}: {match.group(0)!r} has shape {tuple(tensor.shape)}, "
                              f"expected {tuple(dest.shape)}")
    dest.copy_(tensor)
    parts = {f"{fused_name}#{expert}#{kind}"}
    filled.update(parts)
    num_experts = fused.shape[0]
    pieces = ("gate_proj", "up_proj") if kind != "down_proj" else ("down_proj",)
    if all(f"{fused_name}#{e}#{p}" in filled for e in range(num_experts) for p in pieces):
        filled.add(fused_name)
