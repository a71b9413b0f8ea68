"""Incremental detokenizer: property tests with byte-fallback and byte-level tokenizers."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from inference_server.core.detokenizer import IncrementalDetokenizer
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
