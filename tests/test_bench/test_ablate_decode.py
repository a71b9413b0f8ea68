"""``bench/ablate_decode.py`` as a dry run on the CPU (tiny preset, Triton interpreter): every ablation patches the
runner's ops and still gives a decode record (the GPU call is the only other place it runs)."""

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


def test_each_ablation_gives_a_decode_record(tmp_path: Path) -> None:
    ablations = ["none", "no-norm-add", "empty-norm-add", "no-qk-norm", "no-attention", "empty-attention",
                 "attention-1split", "attention-no-pdl", "attention-block16-stages1"]
    command = [sys.executable, str(REPO / "bench" / "ablate_decode.py"), "--model", "gemma-4-31b", "--smoke",
               "--out", str(tmp_path), "--ablations", ",".join(ablations), "--context", "8", "--steps", "1",
               "--repeats", "1"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    finished = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, check=False)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "engine_bench.jsonl").read_text().splitlines()]
    decode = [r for r in records if r["kind"] == "decode"]
    assert [r["variant"] for r in decode] == ablations
    assert all(r["step_ms"] > 0 and r["batch"] == 1 for r in decode)
