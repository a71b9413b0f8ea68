#!/usr/bin/env python3
"""Where a decode step's time goes between its kernels: the device timeline of one bare graph replay.

``engine_bench``'s ``kernels`` record sums each kernel's span; with PDL the spans overlap (a kernel is resident,
waiting, while its predecessor runs) and the step also has idle gaps, so the sums do not say what the step waits
on. This script profiles a few replays of the B=``--batch`` graph and, for the middle one, lists per kernel name
(in the order of the first layer's launches): launches, mean span, and the mean time from its predecessor's end to
its own start (negative: it started while the predecessor still ran), plus the replay's wall time, the union of
the spans (the device busy) and the idle time between them.

Each ``--ablations`` entry (``bench/ablate_decode.py``'s names, ``none`` for the engine as it is) and each
``--variants`` entry (``engine_bench.VARIANTS``) is one runner; a line ``BENCH {"kind": "timeline", ...}`` each.

  python3 bench/step_timeline.py --model gemma-4-31b --quantization int8 --ablations none,no-attention --out $OUT/tl
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ablate_decode
import engine_bench


def replay_timeline(runner, batch: int, replays: int = 3) -> dict | None:
    """The timeline summary of the middle of ``replays`` bare replays of ``batch``'s graph (see the docstring)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    bucket = runner.graphs.bucket_for(batch)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            runner.graphs.run(bucket)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels or len(kernels) % replays:
        return None
    per = len(kernels) // replays
    one = kernels[per * (replays // 2): per * (replays // 2 + 1)]
    rows: dict[str, dict[str, list[float]]] = {}
    busy = idle = 0.0
    covered_to = one[0].time_range.start
    previous_end = None
    for event in one:
        start, end = event.time_range.start, event.time_range.end
        row = rows.setdefault(event.name[:60], {"span": [], "after_predecessor": []})
        row["span"].append(end - start)
        if previous_end is not None:
            row["after_predecessor"].append(start - previous_end)
        previous_end = end
        if start > covered_to:
            idle += start - covered_to
        busy += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
    wall = covered_to - one[0].time_range.start
    return dict(bucket=bucket, kernels=per, wall_us=round(wall, 1), busy_us=round(busy, 1), idle_us=round(idle, 1),
                rows=[dict(name=name, launches=len(r["span"]), span_us=round(statistics.mean(r["span"]), 2),
                           after_predecessor_us=round(statistics.mean(r["after_predecessor"]), 2)
                           if r["after_predecessor"] else None)
                      for name, r in rows.items()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ablations", default="none")
    ap.add_argument("--variants", default="", help="engine_bench.VARIANTS entries, each also timed")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quantization", default="none", choices=("none", "int8"))
    ap.add_argument("--max-model-len", type=int, default=None)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    original = engine_bench.kernel_times

    def with_timeline(runner, batch: int, *args, **kwargs):
        timeline = replay_timeline(runner, batch)
        if timeline is not None:
            engine_bench.emit(a.out, kind="timeline", model=a.model, variant=current[0], batch=batch, **timeline)
        return original(runner, batch, *args, **kwargs)

    engine_bench.kernel_times = with_timeline
    runs = [(name, "ablation") for name in a.ablations.split(",") if name] + \
        [(name, "variant") for name in a.variants.split(",") if name]
    current = [""]
    device = torch.device("cuda")
    for name, kind in runs:
        current[0] = name
        engine_bench.VARIANTS.setdefault(name, {})
        with ablate_decode.ablated(name if kind == "ablation" else "none"):
            engine_bench.bench_decode(a.model, a.model, [a.batch], 512, 24, a.out, device, (name,), 3,
                                      a.quantization, (a.batch,), max_model_len=a.max_model_len)


if __name__ == "__main__":
    main()
