"""Triton paged prefill attention: a packed batch of query chunks over their cached prefix plus themselves.

Contract (reference: ``reference_attention.ref_paged_prefill_attention``):

* ``q``: ``[T, nH, D]``, the chunks of ``B`` sequences back to back; ``cu_seqlens_q``: ``int32 [B + 1]``
  (chunk ``b`` is ``q[cu[b]:cu[b+1]]``; empty chunks are allowed); ``context_lens``: ``int32 [B]`` = cached
  tokens + this chunk's tokens. Query ``i`` of sequence ``b`` sits at ``context_lens[b] - chunk_len_b + i``.
* All keys, the chunk's own included, are read from the paged cache (``[num_blocks, block_size, nKV, D]``,
  last dim contiguous) through ``block_tables`` (``int32 [B, max_blocks]``), so store the chunk's K/V first.
* Causal; with ``window`` = W also ``q_pos - kv_pos < W``. Positions before the window of a program's first
  query are never loaded, so blocks wholly outside the window of the chunk's first query may be released.
* GQA (``nH`` a multiple of ``nKV``): a program owns one kv head and a tile of ``BLOCK_M`` rows, each row one
  (query token, head of the group) pair, ``BLOCK_Q = BLOCK_M // G`` tokens per tile; K/V tiles are loaded
  once for all of them. fp32 scores and softmax; output dtype = q's.
* No host syncs: the grid is ``(T // BLOCK_Q + B, nKV)``, an upper bound on the q tiles that every program
  maps back to (sequence, tile) with a binary search over ``cu_seqlens_q`` (the scheme of vLLM's unified
  Triton attention); surplus programs exit at once.

Head dim 512 (Gemma 4 full layers) and shared memory / registers: Q stays on chip for the whole loop, K
and V tiles are ``BLOCK_N x D`` and the fp32 accumulator is ``BLOCK_M x D``. At D=512 in bf16 a 64x64
tiling needs a 128 KiB accumulator (128 regs/thread over 8 warps, on top of Q and the K/V fragments) and
64 KiB K + 64 KiB V per pipeline stage: ptxas spills and smem overflows the 227 KiB of an SM. Rather than
tiling D (which costs re-reading Q per D-slice or recomputing QK^T per output slice), D=512 uses small
tiles, BLOCK_M=32, BLOCK_N=32, 8 warps, 2 stages (vLLM's H512 tuning, PR #43257): the accumulator is
64 fp32 regs/thread. Compiled ahead of time for sm_90 with Triton 3.6 (bf16, G in 1..16) that shape uses
~100 KiB smem, 180-200 registers, no spills, mma.sync (wgmma needs BLOCK_M >= 64). D=128 (128x64) and
D=256 (64x32) use wgmma, ~96 KiB smem, no spills. fp32 caches (tests only) fit but spill. These are the tiles of
``DETERMINISTIC`` (its split decode kernel shares them) and of fp32 caches; bf16 calls otherwise take larger tiles
tuned on the GPU when its chunks are long (``_prefill_config``, ``bench/tune_attention.py``). There D=512 does tile
D after all: value slices (``_value_slices``), each program recomputing QK^T over all of D and accumulating
``D / slices`` output columns, which lets a 128-row tile (wgmma) fit; measured faster than the one-program tiles.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Triton's CPU interpreter multiplies the raw bits of bf16 operands in tl.dot (triton 3.9): under it, the
# kernels upcast bf16 tiles to fp32 before each dot. Compiled kernels never take that branch.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
NO_WINDOW = 1 << 30
KV_SPLIT_KEYS = 256
"""``align_kv``'s KV split: keys at absolute positions ``[s * KV_SPLIT_KEYS, (s + 1) * KV_SPLIT_KEYS)`` form split
``s`` (a multiple of every ``BLOCK_N``). A constant: a query's reduction order follows from it and the positions alone,
whatever the batch, the chunking or the kernel (``kernels.invariant_decode_attention`` runs one split a program)."""


@triton.jit
def _find_seq(cu_seqlens_q_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b with cu[b] // BLOCK_Q + b <= tile_idx (tile starts are strictly increasing in b)."""
    left: tl.int32 = 0
    right: tl.int32 = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= tile_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _fresh_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """An empty online-softmax state: running max (log2 domain; finite, as a row may see no key in a tile),
    normaliser and unnormalised fp32 accumulator."""
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def _attend_keys(q, q_pos, m_i, l_i, acc, start, end, lo, hi, window, bt_row, k_cache_ptr, v_cache_ptr, kvh,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, offs_n, offs_d, d_mask,
                 offs_dv, dv_mask, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr, ALIGN_KV: tl.constexpr, MASKED: tl.constexpr = True):
    """The online softmax of the rows ``q [BLOCK_M, BLOCK_D]`` (at positions ``q_pos``) over the key tiles at
    ``start, start + BLOCK_N, ... < end``; keys outside ``[lo, hi)`` (``ALIGN_KV``; else below ``hi``) are not read.
    A tile a row cannot see leaves its state exactly as it was (scores -inf: the max stays, alpha is 1, p is 0).
    ``offs_n``, ``offs_d``: ``tl.arange`` over ``BLOCK_N`` and ``BLOCK_D``; ``d_mask``: ``offs_d < D``; ``offs_dv``,
    ``dv_mask``: the value columns this program accumulates (``acc [BLOCK_M, len(offs_dv)]``; all of D, or one slice).
    ``MASKED`` False: the caller vouches that every row of interest sees every key of these tiles (no bounds, causal
    or window test; the same bits as the masked loop for those rows)."""
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N]
        kv_valid = pos < hi
        if ALIGN_KV:
            kv_valid = kv_valid & (pos >= lo)
        if MASKED:
            blk = tl.load(bt_row + pos // PAGE, mask=kv_valid, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + pos // PAGE).to(tl.int64)
        tok = pos % PAGE
        k_ptrs = k_cache_ptr + blk[None, :] * stride_kb + tok[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None]
        if MASKED:
            k = tl.load(k_ptrs, mask=kv_valid[None, :] & d_mask[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        else:
            k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            delta = q_pos[:, None] - pos[None, :]
            visible = kv_valid[None, :] & (delta >= 0) & (delta < window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_cache_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :]
        if MASKED:
            v = tl.load(v_ptrs, mask=kv_valid[:, None] & dv_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        else:
            v = tl.load(v_ptrs, mask=dv_mask[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def split_state(q, q_pos, split_start, lo, hi, first, window, bt_row, k_cache_ptr, v_cache_ptr, kvh, stride_kb,
                stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, offs_n, offs_d, d_mask,
                PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """The state of the KV split at ``split_start`` (a multiple of ``SPLIT_KEYS``) from a fresh one: its key tiles
    from ``max(split_start, first)`` (``first``: ``lo`` rounded down to a tile) in order, keys in ``[lo, hi)``.
    The one definition of a split's state: the aligned prefill and ``invariant_decode_attention`` both call it."""
    m_i, l_i, acc = _fresh_state(BLOCK_M, BLOCK_D)
    return _attend_keys(q, q_pos, m_i, l_i, acc, tl.maximum(split_start, first),
                        tl.minimum(split_start + SPLIT_KEYS, hi), lo, hi, window, bt_row, k_cache_ptr, v_cache_ptr,
                        kvh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, offs_n,
                        offs_d, d_mask, offs_d, d_mask, PAGE, BLOCK_N, DOT_PRECISION, UPCAST, True)


@triton.jit
def fold_split(m_t, l_t, acc_t, m_s, l_s, acc_s):
    """The running total ``(m_t [R], l_t [R], acc_t [R, BLOCK_D])`` with one more split's state folded in: both
    rescaled to their common max, the products rounded as one fma each (never left to the compiler's contraction,
    which could differ between kernels). A row the split gave no key (``l_s == 0``) keeps its total bit for bit.
    The one merge formula: the aligned prefill and ``invariant_decode_attention``'s merge both call it."""
    m_new = tl.maximum(m_t, m_s)
    alpha = tl.exp2(m_t - m_new)
    beta = tl.exp2(m_s - m_new)
    seen = l_s > 0.0
    l_new = tl.fma(l_t, alpha, l_s * beta)
    acc_new = tl.fma(acc_t, alpha[:, None], acc_s * beta[:, None])
    return (tl.where(seen, m_new, m_t), tl.where(seen, l_new, l_t), tl.where(seen[:, None], acc_new, acc_t))


@triton.jit
def _aligned_state(q, q_pos, lo, hi, first, splits_begin, splits_end, window, bt_row, k_cache_ptr, v_cache_ptr, kvh,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, offs_n, offs_d, d_mask,
                   PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """The folded total of the splits starting at ``splits_begin, + SPLIT_KEYS, ... < splits_end``, in split order
    from a fresh total (``split_state``, ``fold_split``)."""
    m_t, l_t, acc_t = _fresh_state(BLOCK_M, BLOCK_D)
    for s0 in range(splits_begin, splits_end, SPLIT_KEYS):
        m_s, l_s, acc_s = split_state(q, q_pos, s0, lo, hi, first, window, bt_row, k_cache_ptr, v_cache_ptr, kvh,
                                      stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
                                      offs_n, offs_d, d_mask, PAGE, BLOCK_M, BLOCK_D, BLOCK_N, SPLIT_KEYS,
                                      DOT_PRECISION, UPCAST)
        m_t, l_t, acc_t = fold_split(m_t, l_t, acc_t, m_s, l_s, acc_s)
    return m_t, l_t, acc_t


@triton.jit(do_not_specialize=['num_seqs', 'stride_btb'])
def _paged_prefill_kernel(
    q_ptr,  # [T, nH, D]
    k_cache_ptr,  # [num_blocks, PAGE, nKV, D]
    v_cache_ptr,  # [num_blocks, PAGE, nKV, D]
    block_tables_ptr,  # int32 [B, max_blocks]
    cu_seqlens_q_ptr,  # int32 [B + 1]
    context_lens_ptr,  # int32 [B]
    out_ptr,  # [T, nH, D]
    qk_scale,  # softmax scale * log2(e)
    window,  # int; NO_WINDOW when full attention
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_ot,
    stride_oh,
    PAGE: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ALIGN_KV: tl.constexpr = False,
    SPLIT_KEYS: tl.constexpr = 256,  # ALIGN_KV: keys per KV split (a multiple of BLOCK_N)
    SLICES: tl.constexpr = 1,  # value slices: each program accumulates BLOCK_D // SLICES output columns (not ALIGN_KV)
):
    tile_idx = tl.program_id(0)
    kvh = tl.program_id(1) // SLICES
    offs_dv = (tl.program_id(1) % SLICES) * (BLOCK_D // SLICES) + tl.arange(0, BLOCK_D // SLICES)
    dv_mask = offs_dv < D
    b = _find_seq(cu_seqlens_q_ptr, tile_idx, num_seqs, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + b)
    chunk_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_begin
    q_start = (tile_idx - (q_begin // BLOCK_Q + b)) * BLOCK_Q  # first chunk-local query of this tile
    if q_start >= chunk_len:
        return
    ctx = tl.load(context_lens_ptr + b)
    prefix = ctx - chunk_len  # absolute position of the chunk's first query

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < D
    q_tok = q_start + offs_m // G  # [BLOCK_M] chunk-local token of each row
    heads = kvh * G + offs_m % G  # [BLOCK_M]
    row_valid = (offs_m // G < BLOCK_Q) & (q_tok < chunk_len)
    q_pos = prefix + q_tok  # [BLOCK_M]
    q_rows = (q_begin + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    hi = prefix + tl.minimum(q_start + BLOCK_Q, chunk_len)  # one past the last query's position
    lo = tl.maximum(prefix + q_start - window + 1, 0)  # first key in the first query's window
    first = lo
    if ALIGN_KV:  # key tiles at multiples of BLOCK_N whatever the tile's first query (keys before lo stay unread)
        first = lo // BLOCK_N * BLOCK_N

    m_i, l_i, acc = _fresh_state(BLOCK_M, BLOCK_D // SLICES)
    bt_row = block_tables_ptr + b * stride_btb
    if ALIGN_KV:  # the state of each KV split of SPLIT_KEYS positions from a fresh one, folded in split order
        m_i, l_i, acc = _aligned_state(q, q_pos, lo, hi, first, first // SPLIT_KEYS * SPLIT_KEYS, hi, window, bt_row,
                                       k_cache_ptr, v_cache_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb,
                                       stride_vt, stride_vh, qk_scale, offs_n, offs_d, d_mask, PAGE, BLOCK_M,
                                       BLOCK_D, BLOCK_N, SPLIT_KEYS, DOT_PRECISION, UPCAST)
    else:
        # The key tiles first, first + BLOCK_N, ... < hi in order, in three runs: those that every query of the tile
        # sees whole (from the last query's window start to the first query's position) without masks, the ones
        # before (window edge) and after (causal diagonal) with them. The same tiles in the same order as one masked
        # loop: the same bits for every stored row.
        full_lo = tl.maximum(hi - window, 0)  # hi - 1 is the last query's position
        full_hi = prefix + q_start + 1
        tiles_lo = (tl.maximum(full_lo - first, 0) + BLOCK_N - 1) // BLOCK_N
        tiles_hi = tl.maximum((full_hi - first) // BLOCK_N, tiles_lo)
        edge_end = tl.minimum(first + tiles_lo * BLOCK_N, hi)
        full_end = tl.maximum(tl.minimum(first + tiles_hi * BLOCK_N, hi), edge_end)  # empty when no tile is whole
        m_i, l_i, acc = _attend_keys(q, q_pos, m_i, l_i, acc, first, edge_end, lo, hi, window, bt_row, k_cache_ptr,
                                     v_cache_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                     stride_vh, qk_scale, offs_n, offs_d, d_mask, offs_dv, dv_mask, PAGE, BLOCK_N,
                                     DOT_PRECISION, UPCAST, False, True)
        m_i, l_i, acc = _attend_keys(q, q_pos, m_i, l_i, acc, edge_end, full_end, lo, hi, window, bt_row,
                                     k_cache_ptr, v_cache_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb,
                                     stride_vt, stride_vh, qk_scale, offs_n, offs_d, d_mask, offs_dv, dv_mask,
                                     PAGE, BLOCK_N, DOT_PRECISION, UPCAST, False, False)
        m_i, l_i, acc = _attend_keys(q, q_pos, m_i, l_i, acc, full_end, hi, lo, hi, window, bt_row, k_cache_ptr,
                                     v_cache_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                     stride_vh, qk_scale, offs_n, offs_d, d_mask, offs_dv, dv_mask, PAGE, BLOCK_N,
                                     DOT_PRECISION, UPCAST, False, True)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dv_mask[None, :],
    )


LONG_CHUNK_TOKENS = 64
"""A call whose chunks average at least this many tokens takes the long-chunk tiles (``_prefill_config``)."""


def _prefill_config(head_dim: int, small_tiles: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim. ``small_tiles``: those of the module docstring, which
    ``DETERMINISTIC``'s split decode kernel shares (its registers), fp32 caches need (shared memory), and a step of
    mostly one-token rows (decodes beside a chunk) keeps (each row's tile is padded to BLOCK_M: a larger one only adds
    compute). Otherwise the tiles ``bench/tune_attention.py`` found fastest for long bf16 chunks (docs/benchmarks.md;
    head_dim 512 with ``_value_slices``)."""
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim <= 128:
        return (128, 64, 8, 2) if small_tiles else (128, 128, 8, 3)
    if head_dim <= 256:
        return (64, 32, 8, 2) if small_tiles else (128, 64, 8, 2)
    return (32, 32, 8, 2) if small_tiles else (128, 32, 8, 2)


def _value_slices(head_dim: int, small_tiles: bool) -> int:
    """Programs a (query tile, kv head) of a long-chunk call splits its output columns over: each recomputes the
    scores over all of D and accumulates ``D / slices`` value columns, so its accumulator leaves registers for a larger
    query tile, at (1 + slices) / 2 times the FLOPs. 1: one program holds the whole row (every head dim up to 256, and
    every small-tile call). Head dim 512 takes 2, with ``_prefill_config``'s 128-row tile: its one-program 64-row tile
    spills (``bench/tune_attention.py`` timed both; docs/benchmarks.md)."""
    return 2 if head_dim > 256 and not small_tiles else 1


def tile_config(head_dim: int, group: int, block_m: int | None = None, block_n: int | None = None,
                small_tiles: bool = True) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of a call (``paged_prefill_attention``'s overrides applied):
    ``kernels.invariant_decode_attention`` launches with the small ones, the aligned prefill's, so that a row's dots
    and sums are the aligned prefill's."""
    cfg_m, cfg_n, num_warps, num_stages = _prefill_config(head_dim, small_tiles)
    return max(block_m or cfg_m, triton.next_power_of_2(group)), block_n or cfg_n, num_warps, num_stages


def paged_prefill_attention(
    q: torch.Tensor,  # [T, nH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    cu_seqlens_q: torch.Tensor,  # int32 [B + 1]
    context_lens: torch.Tensor,  # int32 [B]
    scale: float,
    window: int | None,
    *,
    out: torch.Tensor | None = None,  # [T, nH, D]
    block_m: int | None = None,
    block_n: int | None = None,
    align_kv: bool = False,
    split_keys: int | None = None,
    value_slices: int | None = None,
) -> torch.Tensor:  # [T, nH, D]
    """Paged causal (+ sliding window) prefill attention; see the module docstring for the contract.

    ``align_kv`` (``DETERMINISTIC``): key tiles start at multiples of ``BLOCK_N`` (absolute positions) instead of at
    the window start of the tile's first query, so every query reduces its keys in the same tiles and order whether
    its prefix was computed in chunks, in one piece, by decodes or read from the cache (tiles it cannot see leave
    its running max, sum and accumulator exactly as they were). The tiles are grouped into KV splits of
    ``split_keys`` positions (default ``KV_SPLIT_KEYS``; tests pass small ones): each split's state is computed from
    a fresh one (``split_state``) and folded into the running total in split order (``fold_split``), so the
    one-split-a-program decode kernel (``kernels.invariant_decode_attention``) gives a query the same bits.

    ``block_m``/``block_n`` override the tile sizes (powers of two, >= 16; tests use small ones to cross
    tile boundaries). ``block_m`` is raised to the next power of two >= G if smaller. ``value_slices`` overrides
    ``_value_slices`` (a power of two leaving >= 16 columns a slice; 1 with ``align_kv``).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape[-1] == head_dim and v_cache.shape == k_cache.shape
    assert cu_seqlens_q.shape[0] == num_seqs + 1
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    small_tiles = align_kv or k_cache.dtype == torch.float32 or num_tokens < LONG_CHUNK_TOKENS * num_seqs
    block_m, block_n, num_warps, num_stages = tile_config(head_dim, group, block_m, block_n, small_tiles)
    block_q = block_m // group
    split_keys = split_keys or KV_SPLIT_KEYS
    if align_kv and split_keys % block_n:
        raise ValueError(f"split_keys ({split_keys}) must be a multiple of the key tile ({block_n})")
    upcast = INTERPRETED and k_cache.dtype == torch.bfloat16
    block_d = max(16, triton.next_power_of_2(head_dim))
    slices = value_slices or _value_slices(head_dim, small_tiles)
    if block_d % slices or block_d // slices < 16 or (align_kv and slices != 1):
        raise ValueError(f"value_slices ({slices}) must divide the head tile ({block_d}) into >= 16 columns, and be "
                         "1 with align_kv")
    grid = (num_tokens // block_q + num_seqs, num_kv_heads * slices)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        out,
        scale * LOG2E,
        NO_WINDOW if window is None else window,
        num_seqs,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        PAGE=block_size,
        G=group,
        D=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        ALIGN_KV=align_kv,
        SPLIT_KEYS=split_keys,
        SLICES=slices,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
