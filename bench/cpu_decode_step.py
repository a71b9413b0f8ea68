"""Time of one batch-1 decode step of the embedded model on the CPU, per torch thread count, and where it goes.

Builds the engine's runner (default settings: the CPU default quantization), prefills one prompt, then runs
decode steps through ``runner.execute`` in this thread, alternating the arms in blocks of ``--block`` steps so
both see the same machine load; prints the median ms per step and tok/s of each arm, and the load average.
``--profile`` adds a torch profiler table of one arm's steps (self CPU time by op).

    uv run python bench/cpu_decode_step.py --threads 1 2 --rounds 6
    taskset -c 1 uv run python bench/cpu_decode_step.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from inference_server.config import Settings
from inference_server.engine_factory import build_engine_parts
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=16, help="decode steps per arm per round")
    parser.add_argument("--quantization", default="", help="QUANTIZATION (empty: the default)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    settings = Settings(device="cpu", kv_cache_tokens=4096,
                        **({"quantization": args.quantization} if args.quantization else {}))
    built = build_engine_parts(settings)
    runner, kv = built.runner, built.parts.kv
    runner._cpu_threads = None  # the arms set the thread count themselves (the engine picks 1 for decode steps)
    print(f"model {built.loaded.name}, quantization {settings.quantization}, load average {os.getloadavg()[0]:.2f}")
    request_id = 1
    prompt = tuple(range(100, 106))
    total = len(prompt) + args.rounds * args.block * len(args.threads) + 64
    kv.start_sequence(request_id, prompt)
    kv.append_slots(request_id, total)
    tables = kv.block_tables(request_id)
    groups = (tables.full, tables.sliding) if kv.sliding_pool is not None else (tables.full,)
    greedy = SamplingParams(temperature=0.0)
    result = runner.execute(StepPlan(0, (ScheduledSequence(request_id, prompt, 0, groups, True, greedy, reset=True,
                                                           prompt_len=len(prompt)),)))
    position = len(prompt)
    token = result.tokens[0].token_id
    step_id = 1

    def step() -> float:
        nonlocal position, token, step_id
        sequence = ScheduledSequence(request_id, (token,), position, groups, True, greedy, prompt_len=len(prompt))
        started = time.perf_counter()
        out = runner.execute(StepPlan(step_id, (sequence,)))
        elapsed = time.perf_counter() - started
        token, position, step_id = out.tokens[0].token_id, position + 1, step_id + 1
        return elapsed

    times: dict[int, list[float]] = {n: [] for n in args.threads}
    for _ in range(4):
        step()
    for _ in range(args.rounds):
        for n in args.threads:
            torch.set_num_threads(n)
            times[n].extend(step() for _ in range(args.block))
    for n, samples in times.items():
        median = statistics.median(samples)
        print(f"threads {n}: median {median * 1e3:.1f} ms/step ({1 / median:.1f} tok/s) over {len(samples)} steps")
    print(f"load average now {os.getloadavg()[0]:.2f}")
    if args.profile:
        torch.set_num_threads(args.threads[0])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(8):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
