"""``bench/int8_kernels.py``: its shapes are the presets' real ones, its byte counts and rotation rules, CPU dry
runs of its tables and of its config sweep at tiny shapes (kernels in the Triton interpreter), and the lookup of
the tuned ``int8_linear`` configs the sweep writes."""

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

from inference_server.kernels.int8_linear import int8_linear
from inference_server.kernels.int8_linear_configs import (
    Int8LinearConfig,
    config_file_name,
    config_from_json,
    config_to_json,
    tuned_int8_linear_config,
)
from inference_server.kernels.reference_int8 import int8_linear_reference, quantize_int8_per_channel
from inference_server.models.loading.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import int8_kernels as bench  # noqa: E402  (bench/ is on the path only from here)


def test_shapes_are_the_presets() -> None:
    g = PRESETS["gemma-4-31b"]
    heads, hidden, inter = g["num_attention_heads"], g["hidden_size"], g["intermediate_size"]
    sliding = heads * g["head_dim"] + 2 * g["num_key_value_heads"] * g["head_dim"]
    full = heads * g["global_head_dim"] + g["num_global_key_value_heads"] * g["global_head_dim"]  # k = v
    q = PRESETS["qwen3-30b-a3b"]
    q_heads = q["num_attention_heads"] * q["head_dim"]
    expected = {
        (sliding, hidden), (full, hidden), (hidden, heads * g["head_dim"]), (hidden, heads * g["global_head_dim"]),
        (2 * inter, hidden), (hidden, inter),
        (q_heads + 2 * q["num_key_value_heads"] * q["head_dim"], q["hidden_size"]), (q["hidden_size"], q_heads),
    }
    assert {(c.out_features, c.in_features) for c in bench.LINEAR_CASES} == expected
    moe = {(c.experts, c.hidden, c.intermediate, c.top_k) for c in bench.MOE_CASES}
    g26 = PRESETS["gemma-4-26b-a4b"]
    assert moe == {
        (q["num_experts"], q["hidden_size"], q["moe_intermediate_size"], q["num_experts_per_tok"]),
        (g26["num_experts"], g26["hidden_size"], g26["moe_intermediate_size"], g26["top_k_experts"]),
    }


def test_byte_counts() -> None:
    case = bench.LinearCase("x", 4096, 1024)
    bf16 = bench.linear_bytes(1, case, 2)
    int8 = bench.linear_bytes(1, case, 1)
    assert bf16 == 4096 * 1024 * 2 + (1024 + 4096) * 2
    assert int8 == 4096 * 1024 + 4096 * 2 + (1024 + 4096) * 2  # weight, scales, activations
    moe = bench.MOE_CASES[0]  # qwen3: 3 * 768 * 2048 weights an expert
    assert bench.moe_bytes(1, 8, moe, 2) == 8 * 3 * 768 * 2048 * 2 + 2 * 2048 * 2
    assert bench.moe_bytes(1, 8, moe, 1) == 8 * (3 * 768 * 2048 + (2 * 768 + 2048) * 2) + 2 * 2048 * 2


def test_rotation_keeps_two_l2_sizes_between_reads() -> None:
    l2 = 50 * 2**20
    assert bench.rotation(500 * 2**20, l2) == 1
    assert bench.rotation(10 * 2**20, l2) == 10
    assert bench.rotation(1, l2) == 16  # capped
    for copies in (1, 3, 10, 16):
        calls = bench.calls_per_graph(copies)
        assert calls >= 10 and calls % copies == 0


def test_row_reports_fraction_of_the_limits() -> None:
    row = bench.fraction_row("c", 1, 2e-6, 4.3e6, 1e-6, 4.3e6)  # int8: 4.3 MB in 1 µs = 4.3 TB/s
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["c", "1", "2.0", "2.15", "1.0", "4.30", "1.00", "0.90", "2.00x"]


def test_cpu_dry_run_prints_both_tables() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "int8_kernels.py"), "--device", "cpu", "--tiny", "--reps", "1",
         "--tokens", "1"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny")]
    dense, moe = rows  # the MoE row has one more column: int8 with the exponent-trick dequantisation
    assert dense.count("|") == 10 and moe.count("|") == 11, done.stdout
    assert "int8 kernels on cpu" in done.stdout


def test_lookup_takes_the_smallest_tuned_count_at_or_above(tmp_path: Path) -> None:
    decode = Int8LinearConfig(64, 16, 256, 4, 4, 3)
    mid = Int8LinearConfig(64, 32, 128, 2, 4, 4)
    name = config_file_name("cpu", 37, 100, torch.bfloat16)
    body = {"meta": {}, "configs": {"1": config_to_json(decode), "16": config_to_json(mid)}}
    (tmp_path / name).write_text(json.dumps(body))

    def lookup(tokens: int, dtype: torch.dtype = torch.bfloat16) -> Int8LinearConfig | None:
        return tuned_int8_linear_config(tokens, 37, 100, dtype, "cpu", tmp_path)

    assert lookup(1) == decode and lookup(2) == mid and lookup(16) == mid
    assert lookup(17) is None  # past the largest tuned count: the heuristic
    assert lookup(1, torch.float32) is None  # another activation dtype has its own file
    assert config_from_json(config_to_json(mid)) == mid
    with pytest.raises(ValueError, match="bad int8_linear config"):
        config_from_json({"block_n": 64, "colour": 3})


def test_sweep_dry_run_writes_configs_int8_linear_reads(tmp_path: Path) -> None:
    """The sweep writes the file ``int8_linear`` looks up. Its candidates: the heuristic (at one token the GEMV
    path) and ``magic``'s four, 5 of the 29 all paths give (the rest are more tiles of the same kernels)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "int8_kernels.py"), "--device", "cpu", "--tiny", "--reps", "1",
         "--sweep", "--write", "--out-dir", str(tmp_path), "--tokens", "1", "--paths", "magic"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = json.loads((tmp_path / config_file_name("cpu", 37, 100, torch.bfloat16)).read_text())
    assert set(written["configs"]) == {"1"}
    tuned = tuned_int8_linear_config(1, 37, 100, torch.bfloat16, "cpu", tmp_path)
    assert tuned == config_from_json(written["configs"]["1"])
    gen = torch.Generator().manual_seed(0)
    q, scale = quantize_int8_per_channel(torch.randn(37, 100, generator=gen), torch.bfloat16)
    x = torch.randn(1, 100, generator=gen).bfloat16()
    torch.testing.assert_close(int8_linear(x, q, scale, config=tuned).float(),
                               int8_linear_reference(x, q, scale).float(), atol=1e-2, rtol=2**-7)


def test_int8_linear_consults_the_tuned_configs_only_while_they_are_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    import inference_server.kernels.streamed_linear as streamed_linear_module
    from inference_server.kernels.moe_configs import tuned_configs

    looked_up: list[int] = []

    def spy(num_tokens: int, *args: object) -> None:
        looked_up.append(num_tokens)
        return None  # no tuned entry: the heuristic runs

    monkeypatch.setattr(streamed_linear_module, "tuned_int8_linear_config", spy)
    q, scale = quantize_int8_per_channel(torch.randn(24, 32))
    x = torch.randn(3, 32)
    with tuned_configs(False):
        int8_linear(x, q, scale)
        assert looked_up == []
        with tuned_configs(True):
            torch.testing.assert_close(int8_linear(x, q, scale), int8_linear_reference(x, q, scale))
        assert looked_up == [3]
    int8_linear(x, q, scale)  # the default: tuned
    assert looked_up == [3, 3]
