"""Launch configs of ``int8_linear`` and of ``dense_linear`` (the same ``streamed_linear`` kernel): the dataclass,
and tuned configs read from JSON files per GPU and shape.

``bench/int8_kernels.py --sweep --write`` times candidate configs per dense shape and token count on a GPU and
writes ``configs/int8_linear/<name>.json`` (``config_file_name``): for each tuned token count, the fastest config
whose output matched the reference; ``bench/dense_linear.py --sweep --write`` does the same for float weights
into ``configs/dense_linear/`` (``DENSE_CONFIG_DIR``), with the token counts where cuBLAS beat every config
(``tuned_baseline_faster``: the CUDA backend then keeps cuBLAS). ``tuned_int8_linear_config`` returns the entry
of the smallest tuned token count at or above a step's (tuned counts are bucket tops: 16 covers 2-16), or None
without a file for this GPU, shape and dtype or past the largest tuned count: the kernel then uses its heuristic.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["CONFIG_DIR", "DENSE_CONFIG_DIR", "Int8LinearConfig", "config_file_name", "config_from_json",
           "config_to_json", "tuned_baseline_faster", "tuned_int8_linear_config"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "int8_linear"
DENSE_CONFIG_DIR = CONFIG_DIR.parent / "dense_linear"


@dataclass(frozen=True)
class Int8LinearConfig:
    """Launch config of ``int8_linear`` and ``dense_linear``: tile sizes (powers of two), K splits, warps, stages,
    and the path.

    ``block_t`` of 16 or more runs the tensor-core kernel (tiles of at least 16); below 16 the CUDA-core GEMV of
    ``kernels/int8_gemv.py`` (int8 or float weights; ``block_t`` 1-4, ``block_k`` a multiple of 4, best at least
    256 x ``num_warps``)."""

    block_n: int  # weight rows per program (the dot's M side)
    block_t: int  # tokens per program (the dot's N side)
    block_k: int  # K depth per pipelined tile
    split_k: int = 1  # programs sharing one output tile along K (> 1: fp32 partials plus a reduce kernel)
    num_warps: int = 4
    num_stages: int = 4
    magic_dequant: int = 0  # tensor-core kernel: 1 = bytes to floats by the exponent trick (kernels/int8_dequant)


def config_to_json(config: Int8LinearConfig) -> dict[str, Any]:
    return asdict(config)


def config_from_json(data: dict[str, Any]) -> Int8LinearConfig:
    """The config of one JSON entry; ValueError on a malformed one."""
    try:
        return Int8LinearConfig(**{k: int(v) for k, v in data.items()})
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad int8_linear config entry {data!r}: {err}") from err


def config_file_name(device: str, out_features: int, in_features: int, dtype: torch.dtype) -> str:
    """``N=5376,K=21504,dtype=bfloat16,device=NVIDIA_H200.json`` (dtype: the activations')."""
    dtype_name = str(dtype).removeprefix("torch.")
    return f"N={out_features},K={in_features},dtype={dtype_name},device={device.replace(' ', '_')}.json"


@functools.lru_cache(maxsize=256)
def _load_file(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


@functools.lru_cache(maxsize=256)
def _load(path: Path) -> dict[int, Int8LinearConfig] | None:
    data = _load_file(path)
    if data is None:
        return None
    return {int(tokens): config_from_json(entry) for tokens, entry in data["configs"].items()}


@functools.lru_cache(maxsize=4096)
def tuned_int8_linear_config(num_tokens: int, out_features: int, in_features: int, dtype: torch.dtype, device: str,
                             directory: Path = CONFIG_DIR) -> Int8LinearConfig | None:
    """The tuned config of the smallest tuned token count >= ``num_tokens``, or None."""
    table = _load(directory / config_file_name(device, out_features, in_features, dtype))
    if not table:
        return None
    above = [tokens for tokens in table if tokens >= num_tokens]
    return table[min(above)] if above else None


@functools.lru_cache(maxsize=4096)
def tuned_baseline_faster(num_tokens: int, out_features: int, in_features: int, dtype: torch.dtype, device: str,
                          directory: Path = DENSE_CONFIG_DIR) -> bool:
    """Whether the sweep timed the baseline (cuBLAS, for ``dense_linear``) faster than every config at the
    smallest tuned token count >= ``num_tokens`` (the file's ``baseline_faster`` counts); False without a file or
    past its largest tuned count."""
    path = directory / config_file_name(device, out_features, in_features, dtype)
    table, data = _load(path), _load_file(path)
    if not table or data is None:
        return False
    above = [tokens for tokens in table if tokens >= num_tokens]
    return bool(above) and min(above) in {int(t) for t in data.get("baseline_faster", ())}
