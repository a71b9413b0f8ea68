"""``inference-server tail``: print a running server's telemetry as it happens (``GET /telemetry/tail``).

One line per event: requests (queued, started, first token, finished, rejected) and, unless ``--no-steps``,
engine steps; ``--session-id`` / ``--trace-id`` keep one tenant's or one request's events. When this reader
falls behind, the server drops events for it and says so; the line ``lost N events`` shows it. ``--json``
prints the server's NDJSON lines unchanged. Standard library only (no HTTP client dependency).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import urllib.parse
from collections.abc import Iterator
from typing import IO, Any


def add_parser(commands: Any) -> None:
    tail = commands.add_parser("tail", help="print a running server's telemetry live")
    tail.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    tail.add_argument("--session-id", default=None, help="only this session's requests")
    tail.add_argument("--trace-id", default=None, help="only this request (its X-Trace-Id)")
    tail.add_argument("--no-steps", action="store_true", help="requests only, no step lines")
    tail.add_argument("--json", action="store_true", help="print the raw NDJSON lines")


def tail_url(args: argparse.Namespace) -> str:
    query = {k: v for k, v in (("session_id", args.session_id), ("trace_id", args.trace_id)) if v}
    if args.no_steps:
        query["steps"] = "0"
    return args.url.rstrip("/") + "/telemetry/tail" + ("?" + urllib.parse.urlencode(query) if query else "")


def read_lines(url: str, timeout: float | None = None) -> Iterator[dict[str, Any]]:
    """The decoded NDJSON lines of the tail route until the server ends the stream."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    try:
        connection.request("GET", parts.path + ("?" + parts.query if parts.query else ""))
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {response.read().decode(errors='replace')}")
        while line := response.readline():
            if line.strip():
                yield json.loads(line)
    finally:
        connection.close()


def describe(line: dict[str, Any]) -> str:
    """One human-readable line for a tail event."""
    kind = line.get("event")
    t = f"{line['t']:12.3f}" if "t" in line else " " * 12
    if kind == "step":
        return (f"{t} step {line['step_id']:>6}  seqs {line['sequences']:>4}  prefill {line['prefill_tokens']:>5}  "
                f"decode {line['decode_tokens']:>4}  waiting {line['waiting']:>4}  running {line['running']:>4}  "
                f"kv {100 * line['kv_usage']:5.1f}%  {1000 * line['seconds']:7.2f} ms"
                + (f"  preempted {line['preempted']}" if line["preempted"] else ""))
    if kind == "queued":
        return (f"{t} queued   #{line['request_id']}  trace {line['trace_id']}  session {line['session_id']}  "
                f"prompt {line['prompt_tokens']}  priority {line['priority']}")
    if kind == "started":
        return f"{t} started  #{line['request_id']}  cached {line['cached_prompt_tokens']}"
    if kind == "first_token":
        return f"{t} first    #{line['request_id']}  ttft {1000 * line['ttft']:.1f} ms"
    if kind == "finished":
        error = f"  error {line['error']}" if line.get("error") else ""
        return (f"{t} finished #{line['request_id']}  {line['finish_reason']}  out {line['output_tokens']}  "
                f"e2e {line['e2e']:.3f} s  trace {line['trace_id']}{error}")
    if kind == "rejected":
        return f"{t} rejected trace {line['trace_id']}  {line['code']}: {line['message']}"
    if kind == "kv_blocks":
        return f"{t} kv blocks seq {line['seq']}  stored {line['stored']}  removed {line['removed']}"
    if kind == "lost":
        return f"{'':12} lost {line['events']} events (this reader fell behind; {line['total']} in all)"
    if kind == "subscribed":
        return f"{'':12} tailing (filter: session {line['session_id']}, trace {line['trace_id']})"
    return json.dumps(line)


def run(args: argparse.Namespace, out: IO[str] = sys.stdout) -> int:
    url = tail_url(args)
    try:
        for line in read_lines(url):
            print(json.dumps(line) if args.json else describe(line), file=out, flush=True)
    except (OSError, RuntimeError) as error:
        print(f"error: cannot tail {url}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
