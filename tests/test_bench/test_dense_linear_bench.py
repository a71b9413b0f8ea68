"""``bench/dense_linear.py``: its shapes are the presets' decode projections (fused as the CUDA runner fuses them),
a CPU dry run of its tables (kernel in the Triton interpreter), and its sweep writing a config file that
``dense_linear`` reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from tests.kernels.reference_linear import dense_linear_reference

from inference_server.kernels.dense_linear import dense_linear
from inference_server.kernels.int8_linear_configs import (
    config_file_name,
    config_to_json,
    tuned_baseline_faster,
    tuned_int8_linear_config,
)
from inference_server.models.loading.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import dense_linear as bench  # noqa: E402  (bench/ is on the path only from here)


def _shapes(preset: str) -> dict[tuple[str, int, int], int]:
    return {(p.name, p.out_features, p.in_features): p.calls for p in bench.decode_projections(preset)}


def test_qwen_projections_are_the_preset() -> None:
    q = PRESETS["qwen3-30b-a3b"]
    hidden, layers, d = q["hidden_size"], q["num_hidden_layers"], q["head_dim"]
    heads = q["num_attention_heads"] * d
    assert _shapes("qwen3-30b-a3b") == {
        ("qkv", heads + 2 * q["num_key_value_heads"] * d, hidden): layers,
        ("o", hidden, heads): layers,
        ("logits", q["vocab_size"], hidden): 1,  # untied lm_head
    }


def test_gemma_projections_are_the_presets() -> None:
    g = PRESETS["gemma-4-26b-a4b"]
    hidden, heads, d, full_d = g["hidden_size"], g["num_attention_heads"], g["head_dim"], g["global_head_dim"]
    sliding = sum(t == "sliding_attention" for t in g["layer_types"])
    full = len(g["layer_types"]) - sliding
    assert _shapes("gemma-4-26b-a4b") == {
        ("qkv", heads * d + 2 * g["num_key_value_heads"] * d, hidden): sliding,
        ("qkv", heads * full_d + g["num_global_key_value_heads"] * full_d, hidden): full,  # k = v: no v_proj
        ("o", hidden, heads * d): sliding,
        ("o", hidden, heads * full_d): full,
        ("gate_up", 2 * g["intermediate_size"], hidden): g["num_hidden_layers"],
        ("down", hidden, g["intermediate_size"]): g["num_hidden_layers"],
        ("logits", g["vocab_size"], hidden): 1,  # tied to the embeddings
    }
    e4b = PRESETS["gemma-4-e4b"]
    shapes = _shapes("gemma-4-e4b")
    ple, layers = e4b["hidden_size_per_layer_input"], e4b["num_hidden_layers"]
    assert shapes[("ple gate", ple, e4b["hidden_size"])] == layers
    assert shapes[("ple projection", e4b["hidden_size"], ple)] == layers
    assert shapes[("ple model projection", layers * ple, e4b["hidden_size"])] == 1
    # the KV-shared layers run their q projection alone
    assert sum(c for (name, _, _), c in shapes.items() if name == "q (shared KV)") == e4b["num_kv_shared_layers"]
    assert {(n, k) for (_, n, k) in _shapes("gemma-4-31b")} >= {(43008, 5376), (5376, 21504), (262144, 5376)}


def test_cpu_dry_run_prints_shape_and_step_tables() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dense_linear.py"), "--device", "cpu", "--tiny", "--reps", "1",
         "--tokens", "1", "--models", "qwen3-30b-a3b"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| qkv", "| o ", "| logits"))]
    assert len(rows) == 3 and all(line.count("|") == 11 for line in rows), done.stdout
    assert "dense_linear vs cuBLAS on cpu" in done.stdout
    assert "largest T with Triton's step total" in done.stdout


def test_sweep_writes_configs_dense_linear_reads(tmp_path: Path) -> None:
    """The sweep (the heuristic and one candidate) at one tiny shape writes the file ``dense_linear`` looks up."""
    kernel = bench.dense_kernel(bench.DENSE_SWEEP[:1])
    case = bench.LinearCase("tiny", 37, 100)
    bench.sweep(kernel, torch.device("cpu"), 1, 50 * 2**20, (case,), [1], tmp_path)
    written = json.loads((tmp_path / config_file_name("cpu", 37, 100, torch.bfloat16)).read_text())
    assert written["baseline_faster"] in ([], [1]) and set(written["sweep"][0]) >= {"us", "baseline_us"}
    tuned = tuned_int8_linear_config(1, 37, 100, torch.bfloat16, "cpu", tmp_path)
    assert tuned is not None
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 100, generator=gen).bfloat16()
    x = torch.randn(1, 100, generator=gen).bfloat16()
    torch.testing.assert_close(dense_linear(x, w, config=tuned).float(), dense_linear_reference(x, w).float(),
                               atol=1e-2, rtol=2**-7)
    assert [c.out_features for c in bench.sweep_cases(["qwen3-30b-a3b-tiny"])] == [256, 64, 512]


def test_baseline_faster_follows_the_tuned_count_of_a_step(tmp_path: Path) -> None:
    """cuBLAS is kept exactly for the steps whose tuned count (the smallest at or above) the sweep marked."""
    config = config_to_json(bench.dense_kernel().heuristic(1, 37, 100))
    body = {"meta": {}, "configs": {"1": config, "16": config}, "baseline_faster": [16]}
    (tmp_path / config_file_name("cpu", 37, 100, torch.bfloat16)).write_text(json.dumps(body))

    def faster(tokens: int, n: int = 37) -> bool:
        return tuned_baseline_faster(tokens, n, 100, torch.bfloat16, "cpu", tmp_path)

    assert [faster(t) for t in (1, 2, 16, 17)] == [False, True, True, False]
    assert not faster(1, n=38)  # no file for the shape
