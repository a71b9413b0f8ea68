"""A pool of fixed-size KV blocks with reference counts, a free list and lazily evicted cached blocks.

A block id ``b`` in ``0..num_blocks-1`` names slot ``b`` of every KV-cache tensor of the layers this pool
serves (see :mod:`inference_server.core.kv_layout`; the engine keeps one pool per *layer group*, see
:mod:`inference_server.core.kv_manager`). The pool knows nothing of tokens or tensors: it only answers
"which block ids may be written".

Every block is in exactly one of three states:

* **free**: refcount 0, not cached, on the free list;
* **referenced**: refcount > 0 (cached or not), i.e. some sequence's block table holds it;
* **evictable**: refcount 0 but held by the prefix cache, so its contents can be reused by a prefix hit
  until the pool needs the slot back.

``free + referenced + evictable == num_blocks`` at all times. Allocation takes free blocks first, in free
list order (initially ``0, 1, 2, ...``; a block that becomes free is appended), so ids are deterministic.
Only when the free list is short does the pool ask its *evictor* (the prefix cache) to turn evictable
blocks back into free ones, through :meth:`BlockPool.uncache`. Evictable blocks are kept in the order in
which they became evictable (oldest first), which is the LRU order the evictor consults.

Misuse is a bug and raises: freeing a block whose refcount is already 0 (:class:`DoubleFreeError`),
referencing a free block, allocating more than :meth:`BlockPool.can_allocate` allows
(:class:`OutOfBlocksError`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

Evictor = Callable[[int], None]
"""``evictor(n)`` must turn at least ``n`` evictable blocks into free ones by calling ``pool.uncache``."""


class BlockPoolError(RuntimeError):
    """Base class of block-pool misuse errors."""


class OutOfBlocksError(BlockPoolError):
    """An allocation asked for more blocks than are free or evictable."""


class DoubleFreeError(BlockPoolError):
    """A block was freed while its refcount was already 0."""


class IntegrityError(AssertionError):
    """An internal invariant of the KV block structures does not hold (always a bug)."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`IntegrityError` with ``message`` unless ``condition`` holds (unlike ``assert``,
    this survives ``python -O``)."""
    if not condition:
        raise IntegrityError(message)


class BlockPool:
    """Refcounted fixed-size blocks with a deterministic free list and an LRU list of evictable blocks."""

    def __init__(self, num_blocks: int, *, name: str = "kv") -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.name = name
        self._refcounts: list[int] = [0] * num_blocks
        self._cached: list[bool] = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: dict[int, None] = {}  # insertion order = the order blocks became evictable
        self._num_cached = 0
        self._evictor: Evictor | None = None

    # ---- sizes -------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._refcounts)

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody references: reusable by a prefix hit, reclaimable by eviction."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_referenced(self) -> int:
        """Blocks with refcount > 0."""
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        """Blocks held by the prefix cache (referenced or evictable)."""
        return self._num_cached

    def refcount(self, block_id: int) -> int:
        return self._refcounts[self._checked(block_id)]

    def is_cached(self, block_id: int) -> bool:
        return self._cached[self._checked(block_id)]

    def iter_evictable(self) -> Iterator[int]:
        """Evictable block ids, least recently released first. Do not mutate the pool while iterating."""
        return iter(self._evictable)

    # ---- allocation --------------------------------------------------------------------------------

    def set_evictor(self, evictor: Evictor) -> None:
        """Install the one evictor (the prefix cache) that :meth:`allocate` calls when the free list is
        short."""
        if self._evictor is not None:
            raise BlockPoolError(f"pool {self.name!r} already has an evictor")
        self._evictor = evictor

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether :meth:`allocate` of ``num_blocks`` would succeed (it may evict cached blocks)."""
        return 0 <= num_blocks <= self.num_available

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks with refcount 1, free-list order; evicts LRU cached blocks only if the
        free list is short. Raises :class:`OutOfBlocksError` (changing nothing) if it cannot."""
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(
                f"pool {self.name!r}: asked for {num_blocks} blocks, {self.num_free} free + "
                f"{self.num_evictable} evictable"
            )
        shortfall = num_blocks - len(self._free)
        if shortfall > 0:
            if self._evictor is None:
                raise IntegrityError(f"pool {self.name!r} has evictable blocks but no evictor")
            self._evictor(shortfall)
            require(len(self._free) >= num_blocks, f"evictor of pool {self.name!r} freed too few blocks")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in blocks:
            self._refcounts[block_id] = 1
        return blocks

    def ref(self, block_id: int) -> None:
        """Add a reference to a referenced or evictable (cached) block, e.g. for a prefix hit."""
        self._checked(block_id)
        if self._refcounts[block_id] == 0:
            if not self._cached[block_id]:
                raise BlockPoolError(f"pool {self.name!r}: ref of free block {block_id}")
            del self._evictable[block_id]
        self._refcounts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one reference. At refcount 0 a cached block becomes evictable (newest in LRU order), any
        other block goes to the end of the free list. Raises :class:`DoubleFreeError` at refcount 0."""
        self._checked(block_id)
        if self._refcounts[block_id] == 0:
            raise DoubleFreeError(f"pool {self.name!r}: block {block_id} freed twice")
        self._refcounts[block_id] -= 1
        if self._refcounts[block_id] == 0:
            if self._cached[block_id]:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    # ---- prefix-cache hooks ------------------------------------------------------------------------

    def mark_cached(self, block_id: int) -> None:
        """The prefix cache starts holding a referenced block: from now on refcount 0 means evictable."""
        self._checked(block_id)
        if self._refcounts[block_id] == 0 or self._cached[block_id]:
            raise BlockPoolError(f"pool {self.name!r}: mark_cached({block_id}) needs an uncached referenced block")
        self._cached[block_id] = True
        self._num_cached += 1

    def uncache(self, block_id: int) -> None:
        """The prefix cache drops a block; an unreferenced one goes to the end of the free list."""
        self._checked(block_id)
        if not self._cached[block_id]:
            raise BlockPoolError(f"pool {self.name!r}: uncache of uncached block {block_id}")
        self._cached[block_id] = False
        self._num_cached -= 1
        if self._refcounts[block_id] == 0:
            del self._evictable[block_id]
            self._free.append(block_id)

    # ---- invariants --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless every invariant holds:

        * refcounts are non-negative;
        * the free list has no duplicates and holds exactly the blocks with refcount 0 that are not cached;
        * the evictable list holds exactly the blocks with refcount 0 that are cached;
        * so each block is exactly one of free / referenced / evictable, and the counts add up;
        * ``num_cached`` equals the number of cached flags set.
        """
        free = set(self._free)
        require(len(free) == len(self._free), f"pool {self.name!r}: duplicate block on the free list")
        for block_id, (refcount, cached) in enumerate(zip(self._refcounts, self._cached, strict=True)):
            require(refcount >= 0, f"pool {self.name!r}: block {block_id} has refcount {refcount}")
            unreferenced = refcount == 0
            require((block_id in free) == (unreferenced and not cached), f"free list wrong at {block_id}")
            require((block_id in self._evictable) == (unreferenced and cached), f"evictable wrong at {block_id}")
        referenced = sum(1 for refcount in self._refcounts if refcount > 0)
        require(len(free) + len(self._evictable) + referenced == self.num_blocks, "block counts do not add up")
        require(self._num_cached == sum(self._cached), f"pool {self.name!r}: cached count drifted")

    def _checked(self, block_id: int) -> int:
        if not 0 <= block_id < len(self._refcounts):
            raise IndexError(f"pool {self.name!r}: no block {block_id}")
        return block_id
