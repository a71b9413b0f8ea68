"""Zeroed int32 arrival counters for kernels whose last program to finish does a launch's final step.

Several kernels end with "the last program to arrive" (``router.linear_route`` routes every row, ``moe_decode`` adds
a token's K expert outputs, ``decode_attention`` merges a kv head's splits, ``batch_invariant_matmul`` folds an
output tile's K splits): each program counts itself in with an atomic add, the one that sees the count reach its
total does the rest and puts the counter back to zero. The buffers live here, one per (owner, device), allocated
zeroed on first use and left zeroed by every launch, so launches in stream order (eager or replayed in CUDA graphs)
share them; two launches of one owner must not run concurrently. The first use on a device must not be inside a CUDA
graph capture (the allocation would be captured), which the runners' warm-up before capture guarantees.
"""

from __future__ import annotations

import torch

__all__ = ["arrival_counters"]

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(owner: str, size: int, device: torch.device) -> torch.Tensor:
    """The zeroed ``[size]`` int32 counter buffer of ``owner`` on ``device`` (a kernel module's name; one buffer
    per owner, so kernels whose launches could interleave never share counters). ``size`` must not change between
    calls of one owner."""
    key = (owner, device)
    counters = _BUFFERS.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner} must run once on {device} before a CUDA graph captures it")
        counters = _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    elif counters.numel() != size:
        raise ValueError(f"{owner}'s counters have {counters.numel()} slots, not {size}")
    return counters
