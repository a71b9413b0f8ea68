"""``bench/step_timeline.py``'s summary of overlapped steps from a profiler trace (``summarize_step_trace``), on a
synthetic Chrome trace: which kernels are the graph's, the step period, the graph's span, the operations outside
the graph with the idle time before each, and the idle time per step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from step_timeline import summarize_step_trace


def synthetic_trace(steps: int) -> list[dict]:
    """Every 100 µs: a host-to-device copy (2 µs), the graph's two kernels (40 µs each, from 5 µs), the head
    (6 µs, from 90 µs); the graph's kernels carry their ``cudaGraphLaunch``'s correlation."""
    events: list[dict] = []
    for k in range(steps):
        t = 100.0 * k
        events.append({"name": "cudaGraphLaunch", "cat": "cuda_runtime", "ts": t + 1, "dur": 3,
                       "args": {"correlation": 1000 + k}})
        events.append({"name": "Memcpy HtoD", "cat": "gpu_memcpy", "ts": t, "dur": 2,
                       "args": {"correlation": 2000 + k}})
        for start in (5, 45):
            events.append({"name": "layer_kernel", "cat": "kernel", "ts": t + start, "dur": 40,
                           "args": {"correlation": 1000 + k}})
        events.append({"name": "head", "cat": "kernel", "ts": t + 90, "dur": 6, "args": {"correlation": 3000 + k}})
    events.append({"name": "Python", "cat": "python_function", "ts": 0, "dur": 1000})  # not a device event
    return events


def test_middle_steps_are_summarised() -> None:
    summary = summarize_step_trace(synthetic_trace(6))
    assert summary is not None
    assert summary["steps"] == 3  # six replays: the first and last dropped, three steps between the other four
    assert summary["period_us"] == 100.0
    assert summary["graph_span_us"] == 80.0
    # idle: 5 µs before the head, 4 before the next copy, 3 between the copy and the next graph
    assert summary["idle_us"] == 12.0
    assert summary["outside_us"] == 8.0
    rows = {row["name"]: row for row in summary["outside"]}
    assert rows.keys() == {"head", "Memcpy HtoD"}
    assert rows["head"] == {"name": "head", "per_step": 1.0, "us": 6.0, "gap_before_us": 5.0}
    assert rows["Memcpy HtoD"] == {"name": "Memcpy HtoD", "per_step": 1.0, "us": 2.0, "gap_before_us": 4.0}


def test_too_few_replays_or_no_graph() -> None:
    assert summarize_step_trace(synthetic_trace(3)) is None
    no_graph = [e for e in synthetic_trace(6) if e["name"] != "cudaGraphLaunch"]
    assert summarize_step_trace(no_graph) is None
