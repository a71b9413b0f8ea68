"""Host cost per token of steady-state decode through the real actors, with a zero-cost step.

``--streams`` requests of ``--context`` random prompt ids each, ``max_tokens`` large enough that none ends in
the window, run on the real engine (scheduler actor, KV allocator over a Gemma-4-like two-group KV cache from
``bench/burst.py``, executor with overlap, request streams, telemetry) around a step function that costs no
CPU, with the server's default stream interval (4). After every request has started (prefill done), it
measures process CPU seconds per generated token over ``--seconds``; ``--profile N`` prints the top N
functions of that window by own time (cProfile).
This isolates the per-sequence, per-step cost of planning and delivering decodes (no admission, no finish).

    uv run python bench/decode_plan.py --streams 256 --context 1024
    uv run python bench/decode_plan.py --streams 256 --profile 25
    uv run python bench/decode_plan.py --streams 256 --core 200   # the planning phases alone, no actors

This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import sys
import time

import attrs
import trio

from burst import fake_parts, random_prompt  # type: ignore[import-not-found]


class GCTimer:
    """Wall seconds spent in the cyclic garbage collector, by generation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._began
            self.counts[info["generation"]] += 1


def run(streams: int, context: int, seconds: float, profile: int, seed: int, stream_interval: int,
        gc_threshold: int = 0) -> float:
    """Measured CPU microseconds per generated token (prints the profile when asked). ``gc_threshold`` > 0:
    ``gc.set_threshold(gc_threshold)`` (the young generation's allocation count between collections)."""
    from inference_server.records.requests import GenerationRequest
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.supervisor import Engine

    max_tokens = 100_000
    parts = attrs.evolve(fake_parts(streams, context + max_tokens + 16), stream_interval=stream_interval)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    requests = [GenerationRequest(params=params, prompt_ids=random_prompt(rng, context)) for _ in range(streams)]
    tokens = [0]
    started = [0]
    all_started = trio.Event()
    profiler = cProfile.Profile()
    gc_timer = GCTimer()

    async def client(engine: Engine, request: GenerationRequest) -> None:
        async with engine.submit(request) as handle:
            first = True
            async for update in handle:
                if first and update.tokens:
                    first = False
                    started[0] += 1
                    if started[0] == streams:
                        all_started.set()
                tokens[0] += len(update.tokens)

    async def main() -> tuple[float, int]:
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(Engine(parts).run)
            for request in requests:
                nursery.start_soon(client, engine, request)
            await all_started.wait()
            await trio.sleep(0.5)  # every stream in steady decode
            gc.collect()
            gc.freeze()  # as the server does after start-up
            if gc_threshold:
                gc.set_threshold(gc_threshold)
            gc.callbacks.append(gc_timer)
            count0, cpu0 = tokens[0], time.process_time()
            if profile:
                profiler.enable()
            await trio.sleep(seconds)
            if profile:
                profiler.disable()
            cpu, count = time.process_time() - cpu0, tokens[0] - count0
            gc.callbacks.remove(gc_timer)
            nursery.cancel_scope.cancel()
        return cpu, count

    cpu, count = trio.run(main)
    us = cpu / max(count, 1) * 1e6
    gc_us = sum(gc_timer.seconds) / max(count, 1) * 1e6
    print(f"streams {streams}  context {context}  tokens {count}  cpu {cpu:.2f} s  {us:.1f} us/token  "
          f"(gc {gc_us:.1f} us/token; collections by generation {gc_timer.counts})")
    if profile:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile)
        print(out.getvalue())
    return us


def run_core(streams: int, context: int, steps: int, seed: int) -> dict[str, float]:
    """The planning phases alone, on the core objects (no actors, no trio): ``streams`` running decodes over
    the Gemma-4-like KV cache; microseconds per sequence per step of each phase (median over ``steps``)."""
    import statistics

    from burst import gemma_like_kv  # type: ignore[import-not-found]
    from inference_server.core.kv_grants import allocate_step
    from inference_server.core.policies import make_policy
    from inference_server.core.request import Request
    from inference_server.core.scheduler import Scheduler, SchedulerConfig
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.records.steps import SampledToken, StepResult

    rng = random.Random(seed)
    kv = gemma_like_kv()
    scheduler = Scheduler(SchedulerConfig(max_batch_size=streams, max_num_batched_tokens=2048), make_policy("fcfs"))
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    for rid in range(streams):
        scheduler.add(Request(rid, random_prompt(rng, context), params, 0.0, rid))
    phases: dict[str, list[float]] = {"demand": [], "allocate": [], "apply_grant": [], "runner": [], "result": []}
    previous: StepResult | None = None
    for _ in range(context * streams // 2048 + 2 + steps):  # prefill everything, then ``steps`` decodes
        t0 = time.perf_counter()
        demand = scheduler.demand()
        t1 = time.perf_counter()
        grant = allocate_step(kv, demand)
        t2 = time.perf_counter()
        plan = scheduler.apply_grant(grant)
        t3 = time.perf_counter()
        assert plan is not None
        last = {} if previous is None else {t.request_id: t.token_id for t in previous.tokens}
        sequences = [(s.request_id, last[s.request_id] if s.pending else s.token_ids[-1]) for s in plan.sequences
                     if s.sample]
        t4 = time.perf_counter()
        sampled = tuple(SampledToken(rid, 506 + token % 1000, -1.0) for rid, token in sequences)
        result = StepResult(plan.step_id, sampled, plan.num_tokens, 0.0)
        if previous is not None:  # overlap: the previous step's result arrives after this plan
            scheduler.on_step_result(previous)
        t5 = time.perf_counter()
        previous = result
        if all(len(s.token_ids) == 1 for s in plan.sequences) and len(plan.sequences) == streams:
            for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                phases[name].append(seconds / streams * 1e6)
    medians = {name: statistics.median(values) for name, values in phases.items()}
    print(f"core: streams {streams}  context {context}  decode steps {len(phases['demand'])}  us/sequence/step: "
          + "  ".join(f"{name} {value:.2f}" for name, value in medians.items()))
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--profile", type=int, default=0, help="print the top N functions by own time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-interval", type=int, default=4, help="STREAM_INTERVAL (the server's default: 4)")
    parser.add_argument("--gc-threshold", type=int, default=0,
                        help="gc.set_threshold(N) for the measured window (0: Python's default, 700)")
    parser.add_argument("--core", type=int, default=0,
                        help="time the planning phases alone on the core objects for this many decode steps")
    args = parser.parse_args()
    if args.core:
        run_core(args.streams, args.context, args.core, args.seed)
        return 0
    run(args.streams, args.context, args.seconds, args.profile, args.seed, args.stream_interval, args.gc_threshold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
