"""Tokenizer wrapper: HF folders built with `tokenizers` at test time, GGUF conversion and its cache."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from inference_server.models import gguf_tokenizer
from inference_server.models.tokenizer import ChatTemplateError, Tokenizer, TokenizerError, default_cache_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else 'user' }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for tests",
    "the capital of france is paris and the capital of italy is rome",
] * 20
MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? 😀"},
]


def build_backend() -> BackendTokenizer:
    """A small SentencePiece-style BPE with byte fallback (<0x00>..<0xFF>) and a BOS post-processor."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL_TOKENS, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    backend = BackendTokenizer.from_str(json.dumps(spec))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bos = backend.token_to_id("<bos>")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return backend


def write_folder(folder: Path, *, chat_template: str | None = GEMMA_STYLE_TEMPLATE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    build_backend().save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": {"__type": "AddedToken", "content": "<eos>", "special": True},
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_folder(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(folder: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(folder)


# ------------------------------------------------------------------------------------------ folder


def test_encode_decode_and_special_ids(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("the capital of france")
    assert ids[0] == tokenizer.bos_token_id == tokenizer.token_to_id("<bos>")
    assert tokenizer.encode("the capital of france", add_special_tokens=False) == ids[1:]
    assert tokenizer.decode(ids[1:]) == "the capital of france"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the capital of france"
    assert tokenizer.decode(tokenizer.encode("héllo 😀 中文", add_special_tokens=False)) == "héllo 😀 中文"
    assert tokenizer.eos_token_ids == {tokenizer.token_to_id("<eos>"), tokenizer.token_to_id("<end_of_turn>")}
    assert tokenizer.vocab_size == tokenizer.backend.get_vocab_size(with_added_tokens=True)


def test_generation_config_eos_ids_are_included(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "with-generation-config")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert {7, 9} <= Tokenizer.from_pretrained_dir(folder).eos_token_ids


def test_encode_matches_transformers(folder: Path, tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    for text in ["the lazy dog", "  leading spaces", "naïve café 😀", ""]:
        assert tokenizer.encode(text) == hf.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_chat_template_matches_transformers(folder: Path, tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    for add_generation_prompt in (True, False):
        ours = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt, tokenize=False)
        theirs = hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert ours == theirs
        ours_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt)
        theirs_ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
        assert ours_ids == list(getattr(theirs_ids, "input_ids", theirs_ids))
    assert str(tokenizer.apply_chat_template(MESSAGES, tokenize=False)).endswith("<start_of_turn>model\n")


def test_template_raise_exception_becomes_chat_template_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="bad role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_pretrained_dir(write_folder(tmp_path / "base", chat_template=None))
    assert tokenizer.chat_template is None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        tokenizer.apply_chat_template(MESSAGES)


def test_chat_template_sources(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "jinja", chat_template=None)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tokenizer = Tokenizer.from_pretrained_dir(folder)
    assert tokenizer.apply_chat_template(MESSAGES[:1], tokenize=False) == "[What is the capital of France?]"
    override = Tokenizer.from_pretrained_dir(folder, chat_template="{{ messages | length }}")
    assert override.apply_chat_template(MESSAGES, tokenize=False) == "3"


def test_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does-not-exist"):
        Tokenizer.from_pretrained_dir(tmp_path / "does-not-exist")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match="broken"):
        Tokenizer.from_pretrained_dir(broken)


def test_default_cache_dir_honours_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "inference_server"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "inference_server"


# -------------------------------------------------------------------------------------------- GGUF


def gguf_tokens() -> tuple[list[str], list[int]]:
    """A SentencePiece-style vocabulary as llama.cpp stores it: specials, byte tokens, then pieces."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "▁c", "ap", "▁cap", "it", "al"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, types


def write_tokenizer_gguf(path: Path) -> Path:
    """A tensor-less gemma3 GGUF holding only metadata (enough for transformers' conversion)."""
    tokens, types = gguf_tokens()
    writer = gguf.GGUFWriter(path, "gemma3")
    for add, value in [
        (writer.add_context_length, 128),
        (writer.add_embedding_length, 64),
        (writer.add_block_count, 1),
        (writer.add_feed_forward_length, 128),
        (writer.add_head_count, 2),
        (writer.add_head_count_kv, 1),
        (writer.add_key_length, 32),
        (writer.add_value_length, 32),
        (writer.add_layer_norm_rms_eps, 1e-6),
        (writer.add_rope_freq_base, 1e6),
        (writer.add_sliding_window, 16),
    ]:
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_tokenizer_matches_transformers_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    path = write_tokenizer_gguf(tmp_path / "tiny.gguf")
    cache = tmp_path / "cache"
    first = Tokenizer.from_gguf(path, cache_dir=cache)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the cap it al", "the capital", "ébc 😀"]:
        assert first.encode(text) == hf.encode(text)
        assert first.decode(first.encode(text)) == hf.decode(hf.encode(text))
    assert first.bos_token_id == 2 and first.eos_token_ids == {1, 5}
    assert first.name == str(path)
    assert len(list((cache / "tokenizers").iterdir())) == 1

    def no_conversion(*args: object) -> None:
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(gguf_tokenizer, "_save_converted", no_conversion)
    second = Tokenizer.from_gguf(path, cache_dir=cache)
    assert second.encode("the capital") == first.encode("the capital")

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a changed file: new key
    with pytest.raises(AssertionError, match="cached tokenizer"):
        Tokenizer.from_gguf(path, cache_dir=cache)


def test_gguf_conversion_skips_the_config_parse(tmp_path: Path) -> None:
    """The conversion names the tokenizer type (so transformers does not parse the whole header into a config);
    the test above checks the result equals transformers' own conversion, which does."""
    path = write_tokenizer_gguf(tmp_path / "tiny.gguf")
    assert gguf_tokenizer._gguf_tokenizer_type(path) == "gemma3_text"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 10)
    assert gguf_tokenizer._gguf_tokenizer_type(junk) is None


def test_gguf_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"absent\.gguf"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf", cache_dir=tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(TokenizerError, match=r"junk\.gguf"):
        Tokenizer.from_gguf(junk, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "tokenizers").iterdir())


# ------------------------------------------------------------------------------ embedded (heavy)


@pytest.mark.heavy
def test_embedded_tokenizer(tmp_path: Path) -> None:
    from inference_server.models.loading.embedded import embedded_gguf_path

    path = embedded_gguf_path()
    started = time.perf_counter()
    first = Tokenizer.from_gguf(path, cache_dir=tmp_path)
    converted = time.perf_counter()
    cached = Tokenizer.from_gguf(path, cache_dir=tmp_path)
    loaded = time.perf_counter()
    print(f"\nfirst (convert + save) {converted - started:.1f} s, cached {loaded - converted:.2f} s")
    for tokenizer in (first, cached):
        assert tokenizer.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
        assert tokenizer.bos_token_id == 2
        assert tokenizer.eos_token_ids == {1, 106}
        assert tokenizer.vocab_size == 262144
    assert cached.decode(cached.encode("naïve 😀 中文 text")) == "<bos>naïve 😀 中文 text"
    with pytest.raises(ChatTemplateError):
        cached.apply_chat_template(MESSAGES)


def test_gemma_turn_template_for_models_without_one(tmp_path: Path) -> None:
    """The engine's fallback template renders Gemma's turn format (system folded into the first user turn)."""
    from inference_server.models.chat_templates import GEMMA_TURNS

    tokenizer = Tokenizer.from_pretrained_dir(write_folder(tmp_path / "plain", chat_template=None),
                                              chat_template=GEMMA_TURNS)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    bos = tokenizer.id_to_token(tokenizer.bos_token_id)
    assert text == (f"{bos}<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
                    "Hello!<end_of_turn>\n<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")


def test_chat_template_setting_must_name_a_file(tmp_path: Path) -> None:
    from inference_server.config import SettingsError
    from inference_server.models.chat_templates import read_chat_template

    with pytest.raises(SettingsError, match=r"CHAT_TEMPLATE='.*missing\.jinja' is invalid: no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"


def byte_level_backend() -> BackendTokenizer:
    """A small byte-level BPE (GPT-2 / Qwen style): every byte is a symbol of its alphabet."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def test_token_bytes_join_to_the_text_where_byte_tokens_alone_read_u_fffd(tokenizer: Tokenizer) -> None:
    """OpenAI's logprobs ``bytes``: a character split over byte tokens is those tokens' bytes joined, though
    each decodes alone to U+FFFD; SentencePiece byte fallback (``<0xF0>``) and byte-level BPE alike."""
    byte_level = Tokenizer(byte_level_backend(), special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"},
                           eos_token_ids=frozenset(), chat_template=None, name="byte-level")
    text = "the capital of 𓀀 is 😀 中文"
    for each in (tokenizer, byte_level):
        ids = each.encode(text, add_special_tokens=False)
        assert any(each.decode([i]) == "\ufffd" for i in ids), "the text has characters split over tokens"
        assert b"".join(each.token_bytes(i) for i in ids) == text.encode()
        eos = each.token_to_id("<eos>")
        assert eos is not None and each.token_bytes(eos) == b"<eos>"  # a special token: its text
