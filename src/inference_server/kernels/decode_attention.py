"""Triton paged decode attention (one query token per sequence), with a split-KV (flash-decoding) variant.

Contract (oracle: ``tests/kernels/reference_attention.py``):

* ``q``: ``[B, nH, D]``; ``k_cache``/``v_cache``: ``[num_blocks, block_size, nKV, D]`` (last dim contiguous);
  ``block_tables``: ``int32 [B, max_blocks]``; ``context_lens``: ``int32 [B]`` including the query token,
  whose K/V must already be stored. The query of sequence ``b`` sits at ``q_pos = context_lens[b] - 1``.
* Sees keys ``max(0, q_pos - W + 1) .. q_pos`` (W = ``window``, or all keys when ``window`` is None). Only
  those positions are loaded, so block-table entries of released blocks outside the window are never read.
* ``nH`` is a multiple of ``nKV``; one program serves all ``G = nH // nKV`` query heads of a kv head, so the
  K/V tiles are read once per group. Scores ``q·k * scale`` and the softmax are fp32; output dtype = q's.
* ``context_lens[b] == 0`` (a padded batch slot) gives a zero output row and reads nothing.
* No host syncs: grid sizes come from tensor shapes and Python ints only, so the call can be captured in a
  CUDA graph (the split count is fixed at capture time from the shapes; each sequence divides *its own*
  visible range evenly between the splits at run time).

Split-KV: with ``S`` splits, program ``(b, kv_head, s)`` handles the ``s``-th slice of the visible range and
writes a partial ``(m, l, acc)`` (running max in the log2 domain, normaliser, unnormalised fp32 output) to a
workspace; they are merged with the usual rescaling, by default inside the same launch (the kv head's last split
to finish, found by an arrival counter, merges its G heads: one launch a layer fewer at decode), else by
``_decode_reduce_kernel``. Without splits the grid is only
``B * nKV`` programs, which leaves most of the 132 SMs idle at small batch (vLLM #34579), hence the auto
choice in :func:`choose_num_splits`.

Tiles: the G query heads are padded to 16 rows (the smallest tl.dot M), K is read as ``[D, BLOCK_N]`` and V
as ``[BLOCK_N, D]`` straight from the pages (16-byte cp.async gathers), both issued before the scores need K. The
launch follows a :class:`DecodePlan` (default: :func:`decode_plan`). A plan's ``table_ahead`` (the default never
sets it) loads the next tile's block-table entries an iteration early, with which Triton's pipeliner double-buffers
the K/V tiles (with the table loaded in the iteration that uses it, it keeps one K/V tile in shared memory); the
output is the same bit for bit.

At batch 1 the kernel is a chain of dependent round trips, not a stream of bytes (its time a layer is several times
that of its K/V reads: docs/benchmarks.md, the decode attention at its real context). Hence the many
splits at small batch (one key tile each at a short context) and a merge that loads the partials of the kv head's G
real heads, up to ``_MERGE_ELEMENTS`` at a time, with the maxima and normalisers in the same round trip. With PDL
and an unpipelined key loop (``kv_before_wait``: 1-2 sequences of head_dim <= 128) the first links of that chain
leave it: every program loads the context length, the block table and its first key tile's earlier keys and values
before its PDL wait, while the launch before it (the q/k norm + RoPE that stores this step's key) still runs, and
only the query and its own key and value after it.
"""

from __future__ import annotations

import functools
import os

import attrs
import torch
import triton
import triton.language as tl

from inference_server.kernels.arrival_counters import arrival_counters
from inference_server.kernels.pdl import (
    pdl_enabled,
    pdl_launch,
    pdl_release,
    pdl_release_after_loop,
    pdl_release_after_wait,
    pdl_wait,
)

LOG2E = 1.4426950408889634
# Triton's CPU interpreter multiplies the raw bits of bf16 operands in tl.dot (triton 3.9): under it, the
# kernels upcast bf16 tiles to fp32 before each dot. Compiled kernels never take that branch.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
NO_WINDOW = 1 << 30  # "window" passed to the kernels when there is none
MIN_TOKENS_PER_SPLIT = 64
"""A split of the longest visible range holds at least one key tile: more splits than that would stay empty. (Each
sequence shares its own range out at run time, so at a short context the splits hold a tile each.)"""
MAX_SPLITS = 64
H200_NUM_SMS = 132
_MAX_FUSED_HEADS = 4096
"""Most (sequence, kv head) programs the fused split merge takes (split-KV runs only below one per SM anyway)."""
_MERGE_ELEMENTS = 16384
"""fp32 values of split accumulators the merging program loads at a time (64 KB: with G <= 2 heads of D = 256, or
G = 8 of D = 128, the 16 splits of a short context at decode in one load)."""


@triton.jit
def _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, rows, out_offsets, row_mask, span, num_splits,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLIT_CHUNK: tl.constexpr):
    """Merge the split partials of a block of heads (the decode kernel's last split, or ``_decode_reduce_kernel``
    with one head a program): ``rows [R]`` (split 0's row of each head in the partials), written to
    ``out_ptr + out_offsets[R, None] + d``. ``span``: the visible keys, from which the
    active splits follow as in the decode kernel. ``SPLIT_CHUNK`` splits' accumulators are loaded at a time."""
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    n_active = tl.cdiv(span, tl.maximum(chunk, 1))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    sm = row_mask[:, None] & (offs_s < n_active)[None, :]  # [R, BLOCK_S]
    offs_c = tl.arange(0, SPLIT_CHUNK)
    # Every load the first chunk of splits needs is issued at once, before any of them is used: when the active
    # splits fit one chunk (a short context at decode) the merge costs one L2 round trip, not two.
    m = tl.load(part_m_ptr + rows[:, None] + offs_s[None, :], mask=sm, other=float("-inf"), cache_modifier=".cg")
    l_part = tl.load(part_l_ptr + rows[:, None] + offs_s[None, :], mask=sm, other=0.0, cache_modifier=".cg")
    cm = row_mask[:, None] & (offs_c < n_active)[None, :]  # [R, C]
    m_first = tl.load(part_m_ptr + rows[:, None] + offs_c[None, :], mask=cm, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(part_acc_ptr + (rows[:, None, None] + offs_c[None, :, None]) * D + offs_d[None, None, :],
                   mask=cm[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")  # [R, C, BLOCK_D]
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no active split: all weights 0
    denom = tl.sum(tl.exp2(m - m_max[:, None]) * l_part, 1)  # [R]
    acc = tl.sum(tl.exp2(m_first - m_max[:, None])[:, :, None] * part, 1)  # [R, BLOCK_D]
    for s0 in range(SPLIT_CHUNK, n_active, SPLIT_CHUNK):
        s = s0 + offs_c  # [C]
        cm = row_mask[:, None] & (s < n_active)[None, :]  # [R, C]
        w = tl.exp2(tl.load(part_m_ptr + rows[:, None] + s[None, :], mask=cm, other=float("-inf"),
                            cache_modifier=".cg") - m_max[:, None])  # [R, C]
        part = tl.load(part_acc_ptr + (rows[:, None, None] + s[None, :, None]) * D + offs_d[None, None, :],
                       mask=cm[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")  # [R, C, BLOCK_D]
        acc += tl.sum(w[:, :, None] * part, 1)
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(out_ptr + out_offsets[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _norm_rope_rows(x, q_rows, offs_d, d_mask, g_mask, w_ptr, cos_row, sin_row, eps, D: tl.constexpr,
                    GEMMA: tl.constexpr):
    """Raw query rows ``x [BLOCK_G, BLOCK_D]`` (loaded from ``q_rows [BLOCK_G]`` pointers) normed over D and rotated
    (NeoX half split), with ``kernels.qk_norm_rope``'s arithmetic and roundings: the norm (``gemma``: ``x * inv *
    w``; ``qwen``: ``x * inv`` rounded, then ``* w``) rounded to x's dtype, each RoPE product and their sum rounded.
    The partner half of each element (``d +- D/2``) is a second load of the same rows."""
    HALF: tl.constexpr = D // 2
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    xp = tl.load(q_rows[:, None] + partner[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    dtype = x.dtype
    xf = x.to(tl.float32)
    xpf = xp.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]  # [BLOCK_G, 1]
    n = xf * inv
    npart = xpf * inv
    if not GEMMA:  # Qwen: cast to the input dtype, then times the weight
        n = n.to(dtype).to(tl.float32)
        npart = npart.to(dtype).to(tl.float32)
    n = (n * w[None, :]).to(dtype).to(tl.float32)
    npart = (npart * wp[None, :]).to(dtype).to(tl.float32)
    # first half: n * cos - partner * sin; second half: n * cos + partner * sin (each product rounded, then the sum)
    signed = tl.where((offs_d < HALF)[None, :], -npart, npart)
    a = (n * cos[None, :]).to(dtype).to(tl.float32)
    b = (signed * sin[None, :]).to(dtype).to(tl.float32)
    return (a + b).to(dtype)


@triton.jit
def _split_range(context_lens_ptr, b, window, num_splits, split, BLOCK_N: tl.constexpr):
    """``(ctx, lo, start, end)``: sequence ``b``'s context length, its first visible key, and the keys
    ``[start, end)`` of split ``split`` (whole tiles of the visible range shared out evenly; empty past its end)."""
    ctx = tl.load(context_lens_ptr + b)
    lo = tl.maximum(ctx - window, 0)  # first visible key
    chunk = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, ctx)
    return ctx, lo, start, end


@triton.jit
def _earlier_keys(pos, end, ctx):
    """The positions of ``pos`` (``[BLOCK_N]``) below ``end`` that earlier steps stored: all but the query's own
    key (``ctx - 1``), which this step's launch before the attention writes."""
    return pos < tl.minimum(end, ctx - 1)


@triton.jit
def _tile_blocks(bt_row, pos, valid, PAGE: tl.constexpr):
    """The cache blocks of the key positions ``pos`` (``[BLOCK_N]``) from the block table row ``bt_row``, as int64
    (0 where not ``valid``, whose table entries are not read)."""
    return tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, blk, pos, valid, kvh, offs_d, d_mask, stride_kb, stride_kt, stride_kh,
                  stride_vb, stride_vt, stride_vh, PAGE: tl.constexpr):
    """K as ``[BLOCK_D, BLOCK_N]`` and V as ``[BLOCK_N, BLOCK_D]`` of kv head ``kvh`` at the key positions ``pos`` in
    their blocks ``blk`` (``_tile_blocks``); zero where not ``valid`` (nothing is read there). K and V are both
    issued before the scores need K: at decode a program runs one or two tiles, and V's HBM round trip then overlaps
    K's instead of following the softmax."""
    tok = pos % PAGE
    k = tl.load(
        k_cache_ptr + blk[None, :] * stride_kb + tok[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
        mask=valid[None, :] & d_mask[:, None],
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr + blk[:, None] * stride_vb + tok[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
        mask=valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    return k, v


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of the online softmax: ``q [BLOCK_G, BLOCK_D]``, ``k [BLOCK_D, BLOCK_N]``, ``v [BLOCK_N,
    BLOCK_D]``, ``valid [BLOCK_N]``; returns the updated running max (log2 domain), normaliser and accumulator. A
    tile with no valid key leaves them as they were."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, nH, D]
    k_cache_ptr,  # [num_blocks, PAGE, nKV, D]
    v_cache_ptr,  # [num_blocks, PAGE, nKV, D]
    block_tables_ptr,  # int32 [B, max_blocks]
    context_lens_ptr,  # int32 [B]
    out_ptr,  # [B, nH, D] (when not SPLIT, or with FUSED_REDUCE)
    part_m_ptr,  # fp32 [B, nH, num_splits] (used when SPLIT)
    part_l_ptr,  # fp32 [B, nH, num_splits]
    part_acc_ptr,  # fp32 [B, nH, num_splits, D]
    counter_ptr,  # int32 [B * nKV] arrival counters, zero between launches (FUSED_REDUCE)
    qk_scale,  # softmax scale * log2(e)
    window,  # int; NO_WINDOW when full attention
    num_splits,
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
    qw_ptr,  # Q_NORM_ROPE: [D] the q norm's weight (else any pointer, unread)
    cos_ptr,  # Q_NORM_ROPE: [B, D] this step's RoPE tables (row b for sequence b)
    sin_ptr,
    stride_cs,
    q_eps,
    PAGE: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    FUSED_REDUCE: tl.constexpr = False,  # SPLIT: the kv head's last split to finish merges the partials
    BLOCK_S: tl.constexpr = 1,  # num_splits padded to a power of two (FUSED_REDUCE)
    SPLIT_CHUNK: tl.constexpr = 1,  # splits merged per load (FUSED_REDUCE)
    BLOCK_R: tl.constexpr = 16,  # G padded to a power of two: the merged rows (FUSED_REDUCE)
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
    Q_NORM_ROPE: tl.constexpr = 0,  # q is raw: normed (1: gemma, 2: qwen convention) and rotated here first
    KV_BEFORE_WAIT: tl.constexpr = False,  # the first key tile's earlier keys are loaded before the PDL wait
    TABLE_AHEAD: tl.constexpr = False,  # the key loop loads the next tile's block-table entries one iteration ahead
):
    if not KV_BEFORE_WAIT:
        # PDL (kernels.pdl): the query, the context lengths, the block tables and the new K/V rows all come from
        # earlier launches (nothing here is a weight), so wait before the first load.
        pdl_wait(USE_PDL)
        pdl_release_after_wait(USE_PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * G
    if not KV_BEFORE_WAIT:
        ctx, lo, start, end = _split_range(context_lens_ptr, b, window, num_splits, split, BLOCK_N)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g  # [BLOCK_G]
    bt_row = block_tables_ptr + b * stride_btb

    if KV_BEFORE_WAIT:
        # PDL (kernels.pdl): the context lengths and block tables are copied in before the step, and every key but
        # this step's (position ctx - 1) was stored by earlier steps, so their last writers completed before the
        # launch just before this one passed its own wait. The first tile of those keys is in flight while that
        # launch (the q/k norm + RoPE that stores the new key, or the q projection) still runs: at decode a program
        # holds one or two tiles, and this chain of round trips (length, table, K/V) was most of its time.
        ctx, lo, start, end = _split_range(context_lens_ptr, b, window, num_splits, split, BLOCK_N)
        pos0 = start + offs_n  # [BLOCK_N]
        blk0 = _tile_blocks(bt_row, pos0, pos0 < end, PAGE)  # this step's key's block too: the table is the host's
        k0, v0 = _load_kv_tile(k_cache_ptr, v_cache_ptr, blk0, pos0, _earlier_keys(pos0, end, ctx), kvh, offs_d,
                               d_mask, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, PAGE)
        # the query and this step's K/V row come from the launches just before
        pdl_wait(USE_PDL)
        pdl_release_after_wait(USE_PDL)

    q_rows = q_ptr + b * stride_qb + heads * stride_qh  # [BLOCK_G]
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BG, BD]
    if Q_NORM_ROPE:  # padded heads (rows past G) stay zero: x = 0 normalises to 0
        q = _norm_rope_rows(q, q_rows, offs_d, d_mask, g_mask, qw_ptr, cos_ptr + b * stride_cs,
                            sin_ptr + b * stride_cs, q_eps, D, Q_NORM_ROPE == 1)
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    first = start
    if KV_BEFORE_WAIT:
        # this step's key and value, if the first tile holds them, now that their writer has completed (one round
        # trip, beside the query's)
        fresh = (pos0 == ctx - 1) & (pos0 < end)
        k1, v1 = _load_kv_tile(k_cache_ptr, v_cache_ptr, blk0, pos0, fresh, kvh, offs_d, d_mask, stride_kb, stride_kt,
                               stride_kh, stride_vb, stride_vt, stride_vh, PAGE)
        k0 = tl.where(fresh[None, :], k1, k0)
        v0 = tl.where(fresh[:, None], v1, v0)
        m_i, l_i, acc = _attend_tile(q, k0, v0, pos0 < end, m_i, l_i, acc, qk_scale, DOT_PRECISION, UPCAST)
        first = start + BLOCK_N
    if TABLE_AHEAD:
        # The block-table entries of the next tile are loaded one iteration ahead, so a tile's K/V addresses are known
        # when its iteration starts instead of one L2 round trip into it (the table load then K/V chain).
        blk = _tile_blocks(bt_row, first + offs_n, first + offs_n < end, PAGE)
        for n0 in range(first, end, BLOCK_N):
            pos = n0 + offs_n  # [BLOCK_N]
            valid = pos < end
            blk_next = _tile_blocks(bt_row, pos + BLOCK_N, pos + BLOCK_N < end, PAGE)
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, blk, pos, valid, kvh, offs_d, d_mask, stride_kb,
                                 stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, PAGE)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, UPCAST)
            blk = blk_next
    else:
        for n0 in range(first, end, BLOCK_N):
            pos = n0 + offs_n  # [BLOCK_N]
            valid = pos < end
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, _tile_blocks(bt_row, pos, valid, PAGE), pos, valid, kvh,
                                 offs_d, d_mask, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, PAGE)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, UPCAST)
    # Release after the main loop (kernels.pdl's mode; the other releases right after the wait): only the epilogue
    # is left, so the next launch's CTAs (resident from here on, waiting) hold no shared memory and registers while
    # this kernel's programs still stream their tiles.
    pdl_release_after_loop(USE_PDL)

    if SPLIT:
        # Empty splits (start >= end) write nothing; the reduce recomputes how many splits are active.
        row = (b * num_heads + heads).to(tl.int64) * num_splits + split  # [BLOCK_G]
        active = g_mask & (offs_g * 0 + start < end)  # vector compare: the interpreter rejects scalar&vector
        tl.store(part_m_ptr + row, m_i, mask=active)
        tl.store(part_l_ptr + row, l_i, mask=active)
        tl.store(
            part_acc_ptr + row[:, None] * D + offs_d[None, :],
            acc,
            mask=active[:, None] & d_mask[None, :],
        )
        if FUSED_REDUCE:
            # Every split (empty ones too) counts itself in; the last to arrive merges the kv head's G rows. The
            # barrier puts all of this program's partial stores before the counter's release (acq_rel, GPU scope);
            # the last program's acquire makes the others' visible, and its loads bypass L1 (.cg).
            tl.debug_barrier()
            counter = counter_ptr + b * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(counter, 1)
            if arrived == num_splits - 1:
                # the G real heads only (not the dot's 16 padded rows), so a chunk holds more splits
                offs_r = tl.arange(0, BLOCK_R)
                heads_r = kvh * G + offs_r
                rows = (b * num_heads + heads_r).to(tl.int64) * num_splits  # [BLOCK_R] row of split 0
                _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr + b * stride_ob, rows,
                              heads_r * stride_oh, offs_r < G, ctx - lo, num_splits, D, BLOCK_D, BLOCK_S, BLOCK_N,
                              SPLIT_CHUNK)
                tl.atomic_xchg(counter, 0)  # ready for the next launch (stream order keeps launches apart)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr,  # fp32 [B, nH, num_splits]
    part_l_ptr,  # fp32 [B, nH, num_splits]
    part_acc_ptr,  # fp32 [B, nH, num_splits, D]
    context_lens_ptr,  # int32 [B]
    out_ptr,  # [B, nH, D]
    window,
    num_splits,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels.pdl: launched as a programmatic dependent
):
    # PDL (kernels.pdl): the partial results come from the split kernel just before, so wait before the first load and
    # store; a short kernel, so release the next launch at once (its CTAs get resident and wait while this one runs).
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)

    ctx = tl.load(context_lens_ptr + b)
    span = ctx - tl.maximum(ctx - window, 0)  # the visible keys, from which _merge_splits finds the active splits
    # One head as a block of one row, one split at a time: registers stay O(D) even with 64 splits of D=512.
    head = h + tl.zeros([1], dtype=tl.int32)
    _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr + b * stride_ob,
                  (b * num_heads + head).to(tl.int64) * num_splits, head * stride_oh, head >= 0, span, num_splits,
                  D, BLOCK_D, BLOCK_S, BLOCK_N, 1)


def _arrival_counters(device: torch.device) -> torch.Tensor:
    """The fused split merge's counters, one per (sequence, kv head) (``kernels.arrival_counters``)."""
    return arrival_counters("paged_decode_attention", _MAX_FUSED_HEADS, device)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return H200_NUM_SMS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int = H200_NUM_SMS) -> int:
    """Split count for the decode grid: enough programs to fill ~2 waves of SMs, >= 64 keys per split of the
    longest range. At batch 1 the attention is latency-bound, and more splits shorten its chain of round trips."""
    programs = batch * num_kv_heads
    if programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(2 * num_sms, programs)
    by_length = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


WAVE_PROGRAMS = 128
"""``batch * kv heads`` from which a decode grid is a wave of the H200's 132 SMs before any split: each program then
streams several key tiles, where at small batch a split holds one or two."""


def decode_config(head_dim: int, batch: int, num_kv_heads: int) -> tuple[int, int, int]:
    """``(BLOCK_N, num_warps, num_stages)`` of the decode kernel: K and V tiles of ``BLOCK_N x D`` stay <= 32 KiB each
    in bf16. From a sweep on the H200 (``bench/decode_attention_bench.py``, in git at 6879ed5):

    * batch 1-2 with D <= 128: no pipelining (``num_stages`` 1; the splits hold a tile or two each) and 8 warps.
      Alone the same paid for D = 256 and 512 too, but in the step's graph it lost, so those keep 2 stages;
    * from ``WAVE_PROGRAMS`` programs before splitting (Gemma-4-E4B at 64 sequences): 32-key tiles for D >= 256, 3
      stages, 4 warps (more programs an SM, each streaming its tiles deeper);
    * between: 64-key tiles (32 for D = 512), 2 stages, 4 warps for D <= 128 and 8 above (the kernel before)."""
    if batch * num_kv_heads >= WAVE_PROGRAMS:
        return (64 if head_dim <= 128 else 32), 4, 3
    block_n = 64 if head_dim <= 256 else 32
    if batch <= 2 and head_dim <= 128:
        return block_n, 8, 1
    return block_n, 4 if head_dim <= 128 else 8, 2


@attrs.frozen
class DecodePlan:
    """How one ``paged_decode_attention`` call is launched: the key tile, warps and pipeline depth of the attention
    launch, the split count (1: single pass), and whether the key loop loads the next tile's block-table entries one
    iteration ahead (``table_ahead``). Any plan gives the same result up to the order of fp32 sums."""

    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    table_ahead: bool = False


def decode_plan(head_dim: int, batch: int, num_kv_heads: int, max_context_len: int,
                num_sms: int = H200_NUM_SMS) -> DecodePlan:
    """The plan ``paged_decode_attention`` launches when given none: :func:`decode_config`'s tiles and
    :func:`choose_num_splits`'s splits, the block table loaded in the iteration that uses it. :class:`DecodePlan`
    exists so that ``bench/tune_attention.py`` can time other plans against this one in the same run (docs/benchmarks.md
    keeps the ones that lost)."""
    block_n, num_warps, num_stages = decode_config(head_dim, batch, num_kv_heads)
    return DecodePlan(block_n, num_warps, num_stages, choose_num_splits(batch, num_kv_heads, max_context_len, num_sms))


def earlier_keys_before_wait(num_stages: int) -> bool:
    """``paged_decode_attention``'s default ``kv_before_wait``: where PDL is on and the key loop is not pipelined
    (``num_stages`` 1, :func:`decode_config`'s 1-2 sequences of head_dim <= 128), the one regime where it paid (see
    ``paged_decode_attention``)."""
    return pdl_enabled() and num_stages == 1


@attrs.frozen
class QueryNormRope:
    """The per-head q norm and RoPE that ``paged_decode_attention`` applies to a raw q before attending, as
    ``kernels.qk_norm_rope`` computes them for q (a layer that reads another layer's KV has nothing else to norm or
    rotate): ``weight [D]`` of q's dtype, ``eps``, the ``gemma`` or ``qwen`` norm convention, this step's RoPE
    tables ``cos``/``sin [B, D]`` (half-split layout, one layout, contiguous rows)."""

    weight: torch.Tensor
    eps: float
    gemma: bool
    cos: torch.Tensor
    sin: torch.Tensor


def paged_decode_attention(
    q: torch.Tensor,  # [B, nH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    context_lens: torch.Tensor,  # int32 [B]
    scale: float,
    window: int | None,
    num_splits: int | None = None,
    *,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,  # [B, nH, D], e.g. a static CUDA-graph buffer
    block_n: int | None = None,
    num_stages: int | None = None,
    num_warps: int | None = None,
    q_norm_rope: QueryNormRope | None = None,  # q is raw: normed and rotated in the attention launch first
    kv_before_wait: bool | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor:  # [B, nH, D]
    """Paged decode attention; see the module docstring for the contract.

    ``plan``: the launch (:class:`DecodePlan`); None: :func:`decode_plan` of the shapes (using ``max_context_len``
    if given, else ``max_blocks * block_size``, capped by the window). ``num_splits``, ``block_n``, ``num_stages``
    and ``num_warps`` override the plan's. ``num_splits``: 1 runs the single-pass kernel; >1 runs
    split-KV and merges the splits inside the same launch (each kv head's last split to finish, by an arrival
    counter: one launch instead of two), or in ``_decode_reduce_kernel`` past ``_MAX_FUSED_HEADS`` kv heads (more
    than the arrival counters hold). The two merges differ only in the order of fp32 sums. ``block_n``: the key tile
    (tests use it to cross tiles), ``num_stages`` the key loop's pipeline depth, ``num_warps`` the warps of the
    attention launch.
    With ``q_norm_rope`` every program norms and rotates its query rows itself (``QueryNormRope``): the same q as
    ``qk_norm_rope``'s up to the order of the fp32 sum of squares, one launch fewer a layer.
    ``kv_before_wait``: every program loads its first key tile's earlier keys (all but the query's own, which the
    launch before may still be writing) before its PDL wait, and the query's key and value after it. The output is
    the same either way, bit for bit. None: where PDL is on (``kernels.pdl``; without it the wait is no wait) and
    the key loop is not pipelined (``num_stages`` 1: :func:`decode_config`'s 1-2 sequences of head_dim <= 128): it
    paid only there; a pipelined loop lost with it, the tile held in registers across the wait beside the pipeline's
    stages (docs/benchmarks.md, the earlier keys before the PDL wait).
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape[-1] == head_dim and v_cache.shape == k_cache.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    if q_norm_rope is not None:
        _check_query_norm_rope(q_norm_rope, q)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if plan is None:
        bound = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
        if window is not None:
            bound = min(bound, window)
        plan = decode_plan(head_dim, batch, num_kv_heads, bound, _num_sms(q.device.index if q.is_cuda else None))
    num_splits = num_splits if num_splits is not None else plan.num_splits
    block_n = block_n or plan.block_n
    num_warps = num_warps or plan.num_warps
    num_stages = num_stages or plan.num_stages
    block_d = max(16, triton.next_power_of_2(head_dim))
    upcast = INTERPRETED and k_cache.dtype == torch.bfloat16
    common = dict(
        PAGE=block_size,
        G=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        D=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        Q_NORM_ROPE=0 if q_norm_rope is None else 1 if q_norm_rope.gemma else 2,
        KV_BEFORE_WAIT=kv_before_wait if kv_before_wait is not None else earlier_keys_before_wait(num_stages),
        TABLE_AHEAD=plan.table_ahead,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(loop="attention"),
    )
    win = NO_WINDOW if window is None else window
    args = (q, k_cache, v_cache, block_tables, context_lens)
    strides = (
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *((q_norm_rope.weight, q_norm_rope.cos, q_norm_rope.sin, q_norm_rope.cos.stride(0), q_norm_rope.eps)
          if q_norm_rope is not None else (q, q, q, 0, 0.0)),
    )
    if num_splits <= 1:
        grid = (batch, num_kv_heads, 1)
        _paged_decode_kernel[grid](*args, out, out, out, out, out, scale * LOG2E, win, 1, *strides, SPLIT=False,
                                   **common)
        return out
    part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    grid = (batch, num_kv_heads, num_splits)
    block_s = triton.next_power_of_2(num_splits)
    if batch * num_kv_heads <= _MAX_FUSED_HEADS:
        block_r = triton.next_power_of_2(group)
        chunk = max(1, min(block_s, _MERGE_ELEMENTS // (block_r * block_d)))
        _paged_decode_kernel[grid](
            *args, out, part_m, part_l, part_acc, _arrival_counters(q.device), scale * LOG2E, win, num_splits,
            *strides, SPLIT=True, FUSED_REDUCE=True, BLOCK_S=block_s, SPLIT_CHUNK=chunk, BLOCK_R=block_r, **common,
        )
        return out
    _paged_decode_kernel[grid](
        *args, out, part_m, part_l, part_acc, out, scale * LOG2E, win, num_splits, *strides, SPLIT=True, **common
    )
    _decode_reduce_kernel[(batch, num_heads)](
        part_m,
        part_l,
        part_acc,
        context_lens,
        out,
        win,
        num_splits,
        out.stride(0),
        out.stride(1),
        D=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=block_s,
        BLOCK_N=block_n,
        num_warps=4,
        **pdl_launch(),
    )
    return out


def _check_query_norm_rope(norm: QueryNormRope, q: torch.Tensor) -> None:
    batch, _, head_dim = q.shape
    if head_dim % 2 or tuple(norm.weight.shape) != (head_dim,) or norm.weight.dtype != q.dtype \
            or norm.weight.stride(0) != 1:
        raise ValueError(f"the q norm needs an even head_dim and a [{head_dim}] {q.dtype} weight, got {head_dim} and "
                         f"{tuple(norm.weight.shape)} {norm.weight.dtype}")
    if norm.cos.shape != (batch, head_dim) or norm.sin.shape != norm.cos.shape \
            or norm.cos.stride() != norm.sin.stride() or norm.cos.stride(-1) != 1:
        raise ValueError(f"cos and sin must be [{batch}, {head_dim}] with one layout and contiguous rows")
