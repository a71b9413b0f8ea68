"""Heavy-Hitter Oracle (H2O, Zhang et al. 2023): keep the tokens with the largest accumulated attention, plus a
window of the most recent tokens.

The statistic is each token's attention received so far, summed over every later query (this step's new tokens
included), every query head and every step since it entered the cache. Selection is per layer (heads of a layer
share one kept set, so a KV head's GQA group votes together). Of a ``capacity``, ``recent_fraction`` goes to the
most recent tokens and the rest to the heaviest of the others; ties keep the newer token. Kept tokens stay at
their positions in the sequence (no renumbering).
"""

from __future__ import annotations

import attrs
import torch

from inference_server.backends.hf_eviction.policy import all_indices


@attrs.frozen
class HeavyHitters:
    recent_fraction: float = 0.5
    name: str = "h2o"
    needs_attention: bool = True
    renumbers_positions: bool = False

    def fresh(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)

    def observe(self, weights: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        return weights.float().sum(dim=(1, 2))  # [B, K]: over heads and queries

    def merge(self, stats: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return stats + observed

    def keep(self, positions: torch.Tensor, stats: torch.Tensor, capacity: int) -> torch.Tensor:
        total = positions.shape[0]
        if total <= capacity:
            return all_indices(positions)
        recent = min(capacity, int(capacity * self.recent_fraction))
        candidates = total - recent  # tokens [0, candidates) compete on their score
        heavy = capacity - recent
        # Newest candidate first, then a stable descending sort: among equal scores the newer token wins.
        newest_first = torch.arange(candidates - 1, -1, -1, device=positions.device)
        order = torch.argsort(stats[newest_first], descending=True, stable=True)
        chosen = newest_first[order[:heavy]]
        recent_indices = torch.arange(candidates, total, device=positions.device)
        return torch.cat([torch.sort(chosen).values, recent_indices])
