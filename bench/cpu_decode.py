#!/usr/bin/env python3
"""Offline decode rate of the embedded model on the CPU (the default settings: int8, the CPU ops table), and where a
decode step goes.

Runs the engine through ``offline.LLM`` (the same actors as the server): a warm-up, then ``--repeats`` greedy
completions of ``--tokens`` tokens of the README's prompt (``ignore_eos``), and prints each run's tok/s, the median
decode step (wall and the step thread's CPU time: under load, the CPU time is the steadier figure) and the load
average. ``--threads N`` pins the decode steps' torch thread count (default: the runner's own choice,
``backends/cpu_threads.py``). ``--profile`` adds a torch profiler table of 20 decode steps at a 100-token context
(ops grouped by input shape, and per op type).

    uv run python bench/cpu_decode.py                     # 3 runs of 64 tokens
    uv run python bench/cpu_decode.py --threads 1 --profile
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from torch.profiler import ProfilerActivity, profile

from inference_server.backends.model_runner import LaunchedStep
from inference_server.config import Settings
from inference_server.offline import LLM
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import StepPlan

PROMPT = "The capital of France is"
PROFILE_FROM, PROFILE_STEPS = 8, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads of decode steps (0: measured)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    llm = LLM(Settings(device="cpu"))
    runner = llm.built.runner
    if args.threads and runner._cpu_threads is not None:
        runner._cpu_threads.current = runner._cpu_threads._other = args.threads
    steps: list[tuple[float, float]] = []  # decode steps: (wall, thread CPU) seconds
    profiling: dict[str, object] = {"on": False, "count": 0, "profiler": None}
    launch = runner.launch

    def timed_launch(plan: StepPlan) -> LaunchedStep:
        if profiling["on"] and plan.num_tokens == 1:  # the profiler records the thread that starts it: this one
            profiling["count"] = count = int(profiling["count"]) + 1  # type: ignore[call-overload]
            if count == PROFILE_FROM:
                profiling["profiler"] = prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                prof.__enter__()
            elif count == PROFILE_FROM + PROFILE_STEPS:
                profiling["profiler"].__exit__(None, None, None)  # type: ignore[union-attr]
        wall, cpu = time.perf_counter(), time.thread_time()
        launched = launch(plan)
        if plan.num_tokens == 1:
            steps.append((time.perf_counter() - wall, time.thread_time() - cpu))
        return launched

    runner.launch = timed_launch  # type: ignore[method-assign]
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))
    rates = []
    for _ in range(args.repeats):
        steps.clear()
        started = time.perf_counter()
        [completion] = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                                             ignore_eos=True))
        rate = len(completion.token_ids) / (time.perf_counter() - started)
        rates.append(rate)
        print(f"{rate:.2f} tok/s, median decode step {1000 * statistics.median(s[0] for s in steps):.1f} ms wall, "
              f"{1000 * statistics.median(s[1] for s in steps):.1f} ms thread CPU; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
    print(f"median of {args.repeats}: {statistics.median(rates):.2f} tok/s; first tokens {completion.token_ids[:8]}")
    if args.profile:
        profiling["on"] = True
        llm.generate([list(range(1000, 1100))], SamplingParams(temperature=0.0, max_tokens=PROFILE_FROM + PROFILE_STEPS
                                                               + 2, ignore_eos=True))
        averages = profiling["profiler"].key_averages  # type: ignore[union-attr]
        total = sum(e.self_cpu_time_total for e in averages()) / PROFILE_STEPS / 1000
        matmul = sum(e.self_cpu_time_total for e in averages() if "int8pack" in e.key) / PROFILE_STEPS / 1000
        print(f"per decode step: ops {total:.1f} ms (int8pack matmuls {matmul:.1f}, other ops {total - matmul:.1f}), "
              f"{sum(e.count for e in averages()) / PROFILE_STEPS:.0f} ops")
        print(averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=40))
        print(averages().table(sort_by="self_cpu_time_total", row_limit=40))


if __name__ == "__main__":
    main()
