"""Pure-PyTorch paged attention and KV store: the references for the Triton kernels and the CPU path.

Contract shared with the Triton kernels (see ``core/kv_layout.py``):

* ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``; keys post-norm post-RoPE.
* ``block_tables``: ``int32 [B, max_blocks]``; token ``p`` of sequence ``b`` lives at
  ``(block_tables[b, p // block_size], p % block_size)``.
* ``context_lens``: ``int32 [B]``, the number of tokens of each sequence *already in the cache*, including
  the tokens being attended from (their K/V are stored before attention runs).
* GQA: query head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
* Masks: causal (``kv_pos <= q_pos``) and, when ``window`` is an int W, sliding (``q_pos - kv_pos < W``).
  Only positions inside the window of a sequence's first query are read, so blocks wholly outside it may
  have been released (their block-table entries and contents are never touched).
* Softmax in float32; output in the dtype of ``q``. A query with no visible key (only a padded decode slot
  with ``context_len == 0``) yields zeros.

These functions are written for clarity plus reasonable CPU speed: one host sync per call to read the
lengths, one Python iteration per sequence, everything inside a sequence vectorised.
"""

from __future__ import annotations

import torch


def ref_store_kv(
    k: torch.Tensor,  # [T, nKV, D]
    v: torch.Tensor,  # [T, nKV, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    slot_mapping: torch.Tensor,  # int64 [T]; slot = block_id * block_size + offset; < 0 = skip
) -> None:
    """Write K/V rows into the paged caches in place (rows with a negative slot are skipped)."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep].long()  # [T']
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def ref_paged_prefill_attention(
    q: torch.Tensor,  # [T, nH, D], sequences packed back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    cu_seqlens_q: torch.Tensor,  # int32 [B + 1]
    context_lens: torch.Tensor,  # int32 [B], cached tokens + this chunk's tokens
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [T, nH, D]
    """Causal (+ sliding window) attention of a packed batch of query chunks over their paged K/V.

    Query ``i`` of sequence ``b`` sits at absolute position ``context_lens[b] - chunk_len_b + i`` and sees
    keys ``0 .. its position`` (and, with a window W, only the last W of those).
    """
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    for b, ctx in enumerate(ctx_lens):
        q_lo, q_hi = cu[b], cu[b + 1]
        if q_hi == q_lo or ctx == 0:
            continue
        out[q_lo:q_hi] = _attend_one(q[q_lo:q_hi], k_cache, v_cache, block_tables[b], ctx, scale, window)
    return out


def _attend_one(
    q: torch.Tensor,  # [L, nH, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # int32 [max_blocks]
    ctx: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [L, nH, D]
    """Attention of one sequence's chunk over keys gathered from its block table."""
    chunk, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first_q_pos = ctx - chunk
    kv_lo = max(0, first_q_pos - window + 1) if window is not None else 0
    first_block, end_block = kv_lo // block_size, -(-ctx // block_size)
    blocks = block_table[first_block:end_block].long()  # [nb]
    base = first_block * block_size
    # Gather whole blocks, then trim to exactly [kv_lo, ctx): positions outside are never read.
    k = k_cache[blocks].flatten(0, 1)[kv_lo - base : ctx - base].float()  # [S, nKV, D]
    v = v_cache[blocks].flatten(0, 1)[kv_lo - base : ctx - base].float()  # [S, nKV, D]
    group = num_heads // num_kv_heads
    qf = q.float().view(chunk, num_kv_heads, group, head_dim)  # [L, nKV, G, D]
    scores = torch.einsum("lhgd,shd->hgls", qf, k) * scale  # [nKV, G, L, S]
    q_pos = torch.arange(first_q_pos, ctx, device=q.device)[:, None]  # [L, 1]
    kv_pos = torch.arange(kv_lo, ctx, device=q.device)[None, :]  # [1, S]
    visible = kv_pos <= q_pos  # [L, S]
    if window is not None:
        visible &= q_pos - kv_pos < window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [nKV, G, L, S]
    out = torch.einsum("hgls,shd->lhgd", probs, v)  # [L, nKV, G, D]
    return out.reshape(chunk, num_heads, head_dim).to(q.dtype)
