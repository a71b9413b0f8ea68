"""Triton row log-sum-exp for ``DETERMINISTIC=true``: each row's ``logsumexp`` reduced by one program in one fixed
order, so a row's value is bitwise the same whatever the other rows and however many there are.

Contract: ``row_logsumexp(x)`` for ``x [B, V]`` fp32 (contiguous last dim) returns ``[B]`` fp32 equal to
``torch.logsumexp(x, dim=-1)`` within fp32 rounding (a row of only ``-inf``, every token masked, gives ``-inf``; a
``+inf`` or NaN entry gives NaN, as a grammar's mask never writes them). Program ``b`` walks row ``b`` in chunks of
``BLOCK`` columns from the first: each chunk's maximum and its ``sum(exp(x - running max))`` (``tl.max`` / ``tl.sum``
over a fixed ``BLOCK`` with fixed warps: one reduction tree), folded into the running pair in chunk order, then
``max + log(sum)``. Nothing in it depends on ``B``: not the grid's meaning for a row, not the chunks, not the tree.

Why it exists: ``torch.logsumexp`` over ``[B, V]`` chooses how to split a row's reduction across thread blocks by
the tensor's shape, so a row's log-normaliser (and the logprob every response carries) moved by an ulp with the
batch; ``sampler.sample(row_invariant=True)`` reduced row by row instead, B launches of four kernels a step (what
that cost at batch 64: docs/benchmarks.md, Deterministic inference). One launch here. No host sync, grid
from the shape only (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "row_logsumexp"]

BLOCK = 4096
"""Columns a program reduces per chunk (262,144-token vocabularies: 64 chunks a row)."""
NUM_WARPS = 8
"""Warps a program spreads its chunk over: fixed, as the reduction tree follows from it."""


@triton.jit
def _row_logsumexp_kernel(x_ptr, out_ptr, vocab, stride_xb, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_xb
    cols = tl.arange(0, BLOCK)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=-float("inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # a row of -inf so far: nothing to scale or add (exp(-inf - -inf) would be NaN)
        safe_max = tl.where(new_max == -float("inf"), 0.0, new_max)
        chunk_sum = tl.sum(tl.exp(x - safe_max), axis=0)
        running_sum = running_sum * tl.exp(running_max - safe_max) + chunk_sum
        running_max = new_max
    tl.store(out_ptr + row, running_max + tl.log(running_sum))


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` of each row of ``x [B, V]`` (fp32, contiguous last dim) -> ``[B]`` fp32, one program a row
    (module docstring)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"want x [B, V] fp32 with a contiguous last dim, got {x.dtype} {tuple(x.shape)}")
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and vocab:
        _row_logsumexp_kernel[(rows,)](x, out, vocab, x.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS)
    elif rows:
        out.fill_(-float("inf"))
    return out
