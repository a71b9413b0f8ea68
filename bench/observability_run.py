"""A real observed run for docs/observability.md: ``inference-server serve`` on the embedded model (CPU) with
``TELEMETRY_DIR`` and ``TIMELINE_DIR`` set, a few concurrent clients in three sessions sharing a prompt prefix,
then ``/scheduler/stats`` and ``/metrics`` saved, SIGTERM, and ``inference-server report`` on the run file.

    uv run python bench/observability_run.py --out docs/observability      # ~2-3 minutes on 2 CPU cores

Writes OUT/stats.json, OUT/metrics.txt, OUT/timeline-head.jsonl, the report's summary (OUT/report.txt) and
its PNG plots. This is a demonstration run, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

PREFIX = ("You are a helpful assistant for a travel agency. Answer in one short paragraph and mention one "
          "museum. Question: ")
QUESTIONS = ["What should I see in Paris?", "Where can I eat well in Lyon?", "Is Marseille worth a visit?",
             "What is there to do in Bordeaux?", "How do I spend a day in Nice?", "What is Lille known for?"]


def start(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "inference_server", "serve"], env={**os.environ, **env},
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if "listening on " in line:
            return process, line.split("listening on ", 1)[1].strip()
    raise RuntimeError("the server did not start")


def client(url: str, index: int, requests: int, max_tokens: int) -> None:
    with httpx.Client(base_url=url, timeout=600) as http:
        for k in range(requests):
            question = QUESTIONS[(index + k) % len(QUESTIONS)]
            response = http.post("/generate", json={
                "prompt": PREFIX + question, "max_tokens": max_tokens, "temperature": 0.7, "seed": index * 100 + k,
                "session_id": f"team-{index % 3}"}, headers={"X-Trace-Id": f"client{index}-req{k}"})
            response.raise_for_status()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/observability"))
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--requests", type=int, default=4, help="per client, back to back")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="observability-run-"))
    env = {"HOST": "127.0.0.1", "PORT": "0", "DEVICE": "cpu", "KV_CACHE_TOKENS": "1024", "LOG_LEVEL": "warning",
           "TELEMETRY_DIR": str(folder), "TIMELINE_DIR": str(folder)}
    process, url = start(env)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            http.post("/generate", json={"prompt_token_ids": [2] * 9000, "max_tokens": 4})  # one rejection
            began = time.monotonic()
            threads = [threading.Thread(target=client, args=(url, i, args.requests, args.max_tokens))
                       for i in range(args.clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            print(f"load: {time.monotonic() - began:.1f} s")
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "stats.json").write_text(json.dumps(http.get("/scheduler/stats").json(), indent=2) + "\n")
            (args.out / "metrics.txt").write_text(http.get("/metrics").text)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    [run_file] = folder.glob("run-*.sqlite")
    [timeline] = folder.glob("run-*.jsonl")
    (args.out / "timeline-head.jsonl").write_text("".join(timeline.read_text().splitlines(keepends=True)[:40]))
    report = subprocess.run([sys.executable, "-m", "inference_server", "report", str(run_file), "--out",
                             str(args.out)], capture_output=True, text=True, check=True)
    (args.out / "report.txt").write_text(report.stdout)
    print(report.stdout)
    print(f"run file kept at {run_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
