"""``bench/engine_bench.py`` decode and offline paths as dry runs on the CPU (tiny preset, Triton interpreter):
the GPU call is the only other place they run, so a broken call into the runner must fail here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry runs are for machines without CUDA")


def engine_bench(out: Path, *args: str) -> list[dict]:
    command = [sys.executable, str(REPO / "bench" / "engine_bench.py"), "run", "--model", "qwen3-30b-a3b", "--smoke",
               "--device", "cpu", "--out", str(out), *args]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, check=False)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    return [json.loads(line) for line in (out / "engine_bench.jsonl").read_text().splitlines()]


def test_decode_dry_run_emits_a_decode_record_with_serial_and_overlapped_steps(tmp_path: Path) -> None:
    # 2 steps: the overlapped loop launches the second with its token pending on the device
    records = engine_bench(tmp_path, "--skip-offline", "--batches", "1,2", "--steps", "2", "--context", "8")
    decode = [r for r in records if r["kind"] == "decode"]
    assert [r["batch"] for r in decode] == [1, 2]
    assert all(r["step_ms"] > 0 and r["overlap_ms"] > 0 and len(r["overlap_tok_s_runs"]) == 1 for r in decode)


@pytest.mark.slow  # four interpreted prefills of a tiny prompt: ~45 s on the 2-core machine
def test_prefill_dry_run_emits_a_prefill_record_per_prompt_length(tmp_path: Path) -> None:
    records = engine_bench(tmp_path, "--skip-offline", "--batches", "1", "--steps", "1", "--context", "8",
                           "--prefill", "12", "--prefill-chunk", "8")
    prefill = [r for r in records if r["kind"] == "prefill"]
    assert [(r["prompt_len"], r["chunk"]) for r in prefill] == [(12, 8)]
    assert prefill[0]["wall_ms"] > 0 and prefill[0]["tok_s"] > 0


def test_decode_variants_and_repeats_give_one_record_each_with_every_run(tmp_path: Path) -> None:
    records = engine_bench(tmp_path, "--skip-offline", "--batches", "1", "--steps", "1", "--context", "8",
                           "--variants", "before,after", "--repeats", "2")
    decode = [r for r in records if r["kind"] == "decode"]
    assert [r["variant"] for r in decode] == ["before", "after"]
    assert all(len(r["tok_s_runs"]) == 2 and r["repeats"] == 2 for r in decode)


@pytest.mark.heavy
def test_offline_dry_run_with_overlap_on_and_off(tmp_path: Path) -> None:
    records = engine_bench(tmp_path, "--skip-decode", "--requests", "2", "--overlap", "on,off")
    offline = [r for r in records if r["kind"] == "offline"]
    assert [r["overlap"] for r in offline] == [True, False]
    assert all(r["output_tokens"] == r["expected_tokens"] and not r["errors"] for r in offline)
