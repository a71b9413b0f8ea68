"""The transformers ``Cache`` one forward of the Hugging Face backend runs with: a batch of sequences, each with
its own ``SequenceKV``, left-padded to a common length per layer.

A row holds one sequence's new tokens (``count`` of them from position ``start``), right-padded to the step's
width. Per layer, the keys the model attends to are ``[padded past | new]``; ``kv_positions`` gives each one's
position in its sequence (-1: padding), which is all the attention function needs to build the mask (causal
by position, sliding window by position, padding), so evicted gaps and padding cost nothing special.
After the forward, ``commit`` appends each row's new keys and values to its sequence's cache, with the eviction
statistic the attention function observed.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import attrs
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from inference_server.backends.hf.sequence_kv import SequenceKV
from inference_server.backends.hf_eviction.policy import EvictionPolicy

CURRENT_STEP: ContextVar[StepCache | None] = ContextVar("hf_current_step", default=None)
"""The step cache of the forward running in this thread (the attention function reads its masks here)."""


@attrs.frozen
class StepRow:
    kv: SequenceKV
    start: int  # position of the row's first new token in its sequence
    count: int  # new tokens in the row (the rest of the step's width is padding)


class StepLayer(CacheLayerMixin):
    """One model layer's cache for one forward: the rows' padded past, then this step's keys and values."""

    is_sliding = False

    def __init__(self, step: StepCache, index: int) -> None:
        super().__init__()
        self.step = step
        self.index = index
        self.new_keys: torch.Tensor | None = None
        self.new_values: torch.Tensor | None = None
        self.past_len = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.is_initialized = True
        self.new_keys, self.new_values = key_states, value_states
        past_keys, past_values = self.step.padded_past(self.index, key_states, value_states)
        self.past_len = past_keys.shape[2]
        keys = torch.cat([past_keys, key_states], dim=2) if self.past_len else key_states
        values = torch.cat([past_values, value_states], dim=2) if self.past_len else value_states
        self.step.register(keys, self.index)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past_len + query_length, 0

    def get_seq_length(self) -> int:
        return self.past_len

    def get_max_length(self) -> int:
        return -1


class StepCache(Cache):
    """See the module docstring. Built per forward; ``CURRENT_STEP`` points at it while the model runs."""

    def __init__(self, rows: Sequence[StepRow], width: int, policy: EvictionPolicy | None,
                 device: torch.device) -> None:
        self.step_layers = [StepLayer(self, index) for index in range(len(rows[0].kv.windows))]
        super().__init__(layers=list(self.step_layers))
        self.rows = tuple(rows)
        self.width = width
        self.policy = policy
        self.windows = rows[0].kv.windows
        offsets = torch.arange(width, device=device)
        starts = torch.tensor([row.start for row in rows], device=device)
        counts = torch.tensor([row.count for row in rows], device=device)
        self.query_valid = offsets[None, :] < counts[:, None]  # [B, N]
        # Padded queries repeat their row's last position: they see what it sees (no empty softmax row).
        self.query_positions = starts[:, None] + torch.minimum(offsets[None, :], counts[:, None] - 1)
        self.new_positions = torch.where(self.query_valid, starts[:, None] + offsets[None, :], -1)
        self._layer_of_keys: dict[int, int] = {}
        self._kv_positions: dict[int, torch.Tensor] = {}
        self._masks: dict[int, torch.Tensor] = {}
        self.observed: dict[int, torch.Tensor] = {}

    # -- the forward -------------------------------------------------------------------------------
    def padded_past(self, index: int, like_keys: torch.Tensor,
                    like_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s cached keys and values of every row, left-padded: [B, H, P, D] each."""
        layers = [row.kv.layers[index] for row in self.rows]
        lengths = [len(layer) if layer is not None else 0 for layer in layers]
        longest = max(lengths)
        batch, heads = like_keys.shape[:2]
        past_keys = like_keys.new_zeros(batch, heads, longest, like_keys.shape[-1])
        past_values = like_values.new_zeros(batch, heads, longest, like_values.shape[-1])
        positions = torch.full((batch, longest), -1, dtype=torch.int64, device=like_keys.device)
        for row, (layer, length) in enumerate(zip(layers, lengths, strict=True)):
            if layer is not None and length:
                past_keys[row, :, longest - length:] = layer.keys
                past_values[row, :, longest - length:] = layer.values
                positions[row, longest - length:] = layer.positions
        self._kv_positions[index] = torch.cat([positions, self.new_positions], dim=1)
        return past_keys, past_values

    def register(self, keys: torch.Tensor, index: int) -> None:
        """Remember that attention over ``keys`` is attention over layer ``index``'s cache (KV-shared layers
        of Gemma 4 attend over another layer's keys: the same tensor object)."""
        self._layer_of_keys[id(keys)] = index

    def layer_of(self, keys: torch.Tensor, fallback: int) -> int:
        return self._layer_of_keys.get(id(keys), fallback)

    def mask(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, N, K] for layer ``index``: a key is visible to a query when it is no padding, not
        after the query, and (sliding layers) less than the window before it."""
        mask = self._masks.get(index)
        if mask is None:
            keys = self._kv_positions[index][:, None, :]  # [B, 1, K]
            queries = self.query_positions[:, :, None]  # [B, N, 1]
            visible = (keys >= 0) & (keys <= queries)
            window = self.windows[index]
            if window is not None:
                visible &= queries - keys < window
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            mask.masked_fill_(~visible, torch.finfo(dtype).min)
            mask = mask[:, None]
            self._masks[index] = mask
        return mask

    def observe(self, index: int, weights: torch.Tensor) -> None:
        """Fold one attention call's weights [B, H, N, K] over layer ``index``'s keys into the step's
        observation for the eviction policy (padded queries count for nothing)."""
        assert self.policy is not None
        weights = weights * self.query_valid[:, None, :, None].to(weights.dtype)
        seen = self.policy.observe(weights, self.query_positions)
        previous = self.observed.get(index)
        self.observed[index] = seen if previous is None else self.policy.merge(previous, seen)

    # -- after the forward ---------------------------------------------------------------------------
    def commit(self) -> None:
        """Append every row's new tokens to its sequence's cache, with their statistic."""
        for layer in self.step_layers:
            if layer.new_keys is None or layer.new_values is None:
                continue  # a KV-shared layer: it stores nothing of its own
            observed = self.observed.get(layer.index)
            for row_index, row in enumerate(self.rows):
                positions = self.new_positions[row_index, :row.count]
                keys = layer.new_keys[row_index, :, :row.count].clone()
                values = layer.new_values[row_index, :, :row.count].clone()
                stored = row.kv.layers[layer.index]
                if self.policy is None:
                    stats = torch.zeros(row.count, device=positions.device)
                else:
                    stats = self.policy.fresh(positions)
                    if observed is not None:
                        stats = self.policy.merge(stats, observed[row_index, layer.past_len:layer.past_len + row.count])
                        if stored is not None and len(stored):
                            past = observed[row_index, layer.past_len - len(stored):layer.past_len]
                            stored.stats = self.policy.merge(stored.stats, past)
                row.kv.append(layer.index, keys, values, positions, stats)
        for row in self.rows:
            row.kv.seen += row.count
