"""The global prefix index: which replica caches which block, by chained block hash.

Each replica publishes the hashes its radix cache stores and evicts (``GET /kv/events``); the index keeps,
for every hash, the set of replicas holding it. A replica's radix cache is prefix-closed (a block is cached
only under its parent), so "the longest cached prefix of this request on replica r" is how far the
request's own hashes ``h_1, h_2, ...`` run before one is missing from r: ``longest_prefixes`` walks the
request's hashes once for all replicas together and stops when no replica is left, so its cost is the
matched length times the number of replicas, whatever the replicas hold in total.

The index is a routing hint, never a correctness matter: a stale entry costs one recomputed prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ReplicaId = int


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[ReplicaId]] = {}  # block hash -> replicas caching it
        self._blocks: dict[ReplicaId, set[int]] = {}  # replica -> its block hashes (to forget it at once)

    def num_blocks(self, replica: ReplicaId) -> int:
        return len(self._blocks.get(replica, ()))

    def replicas(self) -> list[ReplicaId]:
        return sorted(self._blocks)

    def reset(self, replica: ReplicaId, hashes: Iterable[int]) -> None:
        """Replace everything known about ``replica`` with ``hashes`` (a snapshot)."""
        self.drop(replica)
        self.apply(replica, hashes, ())

    def apply(self, replica: ReplicaId, stored: Iterable[int], removed: Iterable[int]) -> None:
        """One batch of ``replica``'s changes (idempotent set updates)."""
        blocks = self._blocks.setdefault(replica, set())
        for block_hash in stored:
            if block_hash not in blocks:
                blocks.add(block_hash)
                self._holders.setdefault(block_hash, set()).add(replica)
        for block_hash in removed:
            if block_hash in blocks:
                blocks.discard(block_hash)
                holders = self._holders[block_hash]
                holders.discard(replica)
                if not holders:
                    del self._holders[block_hash]

    def drop(self, replica: ReplicaId) -> None:
        """Forget ``replica`` (it went away, or a snapshot follows)."""
        self.apply(replica, (), list(self._blocks.get(replica, ())))
        self._blocks.pop(replica, None)

    def longest_prefixes(self, hashes: Sequence[int]) -> dict[ReplicaId, int]:
        """For each replica holding at least the first block, how many leading blocks of the request
        (given by its chained ``hashes``) it caches."""
        matched: dict[ReplicaId, int] = {}
        if not hashes:
            return matched
        alive = set(self._holders.get(hashes[0], ()))
        depth = 0
        while alive:
            depth += 1
            for replica in alive:
                matched[replica] = depth
            if depth == len(hashes):
                break
            alive &= self._holders.get(hashes[depth], set())
        return matched

    def check_integrity(self) -> None:
        """The two maps describe the same relation (tests)."""
        pairs = {(h, r) for r, blocks in self._blocks.items() for h in blocks}
        assert pairs == {(h, r) for h, holders in self._holders.items() for r in holders}
        assert all(self._holders.values())
