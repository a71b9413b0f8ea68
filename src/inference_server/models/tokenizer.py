"""A tokenizer wrapper on ``tokenizers.Tokenizer``: encode/decode, special ids and chat templates.

Two sources:

* ``Tokenizer.from_pretrained_dir(folder)``: a Hugging Face checkpoint folder. ``tokenizer.json`` is loaded
  with ``tokenizers`` directly (no transformers import, which alone costs seconds). ``tokenizer_config.json``,
  ``special_tokens_map.json``, ``chat_template.jinja`` and ``generation_config.json`` are read when present.
  A folder without ``tokenizer.json`` falls back to ``transformers.AutoTokenizer``.
* ``Tokenizer.from_gguf(path)``: transformers' GGUF tokenizer conversion (~5 s for Gemma's 262k vocabulary
  plus ~5-8 s to import transformers, on a busy 2-core machine; see ``_gguf_tokenizer_type``),
  saved with ``save_pretrained`` under ``<cache_dir>/tokenizers/<stem>-<key>``. The key hashes the file's
  name, size and mtime plus the transformers/tokenizers versions, so the next start loads that folder
  (~1.5 s for Gemma) and a changed file or library is converted again.

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
* ``apply_chat_template`` renders the Jinja template the way transformers does: a sandboxed environment
  with ``trim_blocks``/``lstrip_blocks``, the ``tojson`` filter, and ``raise_exception``/``strftime_now``,
  with the special-token strings passed in. It tokenizes without adding special tokens, because the
  template writes them. A model without a template (the 270M base GGUF) raises ``ChatTemplateError``,
  as vLLM does. Pass ``chat_template=`` to supply one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal, overload

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from inference_server.startup import phase

__all__ = ["ChatTemplateError", "Tokenizer", "TokenizerError", "default_cache_dir"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_END_OF_TURN_TOKENS = frozenset({"<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>"})
_GGUF_CACHE_FORMAT = 1

Message = Mapping[str, Any]


# SentencePiece-style decoders (their JSON form) under which decoding joins each ordinary token's own text:
# ``Replace`` and ``Fuse`` act on each token alone, ``ByteFallback`` only on ``<0x..>`` tokens (``token_piece``).
_SENTENCEPIECE_DECODERS = (
    {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                                      {"type": "ByteFallback"}, {"type": "Fuse"}]},
)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_REPLACEMENT_CHARACTER = "\ufffd"


class TokenizerError(Exception):
    """A tokenizer cannot be loaded or converted; the message names the file or folder."""


class ChatTemplateError(TokenizerError):
    """The model has no chat template (or it failed to render)."""


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
            chat_template=chat_template or _folder_chat_template(folder, config),
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
        folder = _gguf_cache_folder(path, Path(cache_dir) if cache_dir is not None else default_cache_dir())
        if not (folder / "tokenizer.json").is_file():
            _convert_gguf_tokenizer(path, folder)
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
    def pad_token_id(self) -> int | None:
        return self._token_id(self._special_tokens.get("pad_token"))

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (may be < the model's vocab)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

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
            text = _open_final_message(text, messages[-1]["content"] if messages else "")
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        assert self._chat_template is not None
        try:
            return _template_environment().from_string(self._chat_template)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(f"the chat template does not parse: {error}") from error

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


# ------------------------------------------------------------------------------------------ helpers


def _open_final_message(text: str, final: Any) -> str:
    """``text`` (a rendered chat) cut right after the final message's content, so that message stays open.

    As transformers does: the content's last occurrence is found; when the template trimmed the content's
    trailing whitespace, the cut keeps the trimmed form."""
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError("continue_final_message needs a final message with text to continue")
    stripped = final.strip()
    if stripped not in text:
        raise ChatTemplateError("continue_final_message: the final message does not appear in the rendered chat")
    start = text.rindex(stripped)
    kept = final.lstrip()
    end = start + len(kept) if text[start:start + len(kept)] == kept else start + len(stripped)
    return text[:end]


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


def _folder_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else ``tokenizer_config.json``'s ``chat_template`` (a string, or
    a list of ``{"name", "template"}`` of which the one named ``default`` is used)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        return named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _template_environment() -> jinja2.Environment:
    """The sandboxed environment transformers renders chat templates in."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def _gguf_cache_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """``<cache_dir>/tokenizers/<stem>-<16 hex>``, keyed on the file's identity and the converter versions."""
    stat = gguf_path.stat()
    key = {
        "name": gguf_path.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "transformers": _package_version("transformers"),
        "tokenizers": _package_version("tokenizers"),
        "format": _GGUF_CACHE_FORMAT,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / "tokenizers" / f"{gguf_path.stem}-{digest}"


def write_folder_atomically(folder: Path, write: Callable[[Path], None], *, done_file: str, what: str) -> None:
    """Run ``write`` into a private staging folder, then rename it to ``folder`` (a reader never sees a half
    written folder). If another process got there first (``folder / done_file`` exists), its copy stands."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    try:
        write(staging)
        staging.rename(folder)
    except OSError as error:
        if not (folder / done_file).is_file():
            raise TokenizerError(f"cannot write {what} to {folder}: {error}") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _convert_gguf_tokenizer(gguf_path: Path, folder: Path) -> None:
    """Convert with transformers and save to ``folder`` atomically (staged, then renamed into place)."""

    def convert(staging: Path) -> None:
        with phase("converting the GGUF tokenizer (first start only: cached for later starts)"):
            _save_converted(gguf_path, staging)

    write_folder_atomically(folder, convert, done_file="tokenizer.json", what=f"the tokenizer of {gguf_path}")


_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen2moe": "qwen2_moe",
                     "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
"""transformers' model type for a GGUF architecture where the two differ (``load_gguf_checkpoint``'s renames)."""


def _gguf_tokenizer_type(gguf_path: Path) -> str | None:
    """The ``tokenizer_type`` ``AutoTokenizer`` would derive for this file, read from its header alone; None
    when it cannot be told (then ``AutoTokenizer`` works it out itself, slowly).

    Why: given a GGUF file, ``AutoTokenizer`` first builds the model's config, and for most architectures
    (Gemma 3 among them) it does so with ``gguf.GGUFReader``, which walks every metadata value in Python, the
    262,144-string vocabulary included: ~30 s of a ~40 s conversion on a busy 2-core machine. Naming the
    tokenizer type skips that step; the tokenizer itself is then built from transformers' fast header reader,
    and the saved files are byte-identical (tests/models/test_tokenizer.py checks the ids)."""
    try:
        from transformers.integrations.gguf import read_gguf_metadata
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    except ImportError:  # an older transformers without the fast reader
        return None
    try:
        metadata, _ = read_gguf_metadata(str(gguf_path))
    except Exception:  # a file the fast reader cannot parse: let AutoTokenizer report it
        return None
    architecture = metadata.get("general.architecture")
    model_type = _GGUF_MODEL_TYPES.get(architecture, architecture) if isinstance(architecture, str) else None
    return model_type if model_type in TOKENIZER_MAPPING_NAMES else None


def _save_converted(gguf_path: Path, staging: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer_type = _gguf_tokenizer_type(gguf_path)
    extra = {"tokenizer_type": tokenizer_type} if tokenizer_type is not None else {}
    try:
        hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True,
                                           **extra)
    except Exception as error:  # the converter raises many types for unsupported or corrupt files
        raise TokenizerError(f"cannot convert the tokenizer of GGUF file {gguf_path}: {error}") from error
    hf.save_pretrained(str(staging))
