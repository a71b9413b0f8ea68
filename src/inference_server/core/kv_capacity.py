"""How many tokens of KV fit in a byte budget, with and without sliding-window-aware allocation.

Two ways to store a model's KV cache:

* **window-unaware**: every cache layer keeps every token, so a token costs
  ``full_bytes_per_token + sliding_bytes_per_token``;
* **window-aware** (what :class:`inference_server.core.kv_manager.KVManager` does): full-attention layers
  keep every token, sliding layers keep at most ``ceil(window / block_size) + 1`` blocks per sequence
  (the window rounded up to blocks, plus the block that a window not aligned to blocks straddles).

Everything is counted in whole blocks (a sequence of ``L`` tokens occupies ``ceil(L / block_size)``
blocks), in steady-state decode: during a prefill chunk of ``n`` tokens a sequence briefly holds up to
``ceil(n / block_size)`` more sliding blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from inference_server.core.kv_layout import DEFAULT_BLOCK_SIZE, CacheLayerSpec


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@attrs.frozen
class KVGeometry:
    """Per-token KV bytes of the two layer groups and the sliding group's window (the largest one)."""

    block_size: int
    full_bytes_per_token: int
    sliding_bytes_per_token: int
    sliding_window: int | None

    @classmethod
    def from_cache_layers(
        cls, layers: Sequence[CacheLayerSpec], *, dtype_bytes: int = 2, block_size: int = DEFAULT_BLOCK_SIZE
    ) -> KVGeometry:
        """Group cache layers (one per KV-cache tensor pair, not per model layer) by attention type."""
        windows = [layer.window for layer in layers if layer.window is not None]
        return cls(
            block_size=block_size,
            full_bytes_per_token=sum(x.bytes_per_token(dtype_bytes) for x in layers if x.window is None),
            sliding_bytes_per_token=sum(x.bytes_per_token(dtype_bytes) for x in layers if x.window is not None),
            sliding_window=max(windows) if windows else None,
        )

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token in every cache layer (the window-unaware cost)."""
        return self.full_bytes_per_token + self.sliding_bytes_per_token

    @property
    def full_block_bytes(self) -> int:
        return self.block_size * self.full_bytes_per_token

    @property
    def sliding_block_bytes(self) -> int:
        return self.block_size * self.sliding_bytes_per_token

    @property
    def sliding_blocks_per_window(self) -> int:
        """Most sliding blocks a decoding sequence holds: ``ceil(window / block_size) + 1`` (0 without a
        sliding group)."""
        if self.sliding_window is None:
            return 0
        return _ceil_div(self.sliding_window, self.block_size) + 1

    @property
    def minimum_budget_bytes(self) -> int:
        """The smallest budget ``plan_pool_sizes`` accepts: one sliding window's blocks and one full-attention
        block."""
        return self.sliding_blocks_per_window * self.sliding_block_bytes + self.full_block_bytes

    def sliding_blocks_per_sequence(self, num_tokens: int) -> int:
        return min(_ceil_div(num_tokens, self.block_size), self.sliding_blocks_per_window)


@attrs.frozen
class PoolSizes:
    """Block counts of the two pools that :class:`KVManager` takes (``num_sliding_blocks`` 0 without a
    sliding group)."""

    num_full_blocks: int
    num_sliding_blocks: int


def plan_pool_sizes(geometry: KVGeometry, budget_bytes: int, expected_sequence_tokens: int) -> PoolSizes:
    """Split ``budget_bytes`` between the pools so that sequences of ``expected_sequence_tokens`` fill
    both at the same time (the split the window-aware capacity figures assume).

    Shorter sequences than expected run out of sliding blocks first, longer ones of full blocks; either
    way the scheduler preempts. The sliding pool always gets at least one full window.
    """
    if budget_bytes < geometry.minimum_budget_bytes:  # (so every split below leaves a full block: at least one)
        raise ValueError("the budget does not hold one sliding window plus a full-attention block")
    if geometry.sliding_window is None:
        return PoolSizes(num_full_blocks=budget_bytes // geometry.full_block_bytes, num_sliding_blocks=0)
    full_bytes = _ceil_div(expected_sequence_tokens, geometry.block_size) * geometry.full_block_bytes
    sliding_bytes = geometry.sliding_blocks_per_sequence(expected_sequence_tokens) * geometry.sliding_block_bytes
    num_sliding = budget_bytes * sliding_bytes // (full_bytes + sliding_bytes) // geometry.sliding_block_bytes
    num_sliding = max(num_sliding, geometry.sliding_blocks_per_window)
    num_full = (budget_bytes - num_sliding * geometry.sliding_block_bytes) // geometry.full_block_bytes
    return PoolSizes(num_full_blocks=num_full, num_sliding_blocks=num_sliding)
