"""Pure-PyTorch oracle of the decode attention kernel (``kernels.decode_attention``): the prefill reference with
one query a sequence."""

from __future__ import annotations

import torch

from inference_server.kernels.reference_attention import ref_paged_prefill_attention


def ref_paged_decode_attention(
    q: torch.Tensor,  # [B, nH, D], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, nKV, D]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    context_lens: torch.Tensor,  # int32 [B], including the query token; 0 = padded slot (output zeros)
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [B, nH, D]
    """Decode attention: the query of sequence ``b`` is at position ``context_lens[b] - 1``."""
    batch = q.shape[0]
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return ref_paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window)
