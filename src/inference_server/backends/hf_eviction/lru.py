"""Least recently used: evict the tokens whose last use is oldest.

The rule: in every forward, each (non-padding) query token and each query head *uses* the ``top_k`` keys it
gives the largest attention weights; a key's last use is the position of the latest query that used it. A new
token counts as used at its own position. When a layer must shrink, the tokens with the largest last use stay;
ties keep the newer token. Kept tokens stay at their positions in the sequence (no renumbering).
"""

from __future__ import annotations

import attrs
import torch

from inference_server.backends.hf_eviction.policy import all_indices


@attrs.frozen
class LeastRecentlyUsed:
    top_k: int = 8
    name: str = "lru"
    needs_attention: bool = True
    renumbers_positions: bool = False

    def fresh(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.clone()

    def observe(self, weights: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """[B, K] int64: per key, the position of the latest query whose top ``top_k`` held it (-1: none)."""
        batch, heads, queries, keys = weights.shape
        k = min(self.top_k, keys)
        top = weights.topk(k, dim=-1).indices  # [B, H, Q, k]
        stamp = query_positions[:, None, :, None].expand(batch, heads, queries, k)
        valid = weights.sum(dim=-1, keepdim=True).expand_as(top) > 0  # padded queries have all-zero rows
        stamp = torch.where(valid, stamp, torch.full_like(stamp, -1))
        used = torch.full((batch, keys), -1, dtype=torch.int64, device=weights.device)
        return used.scatter_reduce(1, top.reshape(batch, -1), stamp.reshape(batch, -1), reduce="amax")

    def merge(self, stats: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return torch.maximum(stats, observed)

    def keep(self, positions: torch.Tensor, stats: torch.Tensor, capacity: int) -> torch.Tensor:
        if positions.shape[0] <= capacity:
            return all_indices(positions)
        span = int(positions.max()) + 2
        key = stats * span + positions  # last use first, then the newer position
        return torch.sort(torch.argsort(key, descending=True)[:capacity]).values
