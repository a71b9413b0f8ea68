"""Load with faults on: what survives, what is lost, what leaks (docs/reliability.md records the figures).

Starts ``python -m inference_server serve`` itself (127.0.0.1, a free port, CPU, ``FAULTS=--faults``; the
embedded Gemma 3 270M unless ``--model``), then drives a bounded load at it: ``--concurrency`` clients,
each sending one request after another to ``/generate`` or ``/v1/completions``, streamed or not, until
``--requests`` were sent or ``--seconds`` passed. Some clients misbehave (``--stall``, ``--drop``):

* a *stalled* client reads the first event of its stream, stops reading for ``--stall-seconds``, then reads
  the rest (it must still get its terminal answer);
* a *dropping* client either leaves right after sending (within 50 ms, usually while the request is queued
  or prefilling) or after the first event of its stream.

Every request ends in exactly one bucket: ``completed`` (200 and a successful finish), ``rejected`` (a 4xx,
429 or 503 before any token: the server refused it), ``errored`` (a 5xx, or a stream that ended with an
error event), ``dropped`` (the client left on purpose), ``unreachable`` (the server process was already
gone: no connection) or ``lost``: sent, not dropped, and no terminal answer (a connection cut without an
answer, a stream without its error event or ``[DONE]``, or ``--request-timeout``). Lost must be 0.

After the load, while the server still runs, it waits for the engine to go idle and reads ``GET
/debug/engine``: requests, stream entries, KV sequences and KV blocks in use must all be 0 (cached prefix
blocks may stay). Then SIGTERM, and the exit status. With ``--stuck-readers N`` the SIGTERM comes while N
clients hold streams they stopped reading (the server's writes to them stuck on full TCP windows, seen in
``/proc/net/tcp``: ``kit/stuck_reader.py``) beside two that read, a short one that should finish during the drain
and a long one that the drain deadline (``SHUTDOWN_TIMEOUT``, 10 s here) cuts: it reports the seconds from the
signal to the exit, what each stream got, and whether the hard-exit watchdog had to end the process. When the
server exits by itself (``step_error``: a device fault), it reports the exit status and the seconds from the
injected fault (the server's log line) to the process exit. With the engine in a child process (``--set
ENGINE_PROCESS=separate``; the environment's ``ENGINE_PROCESS`` is passed on too) it also checks that the child
does not outlive the server (Linux): an orphaned engine process holds the device's memory until someone kills it.

    uv run python bench/fault_run.py --faults "alloc_refuse=0.2,seed=1" --seconds 60
    uv run python bench/fault_run.py --faults "step_error=0.02,seed=3" --seconds 90
    uv run python bench/fault_run.py --faults "step_error=0.02,seed=3" --set ENGINE_PROCESS=separate
    uv run python bench/fault_run.py --model gemma-4-31b-tiny --dummy-weights --prompt-ids --faults ...
    uv run python bench/fault_run.py --seconds 10 --stuck-readers 2 --set ENGINE_PROCESS=separate

The process exits 1 when a request was lost, something leaked or the engine process was orphaned, and with
``--stuck-readers`` also when the process did not exit by itself ``SHUTDOWN_TIMEOUT + STUCK_EXIT_SLACK`` seconds
after the signal, the watchdog ended it, or a reading stream did not get its terminal event. This is a
load run, not a test.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import attrs
import httpx
import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kit.server_process import url_from_lines
from kit.stuck_reader import StuckReader, stuck_when

TEXT_PROMPTS = ["The capital of France is", "Once upon a time, there was", "def fibonacci(n):",
                "The three primary colours are", "Water boils at", "My favourite book is"]
SUCCESSFUL_FINISHES = {"stop", "length"}
IDLE_FIELDS = ("requests", "stream_entries", "kv_sequences", "kv_blocks_in_use")
BEHAVIOURS = ("normal", "stall", "drop_after_send", "drop_mid_stream")
SHUTDOWN_TIMEOUT = 10.0
"""The server's drain (``SHUTDOWN_TIMEOUT``) in these runs."""
STUCK_EXIT_SLACK = 5.0
"""With ``--stuck-readers``: seconds past the drain deadline the server may take to exit (its stop sequence
gives responses ``HTTP_FLUSH_SECONDS``, 2 s, to write their last events, then closes the connections of the clients
that did not read them)."""
WATCHDOG_LINE = "exiting now"
"""What the server's hard-exit watchdog logs when it has to end the process."""


# -- the server process ------------------------------------------------------------------------------------


class ServerProcess:
    """``inference_server serve`` in a child process; its log lines are kept with their arrival times."""

    def __init__(self, env: dict[str, str], start_timeout: float) -> None:
        self.workdir = tempfile.mkdtemp(prefix="fault-run-")  # no stray .env is read from here
        started = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-m", "inference_server", "serve"], cwd=self.workdir,
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.log: list[tuple[float, str]] = []
        self.exit_time: float | None = None
        stdout: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(self.process.stdout, stdout), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, None), daemon=True).start()
        threading.Thread(target=self._wait, daemon=True).start()
        self.url = self._await_url(stdout, start_timeout)
        self.start_seconds = time.monotonic() - started
        self.children = self._children()  # the engine process with ENGINE_PROCESS=separate (spawned before listening)

    def _read(self, pipe: Any, lines: queue.Queue[str] | None) -> None:
        for raw in pipe:
            line = raw.decode(errors="replace").rstrip()
            self.log.append((time.monotonic(), line))
            if lines is not None:
                lines.put(line)

    def _wait(self) -> None:
        self.process.wait()
        self.exit_time = time.monotonic()

    def _await_url(self, lines: queue.Queue[str], timeout: float) -> str:
        url = url_from_lines(lines, self.process, timeout)
        if url is not None:
            return url
        exited = self.process.poll()
        self.stop()
        tail = "\n".join(line for _, line in self.log[-30:])
        why = f"exited (status {exited}) before it was ready" if exited is not None \
            else f"did not start within {timeout:.0f} s"
        raise SystemExit(f"the server {why}:\n{tail}")

    def _children(self) -> list[int]:
        """The server's child processes now (Linux; empty elsewhere)."""
        pid = self.process.pid
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as children:
                return [int(child) for child in children.read().split()]
        except OSError:
            return []

    def orphans(self) -> list[int]:
        """The server's children that still run after it exited (a zombie, exited but not yet reaped by its new
        parent, does not count)."""
        left = []
        for pid in self.children:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    state = stat.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                left.append(pid)
        return left

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def first(self, text: str) -> float | None:
        """When the first log line containing ``text`` arrived (monotonic seconds)."""
        return next((t for t, line in list(self.log) if text in line), None)

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def server_env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "DEVICE": "cpu", "HOST": "127.0.0.1", "PORT": "0", "FAULTS": args.faults,
           "LOG_LEVEL": "info", "SHUTDOWN_TIMEOUT": f"{SHUTDOWN_TIMEOUT:g}", "MODEL": args.model,
           "DUMMY_WEIGHTS": "true" if args.dummy_weights else "false"}
    for item in args.set:
        key, _, value = item.partition("=")
        env[key] = value
    return env


# -- the load ----------------------------------------------------------------------------------------------


@attrs.define
class Tally:
    sent: int = 0
    completed: int = 0
    rejected: collections.Counter[str] = attrs.Factory(collections.Counter)
    errored: collections.Counter[str] = attrs.Factory(collections.Counter)
    dropped: collections.Counter[str] = attrs.Factory(collections.Counter)
    unreachable: int = 0
    lost: collections.Counter[str] = attrs.Factory(collections.Counter)
    behaviours: collections.Counter[str] = attrs.Factory(collections.Counter)
    latencies: list[float] = attrs.Factory(list)  # seconds, completed requests of well-behaved clients
    server_failing: bool = False  # a response said so, or no connection could be made
    seconds: float = 0.0

    def latency(self, quantile: float) -> float | None:
        if not self.latencies:
            return None
        ordered = sorted(self.latencies)
        return round(ordered[min(len(ordered) - 1, int(quantile * len(ordered)))], 2)

    def as_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "completed": self.completed, "rejected": sum(self.rejected.values()),
                "errored": sum(self.errored.values()), "dropped": sum(self.dropped.values()),
                "unreachable": self.unreachable, "lost": sum(self.lost.values()),
                "rejected_reasons": dict(self.rejected), "errored_reasons": dict(self.errored),
                "dropped_how": dict(self.dropped), "lost_how": dict(self.lost),
                "behaviours": dict(self.behaviours), "seconds": round(self.seconds, 1),
                "latency_p50": self.latency(0.5), "latency_p90": self.latency(0.9)}


@attrs.frozen
class Plan:
    route: str
    stream: bool
    behaviour: str
    payload: dict[str, Any]
    drop_after: float = 0.0
    progress: list[str] = attrs.Factory(list)  # "answered" once response headers arrived


class ServerGone(Exception):
    """No connection could be made: the server process is gone."""


FAILING = ("engine_failure", "draining", "failed", "unavailable")
"""Error codes that say the server is going down: a client stops sending new requests once it sees one
(``unavailable``: a 503 with ``Retry-After``, which the engine answers once it failed, also to the requests it
had not admitted yet; a client honouring ``Retry-After`` does not send its next request into the exiting
process, where a connection the listener accepted but nobody serves any more is cut without an answer)."""


def make_plan(rng: random.Random, index: int, args: argparse.Namespace) -> Plan:
    route = rng.choice(["/generate", "/v1/completions"])
    roll = rng.random()
    behaviour = ("stall" if roll < args.stall else "drop_after_send" if roll < args.stall + args.drop / 2
                 else "drop_mid_stream" if roll < args.stall + args.drop else "normal")
    stream = behaviour in ("stall", "drop_mid_stream") or rng.random() < 0.5
    payload: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": 0.0, "stream": stream}
    if args.prompt_ids:
        ids = [10 + (index * 7 + k * 13) % 200 for k in range(4 + index % 5)]
        payload["prompt_token_ids" if route == "/generate" else "prompt"] = ids
    else:
        payload["prompt"] = TEXT_PROMPTS[index % len(TEXT_PROMPTS)]
    return Plan(route, stream, behaviour, payload, drop_after=rng.uniform(0.0, 0.05))


def _reason(status: int, body: Any) -> str:
    code = body.get("error", {}).get("code") if isinstance(body, dict) else None
    return f"{status} {code or 'no_code'}"


async def _plain(client: httpx.AsyncClient, url: str, plan: Plan) -> tuple[str, str]:
    response = await client.post(url + plan.route, json=plan.payload)
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code != 200:
        return ("errored" if response.status_code >= 500 and response.status_code != 503 else "rejected",
                _reason(response.status_code, body))
    finish = body.get("finish_reason") if plan.route == "/generate" else body["choices"][0].get("finish_reason")
    return ("completed", "ok") if finish in SUCCESSFUL_FINISHES else ("errored", f"200 finish_reason={finish}")


async def _streamed(client: httpx.AsyncClient, url: str, plan: Plan, stall_seconds: float) -> tuple[str, str]:
    async with client.stream("POST", url + plan.route, json=plan.payload) as response:
        plan.progress.append("answered")
        if response.status_code != 200:
            body = json.loads(await response.aread() or b"null")
            return ("errored" if response.status_code >= 500 and response.status_code != 503 else "rejected",
                    _reason(response.status_code, body))
        events = 0
        error: str | None = None
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return ("errored", error) if error else ("completed", "ok")
            event = json.loads(data)
            if "error" in event:
                error = f"stream {event['error'].get('code')}"
            events += 1
            if events == 1 and plan.behaviour == "drop_mid_stream":
                return "dropped", "mid_stream"
            if events == 1 and plan.behaviour == "stall":
                await trio.sleep(stall_seconds)  # stop reading; the server must neither block nor lose it
        return "lost", "stream ended without [DONE]"


async def one_request(client: httpx.AsyncClient, url: str, plan: Plan, args: argparse.Namespace) -> tuple[str, str]:
    """(bucket, reason) of one request; see the module docstring."""
    try:
        with trio.move_on_after(args.request_timeout) as timeout:
            if plan.behaviour == "drop_after_send":
                with trio.move_on_after(plan.drop_after) as drop:
                    outcome = await (_streamed(client, url, plan, 0.0) if plan.stream else _plain(client, url, plan))
                if drop.cancelled_caught:
                    return "dropped", "after_send"
                return outcome
            if plan.stream:
                return await _streamed(client, url, plan, args.stall_seconds)
            return await _plain(client, url, plan)
        assert timeout.cancelled_caught
        return "lost", f"no answer within {args.request_timeout:g} s"
    except httpx.ConnectError as error:
        raise ServerGone from error
    except (httpx.TransportError, json.JSONDecodeError) as error:
        when = "mid-answer" if plan.progress else "before any response"
        return "lost", f"{type(error).__name__} {when}"


async def run_load(url: str, args: argparse.Namespace, server_alive: Any = lambda: True) -> Tally:
    """The bounded load of the module docstring against ``url``; stops sending once the server is gone."""
    rng = random.Random(args.seed)
    tally = Tally()
    counter = itertools.count()
    gone = trio.Event()
    deadline = trio.current_time() + args.seconds
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    timeout = httpx.Timeout(connect=5.0, read=None, write=10.0, pool=None)
    started = trio.current_time()

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not gone.is_set() and trio.current_time() < deadline:
            index = next(counter)
            if index >= args.requests:
                return
            plan = make_plan(rng, index, args)
            sent_at = trio.current_time()
            try:
                bucket, reason = await one_request(client, url, plan, args)
            except ServerGone:
                tally.unreachable += 1
                tally.server_failing = True
                gone.set()
                return
            tally.sent += 1
            tally.behaviours[plan.behaviour] += 1
            if any(code in reason for code in FAILING):
                tally.server_failing = True
                gone.set()
            if bucket == "completed":
                tally.completed += 1
                if plan.behaviour == "normal":
                    tally.latencies.append(trio.current_time() - sent_at)
            else:
                getattr(tally, bucket)[reason] += 1
            if not server_alive():
                gone.set()

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client, trio.open_nursery() as nursery:
        for _ in range(args.concurrency):
            nursery.start_soon(client_loop, client)
    tally.seconds = trio.current_time() - started
    return tally


async def engine_counts(url: str, settle_seconds: float) -> dict[str, Any] | None:
    """``GET /debug/engine`` once the engine is idle (or after ``settle_seconds``); None if unreachable."""
    counts = None
    async with httpx.AsyncClient(timeout=5.0) as client:
        with trio.move_on_after(settle_seconds):
            while True:
                try:
                    counts = (await client.get(url + "/debug/engine")).json()
                except httpx.TransportError:
                    return counts
                if all(counts[field] == 0 for field in IDLE_FIELDS):
                    return counts
                await trio.sleep(0.25)
    return counts


# -- a stop signal with stuck readers ----------------------------------------------------------------------


def _stream_payload(args: argparse.Namespace, index: int, max_tokens: int) -> dict[str, Any]:
    payload: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True}
    if args.prompt_ids:
        payload["prompt"] = [10 + (index * 7 + k * 13) % 200 for k in range(6)]
    else:
        payload["prompt"] = TEXT_PROMPTS[index % len(TEXT_PROMPTS)]
    return payload


def _generated_tokens(url: str) -> float:
    """The server's generated-token count (``/metrics``); what the stuck readers' wait watches grow."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def _read_stream(url: str, payload: dict[str, Any], events: list[str], first: threading.Event) -> None:
    """A client that reads: every ``data:`` payload of a ``/v1/completions`` stream into ``events``."""
    try:
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", url + "/v1/completions", json=payload) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    first.set()
    except httpx.TransportError as error:
        events.append(f"transport error: {type(error).__name__}")
    finally:
        first.set()


def _ending(events: list[str]) -> str:
    """How a reading stream ended: its finish reason or error code and ``[DONE]``, or what it lacked."""
    if not events or events[-1] != "[DONE]":
        return f"no [DONE] (last: {events[-1][:80] if events else 'nothing'})"
    last = json.loads(events[-2]) if len(events) >= 2 else {}
    if "error" in last:
        return f"error {last['error'].get('code')} + [DONE]"
    return f"{last.get('choices', [{}])[0].get('finish_reason')} + [DONE]"


def stop_with_stuck_readers(server: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    """SIGTERM while ``args.stuck_readers`` clients have stopped reading (see the module docstring); the figures."""
    long_events: list[str] = []
    long_first = threading.Event()
    long_reader = threading.Thread(target=_read_stream, args=(
        server.url, _stream_payload(args, 1, args.stuck_max_tokens), long_events, long_first), daemon=True)
    long_reader.start()
    readers = [StuckReader(server.url, "/v1/completions", _stream_payload(args, 2 + i, args.stuck_max_tokens))
               for i in range(args.stuck_readers)]
    stuck_at = time.monotonic()
    stuck = stuck_when(readers, lambda: _generated_tokens(server.url), min_progress=8 * len(readers) + 8,
                       timeout=args.stuck_timeout)
    stuck_seconds = time.monotonic() - stuck_at
    short_events: list[str] = []
    short_first = threading.Event()
    short_reader = threading.Thread(target=_read_stream, args=(
        server.url, _stream_payload(args, 0, args.short_max_tokens), short_events, short_first), daemon=True)
    short_reader.start()
    short_first.wait(60)
    signal_at = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        exit_code = server.process.wait(SHUTDOWN_TIMEOUT + 60)
    except subprocess.TimeoutExpired:
        exit_code = server.stop()
    exit_seconds = (server.exit_time or time.monotonic()) - signal_at
    for thread in (long_reader, short_reader):
        thread.join(30)
    endings = []
    for reader in readers:
        data, how = reader.read_all(10)
        endings.append(f"{how}{' after [DONE]' if b'data: [DONE]' in data else ''} ({len(data)} bytes)")
        reader.close()
    watchdog = server.first(WATCHDOG_LINE) is not None
    result = {"stuck_readers": len(readers), "stuck_before_signal": stuck, "seconds_to_stuck": round(stuck_seconds, 1),
              "exit_code": exit_code, "seconds_to_exit": round(exit_seconds, 1), "drain": SHUTDOWN_TIMEOUT,
              "watchdog": watchdog, "short_stream": _ending(short_events), "long_stream": _ending(long_events),
              "stuck_streams": endings}
    print(f"  stop with {len(readers)} stuck readers (stuck before the signal: {stuck}, "
          f"after {stuck_seconds:.1f} s): exit status {exit_code} {exit_seconds:.1f} s after SIGTERM "
          f"(drain {SHUTDOWN_TIMEOUT:g} s){'; ended by the hard-exit watchdog' if watchdog else ''}")
    print(f"    reading streams: short {result['short_stream']}, long {result['long_stream']}; "
          f"stuck streams: {', '.join(endings)}")
    return result


def stuck_stop_failed(result: dict[str, Any]) -> bool:
    """Whether the stop with stuck readers broke its promise (see the module docstring)."""
    return (result["seconds_to_exit"] > SHUTDOWN_TIMEOUT + STUCK_EXIT_SLACK or result["watchdog"]
            or result["exit_code"] != 0 or not result["short_stream"].endswith("+ [DONE]")
            or not result["long_stream"].endswith("+ [DONE]"))


# -- the report --------------------------------------------------------------------------------------------


def report(args: argparse.Namespace, tally: Tally, counts: dict[str, Any] | None, exit_code: int,
           exit_note: str) -> dict[str, Any]:
    result = {"faults": args.faults, "model": args.model or "embedded gemma-3-270m", **tally.as_dict(),
              "after_run": counts, "exit_code": exit_code, "exit": exit_note}
    d = tally.as_dict()
    print(f"fault run: FAULTS={args.faults or '(none)'}  model={result['model']}  "
          f"concurrency={args.concurrency}  max_tokens={args.max_tokens}  {d['seconds']} s")
    print(f"  sent         {d['sent']}   (client behaviours: {d['behaviours']})")
    print(f"  completed    {d['completed']}   (latency of well-behaved clients: p50 {d['latency_p50']} s, "
          f"p90 {d['latency_p90']} s)")
    print(f"  rejected     {d['rejected']}   {d['rejected_reasons']}")
    print(f"  errored      {d['errored']}   {d['errored_reasons']}")
    print(f"  dropped      {d['dropped']}   {d['dropped_how']}   (the client left on purpose)")
    if d["unreachable"]:
        print(f"  unreachable  {d['unreachable']}   (the server process was gone)")
    print(f"  lost         {d['lost']}   {d['lost_how']}")
    if counts is not None:
        leaks = {k: counts[k] for k in IDLE_FIELDS}
        print(f"  after the run: {leaks}, kv_blocks_cached={counts['kv_blocks_cached']} (engine {counts['state']})")
    else:
        print("  after the run: the server was gone (no leak figures)")
    print(f"  server exit: {exit_note}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default="", help="the server's FAULTS setting (see core/faults.py)")
    parser.add_argument("--model", default="", help="MODEL for the server (default: the embedded model)")
    parser.add_argument("--dummy-weights", action="store_true", help="DUMMY_WEIGHTS=true (with a preset model)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another server setting")
    parser.add_argument("--prompt-ids", action="store_true", help="send token-id prompts (models without a "
                                                                  "tokenizer)")
    parser.add_argument("--seconds", type=float, default=60.0, help="stop sending after this long")
    parser.add_argument("--requests", type=int, default=200, help="stop sending after this many")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--stall", type=float, default=0.1, help="fraction of clients that stall")
    parser.add_argument("--stall-seconds", type=float, default=3.0)
    parser.add_argument("--drop", type=float, default=0.1, help="fraction of clients that drop")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--exit-timeout", type=float, default=30.0,
                        help="how long a failing server may take to exit by itself")
    parser.add_argument("--settle-seconds", type=float, default=10.0,
                        help="after the load, how long the engine may take to go idle before leaks are read")
    parser.add_argument("--seed", type=int, default=0, help="seed of the load's choices")
    parser.add_argument("--stuck-readers", type=int, default=0,
                        help="after the load, SIGTERM while this many clients hold streams they stopped reading")
    parser.add_argument("--stuck-max-tokens", type=int, default=4000,
                        help="max_tokens of the stuck and the long reading streams (they must outlast the drain)")
    parser.add_argument("--short-max-tokens", type=int, default=16,
                        help="max_tokens of the short reading stream (it should finish during the drain)")
    parser.add_argument("--stuck-timeout", type=float, default=180.0,
                        help="how long the stuck readers' TCP windows may take to fill before the signal")
    parser.add_argument("--json", default="", help="also write the result here")
    args = parser.parse_args(argv)

    server = ServerProcess(server_env(args), args.start_timeout)
    try:
        tally = trio.run(run_load, server.url, args, lambda: server.running)
        if tally.server_failing:  # it is on its way out: let it exit by itself
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.process.wait(args.exit_timeout)
        counts = trio.run(engine_counts, server.url, args.settle_seconds) if server.running else None
        stuck: dict[str, Any] | None = None
        if server.running and args.stuck_readers:
            stuck = stop_with_stuck_readers(server, args)
            exit_code = stuck["exit_code"]
            exit_note = (f"exit status {exit_code} {stuck['seconds_to_exit']} s after SIGTERM with "
                         f"{args.stuck_readers} stuck readers (drain {SHUTDOWN_TIMEOUT:g} s)"
                         f"{', by the watchdog' if stuck['watchdog'] else ''}")
        elif server.running:
            exit_code = server.stop()
            exit_note = f"exit status {exit_code} after SIGTERM"
        else:
            server.process.wait()
            exit_code = server.process.returncode
            fault_time = server.first("injected fault: step_error")
            exit_time = server.exit_time or time.monotonic()
            since = f", {exit_time - fault_time:.1f} s after the injected step_error" if fault_time else ""
            exit_note = f"exited by itself with status {exit_code}{since}"
    finally:
        server.stop()
    orphans = server.orphans()
    if orphans:  # a supervisor's restart would find the device's memory still held: end them, and say so
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        exit_note += f"; its engine process(es) {orphans} outlived it (killed now)"
    print(f"(server started in {server.start_seconds:.1f} s; engine child processes: {server.children or 'none'})")
    result = report(args, tally, counts, exit_code, exit_note)
    result["orphans"] = orphans
    result["stuck_stop"] = stuck
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    leaked = counts is not None and any(counts[k] for k in IDLE_FIELDS)
    return 1 if result["lost"] or leaked or orphans or (stuck is not None and stuck_stop_failed(stuck)) else 0


if __name__ == "__main__":
    sys.exit(main())
