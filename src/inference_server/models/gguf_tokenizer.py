"""The tokenizer of a GGUF file, converted by transformers once and cached as a Hugging Face folder.

The conversion (seconds: it imports transformers and walks the whole vocabulary; see ``_gguf_tokenizer_type``)
is saved with ``save_pretrained`` under ``<cache_dir>/tokenizers/<stem>-<key>``. The key hashes the file's name,
size and mtime plus the transformers/tokenizers versions, so the next start loads that folder and a changed
file or library is converted again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from inference_server.models.tokenizer_errors import TokenizerError
from inference_server.startup import phase

__all__ = ["cache_folder", "converted_tokenizer_folder", "write_folder_atomically"]

_GGUF_CACHE_FORMAT = 1


def converted_tokenizer_folder(gguf_path: Path, cache_dir: Path) -> Path:
    """The cached folder of ``gguf_path``'s tokenizer, converted into it first if it is not there yet."""
    folder = cache_folder(gguf_path, cache_dir)
    if not (folder / "tokenizer.json").is_file():
        _convert_gguf_tokenizer(gguf_path, folder)
    return folder


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def cache_folder(gguf_path: Path, cache_dir: Path) -> Path:
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
