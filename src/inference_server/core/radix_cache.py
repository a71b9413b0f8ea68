"""Radix prefix cache over token ids at block granularity, shared across requests and sessions.

The tree has one root per ``extra_key`` (model revision, tenant salt, ...), so otherwise identical
prefixes under different keys never share KV. Every other node stands for one whole block of
``block_size`` tokens: its edge label is that block's token ids and it names the block(s) that hold the
KV of those tokens *given the whole path above it*. Partial blocks are never cached, and cached blocks
are never written again (a sequence writes only at positions past its cached prefix, i.e. into blocks
that are not in the tree).

The cache holds no references; it marks its blocks *cached* in the pools (:meth:`BlockPool.mark_cached`).
A cached block nobody references is *evictable*: still usable by a prefix hit, reclaimed only when a pool
runs short and calls the evictor this cache installs on it.

**Two layer groups.** A model has a full-attention group (always) and may have a sliding-window group,
each with its own :class:`BlockPool` (see :mod:`inference_server.core.kv_manager`). A node holds its
full-group block and, optionally, its sliding-group block. The rule that keeps prefix hits usable for
every layer type:

* A node's full block is always present; a node's sliding block may be missing ("tombstoned"): the
  sequence that inserted it had already released it as out of window, or the sliding pool evicted it.
* A match of ``k`` blocks is usable only if the sliding blocks the next token can see are all present:
  those of blocks ``first_block_in_window(k * block_size, window, block_size) .. k - 1``. The match is cut
  back to the longest usable ``k``. Sliding blocks before that window are not returned (``None``) and get
  no reference: the sequence never reads them.
* Full-pool eviction removes LRU unreferenced *leaves* (and frees their sliding block too); sliding-pool
  eviction tombstones the LRU unreferenced sliding block of *any* node, which only shortens future
  matches.

**Why leaf eviction always succeeds.** Every holder of cached full blocks holds a whole root path: a match
references a path from the root, and :meth:`insert` makes a sequence *adopt* the canonical block of every
node that already existed (it takes a reference on the node's block and frees its own duplicate). So
referenced nodes are closed under "parent of", unreferenced nodes under "child of", and repeatedly
evicting unreferenced leaves can reclaim every evictable full block. A sliding block is referenced only
by a holder of the same node's full block, so a full leaf with refcount 0 has an unreferenced sliding
block. LRU order is the order in which blocks were last released (the pool keeps it); a sequence
releases its full blocks tail first, so the oldest evictable full block is normally a leaf.

**Block hashes.** Every node carries the chained hash of its path (``core/block_hashes.py``), and the cache
reports each node it adds or removes by that hash to its ``KVEventLog`` (``core/kv_events.py``): the
stream a multi-replica router indexes. Sliding-block tombstones are not reported (they only shorten some
future matches, which a router's estimate may ignore).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from inference_server.core.block_hashes import block_hash, root_hash
from inference_server.core.block_pool import BlockPool, IntegrityError, require
from inference_server.core.kv_events import KVEventLog

ExtraKey = str | None


def first_block_in_window(num_tokens: int, window: int, block_size: int) -> int:
    """Index of the first block the query at position ``num_tokens`` can read in a sliding layer of
    window ``window`` (it sees positions ``>= num_tokens - window + 1``); earlier blocks are dead."""
    return max(0, num_tokens - window + 1) // block_size


@attrs.frozen
class PrefixBlocks:
    """Block ids of a run of whole blocks starting at position 0, per layer group.

    ``sliding_blocks`` is ``()`` when the model has no sliding group; otherwise it has one entry per full
    block, ``None`` where the sliding block is not held (outside the window, or released).
    """

    full_blocks: tuple[int, ...]
    sliding_blocks: tuple[int | None, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.full_blocks)


@attrs.define(eq=False)
class _Node:
    tokens: tuple[int, ...]
    parent: _Node | None
    extra_key: ExtraKey
    full_block: int = -1  # -1 only on a root
    sliding_block: int | None = None
    block_hash: int = 0  # the chained hash of the path to this node (a root: its extra key's root hash)
    children: dict[tuple[int, ...], _Node] = attrs.Factory(dict)


class RadixCache:
    """Prefix cache over whole blocks; installs itself as the evictor of the pools it is given."""

    def __init__(
        self,
        *,
        block_size: int,
        full_pool: BlockPool,
        sliding_pool: BlockPool | None = None,
        sliding_window: int | None = None,
        events: KVEventLog | None = None,
    ) -> None:
        if (sliding_pool is None) != (sliding_window is None):
            raise ValueError("sliding_pool and sliding_window go together")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self._full_pool = full_pool
        self._sliding_pool = sliding_pool
        self._window = sliding_window
        self._events = events
        self._roots: dict[ExtraKey, _Node] = {}
        self._node_by_full_block: dict[int, _Node] = {}
        self._node_by_sliding_block: dict[int, _Node] = {}
        full_pool.set_evictor(self.evict_full)
        if sliding_pool is not None:
            sliding_pool.set_evictor(self.evict_sliding)

    @property
    def num_nodes(self) -> int:
        """Cached blocks in the full group (one per node)."""
        return len(self._node_by_full_block)

    def block_hashes(self) -> list[int]:
        """The chained hash of every cached block (a snapshot for ``KVEventLog`` consumers)."""
        return [node.block_hash for node in self._node_by_full_block.values()]

    # ---- lookup ------------------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], extra_key: ExtraKey = None) -> tuple[PrefixBlocks, int]:
        """Longest usable cached prefix of ``tokens`` (whole blocks) and its length in tokens.

        Takes one reference on every returned block (``None`` entries excepted); the caller gives them back
        with :meth:`BlockPool.free`. To keep at least one token to compute, pass the prompt minus its last
        token.
        """
        path = self._walk(tokens, extra_key)
        matched = path[: self._usable_length(path)]
        full_blocks = tuple(node.full_block for node in matched)
        for block_id in full_blocks:
            self._full_pool.ref(block_id)
        sliding_blocks: tuple[int | None, ...] = ()
        if self._sliding_pool is not None and self._window is not None:
            first = first_block_in_window(len(matched) * self.block_size, self._window, self.block_size)
            sliding_blocks = tuple(None if i < first else n.sliding_block for i, n in enumerate(matched))
            for sliding_block in sliding_blocks[first:]:
                assert sliding_block is not None  # guaranteed by _usable_length
                self._sliding_pool.ref(sliding_block)
        return PrefixBlocks(full_blocks, sliding_blocks), len(matched) * self.block_size

    def _walk(self, tokens: Sequence[int], extra_key: ExtraKey) -> list[_Node]:
        path: list[_Node] = []
        node = self._roots.get(extra_key)
        if node is None:
            return path
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            child = node.children.get(tuple(tokens[start : start + bs]))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _usable_length(self, path: list[_Node]) -> int:
        """Longest ``k <= len(path)`` whose window of sliding blocks before position ``k * block_size`` is
        complete (all of ``path`` without a sliding group)."""
        if self._window is None:
            return len(path)
        usable, last_missing = 0, -1
        for index, node in enumerate(path):
            if node.sliding_block is None:
                last_missing = index
            num_blocks = index + 1
            if last_missing < first_block_in_window(num_blocks * self.block_size, self._window, self.block_size):
                usable = num_blocks
        return usable

    # ---- insertion ---------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], blocks: PrefixBlocks, extra_key: ExtraKey = None) -> PrefixBlocks:
        """Cache the whole blocks of ``tokens`` (their KV must be written) and return the canonical blocks.

        ``blocks`` has exactly ``len(tokens) // block_size`` entries per group, each referenced by the
        caller. Where a node already exists with another block, the caller's reference moves to the
        node's block and its own duplicate is freed; a node missing its sliding block takes the caller's.
        The caller must replace its blocks with the returned ones (same shape, ``None`` stays ``None``).
        """
        num_blocks = len(tokens) // self.block_size
        has_sliding = self._sliding_pool is not None
        if blocks.num_blocks != num_blocks or len(blocks.sliding_blocks) != (num_blocks if has_sliding else 0):
            raise ValueError(f"insert of {num_blocks} whole blocks got {blocks}")
        if num_blocks == 0:
            return blocks
        node = self._roots.get(extra_key)
        if node is None:
            node = self._roots[extra_key] = _Node(tokens=(), parent=None, extra_key=extra_key,
                                                  block_hash=root_hash(extra_key))
        full_out: list[int] = []
        sliding_out: list[int | None] = []
        for index in range(num_blocks):
            key = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            own_sliding = blocks.sliding_blocks[index] if has_sliding else None
            child = node.children.get(key)
            if child is None:
                child = self._add_child(node, key, blocks.full_blocks[index], own_sliding)
            else:
                self._adopt(child, blocks.full_blocks[index], own_sliding)
            full_out.append(child.full_block)
            if has_sliding:
                sliding_out.append(None if own_sliding is None else child.sliding_block)
            node = child
        return PrefixBlocks(tuple(full_out), tuple(sliding_out))

    def _add_child(self, parent: _Node, key: tuple[int, ...], full_block: int, sliding_block: int | None) -> _Node:
        child = _Node(tokens=key, parent=parent, extra_key=parent.extra_key, full_block=full_block,
                      block_hash=block_hash(parent.block_hash, key))
        parent.children[key] = child
        if self._events is not None:
            self._events.stored(child.block_hash)
        self._full_pool.mark_cached(full_block)
        self._node_by_full_block[full_block] = child
        if sliding_block is not None:
            self._cache_sliding(child, sliding_block)
        return child

    def _adopt(self, node: _Node, own_full: int, own_sliding: int | None) -> None:
        if node.full_block != own_full:
            _move_reference(self._full_pool, own_full, node.full_block)
        if own_sliding is None or self._sliding_pool is None:
            return
        if node.sliding_block is None:
            self._cache_sliding(node, own_sliding)
        elif node.sliding_block != own_sliding:
            _move_reference(self._sliding_pool, own_sliding, node.sliding_block)

    def _cache_sliding(self, node: _Node, sliding_block: int) -> None:
        assert self._sliding_pool is not None
        self._sliding_pool.mark_cached(sliding_block)
        node.sliding_block = sliding_block
        self._node_by_sliding_block[sliding_block] = node

    # ---- eviction ----------------------------------------------------------------------------------

    def evict_full(self, num_blocks: int) -> None:
        """Free ``num_blocks`` full blocks by removing least recently released unreferenced leaves (their
        sliding blocks are freed too). The full pool calls this when its free list is short."""
        for _ in range(num_blocks):
            self._remove_leaf(self._oldest_evictable_leaf())

    def evict_sliding(self, num_blocks: int) -> None:
        """Free ``num_blocks`` sliding blocks by tombstoning the least recently released unreferenced ones;
        the nodes stay (matches through them stay possible when they end far enough past them)."""
        assert self._sliding_pool is not None
        for _ in range(num_blocks):
            sliding_block = next(self._sliding_pool.iter_evictable(), None)
            if sliding_block is None:
                raise IntegrityError("sliding eviction asked for more blocks than are evictable")
            node = self._node_by_sliding_block.pop(sliding_block)
            node.sliding_block = None
            self._sliding_pool.uncache(sliding_block)

    def _oldest_evictable_leaf(self) -> _Node:
        for block_id in self._full_pool.iter_evictable():
            node = self._node_by_full_block[block_id]
            if not node.children:
                return node
        raise IntegrityError("full eviction asked for more blocks than are evictable")

    def _remove_leaf(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.tokens]
        del self._node_by_full_block[node.full_block]
        if self._events is not None:
            self._events.removed(node.block_hash)
        self._full_pool.uncache(node.full_block)
        if node.sliding_block is not None:
            assert self._sliding_pool is not None
            require(self._sliding_pool.refcount(node.sliding_block) == 0, "evicted leaf has a live sliding block")
            del self._node_by_sliding_block[node.sliding_block]
            self._sliding_pool.uncache(node.sliding_block)
        if parent.parent is None and not parent.children:
            del self._roots[parent.extra_key]

    # ---- invariants --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise :class:`IntegrityError` unless:

        * roots are keyed by their ``extra_key`` and are never empty; parent/child links agree and every
          edge label is one whole block;
        * every node's blocks are cached in their pools and indexed; no block is in two nodes; the pools
          hold no other cached blocks;
        * referenced full blocks are closed under "parent of" (so every evictable full block can be
          reached by leaf eviction), and a referenced sliding block sits on a node whose full block is
          referenced.
        """
        seen_full: set[int] = set()
        seen_sliding: set[int] = set()
        for extra_key, root in self._roots.items():
            require(root.parent is None and root.extra_key == extra_key, f"bad root {extra_key!r}")
            require(root.block_hash == root_hash(extra_key), f"bad root hash under {extra_key!r}")
            require(bool(root.children), f"empty root {extra_key!r} kept")
            stack = [root]
            while stack:
                node = stack.pop()
                for key, child in node.children.items():
                    self._check_node(node, key, child, seen_full, seen_sliding)
                    stack.append(child)
        require(seen_full == set(self._node_by_full_block), "full-block index out of step with the tree")
        require(seen_sliding == set(self._node_by_sliding_block), "sliding index out of step with the tree")
        require(self._full_pool.num_cached == len(seen_full), "full pool caches blocks outside the tree")
        if self._sliding_pool is not None:
            require(self._sliding_pool.num_cached == len(seen_sliding), "sliding pool caches stray blocks")

    def _check_node(
        self, parent: _Node, key: tuple[int, ...], node: _Node, seen_full: set[int], seen_sliding: set[int]
    ) -> None:
        require(node.parent is parent and node.tokens == key, "parent/child link broken")
        require(len(key) == self.block_size, f"edge label of {len(key)} tokens")
        require(node.extra_key == parent.extra_key, "node under the wrong extra key")
        require(node.block_hash == block_hash(parent.block_hash, key), "block hash does not chain")
        require(node.full_block not in seen_full, f"full block {node.full_block} in two nodes")
        seen_full.add(node.full_block)
        require(self._full_pool.is_cached(node.full_block), f"full block {node.full_block} not marked cached")
        require(self._node_by_full_block.get(node.full_block) is node, "full-block index points elsewhere")
        full_referenced = self._full_pool.refcount(node.full_block) > 0
        if full_referenced and parent.parent is not None:
            require(self._full_pool.refcount(parent.full_block) > 0, "referenced node under an unreferenced one")
        if node.sliding_block is None:
            return
        require(self._sliding_pool is not None, "sliding block cached without a sliding group")
        assert self._sliding_pool is not None
        require(node.sliding_block not in seen_sliding, f"sliding block {node.sliding_block} in two nodes")
        seen_sliding.add(node.sliding_block)
        require(self._sliding_pool.is_cached(node.sliding_block), "sliding block not marked cached")
        require(self._node_by_sliding_block.get(node.sliding_block) is node, "sliding index points elsewhere")
        if self._sliding_pool.refcount(node.sliding_block) > 0:
            require(full_referenced, "referenced sliding block on an unreferenced node")


def _move_reference(pool: BlockPool, own_block: int, canonical_block: int) -> None:
    """Swap the caller's reference from its private duplicate to the cached canonical block."""
    require(not pool.is_cached(own_block), f"duplicate block {own_block} is cached elsewhere")
    pool.ref(canonical_block)
    pool.free(own_block)
