"""llguidance's tokenizer for the served tokenizer, its token table cached on disk for later starts.

llguidance cannot serialise its tokenizer, and building one holds the GIL throughout (core/grammar_compiler.py),
so the build is a start-up phase and its length is start-up time. Most of it is llguidance reading
``tokenizer.json`` (12 MB for Gemma's 262k ids): 1.6 s of the 2.7 s, the rest being the mask slices. What that
reading yields is a token table, each id's bytes and which ids are special, and llguidance also builds a
tokenizer from such a table (``TokenizerWrapper``) in 0.4 s. So:

* the first start with a tokenizer builds from its ``tokenizer.json`` text (llguidance's own reading, exact),
  then writes the table that tokenizer reports (``decode_bytes`` and ``is_special_token`` of every id) to
  ``<cache_dir>/grammar-tokenizers/<key>.npz``;
* a later start builds from that table, with the served tokenizer's ``encode`` for the text llguidance tokenizes
  (what it runs on ``tokenizer.json`` itself). Same bytes, same special ids, same masks (the tests compare them).

The key hashes the tokenizer's identity (``tokenizer_export.backend_identity``: its source file's path, size and
mtime), llguidance's version and the vocabulary size. A table that cannot be read, or that does not give a tokenizer
of ``vocab_size`` ids llguidance accepts, is rebuilt and replaced; one that cannot be written is a warning (the next
start reads ``tokenizer.json`` again).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Collection, Sequence
from importlib.metadata import version
from pathlib import Path

import llguidance
import numpy as np

from inference_server.models.tokenizer import Tokenizer
from inference_server.models.tokenizer_export import backend_identity

log = logging.getLogger(__name__)

FOLDER = "grammar-tokenizers"


class _TableTokenizer:
    """What ``llguidance.TokenizerWrapper`` reads: the table, the special ids, and ``encode`` for text (called
    with ``str``; calling it with ``bytes`` raises, which tells the wrapper so)."""

    def __init__(self, tokens: Sequence[bytes], special_ids: Sequence[int], eos: int, tokenizer: Tokenizer) -> None:
        self.tokens = tokens
        self.special_token_ids = special_ids
        self.eos_token_id = eos  # without one, llguidance appends an EOS token of its own to the vocabulary
        self.bos_token_id = tokenizer.bos_token_id
        self._backend = tokenizer.backend

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        return list(self._backend.encode(text, add_special_tokens=False).ids)


def table_path(tokenizer: Tokenizer, vocab_size: int, cache_dir: Path) -> Path:
    """Where the token table of ``tokenizer`` (read by this llguidance, ``vocab_size`` ids) is cached."""
    key = hashlib.sha256(backend_identity(tokenizer) + f"|llguidance {version('llguidance')}|{vocab_size}".encode())
    return cache_dir / FOLDER / f"{key.hexdigest()[:24]}.npz"


def build_grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Collection[int],
                            slices: list[str], cache_dir: Path) -> llguidance.LLTokenizer:
    """llguidance's tokenizer of ``tokenizer`` (see the module docstring); raises what llguidance raises for a
    tokenizer it cannot read."""
    path = table_path(tokenizer, vocab_size, cache_dir)
    eos = sorted(eos_token_ids)
    table = read_table(path) if eos else None
    if table is not None:
        tokens, special_ids = table
        try:
            if len(tokens) != vocab_size:  # the first start wrote one entry per id of the same vocab_size
                raise ValueError(f"{len(tokens)} tokens, not {vocab_size}")
            wrapper = llguidance.TokenizerWrapper(_TableTokenizer(tokens, special_ids, eos[0], tokenizer))
            return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos, slices=slices)
        except Exception as error:  # a table this build did not write: read tokenizer.json, and replace it
            log.warning("the grammar token table %s does not fit this tokenizer (%s): rebuilding it", path, error)
    built = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos, slices=slices)
    if eos:  # a table is read back only with an EOS id to give llguidance (see _TableTokenizer)
        write_table(path, built)
    return built


def read_table(path: Path) -> tuple[list[bytes], list[int]] | None:
    """The cached (token bytes by id, special ids), or None when absent or unreadable."""
    try:
        with np.load(path) as data:
            blob, ends, special = data["blob"].tobytes(), data["ends"], data["special"]
        starts = [0, *ends[:-1].tolist()]
        return [blob[a:b] for a, b in zip(starts, ends.tolist(), strict=True)], special.tolist()
    except FileNotFoundError:
        return None
    except Exception as error:  # a torn, empty or foreign file: read tokenizer.json again, and rewrite the table
        log.warning("the grammar token table %s is unreadable (%s): rebuilding it", path, error)
        return None


def write_table(path: Path, built: llguidance.LLTokenizer) -> None:
    """Cache ``built``'s token table at ``path`` (atomically: a reader sees the old file or the whole new one)."""
    tokens = [built.decode_bytes([i]) for i in range(built.vocab_size)]
    special = np.array([i for i in range(built.vocab_size) if built.is_special_token(i)], dtype=np.int64)
    ends = np.cumsum([len(t) for t in tokens], dtype=np.int64)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(path.parent)
        handle, staging = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                np.savez(file, blob=np.frombuffer(b"".join(tokens), dtype=np.uint8), ends=ends, special=special)
            os.replace(staging, path)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
    except OSError as error:
        log.warning("the grammar token table was not cached (%s): the next start reads tokenizer.json again", error)


STALE_STAGING_SECONDS = 600.0
"""A staging file this old is a write that was killed before its rename (a process's write takes a second or so)."""


def remove_stale_staging(folder: Path) -> None:
    """Delete the ``*.npz.tmp`` files a killed start left in ``folder`` (a table is tens of MB); younger ones may
    be another process's write in progress and stay."""
    now = time.time()
    for staging in folder.glob("*.npz.tmp"):
        try:
            if now - staging.stat().st_mtime > STALE_STAGING_SECONDS:
                staging.unlink(missing_ok=True)
        except OSError:  # gone meanwhile, or not ours to delete: the write below does not depend on it
            continue
