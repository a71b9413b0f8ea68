"""Batch-invariant paged decode attention (``DETERMINISTIC=true``): one program per KV split, the splits folded in
split order, bit for bit the aligned prefill kernel's result for the same query.

Contract: ``kernels.decode_attention.paged_decode_attention``'s (``q [B, nH, D]``, one query a sequence at
``context_lens[b] - 1``, its K/V already stored; a sliding ``window``; GQA; ``context_lens[b] == 0`` gives a zero
row), and the output of ``paged_prefill_attention(..., align_kv=True)`` for that query, bitwise, whatever the batch.

Why it is the same: the aligned prefill defines a query's attention as the online-softmax state of each KV split
(keys at absolute positions ``[s * S, (s + 1) * S)``, ``S = KV_SPLIT_KEYS``) computed over its ``BLOCK_N`` tiles in
order from a fresh state (``prefill_attention.split_state``), folded from a fresh total in split order by one formula
(``prefill_attention.fold_split``), then normalised. Here program ``(b, kv head, j)`` computes the state of the
``j``-th split its query sees with the same function, on a query tile of the same ``BLOCK_M`` rows (the G heads in
rows ``0 .. G - 1``, as a one-token prefill chunk puts them), the same ``BLOCK_N`` and warps
(``prefill_attention.tile_config``): each row's dot products and sums are then the prefill's. The states go to an
fp32 workspace; the kv head's last split program to finish (an arrival counter, as ``decode_attention``'s fused
merge) folds its G rows' states with ``fold_split`` and normalises, in the same launch (past
``FUSED_FOLD_MAX_HEADS`` a second launch, ``_fold_splits_kernel``, does: the same arithmetic). A split a query does not
see leaves the prefill's total exactly as it was, so the prefill's extra splits (those of its tile's other queries)
change nothing. Nothing depends on the batch: not the split size, not a split's tiles, not the fold order.

Static shapes (CUDA graphs): the grid has ``num_split_programs`` programs a (sequence, kv head), chosen from the batch
size, the kv heads and the longest visible range (``max_context_len``, the window) like the default kernel's split
count. A sequence whose query sees one split, or more splits than there are programs (a long context at a large
batch), is folded by its split-0 program alone, in registers, with ``_aligned_state`` — the prefill kernel's code and
its bits — so the workspace is ``B * nH * num_split_programs`` states, whatever the context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inference_server.kernels.arrival_counters import arrival_counters
from inference_server.kernels.decode_attention import H200_NUM_SMS, MAX_SPLITS, _num_sms
from inference_server.kernels.prefill_attention import (
    INTERPRETED,
    KV_SPLIT_KEYS,
    LOG2E,
    NO_WINDOW,
    _aligned_state,
    _fresh_state,
    fold_split,
    split_state,
    tile_config,
)

FUSED_FOLD_MAX_HEADS = 4096
"""Most (sequence, kv head) pairs whose split states the split launch folds itself (its arrival counters); above, a
second launch folds them (``_fold_splits_kernel``). The same fold, the same bits either way."""


@triton.jit
def _visible_splits(ctx, window, SPLIT_KEYS: tl.constexpr):
    """``(lo, first_split, n)``: the first key the query at ``ctx - 1`` sees, the index of its split, and how many
    splits its keys ``[lo, ctx)`` span (0 for an empty slot: ``ctx == 0``)."""
    lo = tl.maximum(ctx - window, 0)
    first_split = lo // SPLIT_KEYS
    n = tl.where(ctx > 0, (tl.maximum(ctx, 1) - 1) // SPLIT_KEYS - first_split + 1, 0)
    return lo, first_split, n


@triton.jit
def _fold_rows(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, rows, out_offsets, row_mask, n, D: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The split states of ``rows [R]`` (split 0's index in the workspace of each (sequence, head)) folded in split
    order from a fresh total (``fold_split``), normalised as the prefill kernel normalises, stored at ``out_ptr +
    out_offsets[R, None] + d``. Elementwise over rows: the bits do not depend on how many rows a program folds."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    m_t, l_t, acc_t = _fresh_state(BLOCK_R, BLOCK_D)
    for j in range(0, n):
        m_s = tl.load(part_m_ptr + rows + j, mask=row_mask, other=-1.0e30, cache_modifier=".cg")
        l_s = tl.load(part_l_ptr + rows + j, mask=row_mask, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(part_acc_ptr + (rows[:, None] + j) * D + offs_d[None, :],
                        mask=row_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
        m_t, l_t, acc_t = fold_split(m_t, l_t, acc_t, m_s, l_s, acc_s)
    out = acc_t / tl.where(l_t == 0.0, 1.0, l_t)[:, None]
    tl.store(out_ptr + out_offsets[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _split_decode_kernel(
    q_ptr,  # [B, nH, D]
    k_cache_ptr,  # [num_blocks, PAGE, nKV, D]
    v_cache_ptr,  # [num_blocks, PAGE, nKV, D]
    block_tables_ptr,  # int32 [B, max_blocks]
    context_lens_ptr,  # int32 [B]
    out_ptr,  # [B, nH, D]: written here for the sequences folded in one program
    part_m_ptr,  # fp32 [B, nH, P]
    part_l_ptr,  # fp32 [B, nH, P]
    part_acc_ptr,  # fp32 [B, nH, P, D]
    counter_ptr,  # int32 [B * nKV] arrival counters, zero between launches (FUSED_FOLD)
    qk_scale,  # softmax scale * log2(e)
    window,  # int; NO_WINDOW when full attention
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    PAGE: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSED_FOLD: tl.constexpr = False,  # the kv head's last split program to finish folds the states
    BLOCK_R: tl.constexpr = 16,  # G padded to a power of two: the folded rows (FUSED_FOLD)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    j = tl.program_id(2)
    num_programs = tl.num_programs(2)
    ctx = tl.load(context_lens_ptr + b)
    lo, first_split, n = _visible_splits(ctx, window, SPLIT_KEYS)
    alone = (n <= 1) | (n > num_programs)  # folded by program 0 in registers
    if tl.where(alone, j > 0, j >= n):
        return

    # The query tile of a one-token prefill chunk: row r is head kvh * G + r for r < G, zeros below.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < D
    heads = kvh * G + offs_m % G  # [BLOCK_M]
    row_valid = offs_m < G
    q_pos = ctx - 1 + offs_m // G  # [BLOCK_M], as the prefill kernel positions its rows
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)
    first = lo // BLOCK_N * BLOCK_N
    bt_row = block_tables_ptr + b * stride_btb

    if alone:
        _, l_t, acc_t = _aligned_state(q, q_pos, lo, ctx, first, first_split * SPLIT_KEYS, ctx, window, bt_row,
                                       k_cache_ptr, v_cache_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb,
                                       stride_vt, stride_vh, qk_scale, offs_n, offs_d, d_mask, PAGE, BLOCK_M,
                                       BLOCK_D, BLOCK_N, SPLIT_KEYS, DOT_PRECISION, UPCAST)
        out = acc_t / tl.where(l_t == 0.0, 1.0, l_t)[:, None]
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )
    else:
        m_s, l_s, acc_s = split_state(q, q_pos, (first_split + j) * SPLIT_KEYS, lo, ctx, first, window, bt_row,
                                      k_cache_ptr, v_cache_ptr, kvh, stride_kb, stride_kt, stride_kh, stride_vb,
                                      stride_vt, stride_vh, qk_scale, offs_n, offs_d, d_mask, PAGE, BLOCK_M, BLOCK_D,
                                      BLOCK_N, SPLIT_KEYS, DOT_PRECISION, UPCAST)
        row = ((b * tl.num_programs(1) * G + heads).to(tl.int64) * num_programs + j)  # [BLOCK_M]
        tl.store(part_m_ptr + row, m_s, mask=row_valid)
        tl.store(part_l_ptr + row, l_s, mask=row_valid)
        tl.store(part_acc_ptr + row[:, None] * D + offs_d[None, :], acc_s, mask=row_valid[:, None] & d_mask[None, :])
        if FUSED_FOLD:
            # Each split program counts itself in; the last to arrive folds the kv head's G rows (as
            # decode_attention's fused merge: the barrier puts this program's stores before the counter's release,
            # acq_rel at GPU scope; the last program's acquire makes the others' visible, its loads bypass L1).
            tl.debug_barrier()
            counter = counter_ptr + b * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(counter, 1)
            if arrived == n - 1:
                offs_r = tl.arange(0, BLOCK_R)
                heads_r = kvh * G + offs_r
                rows = (b * tl.num_programs(1) * G + heads_r).to(tl.int64) * num_programs  # [BLOCK_R] split 0's
                _fold_rows(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr + b.to(tl.int64) * stride_ob, rows,
                           heads_r * stride_oh, offs_r < G, n, D, BLOCK_R, BLOCK_D)
                tl.atomic_xchg(counter, 0)  # ready for the next launch (stream order keeps launches apart)


@triton.jit
def _fold_splits_kernel(
    part_m_ptr,  # fp32 [B, nH, P]
    part_l_ptr,  # fp32 [B, nH, P]
    part_acc_ptr,  # fp32 [B, nH, P, D]
    context_lens_ptr,  # int32 [B]
    out_ptr,  # [B, nH, D]
    window,
    num_programs,  # P
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
):
    """One (sequence, head): its split states folded in split order from a fresh total (``fold_split``) and
    normalised as the prefill kernel normalises; sequences folded in the split kernel are skipped."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + b)
    _, _, n = _visible_splits(ctx, window, SPLIT_KEYS)
    if (n <= 1) | (n > num_programs):
        return
    head = h + tl.zeros([1], dtype=tl.int32)  # one row: registers O(D)
    _fold_rows(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr + b.to(tl.int64) * stride_ob,
               (b * tl.num_programs(1) + head).to(tl.int64) * num_programs, head * stride_oh, head >= 0, n, D, 1,
               BLOCK_D)


def max_visible_splits(max_context_len: int, window: int | None, split_keys: int = KV_SPLIT_KEYS) -> int:
    """The most KV splits one query's keys span: its whole context's, or a window's (``W`` keys starting anywhere
    in a split reach into ``1 + ceil((W - 1) / S)`` splits)."""
    full = triton.cdiv(max(max_context_len, 1), split_keys)
    return full if window is None else min(full, 1 + triton.cdiv(max(window - 1, 0), split_keys))


def num_split_programs(batch: int, num_kv_heads: int, max_splits: int, num_sms: int = H200_NUM_SMS) -> int:
    """Programs a (sequence, kv head): enough to fill ~2 waves of SMs (as ``decode_attention.choose_num_splits``),
    never more than the splits a query can see or ``MAX_SPLITS``. Only speed and the workspace follow from it: a
    sequence with more splits than programs is folded by one program, with the same bits."""
    return max(1, min(triton.cdiv(2 * num_sms, max(1, batch * num_kv_heads)), max_splits, MAX_SPLITS))


def invariant_decode_attention(
    q: torch.Tensor,  # [B, nH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    context_lens: torch.Tensor,  # int32 [B]
    scale: float,
    window: int | None,
    *,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,  # [B, nH, D]
    num_programs: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    split_keys: int | None = None,
) -> torch.Tensor:  # [B, nH, D]
    """Decode attention with ``paged_prefill_attention(align_kv=True)``'s bits (module docstring).

    ``max_context_len`` bounds every context (default: the block tables' capacity); with the window it sizes the grid
    (``num_programs`` overrides the split programs a sequence gets, for tests). ``block_m``, ``block_n`` and
    ``split_keys`` must be those of the prefill calls whose bits this matches (tests pass small ones; the defaults
    are the prefill's). No host syncs: grid and workspace follow from the shapes and these ints (CUDA graphs)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape[-1] == head_dim and v_cache.shape == k_cache.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    block_m, block_n, num_warps, num_stages = tile_config(head_dim, group, block_m, block_n)
    split_keys = split_keys or KV_SPLIT_KEYS
    if split_keys % block_n:
        raise ValueError(f"split_keys ({split_keys}) must be a multiple of the key tile ({block_n})")
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_programs is None:
        bound = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
        num_programs = num_split_programs(batch, num_kv_heads, max_visible_splits(bound, window, split_keys),
                                          _num_sms(q.device.index if q.is_cuda else None))
    part_m = torch.empty((batch, num_heads, num_programs), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((batch, num_heads, num_programs, head_dim), dtype=torch.float32, device=q.device)
    upcast = INTERPRETED and k_cache.dtype == torch.bfloat16
    block_d = max(16, triton.next_power_of_2(head_dim))
    win = NO_WINDOW if window is None else window
    fused = num_programs > 1 and batch * num_kv_heads <= FUSED_FOLD_MAX_HEADS
    counters = arrival_counters("invariant_decode_attention", FUSED_FOLD_MAX_HEADS, q.device) if fused else part_m
    _split_decode_kernel[(batch, num_kv_heads, num_programs)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc, counters, scale * LOG2E, win,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        PAGE=block_size, G=group, D=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT_KEYS=split_keys, DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast, FUSED_FOLD=fused, BLOCK_R=triton.next_power_of_2(group), num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_programs > 1 and not fused:
        _fold_splits_kernel[(batch, num_heads)](
            part_m, part_l, part_acc, context_lens, out, win, num_programs, out.stride(0), out.stride(1),
            D=head_dim, BLOCK_D=block_d, SPLIT_KEYS=split_keys, num_warps=4,
        )
    return out
