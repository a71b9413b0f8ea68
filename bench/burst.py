"""Host cost of a burst of arrivals: one wave of requests finishing while the next wave arrives.

The H200 serving run (``bench/results``: 200 requests of 512 random prompt ids / 512 output tokens at
concurrency 100) runs as two synchronised waves; between them the device sat idle for seconds. This
benchmark reproduces that boundary on the CPU with a zero-cost step function (no model: one token per
sampled sequence at once), so every second it measures is host time of the serving stack:

* ``--mode engine`` (default): the real engine (admission, scheduler, KV allocator with a Gemma-4-like
  two-group KV cache, executor, telemetry) in this process; ``--clients`` clients each submit two requests
  back to back. It prints the wave boundary (first request of wave 1 done -> last request of wave 2 has its
  first token), the steps and host seconds inside it, and (``--profile``) a cProfile of that window only.
* ``--mode phases``: each phase of a wave boundary timed alone on the real components: admitting the wave
  (validation, detokenizer priming), queueing it in the scheduler, the allocator's grant for every prefill
  step (prefix-cache match and insert), staging the prefill steps' tensors (``ModelRunner._step_tensors`` on
  CPU tensors), finishing the old wave (releases into the prefix cache) and its telemetry.

    uv run python bench/burst.py                    # engine mode, 100 clients x 2 waves of 512/512
    uv run python bench/burst.py --profile 25       # plus the top 25 functions of the boundary by own time
    uv run python bench/burst.py --mode phases

This is a benchmark, not a test; docs/benchmarks.md records its figures.
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
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from inference_server.core.kv_manager import KVManager
from inference_server.core.scheduler import SchedulerConfig
from inference_server.supervisor import EngineParts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for the tests' fake engine
from tests.fake_engine import FakeEngine

VOCAB_SIZE = 262144
BLOCK_SIZE = 16
WINDOW = 1024  # Gemma-4-26B-A4B's sliding window
FULL_BLOCKS = 40_000  # the H200 holds tens of thousands of blocks per group
SLIDING_BLOCKS = 20_000
STEP_TOKENS = 2048  # the CUDA step token budget


def gemma_like_kv() -> KVManager:
    return KVManager(block_size=BLOCK_SIZE, num_full_blocks=FULL_BLOCKS, num_sliding_blocks=SLIDING_BLOCKS,
                     sliding_window=WINDOW)


def fake_parts(clients: int, max_model_len: int) -> EngineParts:
    """The real engine's parts around a zero-cost step (as ``bench/http_overhead.py``), with a Gemma-4-like
    KV cache and the CUDA step budget."""
    from inference_server.config import Settings
    from inference_server.models.loading.embedded import embedded_gguf_path
    from inference_server.models.tokenizer import Tokenizer

    cache_dir = Settings().resolved_cache_dir()
    tokenizer = Tokenizer.from_gguf(embedded_gguf_path(cache_dir), cache_dir=cache_dir)
    step = FakeEngine(token=lambda length, _last: 506 + length % 1000, check_contiguous=False, keep_plans=False)

    return EngineParts(
        step=step, kv=gemma_like_kv(), tokenizer=tokenizer, max_model_len=max_model_len, vocab_size=VOCAB_SIZE,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        scheduler_config=SchedulerConfig(max_batch_size=max(clients, 1), max_num_batched_tokens=STEP_TOKENS),
        max_queue_size=4 * clients, max_queued_tokens=1_000_000, model_name="fake")


def random_prompt(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1000, 200_000) for _ in range(length))


# -- engine mode ---------------------------------------------------------------------------------------------


@attrs.define
class Timings:
    submitted: list[float] = attrs.Factory(list)
    first_token: list[float] = attrs.Factory(list)
    finished: list[float] = attrs.Factory(list)
    ttft: list[float] = attrs.Factory(list)  # per request: first token - submitted


def run_engine(clients: int, prompt_len: int, output_len: int, profile: int, seed: int, gc_freeze: bool) -> None:
    from inference_server.records.requests import GenerationRequest
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.supervisor import Engine

    parts = fake_parts(clients, prompt_len + output_len + 16)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    waves = [[GenerationRequest(params=params, prompt_ids=random_prompt(rng, prompt_len)) for _ in range(clients)]
             for _ in range(2)]
    timings = [Timings(), Timings()]
    profiler = cProfile.Profile()
    window: dict[str, float] = {}
    steps: list[float] = []
    inner_step = parts.step

    async def counted_step(plan):  # type: ignore[no-untyped-def]
        steps.append(time.perf_counter())
        return await inner_step(plan)

    parts = attrs.evolve(parts, step=counted_step)

    def boundary_begins() -> None:
        if "begin" not in window:
            window["begin"] = time.perf_counter()
            window["cpu0"] = time.process_time()
            if profile:
                profiler.enable()

    def boundary_ends() -> None:
        window["end"] = time.perf_counter()
        window["cpu1"] = time.process_time()
        if profile:
            profiler.disable()

    async def client(engine: Engine, index: int) -> None:
        for wave in range(2):
            handle = engine.submit(waves[wave][index])
            submitted = time.perf_counter()
            timings[wave].submitted.append(submitted)
            async with handle:
                await handle.admission()
                first = True
                async for _update in handle:
                    if first:
                        timings[wave].first_token.append(time.perf_counter())
                        timings[wave].ttft.append(timings[wave].first_token[-1] - submitted)
                        first = False
                        if wave == 1 and len(timings[1].first_token) == clients:
                            boundary_ends()
            timings[wave].finished.append(time.perf_counter())
            if wave == 0:
                boundary_begins()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(Engine(parts).run)
            if gc_freeze:  # what a server could do once started: start-up objects leave the collected heap
                gc.freeze()
            started, cpu_started = time.perf_counter(), time.process_time()
            async with trio.open_nursery() as group:
                for index in range(clients):
                    group.start_soon(client, engine, index)
            window["total"], window["total_cpu"] = time.perf_counter() - started, time.process_time() - cpu_started
            nursery.cancel_scope.cancel()

    collections: list[tuple[int, float]] = []  # (generation, seconds) of every garbage collection
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - gc_started[0]))

    gc.callbacks.append(on_gc)
    trio.run(main)
    gc.callbacks.remove(on_gc)
    begin, end = window["begin"], window["end"]
    in_window = [t for t in steps if begin <= t <= end]
    wave1 = timings[0]
    print(f"{clients} clients x 2 waves, {prompt_len} prompt / {output_len} output tokens, zero-cost step, "
          f"budget {STEP_TOKENS} tokens/step; whole run {window['total']:.2f} s ({window['total_cpu']:.2f} s CPU), "
          f"{len(steps)} steps")
    print(f"wave 1: finishes spread over {1e3 * (max(wave1.finished) - min(wave1.finished)):.1f} ms")
    print(f"wave boundary (first wave-1 finish -> last wave-2 first token): {1e3 * (end - begin):.1f} ms wall, "
          f"{1e3 * (window['cpu1'] - window['cpu0']):.1f} ms CPU, {len(in_window)} steps "
          f"(ideal: {-(-clients * prompt_len // STEP_TOKENS)} prefill steps)")
    full = [seconds for generation, seconds in collections if generation == 2]
    print(f"garbage collections in the whole run: {len(collections)} ({1e3 * sum(s for _, s in collections):.1f} ms), "
          f"of which full: {len(full)} ({1e3 * sum(full):.1f} ms, longest {1e3 * max(full, default=0.0):.1f} ms)")
    ttft = sorted(timings[1].ttft)
    if ttft:
        print(f"wave-2 TTFT (host only): median {1e3 * ttft[len(ttft) // 2]:.1f} ms, max {1e3 * ttft[-1]:.1f} ms")
    if profile:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile)
        print(out.getvalue())
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(profile)
        print(out.getvalue())


# -- phases mode -----------------------------------------------------------------------------------------------


def timed(label: str, results: list[tuple[str, float]], function: Callable[[], object]) -> object:
    """Run ``function`` and record this thread's CPU time for it (not wall time: the figures should not
    depend on what else the machine runs)."""
    started = time.thread_time()
    value = function()
    results.append((label, time.thread_time() - started))
    return value


def run_phases(clients: int, prompt_len: int, output_len: int, seed: int, profile: int, gc_freeze: bool) -> None:
    from inference_server.actors.admission import Admission, Submission
    from inference_server.actors.request_streams import RequestStreams
    from inference_server.actors.telemetry import Telemetry
    from inference_server.backends.model_runner import ModelRunner
    from inference_server.core.kv_grants import allocate_step
    from inference_server.core.policies import make_policy
    from inference_server.core.scheduler import Scheduler
    from inference_server.records.requests import GenerationRequest
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.records.steps import SampledToken, StepResult
    from inference_server.supervisor import kv_limits
    from inference_server.telemetry.events import FirstToken, RequestFinished, RequestQueued, RequestStarted
    from inference_server.telemetry.observability import Observability

    parts = fake_parts(clients, prompt_len + output_len + 16)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    results: list[tuple[str, float]] = []
    scheduler = Scheduler(parts.scheduler_config, make_policy("fcfs"))
    kv = parts.kv
    streams = RequestStreams()
    events: list[object] = []
    admission = Admission(trio.open_memory_channel(0)[1], trio.open_memory_channel(0)[0], streams, parts.tokenizer,
                          max_model_len=parts.max_model_len, vocab_size=VOCAB_SIZE,
                          eos_token_ids=parts.eos_token_ids, admission_timeout=60.0, kv_limits=kv_limits(parts),
                          emit=events.append)
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.num_groups, runner.device = BLOCK_SIZE, 2, __import__("torch").device("cpu")

    prompts = {first_id: [random_prompt(rng, prompt_len) for _ in range(clients)] for first_id in (1, 1 + clients)}
    if gc_freeze:  # as the server does once started (server._freeze_startup_heap)
        gc.collect()
        gc.freeze()

    def wave(first_id: int) -> list:  # type: ignore[type-arg]
        requests = []
        for i, prompt in enumerate(prompts[first_id]):
            streams.open(first_id + i)
            submission = Submission(first_id + i, GenerationRequest(params=params, prompt_ids=prompt), 0.0)
            requests.append(admission.admit(submission))
        return requests

    def queue(requests: list) -> None:  # type: ignore[type-arg]
        for request in requests:
            # what SchedulerActor._handle does per arrival: the overload sum over the queue, then add
            queued = sum(len(r.prompt_ids) for r in scheduler.waiting)
            assert queued < 10**9
            streams.admitted(request.request_id, request.prompt_ids)
            scheduler.add(request)

    def prefill_steps() -> list:  # type: ignore[type-arg]
        plans = []
        while scheduler.waiting or any(r.num_uncomputed > 1 for r in scheduler.running):
            plan = scheduler.apply_grant(allocate_step(kv, scheduler.demand()))
            assert plan is not None
            plans.append(plan)
            scheduler.on_step_result(StepResult(plan.step_id, tuple(
                SampledToken(s.request_id, 506, -1.0) for s in plan.sequences if s.sample), plan.num_tokens, 0.0))
        return plans

    release_seconds = [0.0, 0]

    def decode_to_end() -> None:
        while scheduler.running or scheduler.has_pending_releases:
            demand = scheduler.demand()
            if demand.releases:  # the finished requests' KV goes back (into the prefix cache)
                started = time.thread_time()
                allocate_step(kv, attrs.evolve(demand, items=()))
                release_seconds[0] += time.thread_time() - started
                release_seconds[1] += len(demand.releases)
                demand = attrs.evolve(demand, releases=())
            plan = scheduler.apply_grant(allocate_step(kv, demand))
            if plan is None:
                break
            assert plan is not None
            scheduler.on_step_result(StepResult(plan.step_id, tuple(
                SampledToken(s.request_id, 506, -1.0) for s in plan.sequences if s.sample), plan.num_tokens, 0.0))

    first = wave(1)
    queue(first)
    prefill_steps()
    decode_to_end()  # wave 1 runs to its end; its releases are timed
    results.append((f"allocator: release wave 1 ({release_seconds[1]} x {prompt_len + output_len} tokens into "
                    "the prefix cache)", release_seconds[0]))
    telemetry = Telemetry()
    Observability(telemetry, "fake", start_time=0.0)  # the default sinks: stats and Prometheus metrics
    wave_events = [event for r in first for event in (
        RequestQueued(0.0, r.request_id, prompt_len, None, None, 0), RequestStarted(0.0, r.request_id, 0),
        FirstToken(0.0, r.request_id, 0.1), RequestFinished(0.0, r.request_id, "length", prompt_len, output_len, 0,
                                                             1.0, 0.1, None, None, None))]
    timed("telemetry: 4 events per request (default sinks)", results,
          lambda: [telemetry._deliver(event) for event in wave_events])
    second = timed("admission: validate + detokenizer (wave)", results, lambda: wave(1 + clients))
    timed("scheduler: overload sum + add (wave)", results, lambda: queue(second))  # type: ignore[arg-type]
    demand = timed("scheduler: first demand()", results, scheduler.demand)
    grant = timed("allocator: first grant (prefix match + insert)", results, lambda: allocate_step(kv, demand))  # type: ignore[arg-type]
    plan = scheduler.apply_grant(grant)  # type: ignore[arg-type]
    assert plan is not None
    scheduler.on_step_result(StepResult(plan.step_id, tuple(
        SampledToken(s.request_id, 506, -1.0) for s in plan.sequences if s.sample), plan.num_tokens, 0.0))
    profiler = cProfile.Profile()
    profiler.enable()
    plans = [plan, *timed("scheduler+allocator: remaining prefill steps", results, prefill_steps)]  # type: ignore[misc]
    profiler.disable()
    if profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    timed(f"staging: _step_tensors x {len(plans)} steps", results,
          lambda: [ModelRunner._step_tensors(runner, p) for p in plans])
    total = sum(seconds for _, seconds in results)
    print(f"{clients} requests of {prompt_len} prompt tokens arriving as {clients} others of "
          f"{prompt_len}+{output_len} finish; {len(plans)} prefill steps of <= {STEP_TOKENS} tokens; CPU ms")
    for label, seconds in results:
        print(f"  {label:<48} {1e3 * seconds:9.1f} ms")
    print(f"  {'total':<48} {1e3 * total:9.1f} ms")


# -- http mode -------------------------------------------------------------------------------------------------


def serve(clients: int, prompt_len: int, output_len: int, profile_path: str) -> int:
    """The real server (``run_server``) on the fake parts; prints its URL. With ``profile_path``, a cProfile
    of the whole run is written there when the server stops (SIGTERM)."""
    import signal

    from inference_server.config import Settings
    from inference_server.server import run_server

    settings = Settings(host="127.0.0.1", port=0, log_level="warning", max_batch_size=clients,
                        max_queue_size=4 * clients, max_num_batched_tokens=STEP_TOKENS)
    profiler = cProfile.Profile()
    if profile_path:
        signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
        signal.signal(signal.SIGUSR2, lambda *_: (profiler.disable(), profiler.dump_stats(profile_path)))
    return run_server(fake_parts(clients, prompt_len + output_len + 16), settings)


async def stream_completion(stream: trio.SocketStream, host: str, body: bytes,
                            on_first: Callable[[], None]) -> tuple[float, float]:
    """POST one streaming ``/v1/completions`` on a keep-alive connection; (first-token time, end time)."""
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    await stream.send_all(request)
    buffer, first = b"", 0.0
    while not buffer.endswith(b"0\r\n\r\n"):
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("server closed the connection")
        if not first and b'"text"' in data:
            first = time.perf_counter()
            on_first()
        buffer = data[-8:] if len(data) >= 8 else buffer + data
    return first, time.perf_counter()


def run_http(clients: int, prompt_len: int, output_len: int, seed: int, profile: int) -> None:
    import json
    import signal
    import subprocess
    import tempfile

    profile_path = tempfile.mktemp(suffix=".prof") if profile else ""
    command = [sys.executable, __file__, "--serve", "--clients", str(clients), "--prompt-len", str(prompt_len),
               "--output-len", str(output_len), "--profile-path", profile_path]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if "listening on http://" in line:
            host, port = line.rsplit("http://", 1)[1].strip().rsplit(":", 1)
            break
    else:
        raise RuntimeError("the benchmark server did not start")
    rng = random.Random(seed)
    bodies = [[json.dumps({"model": "fake", "prompt": list(random_prompt(rng, prompt_len)), "max_tokens": output_len,
                           "ignore_eos": True, "temperature": 0, "stream": True}).encode() for _ in range(clients)]
              for _ in range(2)]
    timings = [Timings(), Timings()]
    window: dict[str, float] = {}

    first_tokens = [0]

    def first_token_seen() -> None:
        first_tokens[0] += 1
        if first_tokens[0] == 2 * clients and profile:
            process.send_signal(signal.SIGUSR2)  # the last wave-2 first token: the boundary's profile ends

    async def client(index: int) -> None:
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            for wave in range(2):
                submitted = time.perf_counter()
                timings[wave].submitted.append(submitted)
                first, end = await stream_completion(stream, host, bodies[wave][index], first_token_seen)
                timings[wave].first_token.append(first)
                timings[wave].ttft.append(first - submitted)
                timings[wave].finished.append(end)
                if wave == 0 and "begin" not in window:
                    window["begin"] = time.perf_counter()
                    if profile:
                        process.send_signal(signal.SIGUSR1)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for index in range(clients):
                nursery.start_soon(client, index)

    try:
        started = time.perf_counter()
        trio.run(main)
        total = time.perf_counter() - started
    finally:
        time.sleep(1 if profile else 0)  # the server writes its profile
        process.terminate()
        process.wait(30)
    begin = window["begin"]
    last_first = max(timings[1].first_token)
    print(f"HTTP /v1/completions, {clients} clients x 2 waves, {prompt_len}/{output_len} tokens, zero-cost step; "
          f"whole run {total:.2f} s")
    print(f"wave 1: finishes spread over {1e3 * (max(timings[0].finished) - min(timings[0].finished)):.1f} ms")
    print(f"wave boundary (first wave-1 finish -> last wave-2 first token): {1e3 * (last_first - begin):.1f} ms")
    ttft = sorted(timings[1].ttft)
    print(f"wave-2 TTFT: median {1e3 * ttft[len(ttft) // 2]:.1f} ms, max {1e3 * ttft[-1]:.1f} ms")
    if profile:
        out = io.StringIO()
        stats = pstats.Stats(profile_path, stream=out)
        stats.sort_stats("tottime").print_stats(profile)
        stats.sort_stats("cumulative").print_stats(profile)
        print(out.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["engine", "phases", "http"], default="engine")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--profile", type=int, default=0, help="print this many cProfile rows of the boundary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() once the engine is built (as the server does)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.clients, args.prompt_len, args.output_len, args.profile_path)
    if args.mode == "http":
        run_http(args.clients, args.prompt_len, args.output_len, args.seed, args.profile)
        return 0
    if args.mode == "engine":
        run_engine(args.clients, args.prompt_len, args.output_len, args.profile, args.seed, args.gc_freeze)
    else:
        run_phases(args.clients, args.prompt_len, args.output_len, args.seed, args.profile, args.gc_freeze)
    return 0


if __name__ == "__main__":
    sys.exit(main())
