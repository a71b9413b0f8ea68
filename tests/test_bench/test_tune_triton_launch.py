"""``bench/tune_triton_launch.py`` (CPU dry run on the tiny preset) and the tuned-config lookup of the fused MoE.

Tuned configs may only change the tiling: ``fused_moe`` with every written config gives the heuristic config's
output within bf16 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.kernels.fused_moe import fused_moe, moe_kernel_config
from inference_server.kernels.moe_configs import (
    MoeGemmConfig,
    MoeKernelConfig,
    config_file_name,
    config_from_json,
    config_to_json,
    tuned_moe_config,
)

ROOT = Path(__file__).resolve().parents[2]
SHAPE = dict(num_experts=8, hidden=64, intermediate=24, top_k=2)  # qwen3-30b-a3b-tiny


def _write(directory: Path, configs: dict[int, MoeKernelConfig]) -> None:
    name = config_file_name("cpu", SHAPE["num_experts"], SHAPE["hidden"], SHAPE["intermediate"], SHAPE["top_k"],
                            torch.bfloat16)
    body = {"meta": {}, "configs": {str(t): config_to_json(c) for t, c in configs.items()}}
    (directory / name).write_text(json.dumps(body))


def _lookup(tokens: int, directory: Path) -> MoeKernelConfig | None:
    return tuned_moe_config(tokens, SHAPE["hidden"], SHAPE["intermediate"], SHAPE["num_experts"], SHAPE["top_k"],
                            torch.bfloat16, "cpu", directory)


def test_lookup_takes_the_nearest_tuned_token_count(tmp_path: Path) -> None:
    small = MoeKernelConfig(16, MoeGemmConfig(32, 64, 1, 4, 3), MoeGemmConfig(32, 64, 1, 4, 4))
    large = MoeKernelConfig(64, MoeGemmConfig(64, 64, 1, 8, 3), MoeGemmConfig(64, 128, 1, 8, 4))
    _write(tmp_path, {1: small, 16: large})
    assert _lookup(1, tmp_path) == small and _lookup(8, tmp_path) == small  # ties go to the smaller count
    assert _lookup(9, tmp_path) == large and _lookup(4096, tmp_path) == large
    assert _lookup(1, tmp_path / "absent") is None  # no file for this GPU and shape: the heuristic runs
    assert config_from_json(config_to_json(large)) == large
    with pytest.raises(ValueError, match="bad fused-MoE config"):
        config_from_json({"block_m": 16, "gate_up": {"block_n": 32}})


def test_dry_run_writes_configs_that_match_the_heuristic(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tune_triton_launch.py"), "--model", "qwen3-30b-a3b-tiny",
         "--device", "cpu", "--tokens", "1,4", "--quick", "3", "--reps", "1", "--out-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert set(written["configs"]) == {"1", "4"} and written["meta"]["experts"] == 8
    gen = torch.Generator().manual_seed(0)
    for tokens_text, entry in written["configs"].items():
        tokens = int(tokens_text)
        config = config_from_json(entry)
        assert _lookup(tokens, tmp_path) == config
        hidden = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
        w_gu = (torch.randn(8, 48, 64, generator=gen) * 0.125).to(torch.bfloat16)
        w_dn = (torch.randn(8, 64, 24, generator=gen) * 0.2).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, 2, generator=gen), -1).to(torch.bfloat16)
        tuned = fused_moe(hidden, w_gu, w_dn, weights, ids, "silu", config=config)
        heuristic = fused_moe(hidden, w_gu, w_dn, weights, ids, "silu", config=moe_kernel_config(tokens, 64, 24, 8, 2))
        torch.testing.assert_close(tuned.float(), heuristic.float(), atol=2e-2, rtol=2 ** -6)


def test_fused_moe_consults_the_tuned_configs_only_while_they_are_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    import inference_server.kernels.fused_moe as fused_moe_module
    from inference_server.kernels.moe_configs import tuned_configs, tuned_configs_enabled

    looked_up: list[int] = []

    def spy(num_tokens: int, *args: object) -> None:
        looked_up.append(num_tokens)
        return None  # no tuned entry: the heuristic runs

    monkeypatch.setattr(fused_moe_module, "tuned_moe_config", spy)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 64, generator=gen)
    w_gu, w_dn = torch.randn(8, 48, 64, generator=gen) * 0.125, torch.randn(8, 64, 24, generator=gen) * 0.2
    ids, weights = torch.tensor([[0, 3], [5, 3]]), torch.full((2, 2), 0.5)
    assert tuned_configs_enabled()  # the default
    with tuned_configs(False):
        assert not tuned_configs_enabled()
        fused_moe(hidden, w_gu, w_dn, weights, ids, "silu")
        assert looked_up == []
    assert tuned_configs_enabled()  # the previous setting after the block
    fused_moe(hidden, w_gu, w_dn, weights, ids, "silu")
    assert looked_up == [2]


def test_int8_dry_run_writes_the_int8_file(tmp_path: Path) -> None:
    """``--int8`` tunes the int8-expert path and writes the ``dtype=int8`` file fused_moe reads for int8 experts;
    a later run adds its token counts to the file."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tune_triton_launch.py"), "--model", "qwen3-30b-a3b-tiny", "--int8",
         "--device", "cpu", "--tokens", "1", "--quick", "2", "--reps", "1", "--out-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    name = config_file_name("cpu", SHAPE["num_experts"], SHAPE["hidden"], SHAPE["intermediate"], SHAPE["top_k"],
                            torch.int8)
    written = json.loads((tmp_path / name).read_text())
    assert written["meta"]["dtype"] == "int8" and set(written["configs"]) == {"1"}
    assert tuned_moe_config(1, SHAPE["hidden"], SHAPE["intermediate"], SHAPE["num_experts"], SHAPE["top_k"],
                            torch.int8, "cpu", tmp_path) == config_from_json(written["configs"]["1"])
    # A second run for other token counts keeps the first run's entries and times the config they replace.
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tune_triton_launch.py"), "--model", "qwen3-30b-a3b-tiny", "--int8",
         "--device", "cpu", "--tokens", "8", "--quick", "2", "--reps", "1", "--out-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((tmp_path / name).read_text())
    assert set(written["configs"]) == {"1", "8"}
    first, second = written["sweep"]
    assert first["tokens"] == 1 and first["current_us"] is None
    assert second["tokens"] == 8 and second["current_us"] is not None
