#!/usr/bin/env python3
"""The Hugging Face baseline (``BACKEND=hf``) against our own runner, and KV eviction's cost in perplexity.

``throughput``: the same workload through the real engine (admission, scheduler, KV allocator, executor
thread, runner) on ``hf`` and on our runner (``reference`` on CPU, ``custom-cuda`` on CUDA). Per concurrency
``c``: ``c`` requests of ``--prompt`` random token ids (seeded) submitted at once, greedy, ``--output`` tokens
each (ignore EOS), after a short warm-up. Prints output tok/s, median TTFT, median time per output token after
the first (TPOT) and median end-to-end latency, side by side.

``perplexity``: the first ``--tokens`` tokens of a fixed text (``bench/data/long_text.md``: this project's own
docs/architecture.md and docs/kv_cache.md at commit 8c79bf6, under the project's licence) scored by the hf
runner on the embedded model (prompt logprobs, chunked prefill of 256 tokens) with the full cache, then with
each policy at each budget. With a policy a chunk runs in pieces of ``--piece`` tokens (at most half the
budget): a token is scored with between ``budget - piece`` and ``budget`` tokens of cache.

    uv run python bench/baseline_compare.py throughput                       # CPU, embedded model
    uv run python bench/baseline_compare.py perplexity --tokens 4096
    python3 bench/baseline_compare.py throughput --model gemma-4-e4b --dummy --device cuda \\
        --concurrency 1,16,64 --prompt 512 --output 128 --unbatched-up-to 16  # H200, dummy weights (~4 min)

This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TEXT = Path(__file__).resolve().parent / "data" / "long_text.md"


# ----------------------------------------------------------------------------------------- throughput


async def _timed(engine: Any, request: Any) -> tuple[float, float, int]:
    """(TTFT, end-to-end seconds, output tokens) of one request."""
    import trio

    started = trio.current_time()
    first = None
    tokens = 0
    async with engine.submit(request) as handle:
        async for update in handle:
            if update.tokens and first is None:
                first = trio.current_time() - started
            tokens += len(update.tokens)
    return first or math.nan, trio.current_time() - started, tokens


def run_workload(parts: Any, prompts: list[list[int]], output: int) -> dict[str, float]:
    import trio

    from inference_server.records.requests import GenerationRequest
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.supervisor import Engine

    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    timings: list[tuple[float, float, int]] = []

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(Engine(parts).run)
            started = trio.current_time()
            async with trio.open_nursery() as clients:
                for prompt in prompts:
                    async def one(prompt: list[int] = prompt) -> None:
                        timings.append(await _timed(engine, GenerationRequest(params=params, prompt_ids=tuple(prompt))))
                    clients.start_soon(one)
            wall = trio.current_time() - started
            engine.close()
        return wall

    wall = trio.run(main)
    tokens = sum(t for _, _, t in timings)
    return {"tok_s": tokens / wall, "ttft": statistics.median(t for t, _, _ in timings),
            "tpot": statistics.median((e - t) / max(1, n - 1) for t, e, n in timings),
            "e2e": statistics.median(e for _, e, _ in timings), "tokens": tokens, "wall": wall}


def throughput(args: argparse.Namespace) -> None:
    import torch

    from inference_server.config import Settings
    from inference_server.engine_factory import build_engine_parts

    ours = "custom-cuda" if args.device == "cuda" else "reference"
    concurrency = [int(c) for c in args.concurrency.split(",")]
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for backend in ("hf", ours):
        settings = Settings(model=args.model, dummy_weights=args.dummy, device=args.device, backend=backend,
                            max_model_len=args.prompt + args.output + 16, max_batch_size=max(concurrency), seed=0,
                            kv_cache_tokens=(args.prompt + args.output + 16) * max(concurrency) * 2)
        torch.set_num_threads(args.threads) if args.threads else None
        started = time.perf_counter()
        built = build_engine_parts(settings)
        print(f"# {backend}: built in {time.perf_counter() - started:.1f} s", flush=True)
        vocab = built.loaded.spec.vocab_size
        rng = random.Random(0)
        run_workload(built.parts, [[rng.randrange(10, vocab) for _ in range(16)]], 4)  # warm-up
        for c in concurrency:
            prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt)] for _ in range(c)]
            rows[backend, c] = result = run_workload(built.parts, prompts, args.output)
            print(f"# {backend} c={c}: {result}", flush=True)
            if backend == "hf" and 1 < c <= args.unbatched_up_to:  # the same, one forward per decoding sequence
                built.runner.batch_decodes = False  # type: ignore[attr-defined]
                rows["hf-unbatched", c] = result = run_workload(built.parts, prompts, args.output)
                built.runner.batch_decodes = True  # type: ignore[attr-defined]
                print(f"# hf, one decode forward per sequence, c={c}: {result}", flush=True)
        del built
        if args.device == "cuda":
            torch.cuda.empty_cache()
    name = args.model or "gemma-3-270m (embedded)"
    print(f"\n{name} on {args.device}, prompt {args.prompt}, output {args.output}, greedy\n")
    print("| concurrency | hf tok/s | ours tok/s | speed-up | hf TTFT s | ours TTFT s | hf TPOT ms | ours TPOT ms "
          "| hf e2e s | ours e2e s | hf unbatched decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in concurrency:
        h, o = rows["hf", c], rows[ours, c]
        unbatched = rows.get(("hf-unbatched", c))
        last = f"{unbatched['tok_s']:.1f}" if unbatched else "-"
        print(f"| {c} | {h['tok_s']:.1f} | {o['tok_s']:.1f} | {o['tok_s'] / h['tok_s']:.2f}x | {h['ttft']:.3f} | "
              f"{o['ttft']:.3f} | {h['tpot'] * 1e3:.1f} | {o['tpot'] * 1e3:.1f} | {h['e2e']:.2f} | {o['e2e']:.2f} | "
              f"{last} |")


# ----------------------------------------------------------------------------------------- perplexity


def score(runner: Any, ids: list[int], chunk: int) -> float:
    """Perplexity of ``ids`` (every token after the first) through the runner's prompt logprobs."""
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.records.steps import ScheduledSequence, StepPlan

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    logprobs: list[float] = []
    for step, start in enumerate(range(0, len(ids), chunk)):
        tokens = tuple(ids[start:start + chunk])
        targets = tuple(ids[start + 1:start + 1 + len(tokens)])
        last = start + len(tokens) == len(ids)
        sequence = ScheduledSequence(0, tokens, start, ((),), last, params, reset=start == 0, prompt_len=len(ids),
                                     prompt_logprob_targets=targets)
        result = runner.execute(StepPlan(step, (sequence,)))
        logprobs += result.prompt_logprobs[0].token_logprobs
    runner.forget((0,))
    return math.exp(-sum(logprobs) / len(logprobs))


def perplexity(args: argparse.Namespace) -> None:
    import torch

    from inference_server.backends.hf.eviction_config import EvictionConfig
    from inference_server.backends.hf.loading import load_hf_model
    from inference_server.backends.hf.runner import HFModelRunner
    from inference_server.config import Settings

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loaded = load_hf_model(Settings(model=args.model, backend="hf", device="cpu"), torch.device("cpu"),
                           torch.float32)
    print(f"# loaded in {time.perf_counter() - started:.1f} s", flush=True)
    assert loaded.tokenizer is not None
    ids = loaded.tokenizer.encode(TEXT.read_text())[:args.tokens]
    if len(ids) < args.tokens:
        sys.exit(f"the text has only {len(ids)} tokens")
    budgets = [int(b) for b in args.budgets.split(",")]
    policies = args.policies.split(",")
    results: dict[tuple[str, int], float] = {}

    def run(policy: str, budget: int) -> float:
        config = EvictionConfig(policy, budget, args.sink_tokens, max_piece=args.piece)
        began = time.perf_counter()
        value = score(HFModelRunner(loaded.model, loaded.spec, torch.device("cpu"), config), ids, 256)
        print(f"# {policy} budget {budget}: ppl {value:.3f} ({time.perf_counter() - began:.0f} s)", flush=True)
        return value

    full = run("none", 0)
    for policy in policies:
        for budget in budgets:
            results[policy, budget] = run(policy, budget)
    print(f"\nperplexity of the first {len(ids)} tokens of {TEXT.name}, {loaded.name}, fp32; full cache: "
          f"{full:.3f}\n")
    print("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for policy in policies:
        print(f"| {policy} | " + " | ".join(f"{results[policy, b]:.3f} ({results[policy, b] / full:.2f}x)"
                                             for b in budgets) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    speed = commands.add_parser("throughput")
    speed.add_argument("--model", default="", help="MODEL (empty: the embedded Gemma 3 270M)")
    speed.add_argument("--dummy", action="store_true", help="DUMMY_WEIGHTS (presets)")
    speed.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    speed.add_argument("--concurrency", default="1,4")
    speed.add_argument("--prompt", type=int, default=128)
    speed.add_argument("--output", type=int, default=32)
    speed.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    speed.add_argument("--unbatched-up-to", type=int, default=1 << 30,
                       help="run hf's one-forward-per-sequence comparison only up to this concurrency (it is slow)")
    ppl = commands.add_parser("perplexity")
    ppl.add_argument("--model", default="", help="MODEL (empty: the embedded Gemma 3 270M)")
    ppl.add_argument("--tokens", type=int, default=4096)
    ppl.add_argument("--budgets", default="256,512,1024")
    ppl.add_argument("--policies", default="sink,h2o,lru")
    ppl.add_argument("--sink-tokens", type=int, default=4)
    ppl.add_argument("--piece", type=int, default=32, help="most new tokens per forward under a policy")
    ppl.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    throughput(args) if args.command == "throughput" else perplexity(args)


if __name__ == "__main__":
    main()
