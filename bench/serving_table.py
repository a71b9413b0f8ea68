#!/usr/bin/env python3
"""The serving table of one model in one device call: start the server (a preset with dummy weights, or any
MODEL), run ``serve_bench`` at each concurrency ``--repeats`` times, and print one markdown table of the medians.

    python3 bench/serving_table.py --model gemma-4-26b-a4b --concurrency 1,16,100 --num-prompts 8,64,200 \\
        --repeats 3 --input-len 512 --output-len 512 --env MAX_MODEL_LEN=4096 --variant OVERLAP=0 \\
        --engine-only --budget-s 540 --out $OUT/serving
    uv run python bench/serving_table.py --model "" --concurrency 1,2 --num-prompts 2,4 --input-len 8 \\
        --output-len 4 --repeats 2 --out /tmp/serving            # CPU, the embedded model: checks the script
    uv run python bench/serving_table.py --model gemma-4-26b-a4b --concurrency 64 --num-prompts 64 \\
        --json-schema --grammar-host-only --out /tmp/serving      # the host side of 64 constrained rows, no server

Schedule (printed first): for each server variant (the default environment, then each ``--variant KEY=VALUE``,
one server start each), for each concurrency ``C`` with ``N`` prompts: ``--warmup`` requests (default: ``C``)
once (``--warmup-output-len`` tokens out), then ``--repeats`` measured runs of ``N`` prompts, each on its own
seed (no prefix-cache hits between runs). ``--budget-s`` bounds the whole call: when the next run would start
after it, the remaining runs are skipped (and say so in the table) so that a device call ends with a table rather
than a kill.

Per row: output tok/s median over the repeats and their spread (min-max), and the medians over the repeats of
each run's TTFT median / p99, ITL median / p99 (per-token ITL, ``serve_bench``'s definition), GPU busy fraction
(median of NVML samples) and mean power, the server's CPU in cores and its busiest threads (from the run with
the median throughput). ``--engine-only`` first runs ``engine_bench.py run --skip-offline`` in a child process
(before the server starts, so they never share the GPU) at the same batch sizes and adds its decode step and
rate, and HTTP / engine. Every report is kept as JSON under ``--out``.

``--json-schema`` (structured outputs, issue 39): each run is made twice on the same server, unconstrained and
with every request constrained by ``serve_bench.bench_schema`` (same prompts, same lengths), giving a
``<variant>+json_schema`` row beside each row, and the constrained / unconstrained throughput ratio. A preset
model is served from a folder holding its config.json and the embedded Gemma 3 tokenizer (262,144 ids, the
size of Gemma 4's vocabulary), with dummy weights, since a preset alone has no tokenizer to compile grammars
for. The schema's compile time (llguidance tokenizer setup; first compile with its first mask; cached) is
measured in this process on that tokenizer and printed with the table (``compile.json``), and so is the host's
share of a constrained decode step at the largest concurrency (``grammar_host_costs``: advance the matchers, fill
the masks, copy them to the device; ``grammar_host.json``); ``--grammar-host-only`` stops there (no server: on a
CPU machine, the host side alone).

    python3 bench/serving_table.py --model gemma-4-26b-a4b --concurrency 64 --num-prompts 128 --repeats 3 \
        --input-len 512 --output-len 512 --env MAX_MODEL_LEN=4096 --json-schema --budget-s 540 --out $OUT/json

``--arrivals LEN@RATE`` (the chunk policy's question, issue 42): each run is made twice on the same server, as
measured, then again while prompts of ``LEN`` random tokens (``--arrivals-output-len`` out) arrive as a Poisson
stream of ``RATE`` per second from the first measured request until the last one ends (the warm-up has no
arrivals). The second row, ``<variant>+arrivals``, gives the measured streams' ITL under those prefills next to
their ITL without them (``itl_p99_over_plain``), and the arriving prompts' own TTFT (``arrivals_ttft_*``).

    python3 bench/serving_table.py --model gemma-4-26b-a4b --concurrency 64 --num-prompts 64 --repeats 3 \
        --input-len 512 --output-len 256 --arrivals 8192@1 --env MAX_MODEL_LEN=16384 \
        --variant MAX_NUM_BATCHED_TOKENS=4096 --variant MAX_NUM_BATCHED_TOKENS=8192 --out $OUT/chunks
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench
from kit.host_sampling import top_threads
from kit.server_process import launched
from kit.sse_client import SSEConnection

HERE = Path(__file__).resolve().parent


@attrs.frozen
class Point:
    concurrency: int
    num_prompts: int
    input_len: int


@attrs.frozen
class Variant:
    name: str
    env: dict[str, str]


@attrs.frozen
class Arrivals:
    """``--arrivals LEN@RATE``: prompts of ``input_len`` tokens arriving at ``rate`` per second (Poisson)."""

    input_len: int
    rate: float
    output_len: int = 16

    @classmethod
    def parse(cls, text: str, output_len: int) -> Arrivals:
        length, sep, rate = text.partition("@")
        try:
            arrivals = cls(int(length), float(rate), output_len)
        except ValueError:
            arrivals = None
        if not sep or arrivals is None or arrivals.input_len < 1 or not 0 < arrivals.rate < math.inf:
            raise SystemExit(f"--arrivals expects LEN@RATE (e.g. 8192@1), got {text!r}")
        return arrivals


async def run_with_arrivals(config: serve_bench.BenchConfig, arrivals: Arrivals,
                            seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config``'s measured run (no warm-up: the caller warms up first) while ``arrivals`` come, from the run's
    start until its last request ends; the arrivals still in flight then are awaited, none start after. Returns
    the run's report and the arrivals' (``serve_bench.summarize``)."""
    host, port = config.host_port
    results: list[serve_bench.RequestResult] = []
    finished = trio.Event()
    rng = random.Random(seed)

    async def one(request: serve_bench.BenchRequest, result: serve_bench.RequestResult) -> None:
        connection = SSEConnection(host, port)
        try:
            body = serve_bench.request_body(config.endpoint, config.model, request)
            await serve_bench.send(connection, config.endpoint, body, result, config.request_timeout)
        finally:
            await connection.close()

    async def arrive() -> None:
        async with trio.open_nursery() as senders:
            index = 0
            while not finished.is_set():
                request = serve_bench.random_requests(1, arrivals.input_len, arrivals.output_len, 0.0,
                                                      config.vocab_size, seed * 7_919 + index)[0]
                results.append(serve_bench.RequestResult(len(request.prompt_ids), request.output_len))
                senders.start_soon(one, request, results[-1])
                index += 1
                with trio.move_on_after(rng.expovariate(arrivals.rate)):
                    await finished.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(arrive)
        try:
            report = await serve_bench.run_benchmark(config)
        finally:
            finished.set()
    return report, serve_bench.summarize(results)


def parse_pairs(items: Sequence[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        pairs[key] = value
    return pairs


def schedule_text(model: str, variants: Sequence[Variant], points: Sequence[Point], repeats: int, warmup: int | None,
                  output_len: int) -> str:
    lines = [f"schedule for {model or 'the embedded model'}: {output_len} tokens out"]
    for variant in variants:
        lines.append(f"  server start: {variant.name}")
        for p in points:
            w = p.concurrency if warmup is None else warmup
            lines.append(f"    {p.input_len} tokens in, concurrency {p.concurrency}: {w} short warm-up requests, then "
                         f"{repeats} x {p.num_prompts} requests")
    total = sum(repeats * p.num_prompts for p in points) * len(variants)
    lines.append(f"  {total} measured requests, {total * output_len} output tokens in all")
    return "\n".join(lines)


def engine_only(model: str, batches: Sequence[int], out: Path, timeout: float) -> dict[int, dict[str, Any]]:
    """``engine_bench.py run --skip-offline`` at ``batches`` in a child process; its decode records by batch
    (none without CUDA: engine_bench times the custom-cuda runner)."""
    import torch

    if not torch.cuda.is_available():
        print("engine-only: skipped, no CUDA device", flush=True)
        return {}
    import roofline

    if model not in roofline.MODELS:
        print(f"engine-only: skipped, engine_bench knows only {', '.join(sorted(roofline.MODELS))}", flush=True)
        return {}
    command = [sys.executable, str(HERE / "engine_bench.py"), "run", "--model", model, "--skip-offline",
               "--batches", ",".join(map(str, batches)), "--out", str(out)]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "engine_bench.log").open("wb") as log:
        finished = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if finished.returncode != 0:
        print(f"engine_bench failed ({finished.returncode}); see {out / 'engine_bench.log'}", flush=True)
    records = [json.loads(line) for line in (out / "engine_bench.jsonl").read_text().splitlines()] \
        if (out / "engine_bench.jsonl").exists() else []
    return {r["batch"]: r for r in records if r.get("kind") == "decode" and "step_ms" in r}


def preset_vocab_size(model: str) -> int:
    """The vocabulary of a preset (dummy presets have no tokenizer, so /tokenizer_info cannot say); 0 else."""
    try:
        from inference_server.models.loading.presets import preset_config

        return int(preset_config(model)["vocab_size"])
    except Exception:
        return 0


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize_point(model: str, variant: str, point: Point, reports: Sequence[dict[str, Any]], skipped: int,
                    engine: dict[str, Any] | None) -> dict[str, Any]:
    """One table row: medians over the repeats' reports (``None`` where there are none)."""
    rates = [r["output_throughput"] for r in reports]
    median_run = sorted(reports, key=lambda r: r["output_throughput"])[len(reports) // 2] if reports else None
    row: dict[str, Any] = {
        "model": model or "embedded", "variant": variant, "input_len": point.input_len,
        "concurrency": point.concurrency,
        "num_prompts": point.num_prompts, "runs": len(reports), "skipped_runs": skipped,
        "failed": sum(r["failed"] for r in reports),
        "output_tok_s": _median(rates), "output_tok_s_min": min(rates, default=None),
        "output_tok_s_max": max(rates, default=None),
        "ttft_median_ms": _median([r["ttft"]["median_ms"] for r in reports]),
        "ttft_p99_ms": _median([r["ttft"]["p99_ms"] for r in reports]),
        "itl_median_ms": _median([r["itl"]["median_ms"] for r in reports]),
        "itl_p99_ms": _median([r["itl"]["p99_ms"] for r in reports]),
        "tpot_median_ms": _median([r["tpot"]["median_ms"] for r in reports]),
        "gpu_busy": _median([(r["gpu"] or {}).get("busy_median") for r in reports]),
        "gpu_power_w": _median([(r["gpu"] or {}).get("power_mean_w") for r in reports]),
        "server_cores": _median([(r["server_cpu"] or {}).get("total_cores") for r in reports]),
        "server_threads": top_threads(median_run["server_cpu"]) if median_run else "n/a",
        "client_cores": max((r["client_cpu_cores"] for r in reports), default=None),
        "engine_step_ms": engine["step_ms"] if engine else None,
        "engine_tok_s": engine["tok_s"] if engine else None,
    }
    if row["output_tok_s"] is not None and row["engine_tok_s"]:
        row["http_over_engine"] = row["output_tok_s"] / row["engine_tok_s"]
    return row


def _f(value: float | None, spec: str = ".0f") -> str:
    return "n/a" if value is None else format(value, spec)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ("| model | variant | tokens in | conc. | runs x prompts | output tok/s (min-max) | TTFT median / p99 ms "
            "| ITL median / p99 ms | GPU busy | GPU W | server cores | busiest threads (cores) "
            "| engine-only step ms (tok/s) | HTTP / engine |")
    lines = [head, "|" + "---|" * head.count(" |")]
    for r in rows:
        runs = f"{r['runs']} x {r['num_prompts']}" + (f" ({r['skipped_runs']} skipped)" if r["skipped_runs"] else "")
        runs += f", {r['failed']} failed" if r["failed"] else ""
        engine = "n/a" if r["engine_step_ms"] is None else f"{r['engine_step_ms']:.2f} ({r['engine_tok_s']:.0f})"
        ratio = _f(r.get("http_over_engine"), ".2f")
        lines.append(
            f"| {r['model']} | {r['variant']} | {r['input_len']} | {r['concurrency']} | {runs} "
            f"| {_f(r['output_tok_s'])} ({_f(r['output_tok_s_min'])}-{_f(r['output_tok_s_max'])}) "
            f"| {_f(r['ttft_median_ms'])} / {_f(r['ttft_p99_ms'])} "
            f"| {_f(r['itl_median_ms'], '.1f')} / {_f(r['itl_p99_ms'], '.1f')} "
            f"| {_f(r['gpu_busy'], '.0%')} | {_f(r['gpu_power_w'])} | {_f(r['server_cores'], '.2f')} "
            f"| {r['server_threads']} | {engine} | {ratio} |")
    return "\n".join(lines)


def arrivals_table(rows: Sequence[dict[str, Any]]) -> str:
    """The ``--arrivals`` rows: the measured streams' ITL without and with the arriving prefills, and the
    arriving prompts' TTFT."""
    head = ("| variant | conc. | arrivals (tokens @ per s) | ITL p99 plain -> under arrivals ms (ratio) "
            "| ITL median plain -> under ms | output tok/s plain -> under | arrivals done "
            "| their TTFT median / p99 ms |")
    lines = [head, "|" + "---|" * head.count(" |")]
    for plain, loaded in itertools.pairwise(rows):
        if "arrivals" not in loaded or "arrivals" in plain:
            continue
        done = f"{loaded['arrivals_completed']}" + (f" ({loaded['arrivals_failed']} failed)"
                                                    if loaded["arrivals_failed"] else "")
        lines.append(
            f"| {plain['variant']} | {plain['concurrency']} | {loaded['arrivals']} "
            f"| {_f(plain['itl_p99_ms'], '.1f')} -> {_f(loaded['itl_p99_ms'], '.1f')} "
            f"({_f(loaded.get('itl_p99_over_plain'), '.2f')}) "
            f"| {_f(plain['itl_median_ms'], '.1f')} -> {_f(loaded['itl_median_ms'], '.1f')} "
            f"| {_f(plain['output_tok_s'])} -> {_f(loaded['output_tok_s'])} | {done} "
            f"| {_f(loaded['arrivals_ttft_median_ms'])} / {_f(loaded['arrivals_ttft_p99_ms'])} |")
    return "\n".join(lines)


def run_points(url: str, server_pid: int, variant: Variant, points: Sequence[Point], args: argparse.Namespace,
               vocab_size: int, deadline: float, out: Path,
               engine: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every concurrency of one running server: warm-up, then the repeats (with ``--json-schema``, each repeat
    unconstrained then constrained, on the same prompts; with ``--arrivals``, each repeat plain then under the
    arrivals, on the same prompts); one summarized row per kind."""
    rows = []
    arrivals = Arrivals.parse(args.arrivals, args.arrivals_output_len) if args.arrivals else None
    kinds = ("", "+json_schema") if args.json_schema else ("", "+arrivals") if arrivals else ("",)
    for point in points:
        reports: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
        arrival_reports: list[dict[str, Any]] = []
        skipped = 0
        for repeat in range(args.repeats):
            if time.monotonic() >= deadline:
                skipped = args.repeats - repeat
                print(f"  budget spent: {skipped} run(s) of concurrency {point.concurrency} skipped", flush=True)
                break
            for kind in kinds:
                name = variant.name + kind
                warmup = (point.concurrency if args.warmup is None else args.warmup) if repeat == 0 else 0
                config = serve_bench.BenchConfig(
                    url=url, endpoint=args.endpoint, input_len=point.input_len, output_len=args.output_len,
                    warmup_input_len=args.warmup_input_len,
                    range_ratio=args.range_ratio, num_prompts=point.num_prompts, concurrency=point.concurrency,
                    warmup=warmup, warmup_output_len=args.warmup_output_len, seed=1000 * point.concurrency + repeat,
                    vocab_size=vocab_size, server_pid=server_pid, request_timeout=args.request_timeout,
                    json_schema=kind == "+json_schema")
                try:
                    if kind == "+arrivals" and arrivals is not None:
                        config = attrs.evolve(config, vocab_size=vocab_size or serve_bench.model_vocab_size(url))
                        if warmup:
                            trio.run(serve_bench.warm_up, config, config.vocab_size)
                        report, arrived = trio.run(run_with_arrivals, attrs.evolve(config, warmup=0), arrivals,
                                                   7 * config.seed + 1)
                        report["arrivals"] = arrived
                        arrival_reports.append(arrived)
                    else:
                        report = trio.run(serve_bench.run_benchmark, config)
                except (SystemExit, Exception) as error:  # e.g. every warm-up request failed: keep the other rows
                    print(f"  {name} c={point.concurrency} run {repeat + 1}: {error!r}", flush=True)
                    continue
                path = out / (f"{name.replace('=', '_').replace('+', '_')}_in{point.input_len}_c{point.concurrency}"
                              f"_r{repeat}.json")
                path.write_text(json.dumps(report, indent=1, default=str))
                reports[kind].append(report)
                ttft, itl = (serve_bench.fmt_ms(report[key]["median_ms"]) for key in ("ttft", "itl"))
                extra = (f", ITL p99 {serve_bench.fmt_ms(report['itl']['p99_ms'])} ms, "
                         f"{report['arrivals']['completed']} arrivals (TTFT median "
                         f"{serve_bench.fmt_ms(report['arrivals']['ttft']['median_ms'])} ms)"
                         if "arrivals" in report else "")
                print(f"  {name} c={point.concurrency} run {repeat + 1}/{args.repeats}: "
                      f"{report['output_throughput']:.0f} tok/s, TTFT median {ttft} ms, ITL median {itl} ms"
                      f"{extra}, {report['failed']} failed, client CPU {report['client_cpu_cores']:.2f}"
                      + (f"; error: {report['errors'][0][:200]}" if report["failed"] and report.get("errors") else ""),
                      flush=True)
        for kind in kinds:
            missing = args.repeats - len(reports[kind])
            rows.append(summarize_point(args.model, variant.name + kind, point, reports[kind], missing,
                                        engine.get(point.concurrency)))
        if args.json_schema and rows[-1]["output_tok_s"] and rows[-2]["output_tok_s"]:
            rows[-1]["over_unconstrained"] = rows[-1]["output_tok_s"] / rows[-2]["output_tok_s"]
            print(f"  c={point.concurrency}: json_schema / unconstrained output tok/s = "
                  f"{rows[-1]['over_unconstrained']:.3f}", flush=True)
        if arrivals is not None:
            plain, loaded = rows[-2], rows[-1]
            loaded.update(
                arrivals=f"{arrivals.input_len}@{arrivals.rate:g}",
                arrivals_completed=sum(r["completed"] for r in arrival_reports),
                arrivals_failed=sum(r["failed"] for r in arrival_reports),
                arrivals_ttft_median_ms=_median([r["ttft"]["median_ms"] for r in arrival_reports]),
                arrivals_ttft_p99_ms=_median([r["ttft"]["p99_ms"] for r in arrival_reports]))
            if plain["itl_p99_ms"] and loaded["itl_p99_ms"] is not None:
                loaded["itl_p99_over_plain"] = loaded["itl_p99_ms"] / plain["itl_p99_ms"]
            print(f"  c={point.concurrency} under {loaded['arrivals']}: ITL p99 {_f(loaded['itl_p99_ms'], '.1f')} "
                  f"ms ({_f(loaded.get('itl_p99_over_plain'), '.2f')}x plain), {loaded['arrivals_completed']} "
                  f"arrivals, their TTFT median / p99 {_f(loaded['arrivals_ttft_median_ms'])} / "
                  f"{_f(loaded['arrivals_ttft_p99_ms'])} ms", flush=True)
    return rows


def model_with_tokenizer(model: str, folder: Path, tokenizer_folder: Path | None = None) -> Path:
    """A checkpoint folder for ``--json-schema``: the preset's config.json (dummy weights) and the embedded
    Gemma 3 tokenizer (or ``tokenizer_folder``: the one ``inference-server export-tokenizer`` writes, for a
    machine without the embedded model's package), whose vocabulary must have the preset's size."""
    import shutil

    from inference_server.models.loading.embedded import embedded_gguf_path
    from inference_server.models.loading.presets import preset_config
    from inference_server.models.tokenizer import Tokenizer

    config = preset_config(model)
    tokenizer = (Tokenizer.from_pretrained_dir(tokenizer_folder) if tokenizer_folder is not None
                 else Tokenizer.from_gguf(embedded_gguf_path()))
    if tokenizer.source_file is None or tokenizer.backend.get_vocab_size() != config["vocab_size"]:
        raise SystemExit(f"--json-schema: the embedded tokenizer does not fit {model}'s vocabulary")
    folder.mkdir(parents=True, exist_ok=True)
    for source in tokenizer.source_file.parent.iterdir():
        shutil.copy(source, folder / source.name)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def compile_times(tokenizer_folder: Path, vocab_size: int, output_len: int) -> dict[str, float]:
    """Milliseconds to set up llguidance's tokenizer, and to compile ``bench_schema`` first (with its first
    mask) and cached, on the served tokenizer (what the server does before admitting the first request)."""
    from inference_server.core.grammar_compiler import GrammarCompiler
    from inference_server.models.tokenizer import Tokenizer
    from inference_server.records.constraints import Constraint

    tokenizer = Tokenizer.from_pretrained_dir(tokenizer_folder)
    compiler = GrammarCompiler(tokenizer.backend.to_str(), vocab_size, tokenizer.eos_token_ids)
    t0 = time.perf_counter()
    compiler.tokenizer  # noqa: B018 (builds it)
    t1 = time.perf_counter()
    constraint = Constraint.json_schema(serve_bench.bench_schema(output_len))
    compiler.compile(constraint).matcher().compute_bitmask()
    t2 = time.perf_counter()
    compiler.compile(constraint)
    t3 = time.perf_counter()
    return {"tokenizer_setup_ms": (t1 - t0) * 1e3, "first_compile_and_mask_ms": (t2 - t1) * 1e3,
            "cached_compile_ms": (t3 - t2) * 1e3}


def grammar_host_costs(tokenizer_folder: Path, vocab_size: int, output_len: int, rows: int = 64,
                       steps: int = 40, seed: int = 0) -> dict[str, Any]:
    """What one decode step of ``rows`` rows, every one constrained by ``bench_schema``, costs the host in the
    runner's grammar path (``grammar_masks``), in milliseconds per step (median over ``steps``): ``advance`` (each
    matcher consumes its row's sampled token, llguidance's threads), ``fill`` (the ``rows`` masks into the pinned
    buffer, llguidance's threads), ``copy`` (until the masks are on the device; CUDA only), and ``advance_gil``
    and ``fill_gil``: the CPU time of the calling thread in each (what holds the GIL that the event loop needs),
    ``fill_cpu``: the process's CPU time in the fill (every worker's: the fill's wall time times its parallelism).
    Each row takes a seeded random token its mask allows (outside the timings), so the rows drift apart as real
    requests do."""
    import random

    import numpy as np
    import torch

    from inference_server.backends.grammar_masks import BitmaskFiller, GrammarState
    from inference_server.core.grammar_compiler import GrammarCompiler
    from inference_server.models.tokenizer import Tokenizer
    from inference_server.records.constraints import Constraint

    tokenizer = Tokenizer.from_pretrained_dir(tokenizer_folder)
    compiler = GrammarCompiler(tokenizer.backend.to_str(), vocab_size, tokenizer.eos_token_ids)
    compiled = compiler.compile(Constraint.json_schema(serve_bench.bench_schema(output_len)))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    filler = BitmaskFiller(vocab_size, compiler.eos_token_ids, device)
    states = [GrammarState.start(compiled) for _ in range(rows)]
    outputs: list[list[int]] = [[] for _ in range(rows)]
    rng = random.Random(seed)
    times: dict[str, list[float]] = {"advance": [], "fill": [], "copy": [], "advance_gil": [], "fill_gil": [],
                                     "fill_cpu": []}
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        filler.advance([(state, output[state.consumed:]) for state, output in zip(states, outputs, strict=True)])
        t1, c1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
        masks, _ = filler.fill([(state, row) for row, state in enumerate(states)])
        t2, c2, p2 = time.perf_counter(), time.thread_time(), time.process_time()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        times["advance"].append(t1 - t0)
        times["fill"].append(t2 - t1)
        times["copy"].append(t3 - t2)
        # thread_time counts this thread only: llguidance's workers run without the GIL
        times["advance_gil"].append(c1 - c0)
        times["fill_gil"].append(c2 - c1)
        times["fill_cpu"].append(p2 - p1)
        host = masks.cpu().numpy().view(np.uint32)
        for row, output in enumerate(outputs):
            words = np.flatnonzero(host[row])
            word = int(words[rng.randrange(len(words))])
            bits = [b for b in range(32) if int(host[row, word]) >> b & 1]
            output.append(word * 32 + bits[rng.randrange(len(bits))])
    result: dict[str, Any] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result["fill_max"] = max(times["fill"]) * 1e3
    result.update(rows=rows, steps=steps, device=device.type, cpus=os.cpu_count(),
                  cpus_usable=len(os.sched_getaffinity(0)))
    if device.type != "cuda":
        result["copy"] = None
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help='MODEL for the server: a preset (dummy weights) or "" '
                        "for the embedded model, or a checkpoint path")
    parser.add_argument("--concurrency", default="1,16,100")
    parser.add_argument("--num-prompts", "--num-prompts-per-concurrency", default="8,64,200")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up requests per concurrency (default: C)")
    parser.add_argument("--warmup-output-len", type=int, default=16, help="output tokens of each warm-up request")
    parser.add_argument("--input-len", default="512",
                        help="prompt tokens; a comma list runs every concurrency at each length on the same server")
    parser.add_argument("--warmup-input-len", type=int, default=0,
                        help="prompt tokens of each warm-up request (default: the point's --input-len)")
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--endpoint", choices=serve_bench.ENDPOINTS, default="/v1/completions")
    parser.add_argument("--vocab-size", type=int, default=0, help="default: the preset's, else /tokenizer_info")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every server start")
    parser.add_argument("--variant", action="append", default=[],
                        help="KEY=VALUE[,KEY=VALUE]: one more server start with these set (after the default)")
    parser.add_argument("--no-dummy-weights", action="store_true", help="do not set DUMMY_WEIGHTS=true")
    parser.add_argument("--engine-only", action="store_true", help="add engine_bench's decode step per batch")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip runs that would start after this")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("serving_out"))
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="with --json-schema: a tokenizer folder (export-tokenizer) instead of the embedded one")
    parser.add_argument("--json-schema", action="store_true",
                        help="each run also with every request constrained by a JSON schema (see the docstring)")
    parser.add_argument("--arrivals", default="", metavar="LEN@RATE",
                        help="each run also while prompts of LEN tokens arrive at RATE per second (see the docstring)")
    parser.add_argument("--arrivals-output-len", type=int, default=16, help="output tokens of each arriving prompt")
    parser.add_argument("--grammar-host-only", action="store_true",
                        help="with --json-schema: measure the host's grammar costs per step and start no server")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    counts = [int(n) for n in args.num_prompts.split(",")]
    if len(counts) != len(concurrencies):
        raise SystemExit("--num-prompts needs one count per concurrency")
    input_lens = [int(n) for n in args.input_len.split(",")]
    points = [Point(c, n, length) for length in input_lens for c, n in zip(concurrencies, counts, strict=True)]
    if args.arrivals and args.json_schema:
        raise SystemExit("--arrivals and --json-schema each add a kind of run: use one at a time")
    if args.arrivals:
        Arrivals.parse(args.arrivals, args.arrivals_output_len)  # a bad value stops here, before any server start
    variants = [Variant("default", {})] + [Variant(v, parse_pairs(v.split(","))) for v in args.variant]
    print(schedule_text(args.model, variants, points, args.repeats, args.warmup, args.output_len),
          flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    engine = engine_only(args.model, concurrencies, args.out / "engine", args.budget_s) \
        if args.engine_only and args.model else {}
    base_env = {"MODEL": args.model, "LOG_LEVEL": "warning", **parse_pairs(args.env)}
    if args.model and not args.no_dummy_weights and not os.path.exists(args.model):
        base_env["DUMMY_WEIGHTS"] = "true"
    vocab_size = args.vocab_size or preset_vocab_size(args.model)
    if args.json_schema:
        folder = Path(args.model) if os.path.isdir(args.model) else None
        if args.model and folder is None:
            folder = model_with_tokenizer(args.model, args.out / "model", args.tokenizer)
            base_env["MODEL"] = str(folder)
        if folder is None:  # the embedded model
            from inference_server.models.loading.embedded import embedded_gguf_path
            from inference_server.models.tokenizer import Tokenizer

            source = Tokenizer.from_gguf(embedded_gguf_path()).source_file
            assert source is not None
            folder = source.parent
        times = compile_times(folder, vocab_size or 262_144, args.output_len)
        (args.out / "compile.json").write_text(json.dumps(times, indent=1))
        print("json_schema compile: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)
        costs = grammar_host_costs(folder, vocab_size or 262_144, args.output_len,
                                   rows=max(concurrencies))
        (args.out / "grammar_host.json").write_text(json.dumps(costs, indent=1))
        print("json_schema host ms per step: " + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in costs.items()), flush=True)
        if args.grammar_host_only:
            return 0
    rows: list[dict[str, Any]] = []
    for variant in variants:
        if time.monotonic() >= deadline:
            print(f"budget spent: server variant {variant.name} skipped", flush=True)
            continue
        log = args.out / f"server_{variant.name.replace('=', '_').replace(',', '_')}.log"
        t0 = time.monotonic()
        with launched({**base_env, **variant.env}, log, ready_timeout=args.ready_timeout) as (process, url):
            print(f"server {variant.name} ready in {time.monotonic() - t0:.1f} s at {url}", flush=True)
            rows += run_points(url, process.pid, variant, points, args, vocab_size, deadline, args.out, engine)
    table = markdown_table(rows)
    if args.arrivals:
        table += "\n\n" + arrivals_table(rows)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    (args.out / "table.md").write_text(table + "\n")
    print(f"\n{args.output_len} tokens out, {args.endpoint}, median of {args.repeats} runs; "
          f"wall {time.monotonic() - started:.0f} s\n{table}", flush=True)
    return 0 if rows and all(r["runs"] and not r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
