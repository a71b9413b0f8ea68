"""Triton token-bitmask apply: a constrained row's disallowed logits set to ``-inf`` in one launch.

Structured output masks a batch's constrained rows with their grammars' bitmasks (``grammar_masks``): ``bits``
``[K, words]`` int32, bit ``i % 32`` of word ``i // 32`` set when token ``i`` is allowed, for the ``K`` rows of
``logits`` ``[B, V]`` listed in ``rows`` ``[K]``; the other ``B - K`` rows are not touched at all. One program per
(listed row, ``BLOCK`` tokens) reads that block's words and writes ``-inf`` where a bit is clear: no ``[K, V]``
boolean or unpacked intermediate, nothing read from the logits. The torch reference (``token_bitmask_reference``, in
``kernels/token_bitmask_reference.py`` so that a CPU server never imports Triton) unpacks the words into a
``[K, V]`` boolean and ``masked_fill``s; both set exactly the same entries.

No host sync and a grid sized from shapes only (CUDA-graph capturable). ``rows`` must hold distinct indices.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from inference_server.kernels.token_bitmask_reference import token_bitmask_reference

__all__ = ["BLOCK", "apply_token_bitmask_", "token_bitmask_reference", "warm_up_token_bitmask"]

BLOCK = 4096
"""Tokens per program: 128 words of one row's mask (Gemma's 262,144-id vocabulary: 64 programs a row)."""


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bits_ptr, rows_ptr, vocab_size, logits_stride, bits_stride,
                                BLOCK: tl.constexpr):
    k = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab_size
    row = tl.load(rows_ptr + k).to(tl.int64)
    words = tl.load(bits_ptr + k.to(tl.int64) * bits_stride + tokens // 32, mask=inside, other=-1)
    allowed = ((words >> (tokens % 32)) & 1) != 0  # an arithmetic shift: bit 31 still lands in bit 0
    minus_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + tokens, minus_inf, mask=inside & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor) -> None:
    """Set ``logits[rows[k], i]`` to ``-inf`` wherever bit ``i`` of ``bits[k]`` is clear (see the module
    docstring), in place. ``logits`` ``[B, V]`` with unit stride along V; ``bits`` ``[K, >= ceil(V / 32)]``
    int32; ``rows`` ``[K]`` integer, on the same device."""
    if bits.dtype != torch.int32 or bits.dim() != 2 or bits.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bits must be int32 [K, >= {math.ceil(logits.shape[1] / 32)}], got {bits.dtype} "
                         f"{tuple(bits.shape)}")
    if rows.shape != (bits.shape[0],):
        raise ValueError(f"rows must be [{bits.shape[0]}], got {tuple(rows.shape)}")
    if logits.stride(1) != 1 or bits.stride(1) != 1:
        raise ValueError("logits and bits need unit stride along their last dimension")
    if bits.shape[0] == 0:
        return
    vocab_size = logits.shape[1]
    grid = (bits.shape[0], triton.cdiv(vocab_size, BLOCK))
    _apply_token_bitmask_kernel[grid](logits, bits, rows, vocab_size, logits.stride(0), bits.stride(0),
                                      BLOCK=BLOCK)


def warm_up_token_bitmask(vocab_size: int, device: torch.device) -> None:
    """Compile the kernel's variant for a ``vocab_size`` batch on ``device`` (one listed row of fp32 logits, what
    the sampler passes), so that the first constrained request does not wait for Triton."""
    logits = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
    bits = torch.full((1, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)
    apply_token_bitmask_(logits, bits, torch.zeros(1, dtype=torch.int64, device=device))
