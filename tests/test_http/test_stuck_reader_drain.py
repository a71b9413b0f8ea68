"""SIGTERM while a client holds a stream it stopped reading: the drain still ends on time, in both engine modes.

A real server process (the word engine, in process or in its engine process) serves three streams: one whose
client never reads (a raw socket with a small receive buffer: the server's writes to it stick on a full TCP
window, seen in ``/proc/net/tcp``), one short and one long stream that are read. SIGTERM with a short drain: the
short stream finishes, the long one gets its ``shutdown`` error event and ``[DONE]`` at the drain deadline, the
stuck client's connection is closed, and the process exits 0 soon after the deadline, by its own stop sequence:
the hard-exit watchdog is moved out of reach (``HARD_EXIT_GRACE_SECONDS``), so only that sequence can end the
process within the bound. No engine process outlives the server. Every wait is on a condition, with a generous
bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_split_server import SplitServer, is_running, kill_both, metric

from kit.server_process import wait_for_url
from kit.stuck_reader import StuckReader, stuck_when

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/net/tcp (stuck writes) and /proc for the engine's pid")

HERE = Path(__file__).parent
REPO = Path(__file__).parents[2]
DRAIN = 3.0
"""SHUTDOWN_TIMEOUT: the long streams are still running at its deadline."""
EXIT_BOUND = DRAIN + 20.0
"""Seconds from SIGTERM to the exit: the drain, the 2 s flush, the teardown, and room for a loaded 2-core machine."""
WATCHDOG_GRACE = 600.0
"""The hard-exit watchdog's grace in these servers: far beyond ``EXIT_BOUND``."""
BOUND = 90.0
"""Seconds any other awaited condition may take (none is a timing assertion)."""
LONG_TOKENS = 1800
GENERATED = 'vllm:generation_tokens_total{model_name="tiny-test"}'


def server_code(mode: str) -> str:
    """The server's ``python -c`` program: the word engine (10 ms steps, a 2,048-token context), the watchdog
    out of reach."""
    settings = dict(host="127.0.0.1", port=0, log_level="info", shutdown_timeout=DRAIN)
    head = ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "import inference_server.server as server\n"
            f"server.HARD_EXIT_GRACE_SECONDS = {WATCHDOG_GRACE}\n"
            "from inference_server.config import Settings\n")
    if mode == "separate":
        return head + (f"sys.exit(server.run_split_server(Settings(**{settings!r}), tokenizer=lambda: None,\n"
                       "                                 engine_factory='http_testkit:split_word_parts'))\n")
    return head + ("from http_testkit import make_parts, word_engine\n"
                   "parts = make_parts(word_engine(step_seconds=0.01), None, max_model_len=2048, num_blocks=1600)\n"
                   f"sys.exit(server.run_server(parts, Settings(**{settings!r})))\n")


@contextmanager
def serving(tmp_path: Path, mode: str) -> Iterator[SplitServer]:
    """The server in ``mode`` (``in-process`` or ``separate``); killed, with its engine process, on exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]), "SPLIT_STEP_SECONDS": "0.01",
           "SPLIT_MAX_MODEL_LEN": "2048"}
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen([sys.executable, "-c", server_code(mode)], cwd=tmp_path, env=env,
                                   stdout=subprocess.PIPE, stderr=log_file)
    url = wait_for_url(process, BOUND)
    engine_pid: int | None = None
    try:
        if url is None:
            pytest.fail(f"the server did not start:\n{log_path.read_text()}")
        server = SplitServer(process, url, log_path)
        if mode == "separate":
            [engine_pid] = server.children()
        yield server
    finally:
        kill_both(process, engine_pid)


def read_stream(url: str, body: dict[str, Any], events: list[Any], first: threading.Event) -> None:
    """A client that reads: every ``data:`` payload of a ``/generate`` stream into ``events``."""
    try:
        with httpx.Client(timeout=BOUND) as http, http.stream("POST", url + "/generate", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    first.set()
    finally:
        first.set()


def start_reader(url: str, max_tokens: int) -> tuple[threading.Thread, list[Any]]:
    events: list[Any] = []
    first = threading.Event()
    body = {"prompt_token_ids": [2, 9], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    thread = threading.Thread(target=read_stream, args=(url, body, events, first), daemon=True)
    thread.start()
    assert first.wait(BOUND) and events, "a reading stream did not start"
    return thread, events


@pytest.mark.parametrize("mode", ["in-process", "separate"])
def test_a_client_that_stopped_reading_does_not_hold_the_drain(tmp_path: Path, mode: str) -> None:
    with serving(tmp_path, mode) as server, httpx.Client(timeout=BOUND) as http:
        engine_pids = server.children()
        stuck = StuckReader(server.url, "/generate", {"prompt_token_ids": [3, 7], "max_tokens": LONG_TOKENS,
                                                      "logprobs": 5, "ignore_eos": True, "stream": True})
        try:
            assert stuck_when([stuck], lambda: metric(http, server.url, GENERATED), min_progress=40,
                              timeout=BOUND), f"the server's writes to the stuck client never stuck:\n{server.log()}"
            long_thread, long_events = start_reader(server.url, LONG_TOKENS)
            short_thread, short_events = start_reader(server.url, 24)
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            try:
                code = server.process.wait(EXIT_BOUND)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {EXIT_BOUND:g} s after SIGTERM (drain {DRAIN:g} s):\n{server.log()}")
            exit_seconds = time.monotonic() - signalled
            received, ending = stuck.read_all(BOUND)
        finally:
            stuck.close()
        short_thread.join(BOUND)
        long_thread.join(BOUND)
    log = server.log()
    assert code == 0, log
    assert exit_seconds >= DRAIN - 0.5, (exit_seconds, log)  # the long streams held the drain to its deadline
    assert ending in ("reset", "eof"), (ending, received[-200:])  # the connection is closed, not left hanging
    assert short_events[-1] == "[DONE]" and short_events[-2]["finish_reason"] == "length", short_events[-3:]
    assert sum(len(e["token_ids"]) for e in short_events[:-1]) == 24
    assert long_events[-1] == "[DONE]" and long_events[-2]["error"]["code"] == "shutdown", long_events[-3:]
    # Closed by the stop sequence, found by its client's address (not only by HTTP's later sweep); no watchdog.
    assert "(their clients stopped reading): closed 1 connections" in log and "exiting now" not in log, log
    assert not any(is_running(pid) for pid in engine_pids), log
