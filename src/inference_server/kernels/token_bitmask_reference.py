"""The token bitmask in torch ops: the CPU's path and the Triton kernel's oracle (``kernels/token_bitmask.py``).

Kept apart from the kernel so that a CPU server never imports Triton: the import took 0.2 s of the first
constrained request's step, a stall of every stream at that step, and start-up need not pay it either."""

from __future__ import annotations

import math

import torch


def token_bitmask_reference(logits: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor) -> None:
    """Set ``logits[rows[k]]`` (``[B, V]``) to ``-inf`` wherever bit ``i % 32`` of word ``i // 32`` of ``bits[k]``
    (``[K, >= ceil(V / 32)]`` int32) is clear, in place; the other rows are untouched. Unpacks the words into a
    ``[K, V]`` boolean and ``masked_fill``s (the kernel sets exactly the same entries without it)."""
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)  # [32]
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :vocab_size]  # [K, V]
    index = rows.long()
    logits[index] = logits[index].masked_fill(~allowed, -math.inf)
