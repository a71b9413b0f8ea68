"""Incremental detokenizer: property tests with byte-fallback and byte-level tokenizers."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from inference_server.core.detokenizer import IncrementalDetokenizer, PieceDecoder
from inference_server.models.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "naïve café déjà vu, über straße",
    "東京 中文 日本語 한국어",
    "emoji 😀🎉👍🏽 and more 😀😀",
] * 20
REPLACEMENT = "\ufffd"


def _wrap(backend: BackendTokenizer, name: str) -> Tokenizer:
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    return Tokenizer(backend, special_tokens=special, eos_token_ids=frozenset(), chat_template=None, name=name)


def byte_fallback_tokenizer(strip_leading_space: bool) -> Tokenizer:
    """SentencePiece-style BPE with byte fallback: Gemma-style (no "▁" prepended, none stripped), or
    Llama-style ("▁" prepended to the text, one leading space stripped when decoding)."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    prepend_scheme = "first" if strip_leading_space else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    spec = json.loads(backend.to_str())
    for byte in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    backend = BackendTokenizer.from_str(json.dumps(spec))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_leading_space:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return _wrap(backend, f"byte-fallback(strip={strip_leading_space})")


def byte_level_tokenizer() -> Tokenizer:
    """GPT-2-style byte-level BPE: multi-byte characters are routinely split across tokens."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return _wrap(backend, "byte-level")


TOKENIZERS = {
    "gemma-style": byte_fallback_tokenizer(strip_leading_space=False),
    "llama-style": byte_fallback_tokenizer(strip_leading_space=True),
    "byte-level": byte_level_tokenizer(),
}

# Mixed scripts: ASCII, accents (precomposed and combining), CJK, emoji incl. ZWJ/skin tones, whitespace.
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("abc xyz  \n\t.,éüßñ\u0301中文字日本語한😀🎉👍🏽\u200d👩\U0001f9ea€")),
        st.characters(exclude_categories=("Cs",)),
    ),
    max_size=40,
)
PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add_token(token_id) for token_id in ids] + [detokenizer.flush()]


@pytest.mark.parametrize("name", list(TOKENIZERS))
@PROPERTY_SETTINGS
@given(text=TEXT)
def test_stream_concatenates_to_full_decode(name: str, text: str) -> None:
    tokenizer = TOKENIZERS[name]
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(IncrementalDetokenizer(tokenizer), ids)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in piece for piece in pieces)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@PROPERTY_SETTINGS
@given(prompt=TEXT, text=TEXT)
@example(prompt="ab 𐀀𐀀", text="\x07")  # context would start inside a byte-fallback character
def test_stream_after_prompt_continues_the_prompt(name: str, prompt: str, text: str) -> None:
    tokenizer = TOKENIZERS[name]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    emitted = "".join(stream(IncrementalDetokenizer(tokenizer, prompt_ids), ids))
    whole = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
    prefix = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert whole.startswith(prefix)
    assert emitted == whole[len(prefix) :]
    if name != "llama-style":  # a decoder without leading-space stripping: same as decoding alone
        assert emitted == tokenizer.decode(ids, skip_special_tokens=True)


@PROPERTY_SETTINGS
@given(ids=st.lists(st.integers(min_value=0, max_value=399), max_size=30))
def test_byte_level_arbitrary_ids(ids: list[int]) -> None:
    """Even id sequences that are not valid UTF-8 reproduce the full (lossy) decode for byte-level BPE."""
    tokenizer = TOKENIZERS["byte-level"]
    ids = [i for i in ids if i < tokenizer.vocab_size]
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_split_character_is_held_back_until_complete() -> None:
    tokenizer = TOKENIZERS["gemma-style"]
    ids = [tokenizer.token_to_id(f"<0x{byte:02X}>") for byte in "€".encode()]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add_token(i) for i in ids] == ["", "", "€"]
    assert detokenizer.flush() == ""


def test_flush_releases_an_incomplete_tail_like_decode() -> None:
    tokenizer = TOKENIZERS["gemma-style"]
    ids = [tokenizer.token_to_id("<0xE2>"), tokenizer.token_to_id("<0x82>")]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add_tokens(ids) == ""
    assert detokenizer.flush() == tokenizer.decode(ids) == REPLACEMENT * 2


def test_special_tokens_are_skipped_or_kept() -> None:
    tokenizer = TOKENIZERS["gemma-style"]
    ids = [*tokenizer.encode("the dog", add_special_tokens=False), tokenizer.token_to_id("<eos>")]
    assert IncrementalDetokenizer(tokenizer).add_tokens(ids) == "the dog"
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert kept.add_tokens(ids) + kept.flush() == "the dog<eos>"


def test_prompt_context_starts_on_a_character_boundary() -> None:
    tokenizer = TOKENIZERS["gemma-style"]
    prompt_ids = tokenizer.encode("ab 𐀀𐀀", add_special_tokens=False)
    assert tokenizer.decode(prompt_ids[-5:]).startswith("\ufffd")  # the naive context is mid-character
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    assert detokenizer.add_token(tokenizer.token_to_id("<0x07>")) == "\x07"


def test_window_stays_small() -> None:
    tokenizer = TOKENIZERS["byte-level"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    detokenizer.add_tokens(tokenizer.encode("the quick brown fox jumps over the lazy dog " * 50))
    assert len(detokenizer._window) <= 4


# ----------------------------------------------------------------------------- real model (heavy)


@pytest.mark.heavy
@settings(max_examples=300, deadline=None)
@given(prompt=TEXT, text=TEXT)
@example(prompt="Ŗ𐀀", text="\x07")
def test_embedded_gemma_tokenizer_streams_exactly(prompt: str, text: str) -> None:
    tokenizer = _embedded_tokenizer()
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = stream(IncrementalDetokenizer(tokenizer, prompt_ids), ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(REPLACEMENT in piece for piece in pieces) or REPLACEMENT in text


_EMBEDDED: list[Tokenizer] = []


def _embedded_tokenizer() -> Tokenizer:
    if not _EMBEDDED:
        from inference_server.models.loading.embedded import embedded_gguf_path

        _EMBEDDED.append(Tokenizer.from_gguf(embedded_gguf_path()))
    return _EMBEDDED[0]


# ----------------------------------------------------------------------------- the token-piece fast path


class DecodeOnly:
    """The tokenizer without ``token_piece``: the detokenizer then decodes every token (the reference)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decodes = 0

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.decodes += 1
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class CountingPieces(DecodeOnly):
    def token_piece(self, token_id: int) -> str | None:
        return self.tokenizer.token_piece(token_id)


def token_streams(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Random ids mixing ordinary, single-byte (byte fallback or byte-level) and special tokens with the ids of
    multi-byte text."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] + pre_tokenizers.ByteLevel.alphabet()  # one byte each
    byte_ids = [i for i in map(tokenizer.token_to_id, byte_tokens) if i is not None]
    special_ids = [i for i in (tokenizer.token_to_id(s) for s in [*SPECIALS, "<end_of_turn>"]) if i is not None]
    chunk = st.one_of(
        st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=6),
        st.lists(st.sampled_from(byte_ids), max_size=6),
        st.lists(st.sampled_from(special_ids), max_size=2),
        TEXT.map(lambda text: tokenizer.encode(text, add_special_tokens=False)),
    )
    return st.lists(chunk, max_size=6).map(lambda chunks: [i for c in chunks for i in c])


def assert_fast_path_matches_decodes(tokenizer: Tokenizer, prompt_ids: list[int], ids: list[int],
                                     skip_special_tokens: bool) -> None:
    assert isinstance(tokenizer, PieceDecoder)
    fast = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    reference = IncrementalDetokenizer(DecodeOnly(tokenizer), prompt_ids, skip_special_tokens=skip_special_tokens)
    for token_id in ids:
        assert fast.add_token(token_id) == reference.add_token(token_id)
        assert (fast._window, fast._read, fast._emitted_text) == (
            reference._window, reference._read, reference._emitted_text)
    assert fast.flush() == reference.flush()


@pytest.mark.parametrize("name", ["gemma-style", "byte-level"])
@PROPERTY_SETTINGS
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_piece_fast_path_equals_the_decode_path(name: str, data: st.DataObject, skip_special_tokens: bool) -> None:
    tokenizer = TOKENIZERS[name]
    prompt_ids = data.draw(token_streams(tokenizer), label="prompt")
    ids = data.draw(token_streams(tokenizer), label="ids")
    assert_fast_path_matches_decodes(tokenizer, prompt_ids, ids, skip_special_tokens)


def test_pieces_skip_the_decodes_of_ordinary_tokens() -> None:
    tokenizer = TOKENIZERS["gemma-style"]
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 5, add_special_tokens=False)
    counting = CountingPieces(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, ids[:3])
    decodes_at_start = counting.decodes
    assert detokenizer.add_tokens(ids) == tokenizer.decode(ids)
    assert counting.decodes == decodes_at_start  # every token's text came from its piece
    split = tokenizer.encode("ж", add_special_tokens=False)  # byte-fallback tokens: decoded
    assert len(split) == 2 and detokenizer.add_tokens(split) == "ж" and counting.decodes > decodes_at_start


def test_token_pieces_only_for_concatenating_decoders() -> None:
    gemma = TOKENIZERS["gemma-style"]
    word = gemma.encode(" the", add_special_tokens=False)[-1]
    assert gemma.token_piece(word) == gemma.decode([word]) != ""
    assert gemma.token_piece(gemma.token_to_id("<0xE6>")) is None  # byte fallback: part of a character
    assert gemma.token_piece(gemma.token_to_id("<eos>")) is None  # special: skipped or not
    assert gemma.token_piece(10**6) is None  # not in the vocabulary
    byte_level = TOKENIZERS["byte-level"]
    word = byte_level.encode(" the", add_special_tokens=False)[-1]
    assert byte_level.token_piece(word) == byte_level.decode([word]) == " the"
    assert byte_level.token_piece(byte_level.token_to_id("<eos>")) is None
    split = byte_level.encode("ж", add_special_tokens=False)  # one byte per token: no whole character
    assert len(split) == 2 and all(byte_level.token_piece(i) is None for i in split)
    llama = TOKENIZERS["llama-style"]  # one leading space stripped: a token's text depends on its position
    assert all(llama.token_piece(i) is None for i in range(llama.vocab_size))


@pytest.mark.heavy
@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_embedded_gemma_fast_path_equals_the_decode_path(data: st.DataObject, skip_special_tokens: bool) -> None:
    tokenizer = _embedded_tokenizer()
    prompt_ids = data.draw(token_streams(tokenizer), label="prompt")
    ids = data.draw(token_streams(tokenizer), label="ids")
    assert_fast_path_matches_decodes(tokenizer, prompt_ids, ids, skip_special_tokens)
