"""Triton greedy head: the lm_head GEMV with the greedy argmax and its logprob fused, no full-logits round trip.

When every sampled row is greedy and asks for nothing else (``sampler.argmax_suffices``), a step needs from the
``[N, V]`` logits only each row's argmax and that token's log-probability. The unfused path writes the logits
(``[N, V]`` in the model dtype), copies them to fp32, and reads them three more times (logsumexp, argmax,
gather). Here:

1. ``_greedy_head_slices_kernel``: one program per vocabulary slice of ``BLOCK_V`` rows of the head weight
   ``[V, H]`` (and per block of ``BLOCK_N`` hidden rows; the runner's rows fit one block) computes the slice's
   logits in fp32 (``tl.dot``, IEEE products for fp32 activations: no TF32), rounds them to the activation dtype
   (the hidden rows'; a float head has the same) as ``compute_logits``' GEMM output is rounded, applies the final
   soft-cap with ``layers.softcap``'s roundings
   (``x / cap``, ``tanh``, ``* cap``, each rounded to the activation dtype; on CUDA ``x / cap`` is computed as
   ``x * (1 / cap)``, which is what PyTorch's CUDA division by a scalar does, and on CPU as a true division, as
   PyTorch's CPU kernel does), and writes three numbers per (slice, row): the slice's maximum logit, the first
   vocabulary index holding it, and ``sum(exp(logit - max))``.
2. ``_greedy_head_combine_kernel``: one program per row combines the slices in vocabulary order: the global
   maximum, the smallest index among the slices that reach it (``torch.argmax``'s rule: the first maximal
   index), ``lse = max + log(sum over slices of slice_sum * exp(slice_max - max))``, and the logprob
   ``max - lse`` in fp32, the sampler's ``logits.gather(token).float() - logsumexp(logits.float())``.

**int8 heads** (``QUANTIZATION=int8`` with the embeddings quantized: ``Int8Embedding`` tied, or an ``Int8Linear``
lm_head; ``reference_int8``'s format): the weight is int8 ``[V, H]`` with one scale per row, ``scale [V]``. Each
int8 tile is dequantised in registers (int8 -> bf16 is exact for |q| <= 127, so ``tl.dot`` on bf16 tiles with fp32
accumulation sums exact products; with the exponent trick of ``int8_dequant`` the bytes become fp32 first, also
exactly), and the row scale is applied once after the reduction: ``logit = round(fp32 sum * fp32(scale))``, the
order of operations of ``ops.int8_linear`` (``streamed_tile.store_streamed_tile`` and the split-K reduce: the fp32
sum times the scale cast to fp32, then one rounding to the activation dtype) and of ``int8_linear_reference``. The
soft-cap and the reductions follow as for a float head.

The logit of the chosen token is exactly the rounded (and soft-capped) logit, so the token equals
``torch.argmax`` of the unfused logits whenever this kernel's fp32 sums round to the same values as cuBLAS's:
they differ only in summation order (~1e-6 relative in fp32), which the rounding to bf16 absorbs except when a
sum lies within that distance of a rounding boundary; a token can then differ only where the top two logits
are within one ulp. The logprob agrees with the sampler's within fp32 rounding of the two log-sum-exps.

No host sync, fixed grid and reduction order (deterministic: the same inputs give the same bits), CUDA-graph
capturable (the partial buffers are allocated per call from the caching allocator / graph pool). Rounding to
bf16 is done on the fp32 bits (round to nearest even), so the CPU interpreter, whose fp32 -> bf16 cast
truncates, gives the GPU's values. NaN logits are not handled (``torch.argmax`` would return a NaN's index).
"""

from __future__ import annotations

import os

import attrs
import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from inference_server.kernels.int8_dequant import int8_to_fp32_exact
from inference_server.kernels.pdl import (
    pdl_launch,
    pdl_release,
    pdl_release_after_loop,
    pdl_release_after_wait,
    pdl_wait,
)

__all__ = ["LOGIT_SLICE", "MAX_ROWS", "ROW_BLOCKS", "GreedyHeadConfig", "greedy_head", "greedy_head_config",
           "greedy_head_of_logits", "greedy_head_supports", "row_block"]

MAX_ROWS = 64
"""Most hidden rows one weight pass serves (``BLOCK_N``): more rows re-read the weight once per 64, where
cuBLAS reads it once, so the runner takes the fused path only up to here."""
ROW_BLOCKS = (16, 32, MAX_ROWS)
"""Hidden rows per program (``BLOCK_N``): a call takes the smallest block that holds its rows (``MAX_ROWS`` past
it); each block is one compiled variant of the slices kernel."""

LOGIT_SLICE = 1024
"""Vocabulary entries per program of ``greedy_head_of_logits``' slices launch (262,144 logits: 256 slices)."""

_NO_INDEX = tl.constexpr(2**31 - 1)  # a compiled kernel reads only constexpr globals
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@attrs.frozen
class GreedyHeadConfig:
    """Launch shape of the slices kernel: ``block_v`` vocabulary rows per program, ``block_k`` of the hidden
    size per loop iteration (``block_n`` hidden rows per program is set by the row count); ``magic_dequant``
    (int8 heads, compiled kernels): int8 bytes to floats by the exponent trick (``int8_dequant``) instead of the
    quarter-rate conversion instruction."""

    block_v: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    magic_dequant: bool = False


def row_block(n_rows: int) -> int:
    """The ``ROW_BLOCKS`` entry that ``n_rows`` hidden rows run in."""
    return next((block for block in ROW_BLOCKS if n_rows <= block), MAX_ROWS)


def greedy_head_config(n_rows: int, element_size: int, hidden_element_size: int = 2) -> GreedyHeadConfig:
    """A memory-bound streaming shape of ``element_size``-byte weights: 16 KB weight tiles, with about 96 KB of
    weight and hidden tiles in flight per program (more stages at few rows, fewer once the hidden tile is large).

    * bf16 (2 bytes): 64 x 128 tiles, four stages up to 32 rows, three at 64;
    * fp32 (4 bytes): half the K depth (64 x 64), the same stages;
    * int8 (1 byte): 64 x 256 tiles (16 KB: the same bytes in flight per stage as bf16, and the 256-column tiles
      the int8 linear's decode bucket measured fastest on the H200), so the bf16 hidden tile is twice as deep:
      four stages up to 16 rows, three up to 32, two at 64; the exponent-trick dequantisation, as that bucket.
      With fp32 hidden rows (``hidden_element_size`` 4: an fp32 model) the tiles are 64 x 128 (8 KB), as deep as fp32's.
    """
    if element_size == 1:
        stages = 4 if n_rows <= 16 else 3 if n_rows <= 32 else 2
        return GreedyHeadConfig(block_v=64, block_k=256 if hidden_element_size <= 2 else 128, num_warps=4,
                                num_stages=stages, magic_dequant=True)
    block_k = 128 if element_size <= 2 else 64
    stages = 4 if n_rows <= 32 else 3
    return GreedyHeadConfig(block_v=64, block_k=block_k, num_warps=4, num_stages=stages)


@triton.jit
def _round_to_bf16(x):
    """fp32 -> nearest bf16 (ties to even), kept in fp32: the rounding of a bf16 cast, on the bits."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round(x, ROUND_BF16: tl.constexpr):
    if ROUND_BF16:
        x = _round_to_bf16(x)
    return x


@triton.jit
def _head_dot(w, h, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr, MAGIC: tl.constexpr):
    """acc [BV, BN] += w [BV, BK] @ h [BN, BK].T, the weight tile converted to h's dtype in registers (a float
    head already has it: a no-op; int8 values are exact in every float type). IEEE: fp32 activations, exact fp32
    products (no TF32). UPCAST: interpreter only (its numpy dot and int8 -> bf16 conversion mishandle bf16): both
    sides in fp32. MAGIC (int8 only): the bytes go to fp32 by the exponent trick (``int8_dequant``) first."""
    if MAGIC:
        w = int8_to_fp32_exact(w)
    if UPCAST:
        acc = tl.dot(w.to(tl.float32), tl.trans(h.to(tl.float32)), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(w.to(tl.float32), tl.trans(h), acc, input_precision="ieee")
    else:
        acc = tl.dot(w.to(h.dtype), tl.trans(h), acc)
    return acc


@triton.jit(do_not_specialize=["n_rows"])
def _greedy_head_slices_kernel(
    hidden_ptr,  # [N, H]
    weight_ptr,  # [V, H] hidden's dtype, or int8 (HAS_SCALE)
    scale_ptr,  # [V] per-row scale of an int8 head (HAS_SCALE; else any pointer, unread)
    max_ptr,  # [S, N] fp32: each slice's maximum logit
    index_ptr,  # [S, N] int32: the first vocabulary index holding it
    sum_ptr,  # [S, N] fp32: sum(exp(logit - max)) over the slice
    n_rows, vocab, hidden_size, stride_hn, stride_wv, stride_scale,
    inv_cap, cap,  # the final soft-cap (unused without SOFTCAP)
    BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # hidden_size % BLOCK_K == 0: no K mask
    ROUND_BF16: tl.constexpr,  # bf16 activations: round each stage as torch rounds its bf16 output
    SOFTCAP: tl.constexpr,
    RECIPROCAL: tl.constexpr,  # x / cap as x * (1 / cap): PyTorch's CUDA kernel (CPU divides)
    IEEE: tl.constexpr,  # fp32 activations: exact fp32 products (no TF32)
    UPCAST: tl.constexpr,  # interpreter only: bf16 tiles go to fp32 before the dot (its numpy dot needs it)
    LIBDEVICE_TANH: tl.constexpr,  # False only under the interpreter, which has no libdevice
    HAS_SCALE: tl.constexpr,  # int8 weights: times the row scale after the reduction, before the first rounding
    MAGIC: tl.constexpr,  # int8 weights: the exponent-trick dequantisation (int8_dequant)
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the hidden rows come from the previous launch (the head weight is streamed in the same loop)
    # and the partial buffers may still be read by an earlier launch, so wait before the first load.
    pdl_wait(USE_PDL)
    pdl_release_after_wait(USE_PDL)
    slice_id = tl.program_id(0)
    offs_v = slice_id * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range vocabulary and hidden rows read a real row (no load masks on the weight stream); their
    # logits are masked to -inf below and their results never stored.
    rows_v = tl.minimum(offs_v, vocab - 1).to(tl.int64)
    rows_n = tl.minimum(offs_n, n_rows - 1).to(tl.int64)
    w_ptrs = weight_ptr + rows_v[:, None] * stride_wv + offs_k[None, :]  # [BLOCK_V, BLOCK_K]
    h_ptrs = hidden_ptr + rows_n[:, None] * stride_hn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_V, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden_size, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs)
            h = tl.load(h_ptrs)
        else:
            k_mask = offs_k[None, :] < hidden_size - k * BLOCK_K
            w = tl.load(w_ptrs, mask=k_mask, other=0)
            h = tl.load(h_ptrs, mask=k_mask, other=0.0)
        acc = _head_dot(w, h, acc, IEEE, UPCAST, MAGIC)
        w_ptrs += BLOCK_K
        h_ptrs += BLOCK_K
    # Release after the main loop (kernels.pdl's mode; the other releases right after the wait): only the epilogue
    # is left, so the next launch's CTAs (resident from here on, waiting) hold no shared memory and registers while
    # this kernel's programs still stream their tiles.
    pdl_release_after_loop(USE_PDL)
    if HAS_SCALE:  # ops.int8_linear's order: the fp32 sum times the fp32 scale, then one rounding
        acc = acc * tl.load(scale_ptr + rows_v * stride_scale).to(tl.float32)[:, None]
    _store_slice_stats(acc, slice_id, offs_v, offs_n, n_rows, vocab, max_ptr, index_ptr, sum_ptr, inv_cap, cap,
                       ROUND_BF16, SOFTCAP, RECIPROCAL, LIBDEVICE_TANH)


@triton.jit
def _store_slice_stats(acc, slice_id, offs_v, offs_n, n_rows, vocab, max_ptr, index_ptr, sum_ptr, inv_cap, cap,
                       ROUND_BF16: tl.constexpr, SOFTCAP: tl.constexpr, RECIPROCAL: tl.constexpr,
                       LIBDEVICE_TANH: tl.constexpr):
    """Step 1's epilogue (module docstring) for the fp32 logits ``acc [BLOCK_V, BLOCK_N]`` of vocabulary rows
    ``offs_v`` and hidden rows ``offs_n``: the rounding to the activation dtype, the soft-cap's roundings, then the
    slice's maximum, its first index and ``sum(exp(logit - max))`` per hidden row, stored at ``slice_id``."""
    x = _round(acc, ROUND_BF16)  # [BLOCK_V, BLOCK_N] logits as compute_logits' GEMM returns them
    if SOFTCAP:
        if RECIPROCAL:
            y = _round(x * inv_cap, ROUND_BF16)
        else:
            y = _round(x / cap, ROUND_BF16)
        if LIBDEVICE_TANH:
            t = libdevice.tanh(y)
        else:
            e = tl.exp(-2.0 * tl.abs(y))  # in (0, 1]: no overflow at any input
            t = tl.where(y >= 0, (1.0 - e) / (1.0 + e), (e - 1.0) / (1.0 + e))
        x = _round(_round(t, ROUND_BF16) * cap, ROUND_BF16)
    x = tl.where((offs_v < vocab)[:, None], x, float("-inf"))
    best = tl.max(x, axis=0)  # [BLOCK_N]
    first = tl.min(tl.where(x == best[None, :], offs_v[:, None], _NO_INDEX), axis=0)  # [BLOCK_N]
    total = tl.sum(tl.exp(x - best[None, :]), axis=0)  # [BLOCK_N]
    out = slice_id * n_rows + offs_n
    row_ok = offs_n < n_rows
    tl.store(max_ptr + out, best, mask=row_ok)
    tl.store(index_ptr + out, first, mask=row_ok)
    tl.store(sum_ptr + out, total, mask=row_ok)


@triton.jit(do_not_specialize=["n_rows"])
def _logit_slices_kernel(
    logits_ptr,  # [N, V] the head GEMV's logits, in the activation dtype (contiguous last dim)
    max_ptr, index_ptr, sum_ptr,  # [S, N] as the slices kernel's
    n_rows, vocab, stride_ln,
    inv_cap, cap,  # the final soft-cap (unused without SOFTCAP)
    BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr,
    ROUND_BF16: tl.constexpr, SOFTCAP: tl.constexpr, RECIPROCAL: tl.constexpr, LIBDEVICE_TANH: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    """Step 1's epilogue over logits a GEMV already wrote (``greedy_head_of_logits``): one program per slice of
    ``BLOCK_V`` vocabulary entries and block of hidden rows. The logits are values of the activation dtype, so
    the first rounding keeps them; the soft-cap and the statistics are the slices kernel's."""
    # PDL (kernels.pdl): the logits come from the previous launch and the partials may still be read by an earlier
    # one, so wait first; a short kernel, so release the next launch at once.
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    slice_id = tl.program_id(0)
    offs_v = slice_id * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_v < vocab)[:, None] & (offs_n < n_rows)[None, :]
    acc = tl.load(logits_ptr + offs_n.to(tl.int64)[None, :] * stride_ln + offs_v[:, None], mask=mask,
                  other=0.0).to(tl.float32)  # [BLOCK_V, BLOCK_N]
    _store_slice_stats(acc, slice_id, offs_v, offs_n, n_rows, vocab, max_ptr, index_ptr, sum_ptr, inv_cap, cap,
                       ROUND_BF16, SOFTCAP, RECIPROCAL, LIBDEVICE_TANH)


@triton.jit(do_not_specialize=["n_rows", "n_slices"])
def _greedy_head_combine_kernel(
    max_ptr, index_ptr, sum_ptr,  # [S, N] partials of the slices kernel
    ids_ptr,  # [N] int64
    logprobs_ptr,  # [N] fp32
    n_rows, n_slices,
    BLOCK_S: tl.constexpr,  # >= n_slices: one load, one fixed-order reduction
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the partials come from the slices kernel just before, so wait before the first load and
    # store; a short kernel, so release the next launch at once (its CTAs get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    present = s < n_slices
    part_max = tl.load(max_ptr + s * n_rows + row, mask=present, other=float("-inf"))
    part_index = tl.load(index_ptr + s * n_rows + row, mask=present, other=_NO_INDEX)
    part_sum = tl.load(sum_ptr + s * n_rows + row, mask=present, other=0.0)
    best = tl.max(part_max, axis=0)
    token = tl.min(tl.where(part_max == best, part_index, _NO_INDEX), axis=0)
    total = tl.sum(part_sum * tl.exp(part_max - best), axis=0)  # absent slices: 0 * exp(-inf) = 0
    lse = best + tl.log(total)
    tl.store(ids_ptr + row, token.to(tl.int64))
    tl.store(logprobs_ptr + row, best - lse)


def _operands_error(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> str | None:
    """Why ``greedy_head`` cannot take these operands (shapes, dtypes, layout, devices), or None."""
    if not (hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1]):
        return f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
    if hidden.dtype not in (torch.bfloat16, torch.float32):
        return f"hidden must be bf16 or fp32, not {hidden.dtype}"
    if scale is None and weight.dtype != hidden.dtype:
        return f"hidden and weight must be both bf16 or both fp32, got {hidden.dtype}, {weight.dtype}"
    if scale is not None:
        if weight.dtype != torch.int8:
            return f"a scale goes with an int8 weight, not {weight.dtype}"
        if scale.dim() != 1 or scale.shape[0] != weight.shape[0] or not scale.is_floating_point():
            return f"scale must be a float [V], got {scale.dtype} {tuple(scale.shape)} for weight {tuple(weight.shape)}"
        if scale.device != weight.device:
            return "scale and weight must be on one device"
    if hidden.stride(-1) != 1 or weight.stride(-1) != 1:
        return "hidden and weight need a contiguous last dim"
    if hidden.device != weight.device:
        return "hidden and weight must be on one device"
    return None


def greedy_head_supports(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Whether ``greedy_head`` takes these inputs: ``[N, H]`` rows (1 <= N <= ``MAX_ROWS``) in bf16 or fp32 and a
    ``[V, H]`` weight of the same dtype, or (``scale`` given) an int8 weight with its per-row float scale ``[V]``;
    each with a contiguous last dim, all on one device."""
    return 1 <= hidden.shape[0] <= MAX_ROWS and _operands_error(hidden, weight, scale) is None


def _no_rows(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.float32, device=device)


def _partials(n_slices: int, n_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slices' ``(max, index, sum)`` buffers ``[S, N]`` (fp32, int32, fp32), from one allocation."""
    parts = torch.empty(3, n_slices, n_rows, dtype=torch.float32, device=device)
    return parts[0], parts[1].view(torch.int32), parts[2]


def _cap_arguments(softcap: float | None) -> tuple[float, float]:
    """``(inv_cap, cap)`` of the kernels: ``1 / cap`` as PyTorch's opmath reciprocal computes it (fp32 1 / fp32 cap)."""
    cap = float(softcap) if softcap is not None else 1.0
    return float(np.float32(1.0) / np.float32(cap)), cap


def _combine(parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], n_rows: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 (the combine launch) over the slices' partials: ``(token_ids [N] int64, logprobs [N] fp32)``."""
    ids = torch.empty(n_rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(n_rows, dtype=torch.float32, device=device)
    n_slices = parts[0].shape[0]
    _greedy_head_combine_kernel[(n_rows,)](
        *parts, ids, logprobs, n_rows, n_slices,
        BLOCK_S=triton.next_power_of_2(n_slices), num_warps=4, **pdl_launch(),
    )
    return ids, logprobs


def greedy_head(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None,
                config: GreedyHeadConfig | None = None, *,
                scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_ids [N] int64, logprobs [N] fp32)`` of hidden rows ``[N, H]`` against the head ``[V, H]``
    with the final soft-cap ``softcap`` (None: none): ``tests/kernels/reference_greedy_head.py``'s
    contract (see the module docstring). With ``scale [V]`` the head is int8 (``reference_int8``'s format) and
    its logits are ``ops.int8_linear``'s, rounded to hidden's dtype. Any N >= 1 is computed (one weight pass
    per ``MAX_ROWS`` rows)."""
    error = _operands_error(hidden, weight, scale)
    if error is not None:
        raise ValueError(error)
    n_rows, hidden_size = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    if n_rows == 0:
        return _no_rows(device)
    if vocab == 0 or hidden_size == 0:
        raise ValueError("an empty vocabulary or hidden size has no argmax")
    cfg = config or greedy_head_config(n_rows, weight.element_size(), hidden.element_size())
    block_n = row_block(n_rows)
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(hidden_size)))  # tiny test models: H = 64
    n_slices = triton.cdiv(vocab, cfg.block_v)
    parts = _partials(n_slices, n_rows, device)
    inv_cap, cap = _cap_arguments(softcap)
    bf16 = hidden.dtype == torch.bfloat16
    int8 = scale is not None
    scale_arg = scale if scale is not None else weight  # a float head: a valid pointer the kernel never reads
    stride_scale = scale.stride(0) if scale is not None else 0
    _greedy_head_slices_kernel[(n_slices, triton.cdiv(n_rows, block_n))](
        hidden, weight, scale_arg, *parts,
        n_rows, vocab, hidden_size, hidden.stride(0), weight.stride(0), stride_scale, inv_cap, cap,
        BLOCK_V=cfg.block_v, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=hidden_size % block_k == 0,
        ROUND_BF16=bf16, SOFTCAP=softcap is not None, RECIPROCAL=device.type == "cuda",
        IEEE=not bf16, UPCAST=_INTERPRETED and bf16, LIBDEVICE_TANH=not _INTERPRETED,
        HAS_SCALE=int8, MAGIC=int8 and cfg.magic_dequant,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(loop="head"),
    )
    return _combine(parts, n_rows, device)


def greedy_head_of_logits(logits: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_head``'s ``(token_ids [N] int64, logprobs [N] fp32)`` from logits a head GEMV already computed,
    ``[N, V]`` in the activation dtype (bf16 or fp32; contiguous last dim), before the soft-cap ``softcap``: the
    same soft-cap roundings, statistics and combine, in two short launches (one read of the logits).

    For the rows where the head's CUDA-core GEMV streams the weight faster than the slices kernel's tensor-core
    tiles (1-2 rows: the CUDA runner's ``_head_gemv_logits``); the token and logprob are those of ``greedy_head`` on the
    same logits."""
    if logits.dim() != 2 or logits.dtype not in (torch.bfloat16, torch.float32) or logits.stride(-1) != 1:
        raise ValueError(f"want logits [N, V] in bf16 or fp32 with a contiguous last dim, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    n_rows, vocab = logits.shape
    device = logits.device
    if n_rows == 0:
        return _no_rows(device)
    if vocab == 0:
        raise ValueError("an empty vocabulary has no argmax")
    block_n = min(triton.next_power_of_2(n_rows), 16)
    n_slices = triton.cdiv(vocab, LOGIT_SLICE)
    parts = _partials(n_slices, n_rows, device)
    inv_cap, cap = _cap_arguments(softcap)
    _logit_slices_kernel[(n_slices, triton.cdiv(n_rows, block_n))](
        logits, *parts, n_rows, vocab, logits.stride(0), inv_cap, cap,
        BLOCK_V=LOGIT_SLICE, BLOCK_N=block_n, ROUND_BF16=logits.dtype == torch.bfloat16,
        SOFTCAP=softcap is not None, RECIPROCAL=device.type == "cuda", LIBDEVICE_TANH=not _INTERPRETED,
        num_warps=4, **pdl_launch(),
    )
    return _combine(parts, n_rows, device)
