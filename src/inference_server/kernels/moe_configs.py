"""Launch configs of the fused MoE: the dataclasses, and tuned configs read from JSON files per GPU and shape.

``bench/tune_triton_launch.py`` sweeps BLOCK_M and each grouped GEMM's tiles, warps and stages on a GPU and
writes ``configs/fused_moe/<name>.json`` (``config_file_name``): for each tuned token count, the fastest
config whose output matched the heuristic config's within bf16 rounding. ``tuned_moe_config`` returns the
entry of the tuned token count nearest to a step's (vLLM's rule for its fused-MoE files), or None without a
file for this GPU, shape and dtype, in which case ``fused_moe`` uses its heuristic.

Tuned token counts must be step sizes the CUDA runner compiles at start-up (its decode buckets and the
power-of-two ladder of eager warm-up steps): a step then never meets a config variant for the first time
while serving (a Triton compile mid-serving stalls the device for seconds).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["CONFIG_DIR", "MoeGemmConfig", "MoeKernelConfig", "config_file_name", "config_from_json",
           "config_to_json", "device_name", "tuned_configs", "tuned_configs_enabled", "tuned_moe_config"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs" / "fused_moe"
_TUNED: contextvars.ContextVar[bool] = contextvars.ContextVar("tuned_configs", default=True)


@contextlib.contextmanager
def tuned_configs(enabled: bool) -> Iterator[None]:
    """Consult the tuned configs (the default) or not (the heuristic alone) for the kernels launched in the block, in
    this thread or task: the fused MoE, the int8 and dense GEMVs. Benchmarks compare the two; serving never
    sets it."""
    token = _TUNED.set(enabled)
    try:
        yield
    finally:
        _TUNED.reset(token)


def tuned_configs_enabled() -> bool:
    return _TUNED.get()


@dataclass(frozen=True)
class MoeGemmConfig:
    """Tile shape and launch knobs of one grouped GEMM (BLOCK_M is shared, see MoeKernelConfig)."""

    block_n: int
    block_k: int
    group_m: int = 1  # m-blocks per launch-order group; 1 = n-fastest (weight tile reuse via L2)
    num_warps: int = 4
    num_stages: int = 3
    magic_dequant: int = 0  # int8 weights: 1 = bytes to floats by the exponent trick (kernels/int8_dequant)


@dataclass(frozen=True)
class MoeKernelConfig:
    """Block sizes for the whole fused MoE. ``block_m`` is the expert-group padding granularity."""

    block_m: int
    gate_up: MoeGemmConfig
    down: MoeGemmConfig


def config_to_json(config: MoeKernelConfig) -> dict[str, Any]:
    return asdict(config)


def config_from_json(data: dict[str, Any]) -> MoeKernelConfig:
    """The config of one JSON entry; ValueError on a malformed one."""
    try:
        return MoeKernelConfig(int(data["block_m"]), MoeGemmConfig(**data["gate_up"]), MoeGemmConfig(**data["down"]))
    except (KeyError, TypeError) as err:
        raise ValueError(f"bad fused-MoE config entry {data!r}: {err}") from err


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(device: str, num_experts: int, hidden: int, intermediate: int, top_k: int,
                     dtype: torch.dtype) -> str:
    """``E=128,H=2048,I=768,K=8,dtype=bfloat16,device=NVIDIA_H200.json``."""
    return (f"E={num_experts},H={hidden},I={intermediate},K={top_k},dtype={_dtype_name(dtype)},"
            f"device={device.replace(' ', '_')}.json")


@functools.lru_cache(maxsize=16)
def device_name(device: torch.device) -> str:
    """The GPU's name as CUDA reports it (``NVIDIA H200``); ``cpu`` elsewhere."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=64)
def _load(path: Path) -> dict[int, MoeKernelConfig] | None:
    if not path.is_file():
        return None
    entries = json.loads(path.read_text())["configs"]
    return {int(tokens): config_from_json(entry) for tokens, entry in entries.items()}


@functools.lru_cache(maxsize=4096)
def tuned_moe_config(num_tokens: int, hidden: int, intermediate: int, num_experts: int, top_k: int,
                     dtype: torch.dtype, device: str, directory: Path = CONFIG_DIR) -> MoeKernelConfig | None:
    """The tuned config for a step of ``num_tokens`` (the nearest tuned token count), or None."""
    table = _load(directory / config_file_name(device, num_experts, hidden, intermediate, top_k, dtype))
    if not table:
        return None
    nearest = min(table, key=lambda tokens: (abs(tokens - num_tokens), tokens))
    return table[nearest]
