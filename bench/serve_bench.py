#!/usr/bin/env python3
"""Serving benchmark: an OpenAI-streaming load generator that reports what ``vllm bench serve`` reports, plus the
GPU's busy fraction and the server's CPU per thread during the run.

Workload: ``--num-prompts`` prompts of random token ids (seeded; lengths ``--input-len`` / ``--output-len``,
each drawn uniformly from ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` as vLLM's random dataset does),
sent as streaming ``POST /v1/completions`` (prompt as a list of token ids, ``max_tokens``, ``ignore_eos``,
``temperature 0``, ``stream_options.include_usage``, vLLM's ``return_token_ids``) or the native ``/generate``.
Arrivals: all at once (``--request-rate inf``, the default) or Poisson at ``--request-rate`` per second; at most
``--concurrency`` in flight (0: no cap). ``--warmup N`` requests run first, at the same concurrency, on other
prompts (``--warmup-output-len`` tokens out each), and are not counted.

    uv run python bench/serve_bench.py --url http://127.0.0.1:8000 --input-len 512 --output-len 512 \\
        --num-prompts 200 --concurrency 100 --warmup 8 --json result.json
    uv run python bench/serve_bench.py --port 8000 --request-rate 4 --concurrency 32 --num-prompts 64
    uv run python bench/serve_bench.py --port 8000 --endpoint /generate --input-len 8 --output-len 4 \\
        --num-prompts 4 --concurrency 2

Metrics (per request; ms; mean / median / p99 over requests, or over samples for ITL; percentiles interpolate
linearly like numpy's default):

* TTFT: from just before the request is written to the first event that carries a token.
* E2EL: from the same start to the last event that carries a token (vLLM: the last content chunk).
* TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token (vLLM's definition).
* ITL (per token): the gap between consecutive token-carrying events, split evenly over the tokens the later
  event carries (an event with k tokens after a gap g gives k samples of g / k); the first event's extra tokens
  give samples of 0. So each request gives exactly output tokens - 1 samples whose sum is E2EL - TTFT: its mean
  ITL equals its TPOT. vLLM appends one sample per chunk whatever it carries (it assumes one token per chunk);
  that figure is reported too, as ``event_itl`` (the gaps between token-carrying events), beside the mean
  tokens per event. The two agree when the server sends one token per event; they differ when it coalesces.
* Output tokens: the usage chunk's ``completion_tokens`` (else the counted tokens); total token throughput adds
  the prompt tokens. Duration: from the first request's start to the last request's end (warm-up excluded).
* GPU: NVML busy fraction (median and mean of 0.1 s samples, and the samples themselves in the JSON: idle
  stretches show there) and mean power, n/a without ``pynvml``.
* Server CPU: cores used per thread of the server process (and its children), from /proc; the server's pid is
  ``--server-pid`` or the process listening on the URL's port (local servers only).
* Client CPU: this process's CPU time over the duration; above ~0.8 the client may be what limits the run.

``--json-schema``: every measured request carries ``response_format`` json_schema (``/generate``: SGLang's
``json_schema``) with ``bench_schema(output_len)``, which cannot complete before ``max_tokens``: the same
lengths as an unconstrained run, every token masked (``serving_table.py --json-schema`` runs both).

``--dataset shared-prefix`` (multi-turn chat with long system prompts, what prefix-aware routing is for):
``--num-sessions`` sessions, each on one of ``--num-groups`` system prompts of ``--system-len`` random tokens
(session ``k`` uses prompt ``k % groups``), each running ``--turns`` turns one after another: turn ``t``'s prompt
is the system prompt, then every earlier turn's user message (``--user-len`` tokens) and answer
(``--output-len`` tokens, seeded random: the server caches the prompt it was sent, so the next turn shares
all of it), then the new user message. Each request carries its session (``user`` / ``session_id``). At most
``--concurrency`` sessions run at once (0: all); ``--num-prompts`` is ignored.

    uv run python bench/serve_bench.py --port 8000 --dataset shared-prefix --num-groups 8 --system-len 2048 \
        --num-sessions 64 --turns 4 --user-len 128 --output-len 128 --concurrency 32
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kit.host_sampling import GpuSampler, ThreadCpu, listening_pid, top_threads
from kit.sse_client import SSEConnection

ENDPOINTS = ("/v1/completions", "/generate")
PERCENTILES = (50.0, 99.0)


# -- workload ------------------------------------------------------------------------------------------------


@attrs.frozen
class BenchRequest:
    prompt_ids: tuple[int, ...]
    output_len: int
    session: str | None = None
    json_schema: dict[str, Any] | None = None  # structured output: response_format json_schema (/generate: json_schema)


def bench_schema(output_len: int) -> dict[str, Any]:
    """``--json-schema``'s schema: an object holding a list of short strings with at least ``output_len`` items,
    so a constrained request cannot complete before ``max_tokens`` (each item takes 3+ tokens) and its output is
    as long as an unconstrained request's; every token is still masked by the grammar."""
    return {"type": "object", "properties": {"log": {"type": "array", "minItems": max(1, output_len),
                                                     "items": {"type": "string", "maxLength": 24}}},
            "required": ["log"], "additionalProperties": False}


def random_requests(count: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[BenchRequest]:
    """``count`` prompts of uniform random token ids in ``[0, vocab_size)``, lengths drawn uniformly from
    ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (at least 1), from one random stream per seed and
    workload shape: independent random ids make prefix-cache hits between prompts practically impossible, also
    between two workloads of one seed and different lengths (one stream per seed alone gave a table's
    30,000-token prompts the first 8,192 ids of its 8,192-token ones: a prefix-cache hit on the same server)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range_ratio must be in [0, 1)")
    rng = random.Random(f"random:{seed}:{input_len}:{output_len}:{range_ratio}")

    def draw(length: int) -> int:
        low, high = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
        return max(1, rng.randint(low, high))

    requests = []
    for _ in range(count):
        prompt_len, out_len = draw(input_len), draw(output_len)
        requests.append(BenchRequest(tuple(rng.randrange(vocab_size) for _ in range(prompt_len)), out_len))
    return requests


def shared_prefix_sessions(num_sessions: int, num_groups: int, system_len: int, turns: int, user_len: int,
                           output_len: int, vocab_size: int, seed: int) -> list[list[BenchRequest]]:
    """``num_sessions`` sessions of ``turns`` requests each (see the module docstring), from one random stream
    per seed and workload shape (two shapes of one seed share no prefix, as in ``random_requests``)."""
    rng = random.Random(f"shared-prefix:{seed}:{num_sessions}:{num_groups}:{system_len}:{turns}:{user_len}:"
                        f"{output_len}")

    def tokens(count: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(count)]

    systems = [tokens(system_len) for _ in range(max(1, num_groups))]
    sessions = []
    for index in range(num_sessions):
        history = list(systems[index % len(systems)])
        session = []
        for _ in range(turns):
            history += tokens(user_len)
            session.append(BenchRequest(tuple(history), output_len, f"session-{seed}-{index}"))
            history += tokens(output_len)
        sessions.append(session)
    return sessions


def request_body(endpoint: str, model: str | None, request: BenchRequest) -> bytes:
    common: dict[str, Any] = {"max_tokens": request.output_len, "ignore_eos": True, "temperature": 0,
                              "stream": True}
    if endpoint == "/generate":
        body = {"prompt_token_ids": list(request.prompt_ids), **common}
        if request.session:
            body["session_id"] = request.session
        if request.json_schema is not None:
            body["json_schema"] = request.json_schema
    else:
        body = {"prompt": list(request.prompt_ids), **common, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        if model:
            body["model"] = model
        if request.session:
            body["user"] = request.session
        if request.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench",
                                                                              "schema": request.json_schema}}
    return json.dumps(body, separators=(",", ":")).encode()


# -- one request ---------------------------------------------------------------------------------------------


@attrs.define
class RequestResult:
    prompt_len: int
    requested: int
    start: float = 0.0
    event_times: list[float] = attrs.Factory(list)  # perf_counter of each token-carrying event
    event_tokens: list[int] = attrs.Factory(list)  # tokens it carried
    usage_tokens: int | None = None
    done: bool = False  # [DONE] arrived
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error and self.done and bool(self.event_times)

    @property
    def counted_tokens(self) -> int:
        return sum(self.event_tokens)

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.counted_tokens

    @property
    def ttft(self) -> float:
        return self.event_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.event_times[-1] - self.start

    @property
    def end(self) -> float:
        return self.event_times[-1] if self.event_times else self.start

    def itl(self) -> list[float]:
        """Per-token inter-token latencies (seconds): ``counted_tokens - 1`` samples summing to E2EL - TTFT."""
        samples = [0.0] * (self.event_tokens[0] - 1) if self.event_tokens else []
        for previous, now, tokens in zip(self.event_times, self.event_times[1:], self.event_tokens[1:], strict=False):
            samples += [(now - previous) / tokens] * tokens
        return samples

    def event_itl(self) -> list[float]:
        """vLLM's ITL: one sample per gap between token-carrying events, whatever they carry."""
        return [now - previous for previous, now in zip(self.event_times, self.event_times[1:], strict=False)]


def read_event(endpoint: str, payload: bytes) -> tuple[int, int | None, str]:
    """(tokens carried, usage ``completion_tokens`` if the event has usage, error message or ``""``) of one
    event's JSON payload."""
    data = json.loads(payload)
    usage = data.get("usage") or None
    usage_tokens = usage.get("completion_tokens") if usage else None
    error = data.get("error")
    message = (error.get("message") or str(error)) if isinstance(error, dict) else (str(error) if error else "")
    if endpoint == "/generate":
        return len(data.get("token_ids") or ()), usage_tokens, message
    tokens = 0
    for choice in data.get("choices") or ():
        ids = choice.get("token_ids")
        tokens += len(ids) if ids is not None else (1 if choice.get("text") else 0)
    return tokens, usage_tokens, message


async def send(connection: SSEConnection, endpoint: str, body: bytes, result: RequestResult, timeout: float) -> None:
    """Stream one request on ``connection`` into ``result``; failures end up in ``result.error``."""

    def on_event(payload: bytes) -> None:
        now = time.perf_counter()
        if payload == b"[DONE]":
            result.done = True
            return
        tokens, usage_tokens, error = read_event(endpoint, payload)
        if tokens:
            result.event_times.append(now)
            result.event_tokens.append(tokens)
        if usage_tokens is not None:
            result.usage_tokens = usage_tokens
        if error and not result.error:
            result.error = error

    result.start = time.perf_counter()
    try:
        with trio.fail_after(timeout):
            response = await connection.post(endpoint, body, on_event)
    except trio.TooSlowError:
        result.error = f"no end within {timeout:g} s"
        return
    except (OSError, ConnectionError, trio.BrokenResourceError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return
    if response.status != 200:
        result.error = f"HTTP {response.status}: {response.body[:300].decode(errors='replace')}"
    elif not result.done and not result.error:
        result.error = "the stream ended without [DONE]"
    elif not result.event_times and not result.error:
        result.error = "no token arrived"


async def run_requests(host: str, port: int, endpoint: str, model: str | None, requests: Sequence[BenchRequest],
                       concurrency: int, request_rate: float, seed: int, timeout: float) -> list[RequestResult]:
    """Send ``requests`` (arrivals at once or Poisson at ``request_rate``), at most ``concurrency`` in flight
    (0: no cap), over keep-alive connections reused between requests."""
    limiter = trio.CapacityLimiter(concurrency or max(len(requests), 1))
    idle: list[SSEConnection] = []
    results = [RequestResult(len(r.prompt_ids), r.output_len) for r in requests]
    bodies = [request_body(endpoint, model, r) for r in requests]
    arrivals = random.Random(seed + 1)

    async def one(index: int) -> None:
        async with limiter:
            connection = idle.pop() if idle else SSEConnection(host, port)
            try:
                await send(connection, endpoint, bodies[index], results[index], timeout)
            finally:
                idle.append(connection)

    try:
        async with trio.open_nursery() as nursery:
            for index in range(len(requests)):
                if index and math.isfinite(request_rate):
                    await trio.sleep(arrivals.expovariate(request_rate))
                nursery.start_soon(one, index)
    finally:
        for connection in idle:
            await connection.close()
    return results


async def run_sessions(host: str, port: int, endpoint: str, model: str | None,
                       sessions: Sequence[Sequence[BenchRequest]], concurrency: int,
                       timeout: float) -> list[RequestResult]:
    """Run each session's requests one after another, at most ``concurrency`` sessions at once (0: all)."""
    limiter = trio.CapacityLimiter(concurrency or max(len(sessions), 1))
    idle: list[SSEConnection] = []
    results: list[RequestResult] = []

    async def one(session: Sequence[BenchRequest]) -> None:
        async with limiter:
            connection = idle.pop() if idle else SSEConnection(host, port)
            try:
                for request in session:
                    result = RequestResult(len(request.prompt_ids), request.output_len)
                    results.append(result)
                    await send(connection, endpoint, request_body(endpoint, model, request), result, timeout)
            finally:
                idle.append(connection)

    try:
        async with trio.open_nursery() as nursery:
            for session in sessions:
                nursery.start_soon(one, session)
    finally:
        for connection in idle:
            await connection.close()
    return results


# -- the report ----------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile of non-empty ``values``."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean / median / p99 in milliseconds (``None`` for no values)."""
    if not values_s:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    ms = [v * 1e3 for v in values_s]
    return {"mean_ms": sum(ms) / len(ms), "median_ms": percentile(ms, 50.0), "p99_ms": percentile(ms, 99.0)}


def summarize(results: Sequence[RequestResult]) -> dict[str, Any]:
    """vLLM's serving metrics over the successful requests (the failed ones are counted and listed)."""
    done = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    started = min((r.start for r in results), default=0.0)
    ended = max((r.end for r in results), default=0.0)
    duration = max(ended - started, 1e-9)
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    itl = [s for r in done for s in r.itl()]
    event_itl = [s for r in done for s in r.event_itl()]
    events = sum(len(r.event_times) for r in done)
    return {
        "completed": len(done), "failed": len(failed), "errors": sorted({r.error for r in failed})[:5],
        "duration_s": duration, "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "requested_output_tokens": sum(r.requested for r in done),
        "counted_output_tokens": sum(r.counted_tokens for r in done),
        "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft": distribution([r.ttft for r in done]),
        "tpot": distribution([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl": distribution(itl), "itl_samples": len(itl),
        "event_itl": distribution(event_itl), "event_itl_samples": len(event_itl),
        "tokens_per_event": sum(r.counted_tokens for r in done) / events if events else None,
        "e2el": distribution([r.e2e for r in done]),
    }


def fmt_ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_report(report: dict[str, Any]) -> str:
    """The report as ``vllm bench serve`` prints it, plus the GPU, server and client lines."""
    rows: list[tuple[str, str]] = [
        ("Successful requests:", str(report["completed"])), ("Failed requests:", str(report["failed"])),
        ("Maximum request concurrency:", str(report["config"]["concurrency"] or "unlimited")),
        ("Request rate (req/s):", str(report["config"]["request_rate"])),
        ("Benchmark duration (s):", f"{report['duration_s']:.2f}"),
        ("Total input tokens:", str(report["total_input_tokens"])),
        ("Total generated tokens:", str(report["total_output_tokens"])),
        ("Request throughput (req/s):", f"{report['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{report['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{report['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{name:<40}{value:<10}" for name, value in rows]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency (per token)"), ("event_itl", "Inter-event Latency (vLLM's ITL)"),
                       ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        name = key.upper()
        for stat, label in (("mean_ms", "Mean"), ("median_ms", "Median"), ("p99_ms", "P99")):
            lines.append(f"{f'{label} {name} (ms):':<40}{fmt_ms(report[key][stat]):<10}")
    lines.append("{s:{c}^50}".format(s="Host", c="-"))
    tokens_per_event = report["tokens_per_event"]
    lines.append(f"{'Tokens per event:':<40}{'n/a' if tokens_per_event is None else f'{tokens_per_event:.2f}'}")
    gpu = report["gpu"]
    busy = "n/a" if not gpu or gpu["busy_median"] is None else f"{gpu['busy_median']:.0%} (mean {gpu['busy_mean']:.0%})"
    power = "n/a" if not gpu or gpu["power_mean_w"] is None else f"{gpu['power_mean_w']:.0f}"
    lines.append(f"{'GPU busy, median of samples:':<40}{busy}")
    lines.append(f"{'GPU power, mean (W):':<40}{power}")
    server = report["server_cpu"]
    total = "n/a" if not server or server["total_cores"] is None else f"{server['total_cores']:.2f}"
    lines.append(f"{'Server CPU (cores):':<40}{total}")
    lines.append(f"{'Server busiest threads (cores):':<40}{top_threads(server, 4)}")
    lines.append(f"{'Client CPU (cores):':<40}{report['client_cpu_cores']:.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------------------------


@attrs.frozen
class BenchConfig:
    url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    input_len: int = 512
    output_len: int = 512
    range_ratio: float = 0.0
    num_prompts: int = 100
    concurrency: int = 0
    request_rate: float = math.inf
    warmup: int = 0
    warmup_output_len: int = 0  # 0: --output-len (short warm-ups still run every prefill and the batch's decode)
    warmup_input_len: int = 0  # 0: --input-len (a long-context run warms up on short prompts)
    seed: int = 0
    vocab_size: int = 0  # 0: GET /tokenizer_info's model_vocab_size
    server_pid: int = 0  # 0: the process listening on the URL's port; -1: do not sample the server's CPU
    gpu_index: int = 0
    request_timeout: float = 600.0
    dataset: str = "random"  # or "shared-prefix"
    num_groups: int = 8
    system_len: int = 2048
    num_sessions: int = 64
    turns: int = 4
    user_len: int = 128
    json_schema: bool = False  # every request constrained by bench_schema(output_len) (random dataset)

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urllib.parse.urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


def model_vocab_size(url: str) -> int:
    """The served model's vocabulary size, from ``GET /tokenizer_info`` (vLLM's route; ours answers 400 for a
    model without a tokenizer, then pass ``--vocab-size``)."""
    try:
        with urllib.request.urlopen(url + "/tokenizer_info", timeout=30) as response:
            info = json.loads(response.read())
    except OSError as error:
        raise SystemExit(f"cannot learn the vocabulary size from {url}/tokenizer_info ({error}): "
                         "pass --vocab-size") from None
    return int(info.get("model_vocab_size") or info["vocab_size"])


async def warm_up(config: BenchConfig, vocab_size: int) -> None:
    """``config.warmup`` requests (``warmup_input_len`` / ``warmup_output_len`` tokens, defaulting to the run's), on
    other prompts than the measured ones, not counted; every one failing stops the benchmark."""
    host, port = config.host_port
    requests = random_requests(config.warmup, config.warmup_input_len or config.input_len,
                               config.warmup_output_len or config.output_len, config.range_ratio, vocab_size,
                               config.seed + 1_000_003)
    warm = await run_requests(host, port, config.endpoint, config.model, requests, config.concurrency, math.inf,
                              config.seed, config.request_timeout)
    if not any(r.success for r in warm):
        raise SystemExit(f"every warm-up request failed: {sorted({r.error for r in warm})[:3]}")


async def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    """Warm up, then run and measure ``config``'s workload; the report as a JSON-able dict."""
    host, port = config.host_port
    vocab_size = config.vocab_size or await trio.to_thread.run_sync(model_vocab_size, config.url)
    requests = random_requests(config.num_prompts, config.input_len, config.output_len, config.range_ratio,
                               vocab_size, config.seed)
    if config.json_schema:
        requests = [attrs.evolve(r, json_schema=bench_schema(config.output_len)) for r in requests]
    sessions = (shared_prefix_sessions(config.num_sessions, config.num_groups, config.system_len, config.turns,
                                       config.user_len, config.output_len, vocab_size, config.seed)
                if config.dataset == "shared-prefix" else None)
    if config.warmup:
        await warm_up(config, vocab_size)
    pid = config.server_pid or (listening_pid(port) or -1 if host in ("127.0.0.1", "localhost", "::1") else -1)
    server = ThreadCpu(pid) if pid > 0 else None
    gpu = GpuSampler(config.gpu_index)
    before = server.snapshot() if server else None
    gpu.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if sessions is not None:
        results = await run_sessions(host, port, config.endpoint, config.model, sessions, config.concurrency,
                                     config.request_timeout)
    else:
        results = await run_requests(host, port, config.endpoint, config.model, requests, config.concurrency,
                                     config.request_rate, config.seed, config.request_timeout)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    gpu_report = gpu.stop()
    server_cpu = server.delta(before, server.snapshot()) if server and before else None
    report = summarize(results)
    rate = config.request_rate if math.isfinite(config.request_rate) else "inf"
    report.update(config=attrs.asdict(config) | {"vocab_size": vocab_size, "server_pid": pid, "request_rate": rate},
                  gpu=gpu_report, gpu_error=gpu.error, server_cpu=server_cpu,
                  client_cpu_cores=(cpu1 - cpu0) / max(wall1 - wall0, 1e-9),  # not duration_s: 0 if all failed
                  date=time.strftime("%Y-%m-%d %H:%M:%S"))
    return report


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, Path | None]:
    """The run's configuration and the ``--json`` path."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="", help="base URL of the server (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    parser.add_argument("--model", default=None, help="the model field of /v1/completions (default: none sent)")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--concurrency", "--max-concurrency", type=int, default=0,
                        help="most requests in flight (0: no cap)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="Poisson arrivals per second (inf: all at once, the default)")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up requests first, not counted")
    parser.add_argument("--warmup-output-len", type=int, default=0,
                        help="output tokens of each warm-up request (default: --output-len)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="token ids are drawn from [0, this) (default: /tokenizer_info's model_vocab_size)")
    parser.add_argument("--server-pid", type=int, default=0,
                        help="sample this process's CPU (default: the one listening on the port; -1: none)")
    parser.add_argument("--gpu-index", type=int, default=0, help="NVML index of the GPU to sample")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--dataset", choices=("random", "shared-prefix"), default="random")
    parser.add_argument("--num-groups", type=int, default=8, help="shared-prefix: distinct system prompts")
    parser.add_argument("--system-len", type=int, default=2048, help="shared-prefix: system prompt tokens")
    parser.add_argument("--num-sessions", type=int, default=64, help="shared-prefix: sessions")
    parser.add_argument("--turns", type=int, default=4, help="shared-prefix: turns per session")
    parser.add_argument("--user-len", type=int, default=128, help="shared-prefix: tokens per user message")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--json-schema", action="store_true",
                        help="constrain every measured request by a JSON schema that lasts the whole output "
                             "(bench_schema; the server needs a tokenizer)")
    args = parser.parse_args(argv)
    return BenchConfig(url=(args.url or f"http://{args.host}:{args.port}").rstrip("/"), endpoint=args.endpoint,
                       model=args.model, input_len=args.input_len, output_len=args.output_len,
                       range_ratio=args.range_ratio, num_prompts=args.num_prompts, concurrency=args.concurrency,
                       request_rate=args.request_rate, warmup=args.warmup,
                       warmup_output_len=args.warmup_output_len, seed=args.seed,
                       vocab_size=args.vocab_size, server_pid=args.server_pid, gpu_index=args.gpu_index,
                       request_timeout=args.request_timeout, dataset=args.dataset, num_groups=args.num_groups,
                       system_len=args.system_len, num_sessions=args.num_sessions, turns=args.turns,
                       user_len=args.user_len, json_schema=args.json_schema), args.json


def main(argv: Sequence[str] | None = None) -> int:
    config, json_path = parse_args(argv)
    report = trio.run(run_benchmark, config)
    print(format_report(report))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1, default=str))
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
