"""Host cost per token of steady-state decode through the real actors, with a zero-cost step.

``--streams`` requests of ``--context`` random prompt ids each, ``max_tokens`` large enough that none ends in
the window, run on the real engine (scheduler actor, KV allocator over a Gemma-4-like two-group KV cache from
``bench/burst.py``, executor with overlap, request streams, telemetry) around a step function that costs no
CPU. After every request has started (prefill done), it measures process CPU seconds per generated token
over ``--seconds``; ``--profile N`` prints the top N functions of that window by own time (cProfile).
This isolates the per-sequence, per-step cost of planning and delivering decodes (no admission, no finish).

    uv run python bench/decode_plan.py --streams 256 --context 1024
    uv run python bench/decode_plan.py --streams 256 --profile 25

This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time

import trio

from burst import fake_parts, random_prompt  # type: ignore[import-not-found]


def run(streams: int, context: int, seconds: float, profile: int, seed: int) -> float:
    """Measured CPU microseconds per generated token (prints the profile when asked)."""
    from inference_server.records.requests import GenerationRequest
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.supervisor import Engine

    max_tokens = 100_000
    parts = fake_parts(streams, context + max_tokens + 16)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    requests = [GenerationRequest(params=params, prompt_ids=random_prompt(rng, context)) for _ in range(streams)]
    tokens = [0]
    started = [0]
    all_started = trio.Event()
    profiler = cProfile.Profile()

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
            count0, cpu0 = tokens[0], time.process_time()
            if profile:
                profiler.enable()
            await trio.sleep(seconds)
            if profile:
                profiler.disable()
            cpu, count = time.process_time() - cpu0, tokens[0] - count0
            nursery.cancel_scope.cancel()
        return cpu, count

    cpu, count = trio.run(main)
    us = cpu / max(count, 1) * 1e6
    print(f"streams {streams}  context {context}  tokens {count}  cpu {cpu:.2f} s  {us:.1f} us/token")
    if profile:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile)
        print(out.getvalue())
    return us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--profile", type=int, default=0, help="print the top N functions by own time")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    run(args.streams, args.context, args.seconds, args.profile, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
