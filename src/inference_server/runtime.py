"""Runtime facts resolved from settings once at start-up: the torch device and dtype actually used."""

from __future__ import annotations

import torch

from inference_server.config import Settings, SettingsError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(settings: Settings) -> torch.device:
    """CUDA, then MPS, then CPU for ``auto``; an explicit device that is absent is a settings error."""
    if settings.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise SettingsError("DEVICE='cuda' is invalid: no CUDA device is available (accepted: auto, cuda, mps, cpu)")
    if settings.device == "mps" and not torch.backends.mps.is_available():
        raise SettingsError("DEVICE='mps' is invalid: MPS is not available (accepted: auto, cuda, mps, cpu)")
    return torch.device(settings.device)


def resolve_dtype(settings: Settings, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and float32 elsewhere for ``auto``."""
    if settings.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[settings.dtype]


def resolve_quantization(settings: Settings, device: torch.device, backend: str = "reference") -> str:
    """The weight quantization actually applied: ``auto`` is ``int8`` on the CPU with the engine's own model
    classes (decode there reads weights from memory at every step; int8's speed and quality against fp32 are
    in docs/quantization.md) and ``none`` on GPUs and with the hf backend."""
    if settings.quantization != "auto":
        return settings.quantization
    return "int8" if device.type == "cpu" and backend != "hf" else "none"


def resolve_backend(settings: Settings, device: torch.device) -> str:
    """``custom-cuda`` when CUDA is the device (for ``auto``), else ``reference``. KV eviction settings are
    checked here too: they need the hf backend, and a budget goes with a policy; QUANTIZATION needs our own
    model classes (not the hf backend), INT8_EMBEDDINGS=on needs QUANTIZATION=int8 (as resolved), and DETERMINISTIC
    needs a runner with batch-invariant kernels (custom-cuda, or reference on the CPU)."""
    backend = settings.backend
    if backend == "auto":
        backend = "custom-cuda" if device.type == "cuda" else "reference"
    if backend == "custom-cuda" and device.type != "cuda":
        raise SettingsError("BACKEND='custom-cuda' is invalid on a non-CUDA device (accepted: auto, reference, hf)")
    if backend != "hf" and (settings.kv_eviction != "none" or settings.kv_budget_tokens):
        raise SettingsError(f"KV_EVICTION={settings.kv_eviction!r} and KV_BUDGET_TOKENS="
                            f"{settings.kv_budget_tokens} are invalid with BACKEND={backend!r}: KV eviction is a "
                            f"feature of BACKEND=hf")
    quantization = resolve_quantization(settings, device, backend)
    if backend == "hf" and quantization != "none":
        raise SettingsError(f"QUANTIZATION={quantization!r} is invalid with BACKEND='hf': the hf baseline "
                            f"runs the stock transformers model (accepted with hf: auto, none)")
    if settings.int8_embeddings == "on" and quantization != "int8":
        raise SettingsError(f"INT8_EMBEDDINGS='on' is invalid with QUANTIZATION={settings.quantization!r} (here "
                            f"{quantization!r}): int8 embeddings are part of QUANTIZATION=int8 (accepted without "
                            f"it: auto, off)")
    if settings.deterministic and not (backend == "custom-cuda" or (backend == "reference" and device.type == "cpu")):
        raise SettingsError(f"DETERMINISTIC=true is invalid with BACKEND={backend!r} on {device.type}: the "
                            f"batch-invariant kernels exist for the custom-cuda runner and the CPU reference runner")
    if backend == "hf":
        from inference_server.backends.hf.eviction_config import EvictionConfig

        try:
            EvictionConfig(settings.kv_eviction, settings.kv_budget_tokens, settings.kv_sink_tokens)
        except ValueError as error:
            raise SettingsError(str(error)) from None
    return backend
