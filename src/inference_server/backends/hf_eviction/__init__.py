"""KV eviction policies of the Hugging Face backend (``KV_EVICTION``, ``KV_BUDGET_TOKENS``).

Each policy is one small class that decides which of a layer's cached tokens stay when the layer must shrink,
and what it records about the tokens between steps (``policy.py`` is the contract). The cache itself
(``backends/hf/sequence_kv.py``) applies the decisions: it gathers the kept rows, re-rotates keys when a policy
renumbers positions, and updates the per-token statistic from the attention weights.
"""

from __future__ import annotations

from inference_server.backends.hf_eviction.h2o import HeavyHitters
from inference_server.backends.hf_eviction.lru import LeastRecentlyUsed
from inference_server.backends.hf_eviction.policy import EvictionPolicy
from inference_server.backends.hf_eviction.sink import AttentionSink

POLICIES = ("none", "lru", "sink", "h2o")


def make_policy(name: str, *, sink_tokens: int = 4) -> EvictionPolicy | None:
    """The policy ``KV_EVICTION`` names; None for ``none`` (the cache grows with the sequence)."""
    if name == "none":
        return None
    if name == "sink":
        return AttentionSink(sink_tokens)
    if name == "h2o":
        return HeavyHitters()
    if name == "lru":
        return LeastRecentlyUsed()
    raise ValueError(f"unknown KV eviction policy {name!r} (accepted: {', '.join(POLICIES)})")


__all__ = ["POLICIES", "AttentionSink", "EvictionPolicy", "HeavyHitters", "LeastRecentlyUsed", "make_policy"]
