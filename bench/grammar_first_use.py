"""Does a server's first structured-output request freeze the other streams? A benchmark, not a test.

Launches ``inference-server serve`` (the embedded model on the CPU unless the environment says otherwise), times
launch -> ``/ready`` 200, then streams one unconstrained completion (``ignore_eos``) and, once it has produced
``--lead`` tokens, sends the server's first constrained request (a ``json_schema`` ``response_format``), streamed
too. Prints the unconstrained stream's worst inter-token gap while the constrained request was in flight (and its
median over the whole stream, for scale), the constrained request's TTFT, and the server's start-up phases.

    uv run python bench/grammar_first_use.py --port 18120                          # ENGINE_PROCESS=auto
    uv run python bench/grammar_first_use.py --port 18121 --engine-process separate

Figures and the fix they led to: the commits that touch ``core/grammar_compiler.py`` and ``engine_factory.py``.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kit.server_process import launched

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def stream_events(port: int, body: dict[str, object]) -> Iterator[float]:
    """POST ``body`` to ``/v1/completions`` with ``stream: true``; the arrival time of each event that carries
    text."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {response.read()[:400]!r}")
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if any(choice.get("text") for choice in event.get("choices", [])):
            yield time.perf_counter()
    connection.close()


def measure(port: int, lead: int, tokens: int, *, constrained_request: bool = True) -> dict[str, float]:
    """One unconstrained stream and, after ``lead`` of its tokens, the first constrained request (or, with
    ``constrained_request`` false, the same request without its constraint: what any second request costs)."""
    arrivals: list[float] = []
    window: dict[str, float] = {}
    lead_reached = threading.Event()

    def unconstrained() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True,
                "temperature": 0}
        try:
            for arrival in stream_events(port, body):
                arrivals.append(arrival)
                if len(arrivals) == lead:
                    lead_reached.set()
        finally:
            lead_reached.set()

    def constrained() -> None:
        lead_reached.wait()
        body: dict[str, object] = {"prompt": "A person as JSON:", "max_tokens": 40, "temperature": 0}
        if constrained_request:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
        window["sent"] = time.perf_counter()
        first = None
        for arrival in stream_events(port, body):
            first = first or arrival
        window["first"] = first or time.perf_counter()
        window["done"] = time.perf_counter()

    threads = [threading.Thread(target=unconstrained), threading.Thread(target=constrained)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gaps = [(b - a, b) for a, b in itertools.pairwise(arrivals)]
    in_window = [gap for gap, end in gaps if window["sent"] < end <= window["done"] + 0.5]
    return {"worst_gap_s": max(in_window, default=float("nan")),
            "median_gap_s": statistics.median(gap for gap, _ in gaps),
            "constrained_ttft_s": window["first"] - window["sent"], "stream_tokens": len(arrivals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine-process", default="auto", choices=("auto", "in-process", "separate"))
    parser.add_argument("--lead", type=int, default=20, help="unconstrained tokens before the constrained request")
    parser.add_argument("--tokens", type=int, default=200, help="the unconstrained stream's length")
    parser.add_argument("--control", action="store_true",
                        help="also measure, after the constrained request, an unconstrained second request")
    args = parser.parse_args()
    env = {"PORT": str(args.port), "DEVICE": "cpu", "LOG_LEVEL": "info", "ENGINE_PROCESS": args.engine_process}
    log_path = Path(f"/tmp/grammar_first_use-{args.port}.log")
    started = time.perf_counter()
    with launched(env, log_path, ready_timeout=300) as _:
        ready = time.perf_counter() - started
        figures = measure(args.port, args.lead, args.tokens)
        control = measure(args.port, args.lead, args.tokens, constrained_request=False) if args.control else None
    print(f"ENGINE_PROCESS={args.engine_process}: /ready after {ready:.1f} s")
    print("  first constrained request: TTFT {constrained_ttft_s:.3f} s; unconstrained stream meanwhile: worst gap "
          "{worst_gap_s:.3f} s (median over its {stream_tokens} tokens {median_gap_s:.3f} s)".format(**figures))
    if control is not None:
        print("  control, the same request unconstrained: TTFT {constrained_ttft_s:.3f} s; the stream's worst gap "
              "{worst_gap_s:.3f} s (median {median_gap_s:.3f} s)".format(**control))
    for line in log_path.read_text(errors="replace").splitlines():
        if "start-up phases" in line or "grammar" in line:
            print("  " + line.split(": ", 1)[-1] if "start-up phases" in line else "  " + line)


if __name__ == "__main__":
    main()
