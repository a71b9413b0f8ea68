"""A GGUF file's header (metadata and tensor table) read straight from a memory map, without ``gguf.GGUFReader``.

Why: ``GGUFReader`` builds a numpy view for every part of every metadata value, so the embedded model's
262,144-entry vocabulary (three arrays of that length) costs tens of seconds on a busy 2-core machine
(docs/quantization.md, first start). The loader needs none of the vocabulary: the tokenizer is converted
from the file separately. This reader walks the same bytes with ``struct``; string arrays are stepped over
(their element count is kept), numeric arrays are read with one ``numpy.frombuffer`` each.

Contract (tests/models/test_gguf_header.py checks it against ``GGUFReader`` on the embedded file):
``metadata[key]`` equals ``GGUFReader.fields[key].contents()`` for every key except string arrays;
``array_lengths[key]`` equals ``len(GGUFReader.fields[key].data)`` for every array; each tensor's name, type,
shape (GGUF order), data offset, data dtype and data shape equal the ``ReaderTensor``'s. Errors (a short or
foreign file, an unknown type) raise ``ValueError``.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
from gguf.quants import quant_shape_to_byte_shape

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
"""GGUF value type -> struct format, for the fixed-size types (8 is a string, 9 an array)."""
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)

_PLAIN_TYPES = {
    gguf.GGMLQuantizationType.F16: np.float16, gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}
"""Tensor types held as plain values (``GGUFReader`` views them in this dtype); every other type is blocks of
bytes, viewed as uint8 of ``quant_shape_to_byte_shape``."""


@attrs.frozen(eq=False)
class GGUFTensor:
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


@attrs.frozen(eq=False)
class GGUFHeader:
    """What a GGUF header holds, less the contents of string arrays."""

    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: dict[str, GGUFTensor]
    data_offset: int


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse ``path``'s header (see the module docstring); raises ``ValueError`` on a malformed file."""
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    buffer = memoryview(blob)  # type: ignore[arg-type]
    try:
        return _parse(blob, buffer)
    except struct.error as error:
        raise ValueError(f"truncated GGUF header ({error})") from error


def _parse(blob: np.memmap, buffer: memoryview) -> GGUFHeader:
    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError("no GGUF magic at the start of the file")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", buffer, 4)
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (supported: 2, 3)")
    pos = 24
    metadata: dict[str, Any] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key, pos = _string(buffer, pos)
        (value_type,) = struct.unpack_from("<I", buffer, pos)
        pos += 4
        if value_type == _ARRAY:
            element_type, count = struct.unpack_from("<IQ", buffer, pos)
            pos += 12
            array_lengths[key] = count
            if element_type == _STRING:
                for _ in range(count):  # variable length: step over each one
                    (length,) = struct.unpack_from("<Q", buffer, pos)
                    pos += 8 + length
                continue
            dtype = _ARRAY_DTYPES.get(element_type)
            if dtype is None:
                raise ValueError(f"metadata key {key!r}: array of value type {element_type} is not supported")
            values = np.frombuffer(buffer, dtype=dtype, count=count, offset=pos)
            metadata[key] = values.tolist()
            pos += values.nbytes
        else:
            metadata[key], pos = _scalar(buffer, pos, value_type, key)
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    records = []
    for _ in range(tensor_count):
        name, pos = _string(buffer, pos)
        (n_dims,) = struct.unpack_from("<I", buffer, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buffer, pos + 4)
        raw_type, offset = struct.unpack_from("<IQ", buffer, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        records.append((name, dims, raw_type, offset))
    data_offset = pos + (-pos) % alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, raw_type, offset in records:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        tensors[name] = _tensor(blob, name, dims, gguf.GGMLQuantizationType(raw_type), data_offset + offset)
    return GGUFHeader(metadata, array_lengths, tensors, data_offset)


def _tensor(blob: np.memmap, name: str, dims: tuple[int, ...], kind: gguf.GGMLQuantizationType,
            data_offset: int) -> GGUFTensor:
    """``GGUFReader``'s view of one tensor: plain types by element, block types as bytes."""
    elements = math.prod(dims)
    data_shape = tuple(reversed(dims))
    plain = _PLAIN_TYPES.get(kind)
    if plain is not None:
        dtype = np.dtype(plain)
        size = elements * dtype.itemsize
    else:
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        dtype = np.dtype(np.uint8)
        size = elements * type_size // block_size
        data_shape = tuple(int(d) for d in quant_shape_to_byte_shape(data_shape, kind))
    if data_offset + size > blob.size:
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    return GGUFTensor(name, kind, tuple(dims), data_offset, dtype.str, data_shape, blob)


def _string(buffer: memoryview, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buffer, pos)
    end = pos + 8 + length
    if end > len(buffer):
        raise ValueError("a string runs past the end of the file")
    return bytes(buffer[pos + 8:end]).decode("utf-8"), end


def _scalar(buffer: memoryview, pos: int, value_type: int, key: str) -> tuple[Any, int]:
    if value_type == _STRING:
        return _string(buffer, pos)
    form = _SCALAR_FORMATS.get(value_type)
    if form is None:
        raise ValueError(f"metadata key {key!r}: value type {value_type} is not supported")
    (value,) = struct.unpack_from(form, buffer, pos)
    return value, pos + struct.calcsize(form)
