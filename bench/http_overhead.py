"""CPU cost of the HTTP and actor path: streamed tokens per second with a zero-cost fake backend.

The server is the real one (``server.run_server``: Hypercorn, the Quart-Trio app, admission, scheduler, KV
allocator, executor and telemetry actors, detokenisation with the embedded Gemma 3 tokenizer), except that
the step function returns one token per sequence at once, without a model. So every CPU cycle measured is
the serving stack's. The load generator runs in a separate process: raw trio sockets, HTTP/1.1 keep-alive,
``POST /generate`` with ``stream: true`` (token-id prompts, ``ignore_eos``), a fixed number of concurrent
streams, each ``--max-tokens`` long, back to back.

For each concurrency it reports tokens/s and SSE events/s as the client received them, tokens per event
(the server's ``STREAM_INTERVAL``, and coalescing: a stream that falls behind gets several tokens per event),
the server process's CPU time per event and per token (from /proc), and what a client sees: time to first
token, the gap between two events of a stream (ITL p50/p99, one gap per event as ``vllm bench serve``
counts it) and TPOT ((last event - first event) / (tokens - 1), median over streams). Runs with coalescing on
(the default) and off (one event per token).

    uv run python bench/http_overhead.py                      # 1, 64, 256 streams; coalescing on and off
    uv run python bench/http_overhead.py --concurrency 64 --seconds 5 --coalesce on
    uv run python bench/http_overhead.py --slow-client-ms 500 --max-tokens 512   # clients that fall behind
    uv run python bench/http_overhead.py --pure-sse       # the floor: a bare Quart-Trio SSE app, no engine
    uv run python bench/http_overhead.py --engine-only    # the actor path alone, no HTTP
    uv run python bench/http_overhead.py --sinks all      # with every telemetry sink (none: without any)
    uv run python bench/http_overhead.py --coalesce on --stream-interval 1 2 4 8   # one server per interval
    uv run python bench/http_overhead.py --split          # the engine in its own process (ENGINE_PROCESS=separate)
    uv run python bench/http_overhead.py --split --stop '<end_of_turn>' '<start_of_turn>'   # a chat's stop strings

With ``--split`` the server runs its engine in a child process (``server.run_split_server``, the fake step in
the child) and the table adds each process's CPU per token: ``front µs/tok`` (HTTP, SSE, the RemoteEngine and
the telemetry sinks, detokenisation and stop strings) and ``engine µs/tok`` (admission, scheduler, KV allocator,
executor); ``µs/token`` is both together. ``--stop '<end_of_turn>' '<start_of_turn>'`` adds what Gemma's chat
template puts on every chat request (stop strings that never match here).

This is a benchmark, not a test; docs/benchmarks.md records its figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import trio

from inference_server.config import Settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for the tests' fake engine
from tests.fake_engine import FakeEngine

from kit.sse_client import SSEConnection

if TYPE_CHECKING:
    from inference_server.actors.executor import StepPipeline
    from inference_server.models.tokenizer import Tokenizer
    from inference_server.records.steps import StepPlan, StepResult
    from inference_server.supervisor import EngineParts

PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]  # "<bos>The capital of France is" in Gemma 3's vocabulary
SLOW_CLIENT_RCVBUF = 4096
SLOW_CLIENT_READ = 4096
WORD_IDS = [506, 3823, 10541, 39935, 35101, 1024, 506, 31770, 4799, 532, 1299, 1070, 919, 4171, 1500, 528, 672]


# -- server side (a child process) ---------------------------------------------------------------------------


def _small_send_buffers() -> None:
    """Accepted sockets inherit the listener's SO_SNDBUF: a small one (no autotuning) makes the server feel a
    slow client's backpressure after a few KiB instead of megabytes (slow-client runs only)."""
    import socket

    from hypercorn.config import Config

    create_sockets = Config.create_sockets

    def create_small_sockets(self: Config) -> object:
        sockets = create_sockets(self)
        for sock in sockets.insecure_sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SLOW_CLIENT_RCVBUF)
        return sockets

    Config.create_sockets = create_small_sockets  # type: ignore[method-assign]


def fake_parts(max_streams: int, step_ms: float, stream_interval: int = 1,
               stream_interval_ms: float = 100.0) -> EngineParts:
    """Engine parts around the tests' fake engine (``tests/fake_engine.py``) as a step that costs no CPU: one token
    per sampled sequence, at once.
    ``step_ms`` > 0 makes each step take that long off the event loop (like a GPU step, which the executor
    runs in a worker thread while the loop keeps serving HTTP)."""
    from inference_server.core.kv_manager import KVManager
    from inference_server.core.scheduler import SchedulerConfig
    from inference_server.supervisor import EngineParts

    tokenizer = embedded_tokenizer()
    step = FakeEngine(step_ms / 1000, token=lambda length, _last: WORD_IDS[length % len(WORD_IDS)],
                      check_contiguous=False, keep_plans=False)

    return EngineParts(
        step=positional_pipeline(step), kv=KVManager(block_size=16, num_full_blocks=16384), tokenizer=tokenizer,
        max_model_len=4096, vocab_size=262144, eos_token_ids=frozenset(tokenizer.eos_token_ids),
        scheduler_config=SchedulerConfig(max_batch_size=max_streams, max_num_batched_tokens=8192),
        max_queue_size=4 * max_streams, model_name="fake", stream_interval=stream_interval,
        stream_interval_ms=stream_interval_ms)


def positional_pipeline(step: Callable[[StepPlan], Awaitable[StepResult]]) -> StepPipeline:
    """The fake step as a pipeline that passes plans on as they are. Its tokens depend on positions only, so a
    plan's ``PENDING_TOKEN`` stand-ins (overlap) need no resolving; the served engine resolves them on the
    device (``ModelRunner._resolve_pending``), while ``FunctionPipeline`` would rebuild every pending sequence
    on the host each step, a cost of the test harness that is not the serving stack's."""
    from inference_server.actors.executor import StepPipeline

    class PositionalPipeline(StepPipeline):
        def __init__(self) -> None:
            self.results: deque[StepResult] = deque()

        async def advance(self, plan: StepPlan | None, collect: bool) -> StepResult | None:
            if plan is not None:
                self.results.append(await step(plan))
            return self.results.popleft() if collect else None

    return PositionalPipeline()


def _detach_telemetry_sinks() -> None:
    """``--sinks none``: the telemetry actor still drains every event, but feeds no sink (the baseline)."""
    from inference_server.telemetry.observability import Observability

    attach = Observability.attach.__func__  # type: ignore[attr-defined]

    def detached(cls: type[Observability], telemetry: object, *args: object, **kwargs: object) -> Observability:
        observability = attach(cls, telemetry, *args, **kwargs)
        telemetry.sinks.clear()  # type: ignore[attr-defined]
        return observability

    Observability.attach = classmethod(detached)  # type: ignore[method-assign,assignment]


def serve(coalesce: bool, max_streams: int, step_ms: float, small_send_buffers: bool, sinks: str = "default",
          stream_interval: int = 1, stream_interval_ms: float = 100.0, split: bool = False) -> int:
    """Run the real server (``run_server``, which prints its URL) on ``fake_parts``. ``sinks``: ``none`` (no
    telemetry sink), ``default`` (stats and Prometheus, as ``serve`` always has) or ``all`` (plus the SQLite
    run file, the JSONL timeline and profiler ranges, in a temporary folder). ``split``: ``run_split_server``,
    whose engine process builds ``split_fake_parts``."""
    import tempfile

    from inference_server.server import run_server, run_split_server

    if small_send_buffers:
        _small_send_buffers()
    if sinks == "none":
        _detach_telemetry_sinks()
    files = {}
    if sinks == "all":
        folder = tempfile.mkdtemp(prefix="http-overhead-telemetry-")
        files = {"telemetry_dir": folder, "timeline_dir": folder}
    settings = Settings(host="127.0.0.1", port=0, log_level="warning", max_batch_size=max_streams,
                        max_queue_size=4 * max_streams, stream_interval=stream_interval,
                        stream_interval_ms=stream_interval_ms, **files)
    if split:
        here = Path(__file__).resolve().parent
        os.environ["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])
        os.environ[STEP_MS_ENV] = str(step_ms)
        return run_split_server(settings, tokenizer=embedded_tokenizer, engine_factory="http_overhead:split_fake_parts",
                                coalesce=coalesce)
    parts = fake_parts(max_streams, step_ms, stream_interval, stream_interval_ms)
    return run_server(parts, settings, coalesce=coalesce)


STEP_MS_ENV = "HTTP_OVERHEAD_STEP_MS"


def split_fake_parts(settings: Settings) -> EngineParts:
    """The engine process's parts with ``--split``: ``fake_parts`` sized by the front's settings, the step's
    length from the environment (``HTTP_OVERHEAD_STEP_MS``)."""
    return fake_parts(settings.max_batch_size, float(os.environ.get(STEP_MS_ENV, "0")), settings.stream_interval,
                      settings.stream_interval_ms)


def embedded_tokenizer() -> Tokenizer:
    """The embedded Gemma 3 tokenizer (what ``fake_parts`` detokenises with)."""
    from inference_server.models.loading.embedded import embedded_gguf_path
    from inference_server.models.tokenizer import Tokenizer

    cache_dir = Settings().resolved_cache_dir()
    return Tokenizer.from_gguf(embedded_gguf_path(cache_dir), cache_dir=cache_dir)


def engine_only(concurrency: int, max_tokens: int, seconds: float, warmup: float, stream_interval: int = 1,
                stream_interval_ms: float = 100.0) -> Row:
    """The actor path alone (no HTTP): ``concurrency`` clients in this process, each submitting its next
    request as soon as the last one finished (``offline.collect`` reads each stream), on one running engine."""
    from inference_server.offline import collect
    from inference_server.records.requests import GenerationRequest
    from inference_server.records.sampling_params import SamplingParams
    from inference_server.supervisor import Engine

    parts = fake_parts(max(concurrency, 1), 0.0, stream_interval, stream_interval_ms)
    gc.collect()
    gc.freeze()  # as the server does once started (``server._freeze_startup_heap``): full collections scan less
    request = GenerationRequest(params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                                prompt_ids=tuple(PROMPT_IDS))
    counters = Counters()

    async def client(engine: Engine) -> None:
        while True:
            completion = await collect(engine.submit(request))
            if counters.measuring:
                counters.tokens += len(completion.token_ids)
                counters.streams += 1

    async def run() -> tuple[float, float]:
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(Engine(parts).run)
            for _ in range(concurrency):
                nursery.start_soon(client, engine)
            await trio.sleep(warmup)
            counters.measuring, t0, cpu0 = True, time.perf_counter(), time.process_time()
            await trio.sleep(seconds)
            counters.measuring, t1, cpu1 = False, time.perf_counter(), time.process_time()
            nursery.cancel_scope.cancel()
        return t1 - t0, cpu1 - cpu0

    wall, cpu = trio.run(run)
    return Row("engine", concurrency, counters.tokens / wall, 0.0, counters.streams / wall, cpu / wall, 0.0,
               float("nan"), 0, interval=stream_interval)


def serve_pure_sse() -> int:
    """The stack's floor: a bare Quart-Trio app under Hypercorn whose ``/generate`` streams ``max_tokens``
    pre-encoded one-token events and ``[DONE]``, with no engine and no per-token work of ours."""
    import json as json_module

    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve
    from quart import Response, request
    from quart_trio import QuartTrio

    app = QuartTrio("pure-sse")
    app.config["RESPONSE_TIMEOUT"] = None
    event = b'data: {"token_ids":[506],"text":" the"}\n\n'

    @app.post("/generate")
    async def generate() -> Response:
        count = json_module.loads(await request.get_data())["max_tokens"]

        async def body() -> AsyncIterator[bytes]:
            for _ in range(count):
                yield event
            yield b"data: [DONE]\n\n"

        return Response(body(), content_type="text/event-stream")

    async def run() -> None:
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(hypercorn_serve, app, config)
            print(f"listening on {binds[0]}", flush=True)

    trio.run(run)
    return 0


# -- load generator --------------------------------------------------------------------------------------------


@attrs.define
class Counters:
    measuring: bool = False
    tokens: int = 0
    events: int = 0
    streams: int = 0
    errors: int = 0
    first_token_latencies: list[float] = attrs.Factory(list)
    event_gaps: list[float] = attrs.Factory(list)  # between consecutive token events of one stream (ITL seen)
    per_token_times: list[float] = attrs.Factory(list)  # (last event - first event) / (tokens - 1), per stream


def count_tokens(event: bytes) -> int:
    """Tokens in a native event ``data: {"token_ids":[...],...}`` without decoding the JSON (client CPU is the
    scarcer resource here: both processes share two cores)."""
    start = event.index(b"[", event.index(b'"token_ids"')) + 1
    end = event.index(b"]", start)
    return 0 if end == start else event.count(b",", start, end) + 1


async def generate(connection: SSEConnection, body: bytes, counters: Counters) -> None:
    """One streamed ``/generate`` request on ``connection``; its events are counted into ``counters``."""
    started = time.perf_counter()
    first, last_event, first_event, tokens_seen = True, 0.0, 0.0, 0

    def on_event(payload: bytes) -> None:
        nonlocal first, last_event, first_event, tokens_seen
        if payload == b"[DONE]":
            return
        tokens = count_tokens(payload)
        now = time.perf_counter()
        if counters.measuring:
            counters.events += 1
            counters.tokens += tokens
            if first:
                counters.first_token_latencies.append(now - started)
            else:
                counters.event_gaps.append(now - last_event)
        if first:
            first_event = now
        last_event, first, tokens_seen = now, False, tokens_seen + tokens

    response = await connection.post("/generate", body, on_event)
    if response.status != 200:
        counters.errors += 1
        raise ConnectionError(response.head.split(b"\r\n")[0].decode())
    if counters.measuring:
        counters.streams += 1
        if tokens_seen > 1:
            counters.per_token_times.append((last_event - first_event) / (tokens_seen - 1))


async def client_loop(host: str, port: int, body: bytes, counters: Counters, read_interval: float) -> None:
    # A slow client: a small receive window, read in small pieces at intervals, so the server's socket writes
    # block and its tokens pile up (coalescing territory).
    connection = SSEConnection(host, port, read_interval=read_interval,
                               rcvbuf=SLOW_CLIENT_RCVBUF if read_interval else 0,
                               read_size=SLOW_CLIENT_READ if read_interval else 65536)
    try:
        while True:
            try:
                await generate(connection, body, counters)
            except (ConnectionError, trio.BrokenResourceError, ValueError):
                await connection.close()
    finally:
        await connection.close()


def server_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_child(pid: int) -> int | None:
    """The split server's engine process (the front's only child), or None when it has none."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0]) if len(children) == 1 else None


@attrs.frozen
class Row:
    server: str  # "on"/"off": our server with coalescing on/off; "bare": the bare Quart-Trio SSE app
    concurrency: int
    tokens_per_s: float
    events_per_s: float
    streams_per_s: float
    server_cpu: float  # fraction of one core
    client_cpu: float
    ttft_p50_ms: float
    errors: int
    itl_p50_ms: float = float("nan")  # gap between consecutive events of a stream, as a client sees it
    itl_p99_ms: float = float("nan")
    tpot_ms: float = float("nan")  # median per stream of (last event - first event) / (tokens - 1)
    interval: int = 1  # the server's STREAM_INTERVAL (tokens per event after the first)
    engine_cpu: float | None = None  # --split: the engine process's share of server_cpu (fraction of one core)

    @property
    def tokens_per_event(self) -> float:
        return self.tokens_per_s / self.events_per_s if self.events_per_s else 0.0

    @property
    def us_per_event(self) -> float:
        return self.server_cpu / self.events_per_s * 1e6 if self.events_per_s else 0.0

    @property
    def us_per_token(self) -> float:
        return self.server_cpu / self.tokens_per_s * 1e6 if self.tokens_per_s else 0.0

    def split_us_per_token(self) -> tuple[float, float] | None:
        """(front, engine) µs of CPU per token with ``--split``."""
        if self.engine_cpu is None or not self.tokens_per_s:
            return None
        return ((self.server_cpu - self.engine_cpu) / self.tokens_per_s * 1e6,
                self.engine_cpu / self.tokens_per_s * 1e6)


async def measure(host: str, port: int, pid: int, concurrency: int, max_tokens: int, seconds: float,
                  warmup: float, server: str, read_interval: float = 0.0, interval: int = 1,
                  stop: tuple[str, ...] = ()) -> Row:
    body = json.dumps({"prompt_token_ids": PROMPT_IDS, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True, **({"stop": list(stop)} if stop else {})}).encode()
    counters = Counters()
    engine = engine_child(pid)  # --split: measured beside the front; its CPU is part of the server's
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client_loop, host, port, body, counters, read_interval)
        await trio.sleep(warmup)
        counters.measuring, cpu0, t0, c0 = True, server_cpu_seconds(pid), time.perf_counter(), time.process_time()
        engine0 = server_cpu_seconds(engine) if engine is not None else 0.0
        await trio.sleep(seconds)
        counters.measuring, cpu1, t1, c1 = False, server_cpu_seconds(pid), time.perf_counter(), time.process_time()
        engine1 = server_cpu_seconds(engine) if engine is not None else 0.0
        nursery.cancel_scope.cancel()
    wall = t1 - t0
    engine_cpu = (engine1 - engine0) / wall if engine is not None else None
    return Row(server, concurrency, counters.tokens / wall, counters.events / wall, counters.streams / wall,
               (cpu1 - cpu0) / wall + (engine_cpu or 0.0), (c1 - c0) / wall,
               quantile_ms(counters.first_token_latencies, 0.5), counters.errors,
               quantile_ms(counters.event_gaps, 0.5), quantile_ms(counters.event_gaps, 0.99),
               quantile_ms(counters.per_token_times, 0.5), interval, engine_cpu)


def quantile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if ordered else float("nan")


def start_server(coalesce: bool, max_streams: int, step_ms: float, slow_clients: bool, pure_sse: bool,
                 sinks: str = "default", stream_interval: int = 1, stream_interval_ms: float = 100.0,
                 split: bool = False) -> tuple[subprocess.Popen, str, int]:
    command = [sys.executable, __file__, "--serve", "--coalesce", "on" if coalesce else "off",
               "--max-streams", str(max_streams), "--step-ms", str(step_ms), "--sinks", sinks,
               "--stream-interval", str(stream_interval), "--stream-interval-ms", str(stream_interval_ms)]
    command += (["--slow-client-ms", "1"] if slow_clients else []) + (["--pure-sse"] if pure_sse else [])
    command += ["--split"] if split else []
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if "listening on http://" in line:
            host, port = line.rsplit("http://", 1)[1].strip().rsplit(":", 1)
            return process, host, int(port)
    raise RuntimeError("the benchmark server did not start")


def print_table(rows: list[Row], max_tokens: int, step_ms: float) -> None:
    print(f"\nstreams of {max_tokens} tokens, fake step {step_ms:g} ms; server: on/off = coalescing on/off, bare = "
          "bare Quart-Trio SSE app; interval = STREAM_INTERVAL; CPU = fraction of one core; ITL = gap between "
          "a stream's events; TPOT = (last - first event) / (tokens - 1); front/engine µs/tok: --split's two "
          "processes (server CPU and µs/token are both together)")
    header = (f"{'server':>8} {'interval':>8} {'streams':>7} {'tokens/s':>9} {'events/s':>9} {'tok/event':>9} "
              f"{'streams/s':>9} {'server CPU':>10} {'client CPU':>10} {'µs/event':>9} {'µs/token':>9} "
              f"{'TTFT p50':>9} {'ITL p50':>9} {'ITL p99':>9} {'TPOT':>9} {'front µs/tok':>12} "
              f"{'engine µs/tok':>13}")
    print(header)
    print("-" * len(header))
    for r in rows:
        has_events = r.events_per_s > 0
        cells = [f"{r.server:>8}", f"{r.interval:>8}", f"{r.concurrency:>7}", f"{r.tokens_per_s:>9.0f}",
                 f"{r.events_per_s:>9.0f}" if has_events else f"{'-':>9}",
                 f"{r.tokens_per_event:>9.2f}" if has_events else f"{'-':>9}", f"{r.streams_per_s:>9.1f}",
                 f"{r.server_cpu:>10.2f}", f"{r.client_cpu:>10.2f}" if has_events else f"{'-':>10}",
                 f"{r.us_per_event:>9.1f}" if has_events else f"{'-':>9}", f"{r.us_per_token:>9.1f}",
                 *(f"{ms:>7.1f}ms" if has_events else f"{'-':>9}"
                   for ms in (r.ttft_p50_ms, r.itl_p50_ms, r.itl_p99_ms, r.tpot_ms))]
        split = r.split_us_per_token()
        cells += [f"{split[0]:>12.1f}", f"{split[1]:>13.1f}"] if split is not None else [f"{'-':>12}", f"{'-':>13}"]
        print(" ".join(cells) + (f"  ({r.errors} errors)" if r.errors else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--coalesce", choices=["on", "off", "both"], default="both")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per concurrency")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="wall time of one fake step, spent off the event loop like a GPU step (0: none)")
    parser.add_argument("--slow-client-ms", type=float, default=0.0,
                        help="slow clients: each reads 4 KiB every this many ms, through 4 KiB socket buffers on "
                             "both sides (0: clients read at full speed)")
    parser.add_argument("--engine-only", action="store_true",
                        help="measure the actor path alone instead, in this process (no HTTP, no sockets)")
    parser.add_argument("--pure-sse", action="store_true",
                        help="measure the stack's floor instead: a bare Quart-Trio SSE app, no engine")
    parser.add_argument("--sinks", choices=["none", "default", "all"], default="default",
                        help="telemetry sinks on the server: none; default (stats and Prometheus, as serve has); "
                             "all (plus the SQLite run file, the JSONL timeline and profiler ranges)")
    parser.add_argument("--stream-interval", type=int, nargs="+", default=[Settings().stream_interval],
                        help="the server's STREAM_INTERVAL (tokens per event after the first); several: one server "
                             "each (default: the server's default)")
    parser.add_argument("--stream-interval-ms", type=float, default=Settings().stream_interval_ms,
                        help="the server's STREAM_INTERVAL_MS (the longest a token is held back)")
    parser.add_argument("--stop", nargs="+", default=[], metavar="STRING",
                        help="stop strings on every request, e.g. a chat template's '<end_of_turn>' "
                             "'<start_of_turn>' (the fake tokens never match them: the cost of looking)")
    parser.add_argument("--split", action="store_true",
                        help="the server with its engine in a child process (ENGINE_PROCESS=separate); reports each "
                             "process's CPU per token")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-streams", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        if args.pure_sse:
            return serve_pure_sse()
        return serve(args.coalesce == "on", args.max_streams, args.step_ms, args.slow_client_ms > 0, args.sinks,
                     args.stream_interval[0], args.stream_interval_ms, args.split)
    rows = []
    if args.engine_only:
        rows = [engine_only(c, args.max_tokens, args.seconds, args.warmup, interval, args.stream_interval_ms)
                for interval in args.stream_interval for c in args.concurrency]
        print_table(rows, args.max_tokens, 0.0)
        return 0
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.coalesce]
    servers = [(c, i) for c in modes for i in args.stream_interval] if not args.pure_sse else [(False, 1)]
    for coalesce, interval in servers:
        process, host, port = start_server(coalesce, max(args.concurrency), args.step_ms, args.slow_client_ms > 0,
                                           args.pure_sse, args.sinks, interval, args.stream_interval_ms,
                                           args.split and not args.pure_sse)
        try:
            for concurrency in args.concurrency:
                row = trio.run(measure, host, port, process.pid, concurrency, args.max_tokens, args.seconds,
                               args.warmup, "bare" if args.pure_sse else ("on" if coalesce else "off")
                               + ("/split" if args.split else ""),
                               args.slow_client_ms / 1000, interval, tuple(args.stop))
                rows.append(row)
                print_table([row], args.max_tokens, args.step_ms)
        finally:
            process.terminate()
            process.wait(30)
    print_table(rows, args.max_tokens, args.step_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
