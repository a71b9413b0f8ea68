"""Batch-invariant PyTorch ops for the CPU runner (``DETERMINISTIC=true``): a row's result is bitwise the same
whatever the other rows of the call, their number, and the chunk boundaries of its own prefill.

What is not batch-invariant on the CPU by default (found by probing torch's CPU kernels, checked by
``tests/test_batch_invariant_cpu.py`` on the machine that runs the tests):

* fp32 ``F.linear``: MKL/oneDNN take one path at M = 1 (a GEMV), others at M = 2-3 and at M not a multiple of 4,
  and each sums K in its own order; rows of calls whose M is a multiple of 4 agree with each other. The fp32
  int8 reference (``x @ qweight.float().T``) is the same GEMM.
* The paged reference attention (``kernels.reference_attention``): its score and value GEMMs have M = the chunk's
  query count, and its softmax sums over the keys from the *chunk's* window start to its end, so the lanes and
  tails of that sum move with the chunk boundaries and with a sliding window's start (on the AVX2 machine probed;
  on an AVX-512 one the test's chunkings happened to agree, which no contract of the library promises).
* fbgemm's dynamically quantized lm_head (``kernels.cpu_int8`` on VNNI CPUs): the activations' zero point is
  chosen per call.

What is invariant already and kept: per-row norms, RoPE, activations, the router's softmax and top-k, the
per-row sampling, and ``torch._weight_int8pack_mm`` (one row at a time over K).

The ops here:

* ``row_tiled_linear``: ``F.linear`` on x padded with zero rows to a multiple of ``ROW_TILE``, one call a tile of
  ``ROW_TILE`` rows, so every call is the same GEMM shape whatever the row count: the library's path and its
  split of the work over threads follow from the shape, and on an AVX-512 machine (Sapphire Rapids, 2 threads,
  2026-12-05) MKL summed K otherwise from M = 64 rows up. (The CPU runner's deterministic steps run on one thread,
  ``backends.cpu_threads``: another thread count may split one shape otherwise, and is outside the guarantee.)
* ``row_tiled_int8_linear``: ``torch._weight_int8pack_mm`` (bf16 activations, as ``cpu_int8``'s default path) where
  it applies, else the fp32 reference through ``row_tiled_linear``; never fbgemm.
* ``fixed_split_attention``: the paged prefill/decode attention as an online softmax over key tiles of
  ``KV_SPLIT`` positions aligned to absolute positions (0, 64, 128, ...), each tile's GEMMs row-tiled. A query's
  result depends only on its own position and keys: tiles it cannot see leave its running state exactly
  unchanged (scale 1, sum + 0), so a prefix computed in chunks, in one piece, by decodes or read from the
  prefix cache reduces in the same order.
The routed experts' op (``ops.torch_fused_moe``'s expert-by-expert order with each expert's GEMMs through
``row_tiled_linear``) is ``backends.deterministic.row_tiled_fused_moe``: it names activations by their model names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_server.kernels.cpu_int8 import INT8PACK_K_MULTIPLE, int8pack_linear

ROW_TILE = 16
"""Rows of every GEMM call: x is padded to a multiple of this and multiplied one tile at a time. M >= 4 and a
multiple of 4 made MKL's rows agree on the AVX2 machine probed, but not one call of many tiles on an AVX-512 one
with 2 threads (its rows changed from M = 64 up); one shape a call agrees on both."""
KV_SPLIT = 64
"""Key positions per attention tile; tiles start at multiples of it (absolute positions)."""
_NEG = -1.0e30  # the running max before any visible key: finite, so an all-masked tile rescales by exactly 1


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., M, K]`` with zero rows appended up to a multiple of ``ROW_TILE`` (and at least one tile)."""
    rows = x.shape[-2]
    padded = max(ROW_TILE, -(-rows // ROW_TILE) * ROW_TILE)
    if padded == rows:
        return x
    return F.pad(x, (0, 0, 0, padded - rows))


def row_tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``ops.LinearFn``) with each row's result independent of the call's rows."""
    flat = x.reshape(-1, x.shape[-1])
    tiles = _pad_rows(flat).split(ROW_TILE)
    out = torch.cat([F.linear(tile, weight, bias) for tile in tiles])[: flat.shape[0]]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def row_tiled_int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``ops.Int8LinearFn``: ``x [T, K]`` times int8 ``qweight [N, K]`` with per-channel ``scale``, per row."""
    if x.dtype == torch.float32 and qweight.shape[1] % INT8PACK_K_MULTIPLE == 0 \
            and hasattr(torch, "_weight_int8pack_mm") and x.shape[0] > 0:
        return int8pack_linear(x, qweight, scale)
    y = row_tiled_linear(x.float(), qweight.float())  # the reference's fp32 sums, scale after the reduction
    return (y * scale.float()).to(x.dtype)


def fixed_split_attention(
    q: torch.Tensor,  # [T, nH, D], sequences packed back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    cu_seqlens_q: torch.Tensor,  # int32 [B + 1]
    context_lens: torch.Tensor,  # int32 [B], cached tokens + this chunk's
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [T, nH, D]
    """``reference_attention.ref_paged_prefill_attention``'s contract (decode is the one-query case), reduced over
    fixed, position-aligned key tiles (module docstring). Softmax in fp32, output in q's dtype."""
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        lo, hi = cu[b], cu[b + 1]
        if hi > lo and ctx > 0:
            out[lo:hi] = _attend_tiles(q[lo:hi], k_cache, v_cache, block_tables[b], ctx, scale, window)
    return out


def _attend_tiles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  ctx: int, scale: float, window: int | None) -> torch.Tensor:
    chunk, num_heads, head_dim = q.shape
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv
    first_q = ctx - chunk
    kv_lo = max(0, first_q - window + 1) if window is not None else 0
    tile_lo = kv_lo // KV_SPLIT * KV_SPLIT
    tile_hi = -(-ctx // KV_SPLIT) * KV_SPLIT
    # The keys [kv_lo, ctx) at their absolute offsets from tile_lo; positions outside stay zero (never visible).
    first_block, end_block = kv_lo // block_size, -(-ctx // block_size)
    blocks = block_table[first_block:end_block].long()
    base = first_block * block_size
    keys = torch.zeros(tile_hi - tile_lo, num_kv, head_dim, dtype=torch.float32)
    values = torch.zeros_like(keys)
    keys[kv_lo - tile_lo: ctx - tile_lo] = k_cache[blocks].flatten(0, 1)[kv_lo - base: ctx - base].float()
    values[kv_lo - tile_lo: ctx - tile_lo] = v_cache[blocks].flatten(0, 1)[kv_lo - base: ctx - base].float()
    rows = chunk * group
    qh = _pad_rows(q.float().view(chunk, num_kv, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv, rows, head_dim))
    padded = qh.shape[1]
    q_pos = (first_q + torch.arange(padded) // group).clamp(max=ctx - 1)[:, None]  # [R, 1]; pad rows: any position
    running_max = torch.full((num_kv, padded, 1), _NEG)
    denom = torch.zeros(num_kv, padded, 1)
    acc = torch.zeros(num_kv, padded, head_dim)
    for start in range(tile_lo, tile_hi, KV_SPLIT):
        k_t = keys[start - tile_lo: start - tile_lo + KV_SPLIT].transpose(0, 1)  # [nKV, S, D]
        v_t = values[start - tile_lo: start - tile_lo + KV_SPLIT].transpose(0, 1)
        scores = torch.matmul(qh, k_t.transpose(1, 2)) * scale  # [nKV, R, S]
        kv_pos = torch.arange(start, start + KV_SPLIT)[None, :]
        visible = (kv_pos <= q_pos) & (kv_pos >= kv_lo) & (kv_pos < ctx)
        if window is not None:
            visible &= q_pos - kv_pos < window
        scores = scores.masked_fill(~visible, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
        alpha = torch.exp(running_max - new_max)
        p = torch.exp(scores - new_max)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v_t)
        running_max = new_max
    out = (acc / denom.clamp_min(torch.finfo(torch.float32).tiny))[:, :rows]  # [nKV, L*G, D]
    return out.reshape(num_kv, chunk, group, head_dim).permute(1, 0, 2, 3).reshape(chunk, num_heads, head_dim) \
        .to(q.dtype)
