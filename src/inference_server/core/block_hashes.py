"""Chained block hashes: one integer per whole block of a token prefix, naming the prefix it ends.

``hash_i = block_hash(hash_{i-1}, tokens[i * B : (i + 1) * B])`` with ``hash_{-1} = root_hash(extra_key)``, so
a block's hash stands for the *whole path* of blocks before it (and its ``extra_key``: a cache salt keeps its
blocks apart from everyone else's, as the radix cache's roots do). The radix cache gives every node the hash
of its path and reports the hashes it inserts and evicts (``core/kv_events.py``); a router holding those
hashes finds a replica's longest cached prefix of a request by walking the request's own hashes, in time
proportional to the request's length, whatever the replicas hold.

The hash is CPython's tuple hash over ints, which is deterministic across processes of one Python build (int
hashes are not salted; only ``str`` and ``bytes`` are, so the extra key goes through BLAKE2b first).
``HASH_SCHEME`` is the hash of a fixed probe: a consumer compares it with its own before trusting a
producer's hashes (different builds may hash differently). Collisions only ever misroute: the radix cache
itself matches tokens exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

NO_KEY_ROOT = 0


def root_hash(extra_key: str | None) -> int:
    """The hash every chain under ``extra_key`` starts from (0 for no key)."""
    if extra_key is None:
        return NO_KEY_ROOT
    key = extra_key if isinstance(extra_key, str) else repr(extra_key)  # salts are strings; be safe anyway
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little", signed=True)


def block_hash(parent: int, block_tokens: tuple[int, ...]) -> int:
    """The hash of a block holding ``block_tokens`` after the prefix whose last block hashes to ``parent``."""
    return hash((parent, block_tokens))


def chain_hashes(tokens: Sequence[int], block_size: int, extra_key: str | None = None) -> list[int]:
    """The hashes of the whole blocks of ``tokens`` (a partial last block has none)."""
    hashes: list[int] = []
    parent = root_hash(extra_key)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tuple(tokens[start : start + block_size]))
        hashes.append(parent)
    return hashes


HASH_SCHEME = chain_hashes(range(32), 4, "inference_server")[-1]
"""A probe of this process's hash function: equal values in two processes mean their hashes agree."""
