"""The converted-weight cache of GGUF models: a later load reads it and gets the same model; a changed file or
other settings do not read it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tests.models.test_gguf_loader import write_tiny_gemma3

from inference_server.models.loading import gguf_loader, source, weight_cache


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_second_load_reads_the_cache_and_a_changed_file_does_not(
        quantization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gemma3(tmp_path / "model.gguf")
    cache = tmp_path / "cache"
    first, _ = source._load_gguf(path, torch.device("cpu"), torch.float32, cache, quantization, "auto")
    expected = _state(first)
    assert len(list((cache / "weights").glob("*.safetensors"))) == 1

    def no_dequantisation(*args: object, **kwargs: object) -> None:
        raise AssertionError("dequantised although the cache is valid")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_loader.GGUFCheckpoint, "iter_tensors", no_dequantisation)
        second, _ = source._load_gguf(path, torch.device("cpu"), torch.float32, cache, quantization, "auto")
        got = _state(second)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) and got[k].dtype == expected[k].dtype for k in got)
        os.utime(path, ns=(1, 1))  # the file changed: its cached weights no longer apply
        with pytest.raises(AssertionError, match="dequantised although"):
            source._load_gguf(path, torch.device("cpu"), torch.float32, cache, quantization, "auto")
        other = "int8" if quantization == "none" else "none"  # other settings: another cache file
        with pytest.raises(AssertionError, match="dequantised although"):
            source._load_gguf(path, torch.device("cpu"), torch.float32, cache, other, "auto")


def test_a_corrupt_cache_file_is_ignored(tmp_path: Path) -> None:
    path = write_tiny_gemma3(tmp_path / "model.gguf")
    cache = tmp_path / "cache"
    first, _ = source._load_gguf(path, torch.device("cpu"), torch.float32, cache, "int8", "auto")
    [cached] = (cache / "weights").glob("*.safetensors")
    cached.write_bytes(b"not safetensors")
    second, _ = source._load_gguf(path, torch.device("cpu"), torch.float32, cache, "int8", "auto")
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(),
                                                  strict=True))
    assert weight_cache.load_cached(second, cached)  # rewritten by the second load
