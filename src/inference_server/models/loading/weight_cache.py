"""The converted weights of a GGUF model, cached so that later starts skip dequantisation and quantization.

A GGUF's Q4_K/Q6_K blocks are dequantised at every start and, with ``QUANTIZATION=int8`` (the CPU default),
re-quantized to int8: seconds of a later start on a small CPU. The first start saves the loaded model's
parameters (after both steps) as one safetensors file; a later start of the same file with the same settings
builds the model and reads that file instead. The file is named by everything that changes its content: the
GGUF's path, size and modification time, the dtype, the quantization and int8-embeddings settings, the
torch, gguf and inference-server versions and ``CACHE_FORMAT``; a changed GGUF gets a new name, so a stale
cache is never read. Writing is atomic (staged, then renamed); a cache that cannot be written or read only
costs the speed-up.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import safetensors
import safetensors.torch
import torch

log = logging.getLogger(__name__)

CACHE_FORMAT = 1


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def cache_path(gguf_path: Path, cache_dir: Path, dtype: torch.dtype, quantization: str,
               int8_embeddings: str) -> Path:
    """Where the converted weights of ``gguf_path`` under these settings live (see the module docstring)."""
    stat = gguf_path.stat()
    identity = "|".join(str(part) for part in (
        gguf_path.resolve(), stat.st_size, stat.st_mtime_ns, dtype, quantization, int8_embeddings,
        torch.__version__, _version("gguf"), _version("inference-server"), CACHE_FORMAT))
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir / "weights" / f"{gguf_path.stem}-{digest}.safetensors"


def load_cached(model: torch.nn.Module, path: Path) -> bool:
    """Fill ``model``'s parameters from ``path``; False (the model untouched or to be reloaded) when there is
    no such file or it does not match the model."""
    if not path.is_file():
        return False
    try:
        safetensors.torch.load_model(model, str(path), strict=True, device=str(next(model.parameters()).device))
    except (OSError, RuntimeError, ValueError, KeyError, safetensors.SafetensorError) as error:
        log.warning("ignoring the weight cache %s: %s", path, error)
        return False
    return True


def save_cached(model: torch.nn.Module, path: Path) -> None:
    """Write ``model``'s parameters to ``path`` atomically; a failure is logged, not raised."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_model(model, str(staging))
        staging.replace(path)
    except (OSError, RuntimeError, ValueError) as error:
        log.warning("the converted weights were not cached at %s: %s", path, error)
    finally:
        with contextlib.suppress(OSError):
            staging.unlink()
