"""Chained block hashes and the prefix cache's change log: what a multi-replica router rebuilds from a
replica's events matches the replica's cache, and a snapshot plus the later batches is exact."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from inference_server.core.block_hashes import HASH_SCHEME, chain_hashes, root_hash
from inference_server.core.block_pool import BlockPool
from inference_server.core.kv_events import KVEventLog
from inference_server.core.radix_cache import PrefixBlocks, RadixCache

BS = 2


def test_chain_hashes_name_whole_prefixes() -> None:
    a = chain_hashes([1, 2, 3, 4, 5], BS)
    assert len(a) == 2  # the partial block [5] has no hash
    assert chain_hashes([1, 2, 3, 4, 9, 9], BS)[:2] == a  # same prefix, same hashes
    assert chain_hashes([9, 9, 3, 4], BS)[1] != a[1]  # same block, other prefix: another hash
    assert chain_hashes([1, 2, 3, 4], BS, "salt") != a  # a cache salt keeps blocks apart
    assert root_hash(None) == 0 and root_hash("salt") == root_hash("salt") != root_hash("pepper")
    assert chain_hashes([], BS) == [] and isinstance(HASH_SCHEME, int)


def test_the_log_numbers_batches_and_keeps_each_hash_last_state() -> None:
    log = KVEventLog()
    assert log.take() is None and log.last_seq == 0
    log.stored(1), log.stored(2), log.removed(1), log.removed(3), log.stored(3)
    batch = log.take()
    assert batch is not None and (batch.seq, set(batch.stored), set(batch.removed)) == (1, {2, 3}, {1})
    assert log.take() is None and log.last_seq == 1


def test_the_cache_reports_inserted_and_evicted_blocks_by_chained_hash() -> None:
    pool, log = BlockPool(8, name="full"), KVEventLog()
    cache = RadixCache(block_size=BS, full_pool=pool, events=log)
    tokens = [1, 2, 3, 4, 5, 6]
    blocks = cache.insert(tokens, PrefixBlocks(tuple(pool.allocate(3))), "salt")
    batch = log.take()
    assert batch is not None and list(batch.stored) == chain_hashes(tokens, BS, "salt") and batch.removed == ()
    for block in reversed(blocks.full_blocks):
        pool.free(block)
    cache.evict_full(1)  # the leaf goes first
    batch = log.take()
    assert batch is not None and batch.stored == () and list(batch.removed) == chain_hashes(tokens, BS, "salt")[2:]
    assert set(cache.block_hashes()) == set(chain_hashes(tokens, BS, "salt")[:2])
    cache.check_integrity()


operations = st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=40)


@given(before=operations, between=operations, after=operations, takes=st.lists(st.integers(0, 40), max_size=4))
def test_a_snapshot_plus_the_later_batches_is_exact(before: list[tuple[bool, int]],
                                                     between: list[tuple[bool, int]],
                                                     after: list[tuple[bool, int]], takes: list[int]) -> None:
    """A consumer that takes a snapshot (the true set now, and the last batch taken) and then applies only
    the batches numbered after it ends with the true set, even when changes made before the snapshot were
    not yet taken (they come again in a later batch)."""
    log, truth, batches = KVEventLog(), set(), []

    def take() -> None:
        batch = log.take()
        if batch is not None:
            batches.append(batch)

    def apply(ops: list[tuple[bool, int]]) -> None:
        for index, (store, value) in enumerate(ops):
            (log.stored if store else log.removed)(value)
            (truth.add if store else truth.discard)(value)
            if index in takes:
                take()

    apply(before)
    take()
    apply(between)  # not taken yet when the snapshot is made
    copy, seen = set(truth), log.last_seq
    apply(after)
    take()
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    for batch in batches:
        if batch.seq > seen:
            copy = (copy | set(batch.stored)) - set(batch.removed)
    assert copy == truth
