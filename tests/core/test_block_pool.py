"""Exact-state tests of the refcounted block pool, plus a random-operation state machine."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference_server.core.block_pool import (
    BlockPool,
    BlockPoolError,
    DoubleFreeError,
    IntegrityError,
    OutOfBlocksError,
)


def test_allocation_takes_free_list_order_and_freed_blocks_go_to_the_end() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.free(0)
    assert pool.allocate(3) == [2, 3, 0]
    assert [pool.refcount(b) for b in range(4)] == [1, 1, 1, 1]
    assert (pool.num_free, pool.num_evictable, pool.num_referenced) == (0, 0, 4)
    pool.check_integrity()


def test_allocate_zero_and_too_many() -> None:
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.can_allocate(3) and not pool.can_allocate(4) and not pool.can_allocate(-1)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(4)
    assert pool.num_free == 3  # a failed allocation changes nothing
    pool.check_integrity()


def test_double_free_raises_and_leaves_state_intact() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free(block)
    with pytest.raises(DoubleFreeError):
        pool.free(block)
    assert pool.num_free == 2
    pool.check_integrity()


def test_shared_block_is_freed_after_its_last_reference() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.ref(block)
    assert pool.refcount(block) == 2
    pool.free(block)
    assert pool.refcount(block) == 1 and pool.num_free == 1
    pool.free(block)
    assert pool.refcount(block) == 0 and pool.num_free == 2


def test_ref_of_a_free_block_and_unknown_ids_raise() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError):
        pool.ref(0)
    with pytest.raises(IndexError):
        pool.free(2)
    with pytest.raises(IndexError):
        pool.refcount(-1)
    with pytest.raises(ValueError):
        BlockPool(0)


def test_cached_block_becomes_evictable_then_revives_or_returns_to_the_free_list() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.mark_cached(a)
    pool.mark_cached(b)
    pool.free(b)
    pool.free(a)
    assert (pool.num_free, pool.num_evictable, pool.num_cached) == (1, 2, 2)
    assert list(pool.iter_evictable()) == [b, a]  # release order, oldest first
    pool.check_integrity()
    pool.ref(a)  # a prefix hit revives it
    assert pool.refcount(a) == 1 and list(pool.iter_evictable()) == [b]
    pool.uncache(b)  # evicted: back to the free list, at the end
    assert pool.allocate(2) == [2, b]
    pool.uncache(a)  # dropped from the cache while referenced: its last free makes it free
    pool.free(a)
    assert pool.num_evictable == 0 and pool.num_free == 1 and pool.num_cached == 0
    pool.check_integrity()


def test_mark_cached_and_uncache_misuse_raise() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError):
        pool.mark_cached(0)  # free blocks cannot be cached
    [block] = pool.allocate(1)
    pool.mark_cached(block)
    with pytest.raises(BlockPoolError):
        pool.mark_cached(block)
    with pytest.raises(BlockPoolError):
        pool.uncache(1)


def test_allocation_asks_the_evictor_only_for_the_shortfall() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for block in blocks:
        pool.mark_cached(block)
        pool.free(block)
    requests: list[int] = []

    def evict_oldest(num_blocks: int) -> None:
        requests.append(num_blocks)
        for _ in range(num_blocks):
            pool.uncache(next(pool.iter_evictable()))

    pool.set_evictor(evict_oldest)
    with pytest.raises(BlockPoolError):
        pool.set_evictor(evict_oldest)
    assert pool.can_allocate(3)
    assert pool.allocate(2) == [0, 1]
    assert requests == [2]
    assert pool.num_evictable == 1
    pool.check_integrity()


def test_a_lazy_evictor_or_a_missing_one_is_an_integrity_error() -> None:
    pool = BlockPool(1)
    [block] = pool.allocate(1)
    pool.mark_cached(block)
    pool.free(block)
    with pytest.raises(IntegrityError):
        pool.allocate(1)  # no evictor installed
    lazy = BlockPool(1)
    [block] = lazy.allocate(1)
    lazy.mark_cached(block)
    lazy.free(block)
    lazy.set_evictor(lambda num_blocks: None)
    with pytest.raises(IntegrityError):
        lazy.allocate(1)


def test_check_integrity_catches_a_corrupted_free_list() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._free.append(2)  # corrupt on purpose: 2 is now listed twice
    with pytest.raises(IntegrityError):
        pool.check_integrity()


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate/ref/free/cache/evict sequences against a model of who holds which block."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(6)
        self.pool.set_evictor(self._evict_oldest)
        self.held: list[int] = []  # one entry per reference a test "holder" owns
        self.cached: set[int] = set()

    def _evict_oldest(self, num_blocks: int) -> None:
        for _ in range(num_blocks):
            block = next(self.pool.iter_evictable())
            self.pool.uncache(block)
            self.cached.discard(block)

    @rule(count=st.integers(0, 7))
    def allocate(self, count: int) -> None:
        if self.pool.can_allocate(count):
            blocks = self.pool.allocate(count)
            assert len(set(blocks)) == count and not set(blocks) & set(self.held)
            self.cached -= set(blocks)
            self.held.extend(blocks)
        else:
            assert count > self.pool.num_free + self.pool.num_evictable
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(count)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        block = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pool.free(block)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.held))
        self.pool.ref(block)
        self.held.append(block)

    @precondition(lambda self: self.pool.num_evictable)
    @rule(data=st.data())
    def revive(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(list(self.pool.iter_evictable())))
        self.pool.ref(block)
        self.held.append(block)

    @precondition(lambda self: set(self.held) - self.cached)
    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(set(self.held) - self.cached)))
        self.pool.mark_cached(block)
        self.cached.add(block)

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def uncache(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.cached)))
        self.pool.uncache(block)
        self.cached.remove(block)

    @rule(data=st.data())
    def double_free_raises(self, data: st.DataObject) -> None:
        unheld = [b for b in range(self.pool.num_blocks) if b not in self.held]
        if unheld:
            with pytest.raises(DoubleFreeError):
                self.pool.free(data.draw(st.sampled_from(unheld)))

    @invariant()
    def matches_the_model(self) -> None:
        self.pool.check_integrity()
        for block in range(self.pool.num_blocks):
            assert self.pool.refcount(block) == self.held.count(block)
            assert self.pool.is_cached(block) == (block in self.cached)


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
