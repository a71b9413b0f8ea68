"""``KV_EVICTION``, ``KV_BUDGET_TOKENS`` and ``KV_SINK_TOKENS``, checked together (a light module: start-up
validates settings before loading anything)."""

from __future__ import annotations

import attrs

MIN_KV_BUDGET = 16


@attrs.frozen
class EvictionConfig:
    policy: str = "none"
    budget: int = 0
    sink_tokens: int = 4
    max_piece: int = 0
    """Most new tokens of one sequence per forward with a policy; 0: half the budget (benchmarks lower it to
    score tokens with nearly the full budget as context)."""

    def __attrs_post_init__(self) -> None:
        if self.policy == "none":
            if self.budget:
                raise ValueError("KV_BUDGET_TOKENS needs an eviction policy (KV_EVICTION=lru, sink or h2o)")
            return
        if self.budget < MIN_KV_BUDGET:
            raise ValueError(f"KV_EVICTION={self.policy} needs KV_BUDGET_TOKENS >= {MIN_KV_BUDGET}")
        if self.policy == "sink" and not 0 < self.sink_tokens <= self.budget // 4:
            raise ValueError(f"KV_SINK_TOKENS must be between 1 and a quarter of KV_BUDGET_TOKENS "
                             f"({self.budget // 4})")

    @property
    def piece_tokens(self) -> int:
        """Most new tokens of one sequence in one forward: half the budget, the rest is its context."""
        return min(self.max_piece or self.budget // 2, self.budget // 2)
