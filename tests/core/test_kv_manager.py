"""Per-sequence block tables over the full and sliding groups: exact block ids, sliding-window release,
exactly-once release, preemption, and a random-operation state machine that simulates the KV contents."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference_server.core.block_pool import OutOfBlocksError
from inference_server.core.kv_manager import UNUSED_BLOCK, BlockTables, KVManager, SequenceStateError


def test_full_only_model_grows_block_tables_block_by_block() -> None:
    manager = KVManager(block_size=4, num_full_blocks=8, enable_prefix_cache=False)
    assert manager.sliding_pool is None
    assert manager.start_sequence(1, [5] * 6) == 0
    manager.append_slots(1, 6)
    assert manager.block_tables(1) == BlockTables(full=(0, 1), sliding=())
    manager.append_slots(1, 2)  # positions 6, 7 still fit block 1
    assert manager.block_tables(1).full == (0, 1)
    manager.append_slots(1, 1)
    assert manager.block_tables(1).full == (0, 1, 2)
    assert manager.num_tokens(1) == 9
    manager.check_integrity()


def test_sliding_blocks_wholly_before_the_window_are_released_and_full_blocks_kept() -> None:
    manager = KVManager(
        block_size=4, num_full_blocks=16, num_sliding_blocks=8, sliding_window=8, enable_prefix_cache=False
    )
    manager.start_sequence("s", list(range(20)))
    manager.append_slots("s", 20)  # prefill: positions 0-19 in blocks 0-4 of both groups
    assert manager.block_tables("s") == BlockTables(full=(0, 1, 2, 3, 4), sliding=(0, 1, 2, 3, 4))
    assert manager.sliding_pool is not None
    # The query at position 20 sees positions 13-20: blocks 0-2 (positions 0-11) are dead in sliding layers.
    manager.append_slots("s", 1)
    tables = manager.block_tables("s")
    assert tables.full == (0, 1, 2, 3, 4, 5)
    assert tables.sliding == (UNUSED_BLOCK, UNUSED_BLOCK, UNUSED_BLOCK, 3, 4, 5)
    assert [manager.sliding_pool.refcount(b) for b in range(8)] == [0, 0, 0, 1, 1, 1, 0, 0]
    assert list(manager.sliding_pool._free) == [6, 7, 0, 1, 2]
    for _ in range(4):  # positions 21-24: the query at 24 no longer sees block 3 (positions 12-15)
        manager.append_slots("s", 1)
    assert manager.block_tables("s").sliding == (0, 0, 0, 0, 4, 5, 6)
    assert manager.sliding_pool.num_referenced == 3 and manager.full_pool.num_referenced == 7
    manager.check_integrity()


def test_a_prefill_chunk_keeps_the_window_of_its_first_token() -> None:
    manager = KVManager(
        block_size=4, num_full_blocks=16, num_sliding_blocks=8, sliding_window=8, enable_prefix_cache=False
    )
    manager.start_sequence("s", list(range(24)))
    manager.append_slots("s", 12)
    # Chunk 2 (positions 12-23): its first query (12) sees positions 5-12, so only block 0 is dead.
    manager.append_slots("s", 12)
    assert manager.block_tables("s").sliding == (0, 1, 2, 3, 4, 5)
    assert manager.sliding_pool is not None and manager.sliding_pool.refcount(0) == 0
    assert manager.block_tables("s").sliding[0] == UNUSED_BLOCK
    manager.check_integrity()


def test_can_append_counts_the_sliding_blocks_it_will_release() -> None:
    manager = KVManager(
        block_size=4, num_full_blocks=16, num_sliding_blocks=5, sliding_window=8, enable_prefix_cache=False
    )
    manager.start_sequence("s", list(range(20)))
    manager.append_slots("s", 20)
    assert manager.sliding_pool is not None and manager.sliding_pool.num_available == 0
    assert manager.can_append("s", 1)  # releasing blocks 0-2 makes room
    assert not manager.can_append("s", 13)  # positions 20-32 would need 4 new blocks, only 3 come back
    with pytest.raises(OutOfBlocksError):
        manager.append_slots("s", 13)
    assert manager.num_tokens("s") == 20  # nothing changed
    manager.append_slots("s", 12)
    manager.check_integrity()


def test_release_is_exactly_once_and_ids_are_not_reused_by_mistake() -> None:
    manager = KVManager(block_size=4, num_full_blocks=8, num_sliding_blocks=8, sliding_window=4)
    manager.start_sequence(7, [1, 2, 3])
    with pytest.raises(SequenceStateError):
        manager.start_sequence(7, [1, 2, 3])
    manager.append_slots(7, 3)
    manager.release_sequence(7)
    with pytest.raises(SequenceStateError):
        manager.release_sequence(7)
    with pytest.raises(SequenceStateError):
        manager.append_slots(7, 1)
    assert manager.full_pool.num_referenced == 0
    assert manager.sliding_pool is not None and manager.sliding_pool.num_referenced == 0
    with pytest.raises(ValueError):
        manager.start_sequence(8, [])
    manager.check_integrity()


def test_preemption_releases_everything_and_recomputes_from_scratch() -> None:
    manager = KVManager(
        block_size=4, num_full_blocks=3, num_sliding_blocks=4, sliding_window=4, enable_prefix_cache=False
    )
    manager.start_sequence("victim", [1] * 8)
    manager.append_slots("victim", 8)
    manager.start_sequence("other", [2] * 8)
    assert not manager.can_append("other", 8)
    manager.release_sequence("victim")  # preempt
    manager.append_slots("other", 8)
    assert manager.block_tables("other").full == (2, 1)
    manager.release_sequence("other")
    assert manager.start_sequence("victim", [1] * 8 + [9]) == 0  # no prefix cache: recompute all
    manager.append_slots("victim", 9)
    assert manager.block_tables("victim").full == (0, 1, 2)
    manager.check_integrity()


def test_preempted_sequence_with_cached_tokens_recomputes_only_what_was_evicted() -> None:
    manager = KVManager(block_size=4, num_full_blocks=8)
    tokens = list(range(10))
    manager.start_sequence("s", tokens[:6])
    manager.append_slots("s", 6)
    manager.append_slots("s", 3)  # decode positions 6-8 (generated tokens 6, 7, 8)
    manager.release_sequence("s", computed_tokens=tokens[:9])
    assert manager.full_pool.num_evictable == 2  # blocks of positions 0-7
    assert manager.start_sequence("s", tokens) == 8
    assert manager.block_tables("s").full == (0, 1)
    with pytest.raises(ValueError):
        manager.release_sequence("s", computed_tokens=tokens)  # more tokens than have slots
    with pytest.raises(ValueError):
        manager.release_sequence("s", computed_tokens=[9, 9])  # not the sequence's tokens
    manager.release_sequence("s")
    manager.check_integrity()


def test_constructor_validates_groups() -> None:
    with pytest.raises(ValueError):
        KVManager(block_size=4, num_full_blocks=4, num_sliding_blocks=4)
    with pytest.raises(ValueError):
        KVManager(block_size=4, num_full_blocks=4, sliding_window=8)


# ---- random operations, with simulated KV contents ----------------------------------------------------

BLOCK_SIZE = 2
WINDOW = 3
CHUNK = 3
KEYS = (None, "salt")
Label = tuple[object, ...]


class KVManagerMachine(RuleBasedStateMachine):
    """Starts, chunked prefills, decodes, preemptions, finishes and evictions in random order.

    A fake GPU records, for every (group, block, offset) written, the label ``(extra_key, tokens up to
    and including that position)``: the only thing KV there can depend on. After every step each running
    sequence must read, through its block tables, exactly its own labels at every position an attention
    layer of that group can see; writes must only hit private blocks (refcount 1, not cached).
    """

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVManager(block_size=BLOCK_SIZE, num_full_blocks=14, num_sliding_blocks=9, sliding_window=WINDOW)
        self.gpu: dict[tuple[str, int, int], Label] = {}
        self.tokens: dict[int, list[int]] = {}  # running sequence -> prompt, then generated tokens
        self.prompt_lengths: dict[int, int] = {}
        self.keys: dict[int, str | None] = {}
        self.released: list[int] = []
        self.next_id = 0
        self.published: set[int] = set()  # the prefix cache's block hashes as a router rebuilds them from events

    def _label(self, seq_id: int, position: int) -> Label:
        return (self.keys[seq_id], *self.tokens[seq_id][: position + 1])

    def _write(self, seq_id: int, start: int, stop: int) -> None:
        tables = self.manager.block_tables(seq_id)
        groups: list[tuple[str, Sequence[int]]] = [("full", tables.full), ("sliding", tables.sliding)]
        for position in range(start, stop):
            for group, table in groups:
                block = table[position // BLOCK_SIZE]
                pool = self.manager.full_pool if group == "full" else self.manager.sliding_pool
                assert pool is not None
                assert pool.refcount(block) == 1 and not pool.is_cached(block), "write into a shared block"
                self.gpu[(group, block, position % BLOCK_SIZE)] = self._label(seq_id, position)

    def _append(self, seq_id: int, num_tokens: int) -> bool:
        if not self.manager.can_append(seq_id, num_tokens):
            return False
        start = self.manager.num_tokens(seq_id)
        self.manager.append_slots(seq_id, num_tokens)
        self._write(seq_id, start, start + num_tokens)
        self._check_reads(seq_id, first_query=start)  # what this step's queries read
        return True

    def _release(self, seq_id: int, cache_tokens: bool) -> None:
        computed = self.tokens[seq_id][: self.manager.num_tokens(seq_id)]
        self.manager.release_sequence(seq_id, computed if cache_tokens else None)
        del self.tokens[seq_id]
        self.released.append(seq_id)

    @rule(
        prompt=st.lists(st.integers(0, 1), min_size=1, max_size=9),
        key=st.sampled_from(KEYS),
        first_chunk=st.integers(1, CHUNK),
    )
    def start(self, prompt: list[int], key: str | None, first_chunk: int) -> None:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.tokens[seq_id], self.prompt_lengths[seq_id], self.keys[seq_id] = prompt, len(prompt), key
        cached = self.manager.start_sequence(seq_id, prompt, key)
        assert cached % BLOCK_SIZE == 0 and cached < len(prompt)
        self._check_reads(seq_id, first_query=cached)  # the shared prefix holds exactly this request's KV
        if not self._append(seq_id, min(first_chunk, len(prompt) - cached)):
            self._release(seq_id, cache_tokens=False)  # admission fails: back to waiting

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_token=st.integers(0, 1), cache_tokens=st.booleans())
    def step(self, data: st.DataObject, new_token: int, cache_tokens: bool) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        remaining_prompt = self.prompt_lengths[seq_id] - self.manager.num_tokens(seq_id)
        if remaining_prompt > 0:
            num_tokens = min(CHUNK, remaining_prompt)
        else:
            self.tokens[seq_id].append(new_token)  # the token sampled last step gets its slot now
            num_tokens = 1
        if not self._append(seq_id, num_tokens):
            if remaining_prompt <= 0:
                self.tokens[seq_id].pop()
            self._release(seq_id, cache_tokens)  # preempted (recompute later = a new start)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), cache_tokens=st.booleans())
    def finish(self, data: st.DataObject, cache_tokens: bool) -> None:
        self._release(data.draw(st.sampled_from(sorted(self.tokens))), cache_tokens)

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def release_again_raises(self, data: st.DataObject) -> None:
        with pytest.raises(SequenceStateError):
            self.manager.release_sequence(data.draw(st.sampled_from(self.released)))

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        cache, sliding = self.manager.prefix_cache, self.manager.sliding_pool
        assert cache is not None and sliding is not None
        cache.evict_full(data.draw(st.integers(0, self.manager.full_pool.num_evictable)))
        cache.evict_sliding(data.draw(st.integers(0, sliding.num_evictable)))

    def _check_reads(self, seq_id: int, first_query: int) -> None:
        """Queries ``first_query .. num_tokens`` read their own labels: full layers every earlier position,
        sliding layers the positions ``> query - WINDOW``."""
        tables = self.manager.block_tables(seq_id)
        for position in range(self.manager.num_tokens(seq_id)):
            label = self._label(seq_id, position)
            assert self.gpu.get(("full", tables.full[position // BLOCK_SIZE], position % BLOCK_SIZE)) == label
            if position > first_query - WINDOW:
                block = tables.sliding[position // BLOCK_SIZE]
                assert self.gpu.get(("sliding", block, position % BLOCK_SIZE)) == label

    @invariant()
    def integrity_and_contents(self) -> None:
        self.manager.check_integrity()
        batch = self.manager.events.take()
        if batch is not None:
            assert not set(batch.stored) & set(batch.removed)
            self.published = (self.published | set(batch.stored)) - set(batch.removed)
        cache = self.manager.prefix_cache
        assert cache is not None
        assert self.published == set(cache.block_hashes())  # the event stream reproduces the cache exactly
        for seq_id in self.tokens:
            self._check_reads(seq_id, first_query=self.manager.num_tokens(seq_id))

    def teardown(self) -> None:
        for seq_id in sorted(self.tokens):
            self._release(seq_id, cache_tokens=True)
        cache, sliding = self.manager.prefix_cache, self.manager.sliding_pool
        assert cache is not None and sliding is not None
        assert self.manager.full_pool.num_referenced == 0 and sliding.num_referenced == 0
        cache.evict_full(self.manager.full_pool.num_evictable)
        cache.evict_sliding(sliding.num_evictable)
        assert self.manager.full_pool.num_free == self.manager.full_pool.num_blocks  # nothing leaked
        assert sliding.num_free == sliding.num_blocks
        self.manager.check_integrity()


TestKVManagerMachine = KVManagerMachine.TestCase
TestKVManagerMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


# -- what one request alone needs (admission refuses what could never fit) --------------------------------


@pytest.mark.parametrize(("prompt", "max_step"), [(5, 64), (40, 64), (40, 8), (100, 16), (30, None)])
def test_a_request_admission_accepts_runs_alone_in_the_sliding_pool(prompt: int, max_step: int | None) -> None:
    """Whenever ``KVLimits`` says a request fits, it runs to completion alone: every step of its prefill
    (chunks of ``max_step``) and decode finds its sliding blocks."""
    from inference_server.core.validation import KVLimits

    window, block, out = 8, 4, 6
    limits = KVLimits(block_size=block, full_blocks=64, sliding_window=window, max_step_tokens=max_step)
    needed = limits.sliding_blocks_needed(prompt + out)
    kv = KVManager(block_size=block, num_full_blocks=64, num_sliding_blocks=needed, sliding_window=window)
    kv.start_sequence("r", tuple(range(prompt)))
    done = 0
    while done < prompt + out - 1:  # prefill chunks, then one token per decode step
        chunk = min(prompt - done, max_step or prompt) if done < prompt else 1
        assert kv.can_append("r", chunk), (done, chunk)
        kv.append_slots("r", chunk)
        done += chunk
    kv.check_integrity()


def test_block_tables_are_reused_until_they_change() -> None:
    """The tables a step reads are built once per change, not once per step (and never stale)."""
    manager = KVManager(block_size=4, num_full_blocks=8, num_sliding_blocks=8, sliding_window=4)
    manager.start_sequence("s", [1, 2, 3, 4, 5, 6])
    manager.append_slots("s", 6)
    first = manager.block_tables("s")
    manager.append_slots("s", 1)  # position 6: no new block, nothing released (window 4: blocks 0.. live)
    assert manager.block_tables("s") is first
    manager.append_slots("s", 2)  # positions 7, 8: one new block in each group, sliding block 0 released
    assert manager.block_tables("s") == BlockTables(full=(0, 1, 2), sliding=(UNUSED_BLOCK, 1, 2))
    manager.check_integrity()
