"""The paged KV-cache layout shared by the block pool, the step runner and the attention kernels.

Invariants every component relies on:

* One pair of tensors per *KV-cache layer* (not per model layer): KV-shared layers of Gemma 4 read the
  storage of their producer layer, so Gemma 4 E2B has 15 cache layers for 35 model layers.
* Cache layers form two block groups, full attention and sliding window, each with its own block pool and
  block tables (``core/kv_manager.py``); a block id names the same slot in every cache layer of its group.
* ``k_cache[layer]`` and ``v_cache[layer]`` have shape ``[num_blocks, block_size, num_kv_heads, head_dim]``
  (head_dim and num_kv_heads may differ per cache layer: 256/512 on Gemma 4).
* A sequence's token at absolute position ``p`` lives in block ``block_table[p // block_size]`` at offset
  ``p % block_size``. Block tables are ``int32 [batch, max_blocks_per_seq]``; unused entries are 0.
* Sliding-window cache layers may have released blocks wholly outside the window; their block-table
  entries are never read because attention masks positions with ``q_pos - kv_pos >= window``.
* Keys are stored after k_norm and RoPE, values after v_norm (exactly what HF caches).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class CacheLayerSpec:
    """Geometry of one KV-cache layer.

    ``window`` is the sliding window W (attention sees keys with ``q_pos - kv_pos < W``) or None for a
    full-attention layer.
    """

    num_kv_heads: int
    head_dim: int
    window: int | None

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """K plus V bytes one token occupies in this layer."""
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes


DEFAULT_BLOCK_SIZE = 16
