"""The global prefix index against a brute-force model: per replica, the longest run of a request's leading
block hashes it caches, after random stores, evictions, snapshots and drops."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from control_plane.prefix_index import PrefixIndex
from inference_server.core.block_hashes import chain_hashes

BS = 2


def test_longest_prefix_per_replica() -> None:
    index = PrefixIndex()
    system = [7] * 8
    index.reset(0, chain_hashes([*system, 1, 1], BS))
    index.reset(1, chain_hashes(system[:4], BS))
    request = chain_hashes([*system, 1, 1, 2, 2], BS)
    assert index.longest_prefixes(request) == {0: 5, 1: 2}
    assert index.longest_prefixes(chain_hashes([9, 9, 7, 7], BS)) == {}
    assert index.longest_prefixes([]) == {}
    index.apply(0, (), chain_hashes([*system, 1, 1], BS)[2:])  # replica 0 evicts all but two blocks
    assert index.longest_prefixes(request) == {0: 2, 1: 2}
    index.drop(1)
    assert index.longest_prefixes(request) == {0: 2} and index.num_blocks(1) == 0
    index.check_integrity()


prompts = st.lists(st.integers(0, 2), min_size=0, max_size=10)
operations = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["store", "evict", "reset", "drop"]), prompts),
                      max_size=30)


@given(operations=operations, request=prompts)
def test_matches_a_brute_force_model(operations: list[tuple[int, str, list[int]]], request: list[int]) -> None:
    index = PrefixIndex()
    model: dict[int, set[int]] = {}
    for replica, kind, tokens in operations:
        hashes = chain_hashes(tokens, BS)
        if kind == "store":
            index.apply(replica, hashes, ())
            model.setdefault(replica, set()).update(hashes)
        elif kind == "evict":  # radix eviction removes leaves: the tail of a path
            index.apply(replica, (), hashes[len(hashes) // 2:])
            model.setdefault(replica, set()).difference_update(hashes[len(hashes) // 2:])
        elif kind == "reset":
            index.reset(replica, hashes)
            model[replica] = set(hashes)
        else:
            index.drop(replica)
            model.pop(replica, None)
        index.check_integrity()
    wanted = chain_hashes(request, BS)
    expected = {}
    for replica, blocks in model.items():
        depth = 0
        while depth < len(wanted) and wanted[depth] in blocks:
            depth += 1
        if depth:
            expected[replica] = depth
    assert index.longest_prefixes(wanted) == expected
