"""AttentionSink (StreamingLLM, Xiao et al. 2023): keep the first ``sink_tokens`` of the sequence and the most
recent tokens.

Positions follow the paper: a token's RoPE position is its place *within the cache*, not in the text. The
backend stores keys rotated (as transformers does) and, when tokens leave the middle, re-rotates the kept
recent keys back by the number of tokens removed (``renumbers_positions``); new tokens are rotated at the
next position in the cache. So the model never sees a position beyond the budget, however long the stream.
"""

from __future__ import annotations

import attrs
import torch

from inference_server.backends.hf_eviction.policy import all_indices


@attrs.frozen
class AttentionSink:
    sink_tokens: int = 4
    name: str = "sink"
    needs_attention: bool = False
    renumbers_positions: bool = True

    def fresh(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(positions)

    def observe(self, weights: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("AttentionSink reads no attention weights")

    def merge(self, stats: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return stats

    def keep(self, positions: torch.Tensor, stats: torch.Tensor, capacity: int) -> torch.Tensor:
        """The sink tokens still held (positions below ``sink_tokens``; a sliding-window layer may hold none),
        then the most recent tokens up to ``capacity``."""
        if positions.shape[0] <= capacity:
            return all_indices(positions)
        is_sink = positions < self.sink_tokens
        sinks = torch.nonzero(is_sink).flatten()[:capacity]
        others = torch.nonzero(~is_sink).flatten()
        recent = others[others.shape[0] - (capacity - sinks.shape[0]):]
        return torch.cat([sinks, recent])
