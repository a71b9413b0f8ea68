"""``bench/int8_gpu_quality.py`` runs on the CPU (tiny presets, reference ops) and reports a small error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import int8_gpu_quality


def test_dry_run_on_tiny_presets(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["int8_gpu_quality.py", "--device", "cpu", "--layers", "2", "--tokens", "8",
                                      "--presets", "gemma-4-e2b-tiny", "qwen3-30b-a3b-tiny", "--embeddings",
                                      "--int8-op", "inference_server.models.architectures.ops:torch_int8_linear"])
    int8_gpu_quality.main()
    out = capsys.readouterr().out
    errors = [float(line.split("rel err ")[1].split()[0]) for line in out.splitlines() if "rel err" in line]
    assert len(errors) == 2 * 3  # reference ops, kernels, kernels vs reference, per preset
    assert max(errors) < 0.15 and errors[2] == errors[5] == 0.0  # the "kernels" here are the reference


def test_cut_config_keeps_a_full_attention_layer_and_drops_kv_sharing() -> None:
    config = int8_gpu_quality.cut_config("gemma-4-e4b", 4)
    assert config["num_hidden_layers"] == 4 and config["num_kv_shared_layers"] == 0
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
