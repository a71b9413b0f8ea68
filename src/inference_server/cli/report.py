"""``inference-server report RUN.sqlite``: a run's summary on stdout and PNG plots beside it.

Reads the SQLite file written with ``TELEMETRY_DIR`` (read-only; a file still being written works too, WAL).
Prints the run's model, length, requests by finish reason, exact latency percentiles (TTFT, time per output
token, end-to-end, queue), throughput, step time by phase, KV usage, preemptions and telemetry drops; writes
``latency_cdf.png``, ``throughput_queue.png`` and ``kv_usage.png`` into ``--out`` (default: a folder named
after the file, ``RUN-report/``).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import numpy as np

BIN_SECONDS = 1.0


def add_parser(commands: Any) -> None:
    report = commands.add_parser("report", help="summarise a TELEMETRY_DIR run file and plot it")
    report.add_argument("run", type=Path, help="a run-*.sqlite file")
    report.add_argument("--out", type=Path, default=None, help="folder for the PNG plots (default: RUN-report/)")


def load(path: Path) -> dict[str, Any]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        meta = {row["key"]: row["value"] for row in db.execute("SELECT key, value FROM meta")}
        requests = [dict(r) for r in db.execute("SELECT * FROM requests ORDER BY finished")]
        steps = [dict(r) for r in db.execute("SELECT * FROM steps ORDER BY step_id")]
        rejections = [dict(r) for r in db.execute("SELECT * FROM rejections")]
    finally:
        db.close()
    return {"meta": meta, "requests": requests, "steps": steps, "rejections": rejections}


def _column(rows: list[dict[str, Any]], fn: Any) -> np.ndarray:
    values = [fn(r) for r in rows]
    return np.array([v for v in values if v is not None], dtype=float)


def latencies(requests: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    def tpot(r: dict[str, Any]) -> float | None:
        if r["first_token"] is None or r["output_tokens"] < 2:
            return None
        return (r["finished"] - r["first_token"]) / (r["output_tokens"] - 1)

    return {
        "ttft": _column(requests, lambda r: None if r["first_token"] is None else r["first_token"] - r["arrival"]),
        "time_per_output_token": _column(requests, tpot),
        "e2e": _column(requests, lambda r: r["finished"] - r["arrival"]),
        "queue_time": _column(requests, lambda r: (r["admitted"] if r["admitted"] is not None else r["finished"])
                              - r["arrival"]),
    }


def summary(run: dict[str, Any]) -> dict[str, Any]:
    meta, requests, steps = run["meta"], run["requests"], run["steps"]
    duration = max([s["time"] for s in steps] + [r["finished"] for r in requests] + [0.0])
    reasons: dict[str, int] = {}
    for r in requests:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    lat = {name: ({"count": int(v.size), **{f"p{q}": float(np.percentile(v, q)) for q in (50, 95, 99)}}
                  if v.size else {"count": 0}) for name, v in latencies(requests).items()}
    phases = {p: float(np.mean([s[f"{p}_s"] for s in steps])) if steps else None
              for p in ("schedule", "execute", "deliver")}
    kv = [s["kv_usage_full"] for s in steps]
    return {
        "model": meta.get("model"), "schema_version": meta.get("schema_version"),
        "duration_seconds": duration, "requests": len(requests), "finished_by_reason": reasons,
        "rejections": len(run["rejections"]), "latency_seconds": lat,
        "throughput_tokens_per_second": {
            "prompt": sum(s["prefill_tokens"] for s in steps) / duration if duration else 0.0,
            "output": sum(s["sampled_tokens"] for s in steps) / duration if duration else 0.0},
        "steps": len(steps), "mean_step_seconds_by_phase": phases,
        "kv_usage_full": {"mean": float(np.mean(kv)) if kv else None, "max": max(kv, default=None)},
        "preemptions": sum(s["preempted"] for s in steps),
        "drops": json.loads(meta.get("drops", "{}")),
    }


def plot(run: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in latencies(run["requests"]).items():
        if values.size:
            ordered = np.sort(values)
            ax.step(ordered * 1000, np.arange(1, ordered.size + 1) / ordered.size, where="post", label=name)
    ax.set(xscale="log", xlabel="milliseconds (log)", ylabel="fraction of requests", title="Latency CDFs")
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax)
    written.append(_save(fig, out / "latency_cdf.png"))

    steps = run["steps"]
    times = np.array([s["time"] for s in steps], dtype=float)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    if steps:
        edges = np.arange(0.0, times.max() + BIN_SECONDS, BIN_SECONDS)
        for column, label in (("sampled_tokens", "output tok/s"), ("prefill_tokens", "prompt tok/s")):
            totals, _ = np.histogram(times, bins=edges, weights=[s[column] for s in steps])
            top.plot(edges[:-1], totals / BIN_SECONDS, drawstyle="steps-post", label=label)
        bottom.plot(times, [s["waiting"] for s in steps], label="waiting", drawstyle="steps-post")
        bottom.plot(times, [s["running"] for s in steps], label="running", drawstyle="steps-post")
    top.set(ylabel="tokens / s", title="Throughput (1 s bins)")
    bottom.set(xlabel="seconds since start", ylabel="requests", title="Queue depth")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        _legend(ax)
    written.append(_save(fig, out / "throughput_queue.png"))

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot(times, [100 * s["kv_usage_full"] for s in steps], label="full-attention blocks")
    sliding = [(t, s["kv_usage_sliding"]) for t, s in zip(times, steps, strict=True)
               if s["kv_usage_sliding"] is not None]
    if sliding:
        ax.plot([t for t, _ in sliding], [100 * u for _, u in sliding], label="sliding-window blocks")
    ax.set(xlabel="seconds since start", ylabel="% in use", ylim=(0, 100), title="KV cache usage")
    ax.grid(True, alpha=0.3)
    _legend(ax)
    written.append(_save(fig, out / "kv_usage.png"))
    return written


def _legend(ax: Any) -> None:
    """A legend when the axes have labelled lines (a run without requests or steps has none, and matplotlib
    warns for an empty legend)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"model {s['model']}  schema v{s['schema_version']}  {s['duration_seconds']:.1f} s  "
             f"{s['requests']} requests {s['finished_by_reason']}  {s['rejections']} rejected",
             f"throughput: prompt {s['throughput_tokens_per_second']['prompt']:.1f} tok/s, "
             f"output {s['throughput_tokens_per_second']['output']:.1f} tok/s over {s['steps']} steps",
             "latency (ms)          count      p50      p95      p99"]
    for name, v in s["latency_seconds"].items():
        if v["count"]:
            lines.append(f"  {name:<20}{v['count']:>6}{1000 * v['p50']:>9.2f}{1000 * v['p95']:>9.2f}"
                         f"{1000 * v['p99']:>9.2f}")
        else:
            lines.append(f"  {name:<20}{0:>6}")
    phases = s["mean_step_seconds_by_phase"]
    if s["steps"]:
        lines.append("mean step (ms): " + ", ".join(f"{p} {1000 * v:.3f}" for p, v in phases.items()))
        lines.append(f"KV usage (full): mean {100 * s['kv_usage_full']['mean']:.1f}%, "
                     f"max {100 * s['kv_usage_full']['max']:.1f}%; preemptions {s['preemptions']}")
    lines.append(f"telemetry drops: {s['drops']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    path: Path = args.run
    if not path.is_file():
        print(f"error: {path} is not a file", file=sys.stderr)
        return 2
    try:
        data = load(path)
    except sqlite3.DatabaseError as error:
        print(f"error: {path} is not a run file: {error}", file=sys.stderr)
        return 2
    print(format_summary(summary(data)))
    out = args.out or path.with_name(path.stem + "-report")
    for written in plot(data, out):
        print(f"wrote {written}")
    return 0
