"""The prefix cache's change log: the block hashes it inserted and evicted, numbered in batches.

The radix cache records every node it adds (``stored``) and every node it removes (``removed``) by its
chained block hash (``core/block_hashes.py``); the KV allocator ``take``\\ s the batch after each step and
publishes it as one telemetry event. Batches are numbered 1, 2, 3, ... so a consumer sees a gap when one
was lost (a full telemetry inbox or a slow subscriber drops events rather than blocking) and resynchronises
from a snapshot.

**Snapshot plus replay is exact.** Each hash is an idempotent set operation (add on ``stored``, discard on
``removed``) and the last operation on a hash decides whether it is cached. A snapshot taken now (every
hash in the tree) with ``last_seq`` (the last batch taken) is therefore brought up to date by applying every
later batch in order, even when some of their operations (taken after the snapshot's ``last_seq`` but
before the snapshot) are already reflected in it.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class KVBatch:
    """One numbered batch of prefix-cache changes, in the order they happened (stores, then removes, never
    both for one hash in one batch: a hash stored and removed in the same batch cancels out)."""

    seq: int
    stored: tuple[int, ...]
    removed: tuple[int, ...]


class KVEventLog:
    """Collects the cache's changes between two ``take`` calls."""

    def __init__(self) -> None:
        self._changes: dict[int, bool] = {}  # hash -> cached after the latest change (insertion order kept)
        self.last_seq = 0

    def stored(self, block_hash: int) -> None:
        self._changes[block_hash] = True

    def removed(self, block_hash: int) -> None:
        self._changes[block_hash] = False

    @property
    def pending(self) -> int:
        return len(self._changes)

    def take(self) -> KVBatch | None:
        """The changes since the last ``take`` as the next numbered batch, or None when there were none. A
        hash changed several times counts once, with its last state (what a consumer applying the batch as
        a set update needs)."""
        if not self._changes:
            return None
        self.last_seq += 1
        stored = tuple(h for h, cached in self._changes.items() if cached)
        removed = tuple(h for h, cached in self._changes.items() if not cached)
        self._changes.clear()
        return KVBatch(self.last_seq, stored, removed)
