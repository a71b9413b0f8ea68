"""Load what ``MODEL`` names as a stock transformers model for the Hugging Face backend.

* empty (the embedded Gemma 3 270M) or a ``.gguf`` file: transformers' own GGUF loading
  (``from_pretrained(folder, gguf_file=...)``, which dequantises every tensor with the ``gguf`` package);
* a checkpoint folder: ``from_pretrained`` (or ``from_config`` with ``DUMMY_WEIGHTS``);
* a preset with ``DUMMY_WEIGHTS``: ``from_config`` on the preset's config, transformers' random init.

The engine's ``ModelSpec`` (context length, vocabulary, KV geometry for the scheduler's accounting) is parsed
from the loaded model's config; the tokenizer is the one the other backends serve.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs
import torch

from inference_server.config import Settings, SettingsError
from inference_server.models.loading.presets import preset_config, preset_names
from inference_server.models.loading.source import load_tokenizer
from inference_server.models.spec import ModelSpec, parse_model_spec
from inference_server.models.tokenizer import Tokenizer
from inference_server.startup import phase


@attrs.frozen
class HFLoadedModel:
    """A transformers model and what the engine needs to know of it (the fields ``LoadedModel`` shares)."""

    model: Any  # a transformers PreTrainedModel (causal LM)
    spec: ModelSpec
    tokenizer: Tokenizer | None
    name: str
    load_seconds: float
    root: str = ""


def config_from_dict(values: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    rest = dict(values)
    return AutoConfig.for_model(rest.pop("model_type"), **rest)


def _from_config(config: Any, dtype: torch.dtype, device: torch.device, seed: int) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:  # random weights made on the device, as the native backends' dummy weights
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _from_gguf(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    with phase("loading the GGUF with transformers (dequantising every tensor)"):
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)


def load_hf_model(settings: Settings, device: torch.device, dtype: torch.dtype) -> HFLoadedModel:
    started = time.perf_counter()
    source = settings.model
    names = settings.served_model_names()
    if not source:
        from inference_server.models.loading.embedded import embedded_gguf_path

        path = embedded_gguf_path()
        model, root, default_name = _from_gguf(path, dtype), str(path), "gemma-3-270m"
    elif source.endswith(".gguf"):
        if not Path(source).is_file():
            raise SettingsError(f"MODEL={source!r} is invalid: no such .gguf file")
        model, root, default_name = _from_gguf(Path(source), dtype), source, Path(source).stem
    elif Path(source).is_dir():
        from transformers import AutoConfig, AutoModelForCausalLM

        root, default_name = source, Path(source).name
        if settings.dummy_weights:
            model = _from_config(AutoConfig.from_pretrained(source), dtype, device, settings.seed)
        else:
            with phase("loading the checkpoint with transformers"):
                model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    elif source in preset_names():
        if not settings.dummy_weights:
            raise SettingsError(f"MODEL={source!r} is a preset: presets need DUMMY_WEIGHTS=true")
        root, default_name = source, source
        model = _from_config(config_from_dict(preset_config(source)), dtype, device, settings.seed)
    else:
        raise SettingsError(f"MODEL={source!r} is invalid: not a checkpoint folder, an existing .gguf file or a "
                            f"preset (one of {', '.join(preset_names())})")
    model = model.to(device).eval()
    spec = parse_model_spec(model.config.to_dict())
    with phase("loading the tokenizer"):
        tokenizer = load_tokenizer(settings)
    return HFLoadedModel(model=model, spec=spec, tokenizer=tokenizer, name=names[0] if names else default_name,
                         load_seconds=time.perf_counter() - started, root=root)
