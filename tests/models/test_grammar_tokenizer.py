"""llguidance's tokenizer from the token table a first start cached: the same bytes, special ids and masks as
llguidance's own reading of ``tokenizer.json``, which a later start then skips. The tokenizer is the byte-level
test vocabulary of 512 ids (``<pad>``, ``<eos>``, ``<bos>`` special)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import llguidance
import numpy as np
import pytest

from inference_server.core.grammar_compiler import MASK_SLICES, grammar_source
from inference_server.models.grammar_tokenizer import build_grammar_tokenizer, table_path
from inference_server.models.tokenizer import Tokenizer
from inference_server.records.constraints import Constraint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_http"))
from http_testkit import byte_level_tokenizer_json

EOS = 1


@pytest.fixture
def tokenizer(tmp_path: Path) -> Tokenizer:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(byte_level_tokenizer_json(512))
    return Tokenizer.from_pretrained_dir(folder)


class Builds:
    """llguidance tokenizer builds by source while installed: ``json`` (tokenizer.json text) or ``table``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sources: list[str] = []
        real = llguidance.LLTokenizer

        def counted(source: object, *args: object, **kwargs: object) -> llguidance.LLTokenizer:
            self.sources.append("json" if isinstance(source, str) else "table")
            return real(source, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(llguidance, "LLTokenizer", counted)


def assert_same(a: llguidance.LLTokenizer, b: llguidance.LLTokenizer) -> None:
    """Same vocabulary (bytes and special flags of every id) and the same masks along random walks."""
    assert a.vocab_size == b.vocab_size and a.eos_tokens == b.eos_tokens
    for i in range(a.vocab_size):
        assert a.decode_bytes([i]) == b.decode_bytes([i]) and a.is_special_token(i) == b.is_special_token(i), i
    rng = random.Random(0)
    schema = {"type": "object", "properties": {"n": {"type": "string", "maxLength": 5}, "k": {"type": "integer"}},
              "required": ["n", "k"]}
    for grammar in (grammar_source(Constraint.json_schema(schema)), grammar_source(Constraint.regex("[a-c]{2,4}-x")),
                    'start: "ab" <[2]> /[a-z]+/\n'):
        x, y = llguidance.LLMatcher(a, grammar), llguidance.LLMatcher(b, grammar)
        steps = 0
        while not x.is_stopped() and steps < 60:
            mask = x.compute_bitmask()
            assert mask == y.compute_bitmask(), (grammar, steps)
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little"))
            token = int(allowed[rng.randrange(len(allowed))])
            assert x.consume_token(token) and y.consume_token(token)
            steps += 1
        assert steps > 2 and not x.is_error() and not y.is_error()


@pytest.mark.parametrize("vocab_size", [512, 544])  # 544: the model's logits wider than the tokenizer
def test_a_later_build_reads_the_cached_table_and_matches_the_first(
        tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vocab_size: int) -> None:
    builds = Builds(monkeypatch)
    cache = tmp_path / "cache"
    first = build_grammar_tokenizer(tokenizer, vocab_size, {EOS}, MASK_SLICES, cache)
    assert builds.sources == ["json"] and table_path(tokenizer, vocab_size, cache).is_file()
    later = build_grammar_tokenizer(tokenizer, vocab_size, {EOS}, MASK_SLICES, cache)
    assert builds.sources == ["json", "table"]
    assert_same(first, later)


def test_an_unreadable_table_is_rebuilt_from_tokenizer_json(
        tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds = Builds(monkeypatch)
    cache = tmp_path / "cache"
    path = table_path(tokenizer, 512, cache)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"torn")
    first = build_grammar_tokenizer(tokenizer, 512, {EOS}, MASK_SLICES, cache)
    later = build_grammar_tokenizer(tokenizer, 512, {EOS}, MASK_SLICES, cache)
    assert builds.sources == ["json", "table"]  # the torn file was replaced by a whole table
    assert_same(first, later)


@pytest.mark.parametrize("table", ["empty", "short", "rejected"])
def test_a_table_that_does_not_fit_is_replaced(tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                table: str) -> None:
    """A readable table this build did not write (empty; fewer ids than the vocabulary; one llguidance refuses)
    does not leave structured outputs off at every start: it is rebuilt from tokenizer.json and replaced."""
    builds = Builds(monkeypatch)
    cache = tmp_path / "cache"
    path = table_path(tokenizer, 512, cache)
    path.parent.mkdir(parents=True)
    count = {"empty": 0, "short": 100, "rejected": 512}[table]
    tokens = [bytes([i % 256]) for i in range(count)]
    np.savez(path, blob=np.frombuffer(b"".join(tokens), dtype=np.uint8),
             ends=np.cumsum([len(t) for t in tokens], dtype=np.int64), special=np.array([], dtype=np.int64))
    if table == "rejected":  # llguidance refuses the first build from a table (as another version might)
        counted = llguidance.LLTokenizer
        refusals = [ValueError("refused")]

        def refusing(source: object, *args: object, **kwargs: object) -> llguidance.LLTokenizer:
            if not isinstance(source, str) and refusals:
                raise refusals.pop()
            return counted(source, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(llguidance, "LLTokenizer", refusing)
    first = build_grammar_tokenizer(tokenizer, 512, {EOS}, MASK_SLICES, cache)
    later = build_grammar_tokenizer(tokenizer, 512, {EOS}, MASK_SLICES, cache)
    assert builds.sources[-2:] == ["json", "table"]  # the misfit was replaced by a whole table
    assert_same(first, later)


def test_the_table_key_follows_the_tokenizer_file_and_the_vocabulary_size(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = table_path(tokenizer, 512, tmp_path)
    assert table_path(tokenizer, 544, tmp_path) != path
    assert tokenizer.source_file is not None
    tokenizer.source_file.write_text(byte_level_tokenizer_json(520))  # rewritten: another size and mtime
    assert table_path(tokenizer, 512, tmp_path) != path


def test_a_write_removes_the_staging_files_of_killed_writes_but_not_a_young_one(tokenizer: Tokenizer,
                                                                                 tmp_path: Path) -> None:
    """A start killed between ``mkstemp`` and the rename leaves a ``*.npz.tmp`` of tens of MB; the next write
    removes those older than ``STALE_STAGING_SECONDS`` and leaves a younger one (another process's write)."""
    import os
    import time

    from inference_server.models.grammar_tokenizer import STALE_STAGING_SECONDS

    cache = tmp_path / "cache"
    folder = table_path(tokenizer, 512, cache).parent
    folder.mkdir(parents=True)
    killed, writing = folder / "killed.npz.tmp", folder / "writing.npz.tmp"
    killed.write_bytes(b"torn")
    writing.write_bytes(b"in progress")
    old = time.time() - STALE_STAGING_SECONDS - 60
    os.utime(killed, (old, old))
    build_grammar_tokenizer(tokenizer, 512, {EOS}, MASK_SLICES, cache)
    assert not killed.exists() and writing.exists()
    assert sorted(p.name for p in folder.iterdir()) == sorted([table_path(tokenizer, 512, cache).name, writing.name])
