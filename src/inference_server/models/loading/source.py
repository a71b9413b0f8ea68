"""Turn the ``MODEL`` setting into a loaded model, its spec and its tokenizer.

``MODEL`` may be empty (the embedded Gemma 3 270M GGUF), a ``.gguf`` file, a Hugging Face checkpoint
folder, or a preset name (``gemma-4-31b``, ``qwen3-30b-a3b-tiny``, ...) with ``DUMMY_WEIGHTS=true``. Dummy
weights work for a folder too (its config.json at real size). A preset has no tokenizer: such an engine
takes token-id prompts only.
"""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import torch

from inference_server.config import Settings, SettingsError
from inference_server.models.architectures.causal_lm import CausalLM
from inference_server.models.chat_templates import GEMMA_TURNS, read_chat_template
from inference_server.models.loading import weight_cache
from inference_server.models.loading.loader import (
    build_model,
    init_dummy_weights,
    iter_safetensors,
    load_weights,
    read_config,
)
from inference_server.models.loading.presets import preset_config, preset_names
from inference_server.models.spec import ModelSpec, parse_model_spec
from inference_server.models.tokenizer import Tokenizer
from inference_server.runtime import resolve_quantization
from inference_server.startup import phase


@attrs.frozen
class LoadedModel:
    model: CausalLM
    spec: ModelSpec
    tokenizer: Tokenizer | None
    name: str  # the name /v1/models reports
    load_seconds: float
    root: str = ""  # where the model came from (/v1/models' "root"): the checkpoint folder, .gguf or preset


def _served_name(settings: Settings, default: str) -> str:
    names = settings.served_model_names()
    return names[0] if names else default


def load_tokenizer(settings: Settings) -> Tokenizer | None:
    """The tokenizer ``settings.model`` serves, with the chat template it serves (``CHAT_TEMPLATE``, else the
    model's own, else Gemma's turns for the embedded model), without loading any weights; None for a preset
    or a folder without tokenizer files."""
    source, cache_dir = settings.model, settings.resolved_cache_dir()
    template = read_chat_template(settings.chat_template) if settings.chat_template else None
    if not source:
        from inference_server.models.loading.embedded import embedded_gguf_path

        return Tokenizer.from_gguf(embedded_gguf_path(), cache_dir=cache_dir, chat_template=template or GEMMA_TURNS)
    if source.endswith(".gguf"):
        return Tokenizer.from_gguf(source, cache_dir=cache_dir, chat_template=template)
    folder = Path(source)
    if folder.is_dir():
        has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()
        return Tokenizer.from_pretrained_dir(folder, chat_template=template) if has_tokenizer else None
    if source in preset_names():
        return None
    raise _invalid_model(source)


def _invalid_model(source: str) -> SettingsError:
    return SettingsError(f"MODEL={source!r} is invalid: not a checkpoint folder, an existing .gguf file or a "
                         f"preset (one of {', '.join(preset_names())})")


def load_model(settings: Settings, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """Load what ``settings.model`` names onto ``device`` (see the module docstring)."""
    started = time.perf_counter()
    settings = attrs.evolve(settings, quantization=resolve_quantization(settings, device))
    source = settings.model
    cache_dir = settings.resolved_cache_dir()
    if not source:
        from inference_server.models.loading.embedded import embedded_gguf_path

        path = embedded_gguf_path()
        root = str(path)
        model, spec = _load_gguf(path, device, dtype, cache_dir, settings.quantization, settings.int8_embeddings)
        name = _served_name(settings, "gemma-3-270m")
    elif source.endswith(".gguf"):
        root = source
        model, spec = _load_gguf(Path(source), device, dtype, cache_dir, settings.quantization,
                                 settings.int8_embeddings)
        name = _served_name(settings, Path(source).stem)
    elif Path(source).is_dir():
        folder = Path(source)
        root = str(folder)
        spec = parse_model_spec(read_config(folder))
        model = build_model(spec, dtype, device, settings.quantization, settings.int8_embeddings)
        if settings.dummy_weights:
            init_dummy_weights(model, settings.seed)
        else:
            with phase("loading weights", unit="tensors") as progress:
                load_weights(model, spec, progress.wrap(iter_safetensors(folder)), str(folder))
        name = _served_name(settings, folder.name)
    elif source in preset_names():
        if not settings.dummy_weights:
            raise SettingsError(f"MODEL={source!r} is a preset: presets need DUMMY_WEIGHTS=true")
        root = source
        spec = parse_model_spec(preset_config(source))
        model = build_model(spec, dtype, device, settings.quantization, settings.int8_embeddings)
        init_dummy_weights(model, settings.seed)
        name = _served_name(settings, source)
    else:
        raise _invalid_model(source)
    with phase("loading the tokenizer"):
        tokenizer = load_tokenizer(settings)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return LoadedModel(model=model, spec=spec, tokenizer=tokenizer, name=name,
                       load_seconds=time.perf_counter() - started, root=root)


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype, cache_dir: Path,
               quantization: str = "none", int8_embeddings: str = "auto") -> tuple[CausalLM, ModelSpec]:
    from inference_server.models.loading.gguf_loader import open_gguf

    checkpoint = open_gguf(path)
    spec = parse_model_spec(checkpoint.config)
    model = build_model(spec, dtype, device, quantization, int8_embeddings)
    cached = weight_cache.cache_path(path.resolve(), cache_dir, dtype, quantization, int8_embeddings)
    if cached.is_file():
        with phase("loading the converted weights (cached at the first start)"):
            if weight_cache.load_cached(model, cached):
                return model, spec
    names = checkpoint.parameter_names
    with phase("loading weights (dequantising GGUF blocks)", total=len(names), unit="tensors") as progress:
        load_weights(model, spec, progress.wrap(checkpoint.iter_tensors(torch.float32)), str(path))
    with phase("caching the converted weights (first start only)"):
        weight_cache.save_cached(model, cached)
    return model, spec
