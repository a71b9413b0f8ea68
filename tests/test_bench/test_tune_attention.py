"""``bench/tune_attention.py`` as CPU dry runs (Triton interpreter, tiny shapes): prefill, one table per attention
layer kind of the MoE models with the current config timed and marked; decode, one table per (layer kind, batch)
with today's plan first and a summary row per point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "tune_attention.py"), *args],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_dry_run_prints_a_table_per_layer_kind_with_the_current_config() -> None:
    tables = _dry_run("--context", "40", "--chunk", "16", "--quick", "2", "--reps", "1").strip().split("\n\n")
    assert [t.splitlines()[0].split(":")[0] for t in tables] == [
        "qwen3-30b-a3b D=128", "gemma-4-26b-a4b D=256 window 1024", "gemma-4-26b-a4b D=512"]
    for table in tables:
        rows = [line for line in table.splitlines() if line.startswith("| ") and "ok" in line]
        assert len(rows) == 2 and sum("(current)" in row for row in rows) == 1


def test_decode_dry_run_times_today_and_the_candidates_per_kind_and_batch() -> None:
    """Gemma-4-E2B's two layer kinds at 1 and 16 sequences of 40 keys: today's plan first, then with the table ahead;
    at 16 sequences (head_dim > 128) also its split variants; every point is summarised. The kernels are first run by
    worker processes (``--compile-workers``)."""
    out = _dry_run("decode", "--models", "gemma-4-e2b", "--batches", "1,16", "--contexts", "40", "--quick", "3",
                   "--reps", "1", "--compile-workers", "2")
    blocks = out.strip().split("\n\n")
    # the candidates' kernels first run in 2 worker processes (on the GPU: compiled into Triton's cache): 2 kinds at
    # 1 sequence (today's plan, with and without the table ahead) and 16 (the same and today's splits doubled)
    assert "compiled 10 kernel variants in 2 processes" in blocks[0]
    points = [b for b in blocks if b.startswith("gemma-4-e2b")]
    assert [p.splitlines()[0].split(" (")[0] for p in points] == [
        "gemma-4-e2b D=256 W=512: 8/1 heads, B=1, context 40", "gemma-4-e2b D=256 W=512: 8/1 heads, B=16, context 40",
        "gemma-4-e2b D=512: 8/1 heads, B=1, context 40", "gemma-4-e2b D=512: 8/1 heads, B=16, context 40"]
    for point in points:
        rows = [line.split(" | ") for line in point.splitlines()[3:]]
        assert all(row[-1] == "ok |" for row in rows), point
        labels = [row[0].lstrip("| ") for row in rows]  # a plan's labels, "=" between them
        if "B=1," in point:
            assert sorted(labels) == ["today", "today+ahead"]
        else:  # today's 1 split of 40 keys halved is today+ahead itself
            assert sorted(labels) == ["today", "today x2 splits+ahead", "today+ahead=today/2 splits+ahead"]
        # 40 keys x 1 kv head x D x 2 (K, V) x 2 bytes a sequence
        head_dim = 256 if "D=256" in point else 512
        batch = 1 if "B=1," in point else 16
        assert f"{batch * 40 * head_dim * 4 / 1e6:.1f} MB of K+V" in point
    summary = next(b for b in blocks if b.startswith("Summary"))
    assert len([line for line in summary.splitlines() if line.startswith("| gemma-4-e2b")]) == 4
