"""``bench/tune_prefill_attention.py`` as a CPU dry run (Triton interpreter, tiny shapes): one table per attention
layer kind of the MoE models, the current config timed and marked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_prints_a_table_per_layer_kind_with_the_current_config() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tune_prefill_attention.py"), "--context", "40", "--chunk", "16",
         "--quick", "2", "--reps", "1"],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tables = done.stdout.strip().split("\n\n")
    assert [t.splitlines()[0].split(":")[0] for t in tables] == [
        "qwen3-30b-a3b D=128", "gemma-4-26b-a4b D=256 window 1024", "gemma-4-26b-a4b D=512"]
    for table in tables:
        rows = [line for line in table.splitlines() if line.startswith("| ") and "ok" in line]
        assert len(rows) == 2 and sum("(current)" in row for row in rows) == 1
