"""The contract of a KV eviction policy.

A layer's cache holds T tokens; for each the cache keeps its true position in the sequence (``positions``,
int64 [T], increasing) and one statistic the policy defines (``stats``, [T]). When the layer must hold at most
``capacity`` tokens, ``keep`` says which stay. After every forward the cache asks the policy, when
``needs_attention``, to turn the step's attention weights into observations and merges them into ``stats``.

Invariants every policy keeps (``tests/backends/test_hf_eviction.py``): ``keep`` returns ``min(T, capacity)``
distinct indices in increasing order, and never reorders the tokens it keeps.
"""

from __future__ import annotations

from typing import Protocol

import torch


class EvictionPolicy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def needs_attention(self) -> bool:
        """Whether the policy reads attention weights (``observe``): the backend then runs eager attention."""
        ...

    @property
    def renumbers_positions(self) -> bool:
        """Whether kept tokens take new RoPE positions after an eviction (AttentionSink: positions within the
        cache); the others keep every token at its position in the sequence."""
        ...

    def fresh(self, positions: torch.Tensor) -> torch.Tensor:
        """The statistic of new tokens at ``positions`` [N], before any attention was observed."""
        ...

    def observe(self, weights: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        """This step's observation per key from attention weights [B, H, Q, K] (zero rows for padded queries)
        and the queries' positions [B, Q]: a [B, K] tensor that ``merge`` folds into the statistic."""
        ...

    def merge(self, stats: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        """The statistic after this step's observation."""
        ...

    def keep(self, positions: torch.Tensor, stats: torch.Tensor, capacity: int) -> torch.Tensor:
        """Indices (int64, increasing) of the ``min(T, capacity)`` tokens that stay."""
        ...


def all_indices(positions: torch.Tensor) -> torch.Tensor:
    return torch.arange(positions.shape[0], device=positions.device)
