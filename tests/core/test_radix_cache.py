"""Exact-state tests of the radix prefix cache: sharing, extra keys, LRU leaf eviction, adoption of
duplicates, and the sliding-window rule (a match is cut back to where the window's sliding blocks exist)."""

from __future__ import annotations

import pytest

from inference_server.core.block_pool import BlockPool, IntegrityError
from inference_server.core.kv_manager import KVManager
from inference_server.core.radix_cache import PrefixBlocks, RadixCache, first_block_in_window

BS = 2


def full_only_cache(num_blocks: int = 8) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks, name="full")
    return pool, RadixCache(block_size=BS, full_pool=pool)


def hybrid_cache(window: int = 3) -> tuple[BlockPool, BlockPool, RadixCache]:
    full, sliding = BlockPool(8, name="full"), BlockPool(8, name="sliding")
    return (
        full,
        sliding,
        RadixCache(block_size=BS, full_pool=full, sliding_pool=sliding, sliding_window=window),
    )


def cache_and_release(pool: BlockPool, cache: RadixCache, tokens: list[int], key: str | None = None) -> list[int]:
    """Allocate private blocks for ``tokens``, insert them, then release them tail first (a finished
    sequence); returns the cached block ids."""
    blocks = pool.allocate(len(tokens) // BS)
    canonical = cache.insert(tokens, PrefixBlocks(tuple(blocks)), key)
    for block in reversed(canonical.full_blocks):
        pool.free(block)
    return list(canonical.full_blocks)


def test_first_block_in_window() -> None:
    # window 3: the query at position 8 sees 6, 7 (and itself), so blocks 0-2 of size 2 are dead.
    assert first_block_in_window(8, 3, 2) == 3
    assert first_block_in_window(7, 3, 2) == 2
    assert first_block_in_window(2, 3, 2) == 0
    assert first_block_in_window(0, 1024, 16) == 0
    assert first_block_in_window(1040, 1024, 16) == 1


def test_match_shares_whole_blocks_and_takes_references() -> None:
    pool, cache = full_only_cache()
    assert cache_and_release(pool, cache, [1, 2, 3, 4, 5, 6]) == [0, 1, 2]
    assert pool.num_evictable == 3 and pool.num_free == 5
    blocks, num_tokens = cache.match_prefix([1, 2, 3, 4, 5])  # the partial block [5] is never matched
    assert (blocks, num_tokens) == (PrefixBlocks((0, 1)), 4)
    assert [pool.refcount(b) for b in (0, 1, 2)] == [1, 1, 0]
    assert cache.match_prefix([1, 2, 9, 9]) == (PrefixBlocks((0,)), 2)
    assert cache.match_prefix([7, 7, 7]) == (PrefixBlocks(()), 0)
    assert [pool.refcount(b) for b in (0, 1, 2)] == [2, 1, 0]
    cache.check_integrity()
    pool.check_integrity()


def test_extra_key_keeps_identical_prefixes_apart() -> None:
    pool, cache = full_only_cache()
    cache_and_release(pool, cache, [1, 2, 3, 4], key="rev-a")
    assert cache.match_prefix([1, 2, 3, 4, 5], None)[1] == 0
    assert cache.match_prefix([1, 2, 3, 4, 5], "rev-b")[1] == 0
    assert cache_and_release(pool, cache, [1, 2, 3, 4], key="rev-b") == [2, 3]
    assert cache.match_prefix([1, 2, 3, 4, 5], "rev-a") == (PrefixBlocks((0, 1)), 4)
    cache.check_integrity()


def test_insert_adopts_blocks_that_are_already_cached() -> None:
    pool, cache = full_only_cache()
    first = pool.allocate(2)
    assert cache.insert([1, 2, 3, 4], PrefixBlocks(tuple(first))) == PrefixBlocks((0, 1))
    duplicate = pool.allocate(3)  # another sequence computed the same prefix concurrently, plus one block
    assert duplicate == [2, 3, 4]
    canonical = cache.insert([1, 2, 3, 4, 5, 6], PrefixBlocks(tuple(duplicate)))
    assert canonical == PrefixBlocks((0, 1, 4))
    assert [pool.refcount(b) for b in range(5)] == [2, 2, 0, 0, 1]  # duplicates 2 and 3 went back
    assert pool.num_free == 5 and cache.num_nodes == 3
    cache.check_integrity()
    pool.check_integrity()


def test_eviction_removes_least_recently_released_leaves_first() -> None:
    pool, cache = full_only_cache(num_blocks=4)
    a = cache_and_release(pool, cache, [1, 1, 2, 2])
    b = cache_and_release(pool, cache, [3, 3, 4, 4])
    assert (a, b) == ([0, 1], [2, 3])
    blocks, _ = cache.match_prefix([1, 1, 2, 2, 9])  # use A again, then release it: A is now newer
    for block in reversed(blocks.full_blocks):
        pool.free(block)
    assert list(pool.iter_evictable()) == [3, 2, 1, 0]
    assert pool.allocate(2) == [3, 2]  # B's leaf 3 goes first, then 2 once it is a leaf
    assert cache.match_prefix([3, 3, 4, 4, 9])[1] == 0
    assert cache.match_prefix([1, 1, 2, 2, 9])[1] == 4
    cache.check_integrity()
    pool.check_integrity()


def test_eviction_never_touches_referenced_paths_and_drops_empty_roots() -> None:
    pool, cache = full_only_cache(num_blocks=3)
    cache_and_release(pool, cache, [1, 1, 2, 2], key="a")
    held, _ = cache.match_prefix([1, 1, 2, 2, 9], "a")
    assert held.full_blocks == (0, 1)
    with pytest.raises(Exception, match="asked for 2 blocks"):
        pool.allocate(2)
    for block in reversed(held.full_blocks):
        pool.free(block)
    assert pool.allocate(3) == [2, 1, 0]
    assert cache.num_nodes == 0 and cache._roots == {}
    cache.check_integrity()


def test_sliding_match_is_cut_back_to_a_complete_window() -> None:
    full, sliding, cache = hybrid_cache(window=3)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    full_blocks = full.allocate(4)
    sliding_blocks = sliding.allocate(2)  # the writer already released the sliding blocks of blocks 0, 1
    own = PrefixBlocks(tuple(full_blocks), (None, None, *sliding_blocks))
    assert cache.insert(tokens, own) == own
    for block in reversed(full_blocks):
        full.free(block)
    for block in sliding_blocks:
        sliding.free(block)
    # Ending after block 3 needs sliding block of block 3 only (positions 6-7 for the query at 8).
    assert cache.match_prefix([*tokens, 9]) == (PrefixBlocks((0, 1, 2, 3), (None, None, None, 1)), 8)
    # Ending after block 2 needs block 2's sliding block; it is there but block 3's refs are separate.
    assert cache.match_prefix(tokens[:6]) == (PrefixBlocks((0, 1, 2), (None, None, 0)), 6)
    # Ending after block 1 or 0 needs sliding blocks that are gone.
    assert cache.match_prefix(tokens[:4]) == (PrefixBlocks(()), 0)
    assert [sliding.refcount(b) for b in (0, 1)] == [1, 1]
    assert [full.refcount(b) for b in range(4)] == [2, 2, 2, 1]
    cache.check_integrity()


def test_sliding_eviction_tombstones_lru_blocks_and_full_eviction_frees_both() -> None:
    full, sliding, cache = hybrid_cache(window=3)
    full_blocks, sliding_blocks = full.allocate(2), sliding.allocate(2)
    cache.insert([1, 2, 3, 4], PrefixBlocks(tuple(full_blocks), tuple(sliding_blocks)))
    for block in reversed(full_blocks):
        full.free(block)
    for block in sliding_blocks:
        sliding.free(block)
    sliding.allocate(6)
    assert sliding.num_free == 0 and sliding.num_evictable == 2
    assert sliding.allocate(1) == [0]  # the oldest released sliding block is tombstoned
    assert cache.match_prefix([1, 2, 3, 4, 5]) == (PrefixBlocks((0, 1), (None, 1)), 4)
    assert cache.match_prefix([1, 2, 3])[1] == 0  # needs block 0's sliding block
    cache.check_integrity()
    for block in (1, 0):
        full.free(block)
    sliding.free(1)
    full.allocate(6)
    assert full.allocate(2) == [1, 0]  # leaf 1 with its sliding block, then 0
    assert sliding.num_free == 1 and sliding.num_cached == 0
    cache.check_integrity()
    full.check_integrity()
    sliding.check_integrity()


def test_insert_fills_missing_sliding_blocks_and_adopts_present_ones() -> None:
    full, sliding, cache = hybrid_cache(window=3)
    first_full = full.allocate(2)
    first_sliding = sliding.allocate(1)
    cache.insert([1, 2, 3, 4], PrefixBlocks(tuple(first_full), (None, first_sliding[0])))
    second_full, second_sliding = full.allocate(2), sliding.allocate(2)
    canonical = cache.insert([1, 2, 3, 4], PrefixBlocks(tuple(second_full), tuple(second_sliding)))
    # Block 0's node had no sliding block: it takes ours (1). Block 1's node has 0: we adopt it, free 2.
    assert canonical == PrefixBlocks((0, 1), (1, 0))
    assert [full.refcount(b) for b in range(4)] == [2, 2, 0, 0]
    assert [sliding.refcount(b) for b in range(3)] == [2, 1, 0]
    assert sliding.is_cached(1)
    cache.check_integrity()
    sliding.check_integrity()


def test_insert_rejects_mismatched_block_lists() -> None:
    _, _, cache = hybrid_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], PrefixBlocks((0, 1)))  # sliding entries missing
    with pytest.raises(ValueError):
        RadixCache(block_size=BS, full_pool=BlockPool(2), sliding_window=4)


def test_check_integrity_catches_a_referenced_node_under_an_unreferenced_parent() -> None:
    pool, cache = full_only_cache()
    cache_and_release(pool, cache, [1, 1, 2, 2])
    pool.ref(1)  # a holder of block 1 without block 0 breaks leaf-first eviction
    with pytest.raises(IntegrityError):
        cache.check_integrity()


def test_a_second_request_with_the_same_prefix_computes_only_its_suffix() -> None:
    manager = KVManager(block_size=4, num_full_blocks=32, num_sliding_blocks=16, sliding_window=8)
    system_prompt = list(range(100, 120))  # 20 tokens = 5 blocks
    first = [*system_prompt, 1, 2, 3]
    assert manager.start_sequence("a", first) == 0
    manager.append_slots("a", len(first))  # prefill
    manager.append_slots("a", 1)  # first decode step: the prompt's whole blocks enter the cache
    manager.release_sequence("a")
    second = [*system_prompt, 7, 8, 9, 10, 11]
    cached = manager.start_sequence("b", second)
    assert cached == 20 and len(second) - cached == 5
    assert manager.num_tokens("b") == 20
    manager.append_slots("b", len(second) - cached)
    assert manager.block_tables("b").full[:5] == (0, 1, 2, 3, 4)
    # a different extra key (another model revision) shares nothing
    assert manager.start_sequence("c", second, extra_key="rev-2") == 0
    manager.check_integrity()
