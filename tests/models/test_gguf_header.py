"""The fast GGUF header reader returns exactly what ``gguf.GGUFReader`` returns (less string arrays' contents)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tests.models.test_gguf_loader import write_tiny_gemma3, write_tiny_qwen3moe

from inference_server.models.loading.gguf_header import read_gguf_header

_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # GGUFReader's own, not key/values


def assert_header_matches_gguf_reader(path: Path) -> None:
    reader = gguf.GGUFReader(path, "r")
    header = read_gguf_header(path)
    keys = {key for key in reader.fields if key not in _HEADER_FIELDS}
    assert set(header.metadata) | set(header.array_lengths) == keys
    for key in keys:
        field = reader.fields[key]
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert header.array_lengths[key] == len(field.data), key
            if field.types[-1] == gguf.GGUFValueType.STRING:
                assert key not in header.metadata, key  # stepped over, never materialised
                continue
        value = header.metadata[key]
        expected = field.contents()
        assert value == expected and type(value) is type(expected), key
    assert header.data_offset == reader.data_offset
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for theirs in reader.tensors:
        ours = header.tensors[theirs.name]
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.data_offset == theirs.data_offset
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)


@pytest.mark.parametrize("writer", [write_tiny_gemma3, write_tiny_qwen3moe])
def test_header_equals_gguf_reader_on_written_files(writer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    assert_header_matches_gguf_reader(writer(tmp_path / "model.gguf"))


@pytest.mark.heavy
def test_header_equals_gguf_reader_on_the_embedded_file() -> None:
    from inference_server.models.loading.embedded import embedded_gguf_path

    assert_header_matches_gguf_reader(embedded_gguf_path())


@pytest.mark.parametrize("cut", [3, 30, 200])
def test_a_truncated_header_is_a_value_error(cut: int, tmp_path: Path) -> None:
    path = write_tiny_gemma3(tmp_path / "model.gguf")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(ValueError):
        read_gguf_header(broken)
