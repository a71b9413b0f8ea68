"""A tokenizer wrapper on ``tokenizers.Tokenizer``: encode/decode, special ids and chat templates.

Two sources:

* ``Tokenizer.from_pretrained_dir(folder)``: a Hugging Face checkpoint folder. ``tokenizer.json`` is loaded
  with ``tokenizers`` directly (no transformers import, which alone costs seconds). ``tokenizer_config.json``,
  ``special_tokens_map.json``, ``chat_template.jinja`` and ``generation_config.json`` are read when present.
  A folder without ``tokenizer.json`` falls back to ``transformers.AutoTokenizer``.
* ``Tokenizer.from_gguf(path)``: transformers' GGUF tokenizer conversion, cached as such a folder
  (``gguf_tokenizer.py``).

Contracts:

* ``encode(text, add_special_tokens=True)`` applies the ``tokenizer.json`` post-processor (e.g. Gemma's
  ``<bos>``). It equals ``transformers`` ``tokenizer.encode`` for folders whose post-processor is saved
  in ``tokenizer.json``, which includes every folder this module writes.
* ``decode`` is the backend's decode. transformers' optional ``clean_up_tokenization_spaces`` pass is not
  applied.
* ``eos_token_ids`` is the union of:
  - ``generation_config.json``'s ``eos_token_id`` (int or list),
  - the configured ``eos_token``,
  - any special token whose text is a well-known end-of-turn marker (``<end_of_turn>``, ``<|im_end|>``,
    ...), as llama.cpp does.

  For the embedded Gemma 3 270M this gives {1, 106}, the same as its upstream ``generation_config.json``.
* ``apply_chat_template`` renders the Jinja template the way transformers does (``chat_template.py``),
  with the special-token strings passed in. It tokenizes without adding special tokens, because the
  template writes them. A model without a template (the 270M base GGUF) raises ``ChatTemplateError``,
  as vLLM does. Pass ``chat_template=`` to supply one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
import tokenizers

from inference_server.models.chat_template import folder_chat_template, open_final_message, template_environment
from inference_server.models.gguf_tokenizer import converted_tokenizer_folder
from inference_server.models.tokenizer_errors import ChatTemplateError, TokenizerError

__all__ = ["ChatTemplateError", "Tokenizer", "TokenizerError", "default_cache_dir"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_END_OF_TURN_TOKENS = frozenset({"<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>"})

Message = Mapping[str, Any]


# SentencePiece-style decoders (their JSON form) under which decoding joins each ordinary token's own text:
# ``Replace`` and ``Fuse`` act on each token alone, ``ByteFallback`` only on ``<0x..>`` tokens (``token_piece``).
_SENTENCEPIECE_DECODERS = (
    {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                      {"type": "ByteFallback"}, {"type": "Fuse"}]},
)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT_CHARACTER = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> the byte it stands for: printable Latin-1 bytes are
    themselves, the others (controls, space, ...) are shifted to U+0100 and up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(shifted)}


_BYTE_LEVEL_BYTES = _byte_level_alphabet()


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/inference_server``, else ``~/.cache/inference_server``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inference_server"


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus special tokens, end-of-sequence ids and an optional chat template.

    Stateless after construction, so it is safe to share between threads.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str | None],
        eos_token_ids: frozenset[int],
        chat_template: str | None,
        name: str,
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._eos_token_ids = eos_token_ids
        self._chat_template = chat_template
        self.name = name
        self.source_file: Path | None = None
        """The ``tokenizer.json`` the backend was read from, when it was read from one."""

    # ---------------------------------------------------------------------------------- constructors

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """Load a Hugging Face tokenizer folder; ``chat_template`` overrides the folder's template."""
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder {folder} does not exist")
        if not (folder / "tokenizer.json").is_file():
            return cls._from_transformers(folder, chat_template)
        try:
            backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as error:  # tokenizers raises a plain Exception on malformed JSON
            raise TokenizerError(f"cannot read {folder / 'tokenizer.json'}: {error}") from error
        config = {**_read_json(folder / "special_tokens_map.json"), **_read_json(folder / "tokenizer_config.json")}
        special_tokens = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}
        generation_eos = _as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id"))
        tokenizer = cls(
            backend,
            special_tokens=special_tokens,
            eos_token_ids=_eos_token_ids(backend, special_tokens.get("eos_token"), generation_eos),
            chat_template=chat_template or folder_chat_template(folder, config),
            name=str(folder),
        )
        tokenizer.source_file = folder / "tokenizer.json"
        return tokenizer

    @classmethod
    def from_gguf(
        cls, gguf_path: str | Path, *, cache_dir: str | Path | None = None, chat_template: str | None = None
    ) -> Tokenizer:
        """The tokenizer of a GGUF file, converted by transformers once and cached (see module docstring)."""
        path = Path(gguf_path)
        if not path.is_file():
            raise TokenizerError(f"GGUF file {path} does not exist")
        folder = converted_tokenizer_folder(path, Path(cache_dir) if cache_dir is not None else default_cache_dir())
        tokenizer = cls.from_pretrained_dir(folder, chat_template=chat_template)
        tokenizer.name = str(path)
        return tokenizer

    @classmethod
    def _from_transformers(cls, folder: Path, chat_template: str | None) -> Tokenizer:
        """Fallback for folders without ``tokenizer.json`` (e.g. only a SentencePiece model)."""
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as error:
            raise TokenizerError(f"cannot load a tokenizer from {folder}: {error}") from error
        special_tokens = {key: _token_text(getattr(hf, key, None)) for key in _SPECIAL_TOKEN_KEYS}
        generation_eos = _as_id_list(_read_json(folder / "generation_config.json").get("eos_token_id"))
        return cls(
            hf.backend_tokenizer,
            special_tokens=special_tokens,
            eos_token_ids=_eos_token_ids(hf.backend_tokenizer, special_tokens.get("eos_token"), generation_eos),
            chat_template=chat_template or getattr(hf, "chat_template", None),
            name=str(folder),
        )

    # ------------------------------------------------------------------------------------ properties

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``, for fast id -> token work (``id_to_token`` etc.)."""
        return self._backend

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation (see module docstring)."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self._special_tokens.get("bos_token"))

    @property
    def special_tokens(self) -> dict[str, str | None]:
        """The configured ``bos_token``, ``eos_token``, ``unk_token`` and ``pad_token`` texts."""
        return dict(self._special_tokens)

    @property
    def eos_token(self) -> str | None:
        """The configured end-of-sequence token's text (``<eos>`` for Gemma)."""
        return self._special_tokens.get("eos_token")

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (may be < the model's vocab)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer with ``chat_template`` (Jinja text) in place of its own: the same vocabulary, special
        tokens and EOS ids (vLLM's per-call ``chat_template``). The template is compiled when first rendered,
        so one that does not parse raises ``ChatTemplateError`` from ``apply_chat_template``."""
        other = Tokenizer(self._backend, special_tokens=self._special_tokens, eos_token_ids=self._eos_token_ids,
                          chat_template=chat_template, name=self.name)
        other.source_file = self.source_file
        return other

    # ------------------------------------------------------------------------------------- encoding

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (BOS etc.)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (the backend decoder: SentencePiece ``▁`` -> space, byte fallback, ...)."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_piece(self, token_id: int) -> str | None:
        """The text ``token_id`` appends to the decode of any run of ids it follows, when that text does not
        depend on its neighbours; None when it may (then only a decode of the whole run is exact).

        Pieces exist for two kinds of decoders, and only for ordinary vocabulary tokens (added and special
        tokens, skipped or not by ``skip_special_tokens``, and unknown ids have none):

        * SentencePiece-style ``▁`` -> space with byte fallback (``_SENTENCEPIECE_DECODERS``, Gemma's): each
          token's text is its own, except byte-fallback tokens (``<0xE2>``: a run of them forms a character),
          which have no piece;
        * byte-level BPE (``ByteLevel``, GPT-2/Llama 3/Qwen): the tokens' bytes are joined, then decoded as
          UTF-8; a token whose bytes are whole characters (its decode has no U+FFFD) has its decode as piece.

        So ``decode(ids + [t]) == decode(ids) + token_piece(t)`` whenever every id of ``ids`` and ``t`` have a
        piece, whatever ``skip_special_tokens`` is. Computed once per id (a dict lookup afterwards); the
        incremental detokenizer uses it to skip the backend decodes of most tokens.
        """
        pieces = self._pieces
        if token_id in pieces:
            return pieces[token_id]
        piece: str | None = None
        kind = self._piece_decoder
        if kind is not None and token_id not in self._added_token_ids:
            token = self._backend.id_to_token(token_id)
            if token is not None and not (kind == "sentencepiece" and _BYTE_TOKEN.fullmatch(token)):
                piece = self._backend.decode([token_id], skip_special_tokens=False)
                if kind == "byte_level" and _REPLACEMENT_CHARACTER in piece:
                    piece = None  # part of a character (or invalid bytes): only whole runs decode exactly
        pieces[token_id] = piece
        return piece

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` contributes to a decode, as OpenAI's logprobs ``bytes`` give them. A token
        that is part of a character (a byte-fallback ``<0xF0>``, a byte-level BPE piece holding a partial UTF-8
        sequence) decodes alone to U+FFFD, but its own bytes are exact: joined with its neighbours' they form
        the character, which is what ``bytes`` is for. Every other token: the UTF-8 of its decode."""
        text = self._backend.decode([token_id], skip_special_tokens=False)
        if _REPLACEMENT_CHARACTER in text and token_id not in self._added_token_ids:
            token = self._backend.id_to_token(token_id) or ""
            kind = self._piece_decoder
            if kind == "sentencepiece" and (byte := _BYTE_TOKEN.fullmatch(token)):
                return bytes([int(byte.group(1), 16)])
            if kind == "byte_level" and token and all(c in _BYTE_LEVEL_BYTES for c in token):
                return bytes(_BYTE_LEVEL_BYTES[c] for c in token)
        return text.encode("utf-8", "replace")

    @cached_property
    def _pieces(self) -> dict[int, str | None]:
        return {}

    @cached_property
    def _piece_decoder(self) -> Literal["sentencepiece", "byte_level"] | None:
        """Which kind of decoder joins per-token texts (see ``token_piece``); None for any other."""
        decoder = self._backend.decoder
        if decoder is None:
            return None
        spec = json.loads(decoder.__getstate__())
        if spec in _SENTENCEPIECE_DECODERS:
            return "sentencepiece"
        if spec.get("type") == "ByteLevel":  # its options shape pre-tokenization only, not decoding
            return "byte_level"
        return None

    @cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._backend.get_added_tokens_decoder())

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @overload
    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True, *,
                            tokenize: Literal[True] = True, continue_final_message: bool = False,
                            **template_kwargs: Any) -> list[int]: ...

    @overload
    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True, *,
                            tokenize: Literal[False], continue_final_message: bool = False,
                            **template_kwargs: Any) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        tokenize: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> list[int] | str:
        """Render ``messages`` with the chat template; token ids (no special tokens added) or the text.

        ``continue_final_message`` (transformers' rule, for assistant prefill): the text ends right after the
        final message's content, without the end of its turn, so the model continues that message; it
        excludes ``add_generation_prompt``.

        Raises ``ChatTemplateError`` when there is no template or the template raises.
        """
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        if self._chat_template is None:
            raise ChatTemplateError(
                "this model's tokenizer has no chat template (likely a base model), so chat requests cannot be "
                "formatted; use a plain-text completion or supply a chat template"
            )
        context = {key: value for key, value in self._special_tokens.items() if value is not None}
        context |= template_kwargs
        try:
            text = self._compiled_template.render(
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as error:
            # (not naming self.name: it is a path on the server's disk, and this message reaches clients)
            raise ChatTemplateError(f"the chat template failed: {error}") from error
        if continue_final_message:
            text = open_final_message(text, messages[-1]["content"] if messages else "")
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        assert self._chat_template is not None
        try:
            return template_environment().from_string(self._chat_template)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(f"the chat template does not parse: {error}") from error

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


# ------------------------------------------------------------------------------------------ helpers


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ``{}`` if absent. A malformed file is a ``TokenizerError``."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TokenizerError(f"cannot read {path}: {error}") from error
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} does not hold a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as configured: a string, an AddedToken-like dict ``{"content": ...}``, or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return value.get("content")
    return str(value)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _eos_token_ids(backend: tokenizers.Tokenizer, eos_token: str | None, extra_ids: list[int]) -> frozenset[int]:
    """Configured EOS + ``extra_ids`` + special tokens that are well-known end-of-turn markers."""
    ids = set(extra_ids)
    if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
        ids.add(eos_id)
    # Look the markers up in the whole vocabulary: converters differ on whether they register them as
    # special added tokens (transformers 5.17's GGUF conversion does not, 5.24's does).
    for marker in _END_OF_TURN_TOKENS:
        if (token_id := backend.token_to_id(marker)) is not None:
            ids.add(token_id)
    return frozenset(ids)
