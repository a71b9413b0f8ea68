"""The served tokenizer as a Hugging Face folder, so clients (aiperf, lm-eval, any ``transformers`` tool)
count and build prompts with exactly the ids the server uses.

``export_tokenizer(tokenizer, folder)`` writes ``tokenizer.json`` (the backend as loaded, post-processor
included, so ``transformers.AutoTokenizer.from_pretrained(folder).encode(text)`` equals the server's
``encode``) and ``tokenizer_config.json`` (the special tokens, the chat template actually served, fallback
or ``CHAT_TEMPLATE`` included, and ``model_max_length``). ``served_tokenizer_folder`` is the folder the
server exports to at start: ``<cache_dir>/served-tokenizers/<name>-<key>``, the key hashing what is
written, so an unchanged tokenizer is reused (no write) and a changed one gets a new folder.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from inference_server.models.gguf_tokenizer import write_folder_atomically
from inference_server.models.tokenizer import Tokenizer, TokenizerError
from inference_server.startup import phase


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int | None = None) -> dict[str, Any]:
    """``tokenizer_config.json`` for ``tokenizer`` (``PreTrainedTokenizerFast`` over ``tokenizer.json``)."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config |= {key: value for key, value in tokenizer.special_tokens.items() if value is not None}
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


def export_tokenizer(tokenizer: Tokenizer, folder: str | Path, *, model_max_length: int | None = None) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (created if needed)."""
    target = Path(folder)
    try:
        target.mkdir(parents=True, exist_ok=True)
        tokenizer.backend.save(str(target / "tokenizer.json"))
        text = json.dumps(tokenizer_config(tokenizer, model_max_length), indent=2, ensure_ascii=False)
        (target / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")
    except OSError as error:
        raise TokenizerError(f"cannot write the tokenizer to {target}: {error}") from error
    return target


def backend_identity(tokenizer: Tokenizer) -> bytes:
    """What identifies the backend: its source ``tokenizer.json`` (path, size, mtime: cheap, and the file is
    what gets written), else its whole serialisation (~1 s for Gemma's 33 MB on a busy machine)."""
    source = tokenizer.source_file
    if source is not None and source.is_file():
        stat = source.stat()
        return f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    return tokenizer.backend.to_str().encode()


def served_tokenizer_folder(tokenizer: Tokenizer, cache_dir: Path, model_name: str,
                            model_max_length: int | None = None) -> Path:
    """The tokenizer exported under ``cache_dir`` (see the module docstring); written only when absent."""
    config = tokenizer_config(tokenizer, model_max_length)
    digest = hashlib.sha256(backend_identity(tokenizer) + json.dumps(config, sort_keys=True).encode())
    safe_name = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name)[:64] or "model"
    folder = cache_dir / "served-tokenizers" / f"{safe_name}-{digest.hexdigest()[:16]}"
    if (folder / "tokenizer_config.json").is_file():
        return folder

    def export(staging: Path) -> None:
        with phase("exporting the tokenizer for clients (once per tokenizer)"):
            export_tokenizer(tokenizer, staging, model_max_length=model_max_length)

    write_folder_atomically(folder, export, done_file="tokenizer_config.json", what="the served tokenizer")
    return folder
