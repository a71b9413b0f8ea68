"""``bench/int8_gpu_quality.py`` runs on the CPU (tiny presets, reference ops) and reports a small error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import int8_gpu_quality


def test_dry_run_on_tiny_presets(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Both heads (bf16, int8) of two tiny presets; the fused int8 greedy head runs in the Triton interpreter."""
    monkeypatch.setattr(sys, "argv", ["int8_gpu_quality.py", "--device", "cpu", "--layers", "2", "--tokens", "8",
                                      "--presets", "gemma-4-e2b-tiny", "qwen3-30b-a3b-tiny", "--heads", "bf16", "int8",
                                      "--int8-op", "inference_server.models.architectures.ops:torch_int8_linear"])
    int8_gpu_quality.main()
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "rel err" in line]
    errors = [float(line.split("rel err ")[1].split()[0]) for line in lines]
    # per preset and head: reference ops, kernels, kernels vs reference; per preset: the int8 head's share
    assert len(errors) == 2 * (2 * 3 + 1)
    assert max(errors) < 0.15
    assert all(e == 0.0 for line, e in zip(lines, errors, strict=True) if "kernels vs" in line)  # the reference
    assert out.count("fused greedy head vs the kernels' logits: 8/8 tokens equal") == 2


def test_cut_config_keeps_a_full_attention_layer_and_drops_kv_sharing() -> None:
    config = int8_gpu_quality.cut_config("gemma-4-e4b", 4)
    assert config["num_hidden_layers"] == 4 and config["num_kv_shared_layers"] == 0
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
