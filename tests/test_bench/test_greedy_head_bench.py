"""``bench/greedy_head.py``: its heads are the presets' real ones, and a CPU dry run of one row of its table (the
kernel in the Triton interpreter) times both paths and finds them choosing the same token."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or the kernels are imported

from inference_server.models.loading.presets import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import greedy_head as bench  # bench/greedy_head.py (bench/ is on the path from here and from conftest.py)


def test_heads_are_the_presets() -> None:
    for head in bench.HEADS:
        config = PRESETS[head.model]
        assert (head.vocab, head.hidden) == (config["vocab_size"], config["hidden_size"])
        assert head.softcap == config.get("final_logit_softcapping")
    assert bench.head_bytes(bench.HEADS[0], 1) == 2 * 151936 * 2048 + 2 * 2048


def test_dry_run_row() -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    head = bench.TINY_HEADS[1]  # soft-capped, hidden 96 (a masked K tail)
    weights = bench.make_head(head, device, bench.device_l2_bytes(device))
    row = bench.bench_head(head, 3, weights, device, reps=1)
    assert row["same"] == 3 and row["fused_us"] > 0 and row["unfused_us"] > 0


def test_dry_run_row_int8() -> None:
    """``--int8``: the int8 head (bf16 row scales) against the unfused int8 path, the same token; its bytes count
    one per weight plus the scales."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    head = bench.TINY_HEADS[1]
    [(qweight, scale)] = bench.make_head(head, device, bench.device_l2_bytes(device), int8=True)
    assert qweight.dtype == torch.int8 and scale is not None and scale.dtype == torch.bfloat16
    row = bench.bench_head(head, 3, [(qweight, scale)], device, reps=1)
    assert row["same"] == 3 and row["fused_us"] > 0 and row["unfused_us"] > 0
    assert bench.head_bytes(head, 1, int8=True) == 777 * 96 + 2 * 777 + 2 * 96
