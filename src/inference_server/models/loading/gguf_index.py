"""A cached index of a GGUF file's header, so that later starts skip the header parse.

The parse (``gguf_header.read_gguf_header``) steps over the tokenizer's 262,144 strings, a fraction of a second
for the embedded model (``gguf.GGUFReader``, which it replaced, took far longer: README's start-up figures);
the index still saves that and the config build. It keeps what the
loader needs (architecture, the HF config built from the metadata, and each tensor's type, shape and byte
range), keyed by the file's size and modification time and the ``gguf`` package version; tensor data is read
from the file through a memory map exactly as ``GGUFReader`` does, and dequantised by the ``gguf`` package.
"""

from __future__ import annotations

import hashlib
import json
import math
from importlib.metadata import version
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

INDEX_FORMAT = 1


@attrs.frozen(eq=False)
class IndexedTensor:
    """A tensor of a GGUF file, located by byte offset (the fields ``GGUFCheckpoint`` reads of a
    ``gguf.ReaderTensor``)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (fastest dimension first), as ReaderTensor.shape
    data_offset: int
    data_dtype: str
    data_shape: tuple[int, ...]
    file: np.memmap

    @property
    def data(self) -> np.ndarray:
        count = math.prod(self.data_shape)
        dtype = np.dtype(self.data_dtype)
        raw = self.file[self.data_offset: self.data_offset + count * dtype.itemsize]
        return raw.view(dtype).reshape(self.data_shape)


def index_path(gguf_path: Path, cache_dir: Path) -> Path:
    """Where the index of ``gguf_path`` lives: named by the file and everything that invalidates it."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version('gguf')}|{INDEX_FORMAT}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir / "gguf" / f"{gguf_path.stem}-{digest}.json"


def write_index(path: Path, architecture: str, config: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Record the header of an opened file (``tensors``: name -> ``gguf.ReaderTensor``); atomic rename."""
    records = [
        {"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
         "offset": int(t.data_offset), "dtype": t.data.dtype.str, "data_shape": [int(d) for d in t.data.shape]}
        for t in tensors.values()
    ]
    payload = {"format": INDEX_FORMAT, "architecture": architecture, "config": config, "tensors": records}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(payload))
    staging.replace(path)


def read_index(path: Path, gguf_path: Path) -> tuple[str, dict[str, Any], dict[str, IndexedTensor]] | None:
    """``(architecture, config, tensors)`` from an index, or None when there is none or it is unreadable."""
    try:
        payload = json.loads(path.read_text())
        if payload.get("format") != INDEX_FORMAT:
            return None
        file = np.memmap(gguf_path, mode="r")
        tensors = {
            r["name"]: IndexedTensor(r["name"], gguf.GGMLQuantizationType(r["type"]), tuple(r["shape"]),
                                     r["offset"], r["dtype"], tuple(r["data_shape"]), file)
            for r in payload["tensors"]
        }
        return payload["architecture"], payload["config"], tensors
    except (OSError, ValueError, KeyError, TypeError):
        return None
