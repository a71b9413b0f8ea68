"""Per-sequence block tables over two layer groups (full attention, sliding window) and a prefix cache.

**Two block groups** (vLLM's hybrid allocator, one pool per group). The full-attention cache layers and
the sliding-window cache layers get separate KV tensors and separate :class:`BlockPool` s, and each
sequence has one block table per group, both indexed by ``position // block_size``. A block id names the
same slot in every cache layer *of its group*. Full-group tables keep every block for the life of the
sequence; in the sliding group a block is released as soon as it lies wholly before the window of the
next query (``first_block_in_window``), so a long sequence holds about ``window / block_size + 1``
sliding blocks however long it grows. A single pool shared by both groups could not give that memory
back: the slot would still be reserved in the full layers' tensors. A model without sliding layers
(Qwen3-MoE) has only the full group; a model without full-attention layers is not supported (every
supported model has some: Gemma 4 forces its last layer to full attention).

**When sliding blocks are released.** :meth:`KVManager.append_slots` first releases the sliding blocks
that the *first* of the new tokens can no longer see, then allocates slots for the new tokens. Releasing
against the newest position instead would take away keys that the earlier queries of a prefill chunk
still read. During a step a sequence therefore holds up to ``ceil((window - 1 + n) / block_size) + 1``
sliding blocks for ``n`` new tokens.

**Prefix cache.** A new sequence matches its prompt minus the last token (whose logits must be
computed) against the :class:`RadixCache`; matched blocks are shared, referenced, and never written
again. Before releasing out-of-window sliding blocks, ``append_slots`` inserts the prompt's written whole
blocks into the cache, so a long prompt's sliding blocks stay reusable (cached, evictable) rather than
lost; :meth:`KVManager.release_sequence` can insert the generated tokens too (multi-turn reuse, cheap
recompute after preemption). See :mod:`inference_server.core.radix_cache` for the rule that makes a hit
usable for both groups.

**Exactly-once release.** :meth:`KVManager.release_sequence` drops every reference the sequence holds and
forgets it; a second call raises :class:`SequenceStateError`. Preemption by recompute is
``release_sequence`` now and :meth:`KVManager.start_sequence` again later (with prompt plus generated
tokens; the prefix cache may then make the recompute short).

Positions a step writes must be issued after the steps that wrote the positions it reads (one CUDA
stream), so caching the blocks of a step that has been planned but not yet finished is safe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import cast

import attrs

from inference_server.core.block_pool import BlockPool, OutOfBlocksError, require
from inference_server.core.kv_events import KVEventLog
from inference_server.core.radix_cache import ExtraKey, PrefixBlocks, RadixCache, first_block_in_window

SequenceId = Hashable
UNUSED_BLOCK = 0
"""Block-table entry for a released sliding block (never read: attention masks it)."""


class SequenceStateError(RuntimeError):
    """A sequence id was started twice or used after release."""


@attrs.frozen
class BlockTables:
    """A sequence's block tables, one entry per block of positions; released entries are ``UNUSED_BLOCK``."""

    full: tuple[int, ...]
    sliding: tuple[int, ...]  # () without a sliding group


@attrs.define
class _Sequence:
    prompt: tuple[int, ...]
    extra_key: ExtraKey
    num_tokens: int  # positions with a slot, all written by issued steps
    num_cached_tokens: int  # prefix-cache hit at start
    full_blocks: list[int]
    sliding_blocks: list[int | None]  # same length as full_blocks when there is a sliding group
    num_released_sliding: int  # sliding_blocks[:num_released_sliding] are None
    num_inserted_blocks: int  # full_blocks[:num_inserted_blocks] are in the prefix cache
    tables: BlockTables | None = None  # block_tables' answer, kept until the tables change (None: stale)


class KVManager:
    """Owns the block pools, the prefix cache and every running sequence's block tables."""

    def __init__(
        self,
        *,
        block_size: int,
        num_full_blocks: int,
        num_sliding_blocks: int = 0,
        sliding_window: int | None = None,
        enable_prefix_cache: bool = True,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if (sliding_window is None) != (num_sliding_blocks == 0):
            raise ValueError("a sliding window needs sliding blocks, and sliding blocks need a window")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.full_pool = BlockPool(num_full_blocks, name="full")
        self.sliding_pool = None if sliding_window is None else BlockPool(num_sliding_blocks, name="sliding")
        self.events = KVEventLog()
        """The prefix cache's inserted and evicted block hashes (the KV allocator publishes them per step)."""
        self.prefix_cache = (
            RadixCache(
                block_size=block_size,
                full_pool=self.full_pool,
                sliding_pool=self.sliding_pool,
                sliding_window=sliding_window,
                events=self.events,
            )
            if enable_prefix_cache
            else None
        )
        self._sequences: dict[SequenceId, _Sequence] = {}

    # ---- queries -----------------------------------------------------------------------------------

    def __contains__(self, seq_id: SequenceId) -> bool:
        return seq_id in self._sequences

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def num_tokens(self, seq_id: SequenceId) -> int:
        """Positions of the sequence that have a KV slot (written, or being written by an issued step)."""
        return self._get(seq_id).num_tokens

    def num_cached_tokens(self, seq_id: SequenceId) -> int:
        """Prompt tokens served by the prefix cache at start (the rest must be computed)."""
        return self._get(seq_id).num_cached_tokens

    def block_tables(self, seq_id: SequenceId) -> BlockTables:
        """The sequence's tables; built once and reused until a block is added, released or replaced (a
        decode step adds a block once every ``block_size`` tokens, so most steps copy nothing)."""
        seq = self._get(seq_id)
        if seq.tables is None:
            # Entries before num_released_sliding are None, the rest are held (check_integrity's invariant),
            # so the sliding table is two slices rather than a test per entry.
            released = seq.num_released_sliding if seq.sliding_blocks else 0
            sliding: tuple[int, ...] = (UNUSED_BLOCK,) * released + tuple(
                cast(list[int], seq.sliding_blocks)[released:])
            seq.tables = BlockTables(full=tuple(seq.full_blocks), sliding=sliding)
        return seq.tables

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start_sequence(self, seq_id: SequenceId, prompt: Sequence[int], extra_key: ExtraKey = None, *,
                       use_prefix_cache: bool = True) -> int:
        """Register a sequence, sharing the longest usable cached prefix of ``prompt[:-1]`` (none when
        ``use_prefix_cache`` is false); returns the number of cached tokens. Allocates nothing else: follow
        with ``can_append``/``append_slots`` for ``len(prompt) - cached`` tokens (or release the sequence if
        that does not fit)."""
        if seq_id in self._sequences:
            raise SequenceStateError(f"sequence {seq_id!r} already started")
        if not prompt:
            raise ValueError("empty prompt")
        blocks, num_cached = PrefixBlocks(()), 0
        if self.prefix_cache is not None and use_prefix_cache:
            blocks, num_cached = self.prefix_cache.match_prefix(prompt[:-1], extra_key)
        num_released = 0
        if self.sliding_window is not None:
            num_released = first_block_in_window(num_cached, self.sliding_window, self.block_size)
        self._sequences[seq_id] = _Sequence(
            prompt=tuple(prompt),
            extra_key=extra_key,
            num_tokens=num_cached,
            num_cached_tokens=num_cached,
            full_blocks=list(blocks.full_blocks),
            sliding_blocks=list(blocks.sliding_blocks),
            num_released_sliding=num_released,
            num_inserted_blocks=blocks.num_blocks,
        )
        return num_cached

    def can_append(self, seq_id: SequenceId, num_new_tokens: int) -> bool:
        """Whether :meth:`append_slots` of ``num_new_tokens`` would succeed (counting the sliding blocks it
        releases first)."""
        seq = self._get(seq_id)
        num_new_blocks = self._num_new_blocks(seq, num_new_tokens)
        if num_new_blocks == 0:
            return True  # nothing to allocate (most decode steps)
        if not self.full_pool.can_allocate(num_new_blocks):
            return False
        if self.sliding_pool is None:
            return True
        pool = self.sliding_pool
        releasable = seq.sliding_blocks[seq.num_released_sliding : self._first_live_sliding_block(seq)]
        num_released = sum(1 for b in releasable if b is not None and pool.refcount(b) == 1)
        return num_new_blocks <= pool.num_available + num_released

    def append_in_block(self, seq_id: SequenceId) -> BlockTables | None:
        """The decode fast path: ``append_slots(seq_id, 1)`` when the new token needs no new block (15 decode
        steps of 16 with 16-token blocks), returning the tables; None, changing nothing, when it does (the
        caller then takes the general path: ``can_append``, preemption, ``append_slots``).

        Without a new block, ``append_slots`` of one token cannot fail, and what it does besides counting the
        token (caching written prompt blocks, releasing a sliding block that left the window) is rare, so it
        is tested for inline here and done by the same methods."""
        seq = self._get(seq_id)
        num_tokens = seq.num_tokens
        block_size = self.block_size
        if num_tokens % block_size == 0:
            return None  # the new token starts a block
        if self.prefix_cache is not None and \
                min(num_tokens, len(seq.prompt)) // block_size > seq.num_inserted_blocks:
            self._cache_written_prompt(seq)
        window = self.sliding_window
        if window is not None and (num_tokens - window + 1) // block_size > seq.num_released_sliding:
            self._release_out_of_window(seq)
        seq.num_tokens = num_tokens + 1
        return seq.tables if seq.tables is not None else self.block_tables(seq_id)

    def append_slots(self, seq_id: SequenceId, num_new_tokens: int) -> None:
        """Give positions ``num_tokens .. num_tokens + num_new_tokens - 1`` KV slots in both groups.

        First caches the prompt's written whole blocks and releases the sliding blocks the first new token
        cannot see. Raises :class:`OutOfBlocksError` (changing nothing) when ``can_append`` is false.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not self.can_append(seq_id, num_new_tokens):
            raise OutOfBlocksError(f"no room for {num_new_tokens} more tokens of sequence {seq_id!r}")
        seq = self._sequences[seq_id]
        self._cache_written_prompt(seq)
        self._release_out_of_window(seq)
        num_new_blocks = self._num_new_blocks(seq, num_new_tokens)
        if num_new_blocks:
            seq.tables = None
            seq.full_blocks.extend(self.full_pool.allocate(num_new_blocks))
            if self.sliding_pool is not None:
                seq.sliding_blocks.extend(self.sliding_pool.allocate(num_new_blocks))
        seq.num_tokens += num_new_tokens

    def release_sequence(self, seq_id: SequenceId, computed_tokens: Sequence[int] | None = None) -> None:
        """Drop every block reference of the sequence, exactly once, and forget it.

        With ``computed_tokens`` (its tokens whose KV is written: a prefix of prompt plus generated tokens,
        at most ``num_tokens`` long) their whole blocks are first inserted into the prefix cache, where
        they stay evictable (ignored without a prefix cache). Raises :class:`SequenceStateError` for an
        unknown or released sequence.
        """
        seq = self._get(seq_id)
        if computed_tokens is not None and self.prefix_cache is not None:
            self._check_computed_tokens(seq, computed_tokens)
            num_blocks = len(computed_tokens) // self.block_size
            self._insert(seq, computed_tokens[: num_blocks * self.block_size])
        del self._sequences[seq_id]
        for full_block in reversed(seq.full_blocks):  # tail first: leaves become evictable before parents
            self.full_pool.free(full_block)
        if self.sliding_pool is not None:
            for sliding_block in seq.sliding_blocks:
                if sliding_block is not None:
                    self.sliding_pool.free(sliding_block)

    # ---- internals ---------------------------------------------------------------------------------

    def _get(self, seq_id: SequenceId) -> _Sequence:
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise SequenceStateError(f"unknown or released sequence {seq_id!r}") from None

    def _num_new_blocks(self, seq: _Sequence, num_new_tokens: int) -> int:
        total_blocks = -(-(seq.num_tokens + num_new_tokens) // self.block_size)
        return max(0, total_blocks - len(seq.full_blocks))

    def _first_live_sliding_block(self, seq: _Sequence) -> int:
        assert self.sliding_window is not None
        return first_block_in_window(seq.num_tokens, self.sliding_window, self.block_size)

    def _release_out_of_window(self, seq: _Sequence) -> None:
        if self.sliding_pool is None:
            return
        first_live = self._first_live_sliding_block(seq)
        for index in range(seq.num_released_sliding, first_live):
            sliding_block = seq.sliding_blocks[index]
            assert sliding_block is not None
            seq.sliding_blocks[index] = None
            seq.tables = None
            self.sliding_pool.free(sliding_block)
        seq.num_released_sliding = max(seq.num_released_sliding, first_live)

    def _cache_written_prompt(self, seq: _Sequence) -> None:
        if self.prefix_cache is None:
            return
        num_blocks = min(seq.num_tokens, len(seq.prompt)) // self.block_size
        if num_blocks > seq.num_inserted_blocks:
            self._insert(seq, seq.prompt[: num_blocks * self.block_size])

    def _insert(self, seq: _Sequence, tokens: Sequence[int]) -> None:
        assert self.prefix_cache is not None
        num_blocks = len(tokens) // self.block_size
        own = PrefixBlocks(tuple(seq.full_blocks[:num_blocks]), tuple(seq.sliding_blocks[:num_blocks]))
        canonical = self.prefix_cache.insert(tokens, own, seq.extra_key)
        if canonical != own:
            seq.tables = None
            seq.full_blocks[:num_blocks] = canonical.full_blocks
            seq.sliding_blocks[:num_blocks] = canonical.sliding_blocks
        seq.num_inserted_blocks = max(seq.num_inserted_blocks, num_blocks)

    def _check_computed_tokens(self, seq: _Sequence, computed_tokens: Sequence[int]) -> None:
        if len(computed_tokens) > seq.num_tokens:
            raise ValueError(f"{len(computed_tokens)} computed tokens but only {seq.num_tokens} have slots")
        overlap = min(len(computed_tokens), len(seq.prompt))
        if tuple(computed_tokens[:overlap]) != seq.prompt[:overlap]:
            raise ValueError("computed_tokens do not start with the sequence's prompt")

    # ---- invariants --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Check the pools and the cache, then that every block's refcount equals the number of block-table
        entries holding it (so nothing leaks and nothing is freed twice), and each sequence's tables have
        the right length, no duplicates, released sliding entries only before the window, and cached
        blocks where it says it inserted them."""
        self.full_pool.check_integrity()
        if self.sliding_pool is not None:
            self.sliding_pool.check_integrity()
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
        full_holders: Counter[int] = Counter()
        sliding_holders: Counter[int] = Counter()
        for seq_id, seq in self._sequences.items():
            self._check_sequence(seq_id, seq)
            full_holders.update(seq.full_blocks)
            sliding_holders.update(b for b in seq.sliding_blocks if b is not None)
        _check_refcounts(self.full_pool, full_holders)
        if self.sliding_pool is not None:
            _check_refcounts(self.sliding_pool, sliding_holders)

    def _check_sequence(self, seq_id: SequenceId, seq: _Sequence) -> None:
        num_blocks = len(seq.full_blocks)
        require(num_blocks == -(-seq.num_tokens // self.block_size), f"{seq_id!r}: table length wrong")
        if seq.tables is not None:
            sliding = tuple(UNUSED_BLOCK if b is None else b for b in seq.sliding_blocks)
            require(seq.tables == BlockTables(tuple(seq.full_blocks), sliding), f"{seq_id!r}: stale block tables")
        require(len(set(seq.full_blocks)) == num_blocks, f"{seq_id!r}: duplicate full block")
        require(0 <= seq.num_cached_tokens <= seq.num_tokens, f"{seq_id!r}: cached tokens out of range")
        require(seq.num_inserted_blocks <= num_blocks, f"{seq_id!r}: inserted more blocks than it has")
        if self.prefix_cache is not None:
            inserted = seq.full_blocks[: seq.num_inserted_blocks]
            require(all(self.full_pool.is_cached(b) for b in inserted), f"{seq_id!r}: inserted block evicted")
        if self.sliding_pool is None:
            require(not seq.sliding_blocks, f"{seq_id!r}: sliding blocks without a sliding group")
            return
        released = seq.num_released_sliding
        require(len(seq.sliding_blocks) == num_blocks, f"{seq_id!r}: sliding table length wrong")
        require(released <= self._first_live_sliding_block(seq), f"{seq_id!r}: released a live block")
        require(all(b is None for b in seq.sliding_blocks[:released]), f"{seq_id!r}: stale released entry")
        live = seq.sliding_blocks[released:]
        require(all(b is not None for b in live), f"{seq_id!r}: hole inside the window")
        require(len(set(live)) == len(live), f"{seq_id!r}: duplicate sliding block")


def _check_refcounts(pool: BlockPool, holders: Counter[int]) -> None:
    for block_id in range(pool.num_blocks):
        require(
            pool.refcount(block_id) == holders[block_id],
            f"pool {pool.name!r}: block {block_id} refcount {pool.refcount(block_id)} "
            f"but {holders[block_id]} table entries",
        )
