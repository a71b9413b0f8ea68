"""One sequence's KV cache in the Hugging Face backend: per model layer, the cached keys and values, each
token's position in the sequence, and the eviction policy's statistic.

Keys are stored as the model computed them (rotated at their RoPE position, as transformers caches them).
Invariants: ``seen`` tokens (positions ``0 .. seen - 1``) went through the model; a layer holds a subset of
them in increasing position order; a sliding-window layer holds none older than its window needs (the last
``window - 1``, as transformers' ``DynamicSlidingWindowLayer``); with a budget, no layer ever holds more than
``budget`` tokens between steps, nor while a step attends (``make_room`` runs before the step's tokens arrive).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from inference_server.backends.hf_eviction.policy import EvictionPolicy

KeyShift = Callable[[torch.Tensor, int, int], torch.Tensor]
"""(keys [H, T, D], layer index, delta) -> the keys rotated by ``delta`` positions (``rope.KeyRotation``)."""


@attrs.define(eq=False)
class LayerKV:
    keys: torch.Tensor  # [H, T, D]
    values: torch.Tensor  # [H, T, Dv]
    positions: torch.Tensor  # int64 [T]: each token's position in the sequence
    stats: torch.Tensor  # [T]: the eviction policy's statistic (zeros without a policy)

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def select(self, indices: torch.Tensor) -> None:
        self.keys = self.keys.index_select(1, indices)
        self.values = self.values.index_select(1, indices)
        self.positions = self.positions.index_select(0, indices)
        self.stats = self.stats.index_select(0, indices)


@attrs.define(eq=False)
class SequenceKV:
    """The cache of one sequence (keyed by request id in the runner)."""

    windows: tuple[int | None, ...]  # per model layer: its sliding window, None for full attention
    layers: list[LayerKV | None] = attrs.field()
    seen: int = 0
    rope_shift: int = 0
    """Positions the kept non-pinned tokens were moved back by (AttentionSink); 0 for the other policies."""

    @layers.default
    def _no_layers(self) -> list[LayerKV | None]:
        return [None] * len(self.windows)

    def rope_positions(self, positions: torch.Tensor, pinned: int) -> torch.Tensor:
        """RoPE positions of tokens at sequence ``positions``: moved back by ``rope_shift`` from ``pinned`` on."""
        if not self.rope_shift:
            return positions
        return torch.where(positions >= pinned, positions - self.rope_shift, positions)

    def max_len(self) -> int:
        return max((len(layer) for layer in self.layers if layer is not None), default=0)

    def make_room(self, policy: EvictionPolicy, budget: int, incoming: int, shift_keys: KeyShift,
                  pinned: int) -> None:
        """Evict so that every layer can take ``incoming`` more tokens within ``budget``. A renumbering policy
        moves the kept tokens from ``pinned`` on back by what the longest layer lost, in every layer."""
        capacity = budget - incoming
        if capacity < 0:
            raise ValueError(f"{incoming} tokens cannot enter a {budget}-token KV budget")
        removed = 0
        for layer in self.layers:
            if layer is not None and len(layer) > capacity:
                before = len(layer)
                layer.select(policy.keep(layer.positions, layer.stats, capacity))
                removed = max(removed, before - len(layer))
        if removed and policy.renumbers_positions:
            self.rope_shift += removed
            for index, layer in enumerate(self.layers):
                if layer is not None:
                    moved = layer.positions >= pinned
                    if bool(moved.any()):
                        layer.keys = layer.keys.clone()
                        layer.keys[:, moved] = shift_keys(layer.keys[:, moved], index, -removed)

    def append(self, index: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               stats: torch.Tensor) -> None:
        """Add a step's tokens to layer ``index`` and drop what its sliding window no longer reaches."""
        layer = self.layers[index]
        if layer is None:
            layer = LayerKV(keys, values, positions, stats)
            self.layers[index] = layer
        else:
            layer.keys = torch.cat([layer.keys, keys], dim=1)
            layer.values = torch.cat([layer.values, values], dim=1)
            layer.positions = torch.cat([layer.positions, positions])
            layer.stats = torch.cat([layer.stats, stats])
        window = self.windows[index]
        if window is not None:
            # The next query (position ``last + 1``) reaches positions above ``last + 1 - window``.
            reach = layer.positions >= layer.positions[-1] + 2 - window
            if not bool(reach.all()):
                layer.select(torch.nonzero(reach).flatten())
