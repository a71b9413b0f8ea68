#!/usr/bin/env python3
"""Replicas behind the control-plane front on one host: the shared-prefix workload (``serve_bench.py
--dataset shared-prefix``) through the front with one replica, then two replicas under ``round_robin`` and
under ``prefix_aware``; prints TTFT p50 / p99, output tok/s, the share of prompt tokens served from the
replicas' prefix caches and the two-replica speed-up.

The speed-up compares equal load per replica: the one-replica run gets ``1/N`` of the sessions and of the
concurrency (``--same-load`` gives it the whole load instead, which measures what one GPU does with N GPUs'
traffic rather than how throughput scales).

Replicas are plain ``inference-server serve`` processes (one per GPU, ``CUDA_VISIBLE_DEVICES=i``; on a machine
without CUDA they share the CPU), started once and kept for every run; the front is ``inference-server cluster
--replica-url ...`` (no Ray, so this runs where Ray is not installed; ``--ray`` starts the replicas as Ray
actors with ``inference-server cluster --replicas N`` instead, one front per run). Each run uses its own seed,
so its system prompts are new to every replica's cache. The model comes from the environment (``MODEL``,
``DUMMY_WEIGHTS``, ...), as for ``serve``. The ``front`` column is the front process's CPU (cores), children
included: with ``--ray`` that is the local Ray and the replicas too.

    MODEL=gemma-4-e4b DUMMY_WEIGHTS=true python bench/cluster_bench.py --json cluster.json
    uv run python bench/cluster_bench.py --replicas 2 --num-sessions 4 --turns 2 --system-len 128 \\
        --user-len 16 --output-len 8 --num-groups 2 --concurrency 4     # a tiny CPU run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench
from kit.server_process import SERVE_COMMAND, ServerDidNotStart, launched, stop, wait_for_url, wait_until_ready

START_TIMEOUT = 600.0


def cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def start_replicas(stack: ExitStack, count: int, logs: Path) -> list[str]:
    """``count`` servers started together (GPU ``i`` each where there are GPUs); their URLs once all answer
    ``/ready``. ``stack`` stops them (SIGTERM, then SIGKILL)."""
    gpus = cuda_count()
    processes = []
    for index in range(count):
        env = {**os.environ, "HOST": "127.0.0.1", "PORT": "0"}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
        log_file = stack.enter_context((logs / f"replica-{index}.log").open("wb"))
        process = subprocess.Popen(SERVE_COMMAND, env=env, stdout=subprocess.PIPE, stderr=log_file)
        stack.callback(stop, process, 30.0)
        processes.append(process)
    urls = []
    for index, process in enumerate(processes):
        url = wait_for_url(process, START_TIMEOUT)
        if url is None or not wait_until_ready(url, START_TIMEOUT, process):
            log = (logs / f"replica-{index}.log").read_text(errors="replace")[-3000:]
            raise ServerDidNotStart(f"replica {index} did not start:\n{log}")
        urls.append(url)
    return urls


def vocab_size(url: str | None) -> int:
    """A dummy preset's vocabulary (it has no tokenizer for /tokenizer_info to read), else the server's (0:
    let each run ask its front)."""
    try:
        from inference_server.models.loading.presets import preset_config

        return int(preset_config(os.environ.get("MODEL", ""))["vocab_size"])
    except Exception:
        return serve_bench.model_vocab_size(url) if url else 0


def front_command(policy: str, urls: list[str] | None, replicas: int) -> list[str]:
    command = [sys.executable, "-m", "inference_server", "cluster", "--policy", policy]
    if urls is None:
        return [*command, "--replicas", str(replicas)]
    for url in urls:
        command += ["--replica-url", url]
    return command


def cache_counters(url: str) -> tuple[float, float]:
    """(prompt tokens found in the replicas' prefix caches, prompt tokens looked up), summed over replicas,
    from the front's ``/metrics``."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prefix_cache_hits_total"], totals["vllm:prefix_cache_queries_total"]


def run_one(label: str, policy: str, urls: list[str] | None, replicas: int, args: argparse.Namespace, seed: int,
            logs: Path, share: float = 1.0) -> dict[str, Any]:
    """One run through a new front; ``share`` scales the sessions and the concurrency (the one-replica run gets
    one replica's share of the load, so the speed-up compares equal load per replica)."""
    with launched({}, logs / f"front-{label}.log", command=front_command(policy, urls, replicas),
                  start_timeout=START_TIMEOUT, ready_timeout=START_TIMEOUT) as (front, url):
        if urls is None:  # Ray: wait for every replica, not just the first
            deadline = time.monotonic() + START_TIMEOUT
            while time.monotonic() < deadline and "all" not in (logs / f"front-{label}.log").read_text():
                time.sleep(1)
        config = serve_bench.BenchConfig(
            url=url, dataset="shared-prefix", num_groups=args.num_groups, system_len=args.system_len,
            num_sessions=max(1, round(args.num_sessions * share)), turns=args.turns, user_len=args.user_len,
            output_len=args.output_len, concurrency=max(1, round(args.concurrency * share)),
            vocab_size=args.vocab_size, seed=seed, server_pid=front.pid,
            warmup=args.warmup, input_len=args.system_len, warmup_output_len=4)
        hits0, queries0 = cache_counters(url)
        report = trio.run(serve_bench.run_benchmark, config)
        hits1, queries1 = cache_counters(url)
    hit_rate = (hits1 - hits0) / (queries1 - queries0) if queries1 > queries0 else None
    return {"label": label, "policy": policy, "replicas": replicas, "report": report, "cache_hit_rate": hit_rate}


def row(result: dict[str, Any], base: float | None) -> str:
    report = result["report"]
    throughput = report["output_throughput"]
    speedup = f"{throughput / base:.2f}x" if base else "-"
    cores = (report.get("server_cpu") or {}).get("total_cores")
    ttft = report["ttft"]
    hit_rate = result["cache_hit_rate"]
    cached = "n/a" if hit_rate is None else f"{hit_rate:.0%}"
    p50, p99 = serve_bench.fmt_ms(ttft["median_ms"]), serve_bench.fmt_ms(ttft["p99_ms"])
    return (f"{result['label']:<24}{cached:>7}{p50:>10}{p99:>10}{throughput:>12.1f}"
            f"{report['request_throughput']:>9.2f}{report['failed']:>7}{speedup:>9}"
            f"{'n/a' if cores is None else f'{cores:.2f}':>8}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--ray", action="store_true", help="replicas as Ray actors (inference-server cluster)")
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=2048)
    parser.add_argument("--num-sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32, help="sessions at once")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up requests per run (not counted)")
    parser.add_argument("--vocab-size", type=int, default=0, help="0: the served model's")
    parser.add_argument("--same-load", action="store_true",
                        help="the one-replica run gets the whole load (default: one replica's share of it)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of the three runs (new seeds each); the table shows each run's median round")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=None, help="folder for the servers' logs (default: temp)")
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    plan = [("1 replica, round_robin", "round_robin", 1)]
    plan += [(f"{args.replicas} replicas, {policy}", policy, args.replicas) for policy in ("round_robin",
                                                                                           "prefix_aware")]
    rounds: list[list[dict[str, Any]]] = []
    with ExitStack() as stack:
        urls = None if args.ray else start_replicas(stack, args.replicas, logs)
        args.vocab_size = args.vocab_size or vocab_size(urls[0] if urls else None)
        for round_index in range(args.repeats):
            results = []
            for seed, (label, policy, count) in enumerate(plan, start=1):
                chosen = None if urls is None else urls[:count]
                share = 1.0 if args.same_load or count == args.replicas else count / args.replicas
                results.append(run_one(label, policy, chosen, count, args, round_index * 100_000 + seed * 1000, logs,
                                       share))
                print(f"{label}: {results[-1]['report']['output_throughput']:.1f} output tok/s", flush=True)
            rounds.append(results)
    # per run, the round with the median output throughput (the upper median for an even count)
    results = [sorted((r[i] for r in rounds), key=lambda x: x["report"]["output_throughput"])[len(rounds) // 2]
               for i in range(len(plan))]
    base = results[0]["report"]["output_throughput"]
    print(f"shared prefix: {args.num_sessions} sessions x {args.turns} turns, {args.num_groups} system prompts of "
          f"{args.system_len} tokens, user {args.user_len}, output {args.output_len}, {args.concurrency} sessions "
          f"at once" + ("" if args.same_load else f" (the 1-replica run: 1/{args.replicas} of the sessions and of the "
                        "concurrency, one replica's share)") + f"; median of {len(rounds)} rounds; logs in {logs}")
    print(f"{'run':<24}{'cached':>7}{'TTFT p50':>10}{'TTFT p99':>10}{'out tok/s':>12}{'req/s':>9}{'failed':>7}"
          f"{'vs 1':>9}{'front':>8}")
    for result in results:
        print(row(result, base))
    for index, (label, _, _) in enumerate(plan):
        print(f"{label}: output tok/s per round " + ", ".join(f"{r[index]['report']['output_throughput']:.1f}"
                                                              for r in rounds))
    if args.json is not None:
        args.json.write_text(json.dumps(rounds, indent=1, default=str))
    return 0 if all(r["report"]["failed"] == 0 for results in rounds for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    sys.exit(main())
