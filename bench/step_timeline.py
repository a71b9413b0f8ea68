#!/usr/bin/env python3
"""Where a decode step's time goes between its kernels: the device timeline of one bare graph replay.

``engine_bench``'s ``kernels`` record sums each kernel's span; with PDL the spans overlap (a kernel is resident,
waiting, while its predecessor runs) and the step also has idle gaps, so the sums do not say what the step waits
on. This script profiles a few replays of the B=``--batch`` graph and, for the middle one, lists per kernel name
(in the order of the first layer's launches): launches, mean span, and the mean time from its predecessor's end to
its own start (negative: it started while the predecessor still ran), plus the replay's wall time, the union of
the spans (the device busy) and the idle time between them.

``--overlapped``: also the device timeline of whole steps as the engine runs them with OVERLAP on (stage inputs,
resolve the pending tokens, graph replay, head and sampling, token read-back; step k+1 launched before step k is
collected): per step, the graph's span, every device operation outside the graph (name, µs, the gap before it) and
the device's idle time, from the profiler's trace (a kernel belongs to the graph when its launch is the
``cudaGraphLaunch``). A line ``BENCH {"kind": "step_timeline", ...}`` each.

Each ``--variants`` entry (``engine_bench.VARIANTS``; ``after`` for the engine as it is) is one runner; a line
``BENCH {"kind": "timeline", ...}`` each.

  python3 bench/step_timeline.py --model gemma-4-31b --quantization int8 --variants after --out $OUT/tl
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_bench

CONTEXT, STEPS = 512, 24
"""The decode benchmark's context and timed steps (``engine_bench.bench_decode``'s arguments)."""


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


def overlapped_timeline(runner, batch: int, context: int, blocks_per_seq: int, steps: int = 8) -> dict | None:
    """The device timeline of ``steps`` overlapped decode steps at ``batch`` (module docstring), summarised over the
    middle steps: the mean step period, the graph's span, the device time outside the graph by operation, and the
    idle time. Sequences restart at ``context`` with block tables of ``blocks_per_seq`` blocks each (as
    ``engine_bench.decode_batches``)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    from inference_server.records.sampling_params import SamplingParams
    from inference_server.records.steps import PENDING_TOKEN, ScheduledSequence, StepPlan

    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    groups = runner.num_groups
    tables = [(tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),) * groups for i in range(batch)]

    def plan(k: int) -> StepPlan:
        return StepPlan(step_id=10_000 + k, sequences=tuple(ScheduledSequence(
            request_id=7_000_000 + i, token_ids=(PENDING_TOKEN if k else 100 + i,), cached_len=context + k,
            block_tables=tables[i], sample=True, sampling=greedy, reset=k == 0, prompt_len=1) for i in range(batch)))

    def run(count: int) -> None:
        in_flight = runner.launch(plan(0))
        for k in range(1, count):
            launched = runner.launch(plan(k))
            runner.collect(in_flight)
            in_flight = launched
        runner.collect(in_flight)
        runner.forget(tuple(7_000_000 + i for i in range(batch)))

    run(4)  # warm
    torch.cuda.synchronize()
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(steps)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())["traceEvents"]
    summary = summarize_step_trace(trace)
    return None if summary is None else dict(batch=batch, **summary)


def summarize_step_trace(trace: list[dict]) -> dict | None:
    """The step summary of a Chrome trace's events (``torch.profiler``'s export) of overlapped steps: graph kernels
    are those whose ``correlation`` is a ``cudaGraphLaunch``'s; each step runs from one graph's first kernel to the
    next one's; the first and last steps are dropped (warm-up, drain). Per step (means over the middle steps): the
    period, the graph's span, each operation outside the graph by name (launches, µs, the device's idle time just
    before it) and the idle time. None with fewer than four graph replays in the trace. The events are not changed."""
    graph_launches = {e["args"]["correlation"] for e in trace
                      if e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {})}
    device = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                    key=lambda e: e["ts"])
    if not device or not graph_launches:
        return None
    in_graph = [e.get("args", {}).get("correlation") in graph_launches for e in device]
    starts = [i for i, inside in enumerate(in_graph) if inside and (i == 0 or not in_graph[i - 1])]
    if len(starts) < 4:
        return None
    periods, spans, idles, outside = [], [], [], {}
    for a, b in itertools.pairwise(starts[1:-1]):  # the middle steps, graph start to graph start
        window = list(zip(device[a:b], in_graph[a:b], strict=True))
        periods.append(device[b]["ts"] - device[a]["ts"])
        graph = [e for e, inside in window if inside]
        spans.append(max(e["ts"] + e["dur"] for e in graph) - graph[0]["ts"])
        covered, idle = device[a]["ts"], 0.0
        for e, inside in window:
            gap = max(0.0, e["ts"] - covered)
            idle += gap
            if not inside:
                row = outside.setdefault(e["name"][:70], {"us": [], "gap_before": []})
                row["us"].append(e["dur"])
                row["gap_before"].append(gap)
            covered = max(covered, e["ts"] + e["dur"])
        idle += max(0.0, device[b]["ts"] - covered)
        idles.append(idle)
    n = len(periods)
    return dict(steps=n, period_us=round(statistics.mean(periods), 1),
                graph_span_us=round(statistics.mean(spans), 1), idle_us=round(statistics.mean(idles), 1),
                outside_us=round(sum(sum(r["us"]) for r in outside.values()) / n, 1),
                outside=[dict(name=name, per_step=round(len(r["us"]) / n, 2), us=round(sum(r["us"]) / n, 2),
                              gap_before_us=round(sum(r["gap_before"]) / n, 2)) for name, r in outside.items()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variants", default="after", help="engine_bench.VARIANTS entries, each timed")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quantization", default="none", choices=("none", "int8"))
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--overlapped", action="store_true", help="also the timeline of whole overlapped steps")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    original = engine_bench.kernel_times

    def with_timeline(runner, batch: int, *args, **kwargs):
        timeline = replay_timeline(runner, batch)
        if timeline is not None:
            engine_bench.emit(a.out, kind="timeline", model=a.model, variant=current[0], batch=batch, **timeline)
        if a.overlapped:
            steps = overlapped_timeline(runner, batch, CONTEXT, -(-(CONTEXT + 2 * (3 + STEPS) + 2) // 16))
            if steps is not None:
                engine_bench.emit(a.out, kind="step_timeline", model=a.model, variant=current[0], **steps)
        return original(runner, batch, *args, **kwargs)

    engine_bench.kernel_times = with_timeline
    current = [""]
    device = torch.device("cuda")
    for name in (name for name in a.variants.split(",") if name):
        current[0] = name
        engine_bench.bench_decode(a.model, a.model, [a.batch], CONTEXT, STEPS, a.out, device, (name,), 3,
                                  a.quantization, (a.batch,), max_model_len=a.max_model_len)


if __name__ == "__main__":
    main()
