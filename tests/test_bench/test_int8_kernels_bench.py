"""``bench/int8_kernels.py``: its shapes are the presets' real ones, its byte counts and rotation rules, and a CPU
dry run of the whole script at tiny shapes (kernels in the Triton interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    assert len(rows) == 2 and all(line.count("|") == 10 for line in rows), done.stdout
    assert "int8 kernels on cpu" in done.stdout
