"""The server with its engine in a child process (``ENGINE_PROCESS=separate``), as real processes on a loopback
socket: streams, a client leaving, backpressure, the engine dying, the front dying, and a group signal's drain.

The engine process runs the word engine (``http_testkit.split_word_parts``: token-id prompts, each step
``SPLIT_STEP_SECONDS`` long); one test serves the tiny Gemma 4 checkpoint through ``inference-server serve``.
Every wait is on a condition with a generous bound, never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from test_serve_process import write_checkpoint

from inference_server.config import Settings
from inference_server.server import DUPLICATE_SIGNAL_SECONDS, engine_process_mode
from kit.server_process import wait_for_url

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the engine's pid")

HERE = Path(__file__).parent
REPO = Path(__file__).parents[2]
START_TIMEOUT = 120.0
BOUND = 60.0
"""Seconds any awaited condition may take on a loaded 2-core machine (none is a timing assertion)."""


class SplitServer:
    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        """The server process's children (the engine process, with a separate engine)."""
        pid = self.process.pid
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]

    def engine_pid(self) -> int:
        """The engine process: the front's only child."""
        children = self.children()
        assert len(children) == 1, children
        return children[0]


def server_code(**settings: Any) -> str:
    values = dict(host="127.0.0.1", port=0, log_level="info", shutdown_timeout=120.0) | settings
    return ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "from inference_server.config import Settings\n"
            "from inference_server.server import run_split_server\n"
            f"sys.exit(run_split_server(Settings(**{values!r}), tokenizer=lambda: None,\n"
            "                          engine_factory='http_testkit:split_word_parts'))\n")


@contextmanager
def split_server(tmp_path: Path, *, env: dict[str, str] | None = None, new_session: bool = False,
                 **settings: Any) -> Iterator[SplitServer]:
    """A front running ``run_split_server`` with the word engine in its child; killed (both) on exit."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]), **(env or {})}
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen([sys.executable, "-c", server_code(**settings)], cwd=tmp_path, env=environment,
                                   stdout=subprocess.PIPE, stderr=log_file, start_new_session=new_session)
    url = wait_for_url(process, START_TIMEOUT)
    engine_pid: int | None = None
    try:
        if url is None:
            pytest.fail(f"the server did not start:\n{log_path.read_text()}")
        server = SplitServer(process, url, log_path)
        engine_pid = server.engine_pid()
        yield server
    finally:
        kill_both(process, engine_pid)


def kill_both(front: subprocess.Popen[bytes], engine_pid: int | None) -> None:
    """A test's cleanup: the front killed and reaped if it still runs, then the engine process if it is left."""
    if front.poll() is None:
        front.kill()
        front.wait()
    if engine_pid is not None and is_running(engine_pid):
        os.kill(engine_pid, signal.SIGKILL)


def is_running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition: Callable[[], bool], what: str, server: SplitServer) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {BOUND} s:\n{server.log()}")
        time.sleep(0.05)  # a probe interval: the loop ends on the condition


def stream_events(http: httpx.Client, url: str, body: dict[str, Any],
                  on_event: Callable[[int], None] = lambda _: None) -> list[str]:
    """Every ``data:`` payload of a ``/generate`` stream; ``on_event(n)`` after the n-th."""
    data: list[str] = []
    with http.stream("POST", url + "/generate", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data.append(line[len("data: "):])
                on_event(len(data))
    return data


def engine_counts(http: httpx.Client, url: str) -> dict[str, Any]:
    response = http.get(url + "/debug/engine")
    assert response.status_code == 200
    return response.json()


def metric(http: httpx.Client, url: str, line_prefix: str) -> float:
    for line in http.get(url + "/metrics").text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_stream_completes_and_every_route_sees_the_engine(tmp_path: Path) -> None:
    with split_server(tmp_path) as server, httpx.Client(timeout=BOUND) as http:
        assert http.get(server.url + "/ready").json()["status"] == "ready"
        assert [m["id"] for m in http.get(server.url + "/v1/models").json()["data"]] == ["tiny-test"]
        data = stream_events(http, server.url, {"prompt_token_ids": [2, 9], "max_tokens": 24, "ignore_eos": True,
                                                "stream": True})
        assert data[-1] == "[DONE]"
        events = [json.loads(d) for d in data[:-1]]
        assert sum(len(e["token_ids"]) for e in events) == 24 and events[-1]["finish_reason"] == "length"
        # The engine's telemetry reaches the front's metrics and stats; its counts read zero once idle.
        length_done = 'vllm:request_success_total{finished_reason="length",model_name="tiny-test"}'
        wait_until(lambda: metric(http, server.url, length_done) == 1.0, "the finish in /metrics", server)
        stats = http.get(server.url + "/scheduler/stats").json()
        assert stats["window_last_1000_requests"]["latency_seconds"]["ttft"]["count"] == 1
        counts = engine_counts(http, server.url)
        assert counts["state"] == "ready"
        assert {k: counts[k] for k in ("requests", "stream_entries", "kv_sequences", "kv_blocks_in_use")} == dict(
            requests=0, stream_entries=0, kv_sequences=0, kv_blocks_in_use=0)
        # Compiling a constraint is a call to the engine: this one has no grammar engine (no tokenizer).
        refused = http.post(server.url + "/generate", json={"prompt_token_ids": [2, 9], "regex": "a+"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "regex", refused.text
        with http.stream("GET", server.url + "/kv/events") as feed:
            first = json.loads(next(feed.iter_lines()))
        assert first["event"] == "snapshot" and first["block_size"] == 4 and len(first["hashes"]) >= 1
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=BOUND) == 0, server.log()
    assert "the engine process exits (drained)" in server.log()


def test_a_client_leaving_mid_stream_aborts_in_the_engine(tmp_path: Path) -> None:
    with split_server(tmp_path, env={"SPLIT_STEP_SECONDS": "0.05"}) as server, \
            httpx.Client(timeout=BOUND) as http:
        body = {"prompt_token_ids": [2, 9], "max_tokens": 250, "ignore_eos": True, "stream": True}
        with http.stream("POST", server.url + "/generate", json=body) as response:
            received: list[str] = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    received.append(line)
                    if len(received) == 3:
                        break  # the client leaves: the connection closes with the stream open
        aborted = 'vllm:request_success_total{finished_reason="abort",model_name="tiny-test"}'
        wait_until(lambda: metric(http, server.url, aborted) == 1.0, "the abort in the engine", server)

        def idle() -> bool:
            counts = engine_counts(http, server.url)
            return counts["requests"] == counts["stream_entries"] == counts["kv_blocks_in_use"] == 0

        wait_until(idle, "an idle engine", server)
        length_done = 'vllm:request_success_total{finished_reason="length",model_name="tiny-test"}'
        assert metric(http, server.url, length_done) == 0.0  # it was cut, not run to its end


def test_backpressure_across_the_boundary_is_429(tmp_path: Path) -> None:
    """The engine's steps wait on a file (a stalled engine): one request runs, a few fill the engine's queues
    (``MAX_QUEUE_SIZE=1``, ``MAX_BATCH_SIZE=1``), and the rest are refused with 429 and ``Retry-After`` at once."""
    gate = tmp_path / "gate"
    with split_server(tmp_path, env={"SPLIT_GATE_FILE": str(gate)}, max_queue_size=1, max_batch_size=1) as server:
        statuses: list[httpx.Response] = []
        lock = threading.Lock()

        def request() -> None:
            with httpx.Client(timeout=BOUND * 2) as http:
                response = http.post(server.url + "/generate", json={"prompt_token_ids": [2, 9], "max_tokens": 1})
            with lock:
                statuses.append(response)

        threads = [threading.Thread(target=request) for _ in range(12)]
        for thread in threads:
            thread.start()
        wait_until(lambda: any(r.status_code == 429 for r in statuses), "a 429", server)
        gate.touch()
        for thread in threads:
            thread.join(BOUND)
        assert not any(thread.is_alive() for thread in threads)
        codes = sorted(r.status_code for r in statuses)
        assert set(codes) == {200, 429} and len(codes) == 12, codes
        refused = next(r for r in statuses if r.status_code == 429)
        assert refused.json()["error"]["code"] == "overloaded" and int(refused.headers["retry-after"]) >= 1


def test_the_engine_dying_mid_stream_ends_the_stream_and_the_front(tmp_path: Path) -> None:
    with split_server(tmp_path, env={"SPLIT_STEP_SECONDS": "0.05"}) as server, \
            httpx.Client(timeout=BOUND) as http:
        engine_pid = server.engine_pid()

        def kill_engine(count: int) -> None:
            if count == 3:
                os.kill(engine_pid, signal.SIGKILL)

        body = {"prompt_token_ids": [2, 9], "max_tokens": 250, "ignore_eos": True, "stream": True}
        data = stream_events(http, server.url, body, kill_engine)
        assert data[-1] == "[DONE]"
        final = json.loads(data[-2])
        assert final["finish_reason"] == "error", final
        assert server.process.wait(timeout=BOUND) == 1, server.log()
        assert not is_running(engine_pid)
    assert f"the engine process (pid {engine_pid}) died" in server.log()


def test_the_front_dying_ends_the_engine(tmp_path: Path) -> None:
    with split_server(tmp_path, env={"SPLIT_STEP_SECONDS": "0.05"}) as server:
        engine_pid = server.engine_pid()
        started = threading.Event()

        def stream() -> None:
            body = {"prompt_token_ids": [2, 9], "max_tokens": 250, "ignore_eos": True, "stream": True}
            try:
                with httpx.Client(timeout=BOUND) as http, http.stream("POST", server.url + "/generate",
                                                                       json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            started.set()
            except httpx.HTTPError:
                pass  # the front is killed mid-stream: its connection breaks
            started.set()

        thread = threading.Thread(target=stream, daemon=True)
        thread.start()
        assert started.wait(BOUND), server.log()
        server.process.kill()
        server.process.wait()
        wait_until(lambda: not is_running(engine_pid), "the engine's exit", server)


def test_the_front_dying_while_the_engine_starts_ends_the_engine(tmp_path: Path) -> None:
    """An engine process wedged in its start-up (no event loop yet, so no socket EOF is read) dies with its
    front: ``PR_SET_PDEATHSIG``."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]),
                   "SPLIT_START_FILE": str(tmp_path / "never")}
    with (tmp_path / "server.log").open("wb") as log_file:
        process = subprocess.Popen([sys.executable, "-c", server_code()], cwd=tmp_path, env=environment,
                                   stdout=subprocess.DEVNULL, stderr=log_file)
    engine_pid: int | None = None
    try:
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
        deadline = time.monotonic() + START_TIMEOUT
        while engine_pid is None and time.monotonic() < deadline:
            listed = children.read_text().split()
            engine_pid = int(listed[0]) if listed else None
            time.sleep(0.05)  # a probe interval: the loop ends on the condition
        assert engine_pid is not None, (tmp_path / "server.log").read_text()
        process.kill()
        process.wait()
        deadline = time.monotonic() + BOUND
        while is_running(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_running(engine_pid)
    finally:
        kill_both(process, engine_pid)


def test_a_group_signal_delivered_twice_drains_once(tmp_path: Path) -> None:
    """SIGTERM to the whole process group twice, 48 ms apart (``uv run``'s forwarding): the engine ignores both
    and the front takes them as one stop, so the in-flight stream drains to its end and both exit 0."""
    with split_server(tmp_path, env={"SPLIT_STEP_SECONDS": "0.05"}, new_session=True) as server, \
            httpx.Client(timeout=BOUND) as http:
        engine_pid = server.engine_pid()

        def signal_group(count: int) -> None:
            if count == 1:
                os.killpg(server.process.pid, signal.SIGTERM)
                time.sleep(0.048)
                os.killpg(server.process.pid, signal.SIGTERM)

        body = {"prompt_token_ids": [2, 9], "max_tokens": 60, "ignore_eos": True, "stream": True}
        data = stream_events(http, server.url, body, signal_group)
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["finish_reason"] == "length"
        assert sum(len(json.loads(d)["token_ids"]) for d in data[:-1]) == 60
        assert server.process.wait(timeout=BOUND) == 0, server.log()
        wait_until(lambda: not is_running(engine_pid), "the engine's exit", server)
    log_text = server.log()
    assert "the same stop" in log_text and "ending in-flight requests now" not in log_text, log_text
    assert "the engine process exits (drained)" in log_text


@contextmanager
def serving_checkpoint(tmp_path: Path, **settings: str) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """``inference-server serve`` with ``ENGINE_PROCESS=separate`` on a tiny real checkpoint (``settings`` added to
    its environment): yields the front process, its URL and its log file; killed if still running at the end."""
    checkpoint = write_checkpoint(tmp_path / "tiny-gemma")
    env = {**os.environ, "MODEL": str(checkpoint), "DEVICE": "cpu", "HOST": "127.0.0.1", "PORT": "0",
           "SERVED_MODEL_NAME": "tiny", "ENGINE_PROCESS": "separate", "LOG_LEVEL": "info", **settings}
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "inference_server", "serve"], cwd=tmp_path, env=env,
                                   stdout=subprocess.PIPE, stderr=log_file)
    try:
        url = wait_for_url(process, START_TIMEOUT)
        assert url is not None, log_path.read_text()
        yield process, url, log_path
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_with_a_separate_engine_process_serves_the_checkpoint(tmp_path: Path) -> None:
    """``inference-server serve`` with ``ENGINE_PROCESS=separate``: the front loads the tokenizer (chat template,
    detokenised text), the child the model."""
    with serving_checkpoint(tmp_path) as (process, url, log_path):
        client = openai.OpenAI(api_key="unused", base_url=url + "/v1", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                                max_completion_tokens=12, stream=True,
                                                extra_body={"ignore_eos": True})
        text, finish = "", None
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert finish == "length" and len(text.split()) == 12
        # A constraint compiles in the engine process (a call across the boundary); the grammar engine there
        # refuses this word-level test tokenizer, and the refusal comes back as the 400 naming the field.
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                           max_completion_tokens=8, response_format={"type": "json_object"})
        assert refused.value.param == "response_format" and "tokenizer" in str(refused.value)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=BOUND) == 0, log_path.read_text()
    assert "engine process started" in log_path.read_text()


def test_a_second_signal_ends_the_engines_requests_now(tmp_path: Path) -> None:
    """SIGTERM, then another after the duplicate window: the front sends ``Drain(0)``, the engine ends its
    in-flight stream with the shutdown error at once (the fake steps make the stream last at least 12.5 s), and
    both processes exit 0."""
    with split_server(tmp_path, env={"SPLIT_STEP_SECONDS": "0.05"}) as server, \
            httpx.Client(timeout=BOUND) as http:
        engine_pid = server.engine_pid()
        first_signal_at: list[float] = []

        def signal_front(count: int) -> None:
            if count == 1:
                server.process.send_signal(signal.SIGTERM)
                first_signal_at.append(time.monotonic())
                wait_until(lambda: http.get(server.url + "/ready").status_code == 503, "draining", server)
                # past the duplicate window: a protocol rule, not a timing guess
                time.sleep(max(0.0, first_signal_at[0] + DUPLICATE_SIGNAL_SECONDS + 0.5 - time.monotonic()))
                server.process.send_signal(signal.SIGTERM)

        body = {"prompt_token_ids": [2, 9], "max_tokens": 250, "ignore_eos": True, "stream": True}
        data = stream_events(http, server.url, body, signal_front)
        assert data[-1] == "[DONE]"
        final = json.loads(data[-2])
        assert final["finish_reason"] == "error" and final["error"]["code"] == "shutdown", final
        assert server.process.wait(timeout=BOUND) == 0, server.log()
        wait_until(lambda: not is_running(engine_pid), "the engine's exit", server)
    assert "ending in-flight requests now" in server.log()


def test_tokenizer_faults_reach_the_front_that_tokenizes(tmp_path: Path) -> None:
    """``FAULTS=tokenizer_error=1`` with ``ENGINE_PROCESS=separate``: the front tokenizes the prompts, so it
    is the front's tokenizer that must fail. The wrapper used to go only on the engine process's tokenizer,
    which never sees a text prompt there: the fault was silently off and every request was served."""
    with serving_checkpoint(tmp_path, FAULTS="tokenizer_error=1") as (process, url, log_path), \
            httpx.Client(timeout=BOUND) as http:
        for path, body in [("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "hello"}]})]:
            response = http.post(url + path, json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "invalid_request" and "injected tokenizer_error" in error["message"]
        served = http.post(url + "/generate", json={"prompt_token_ids": [5, 6, 7], "max_tokens": 2})
        assert served.status_code == 200, served.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=BOUND) == 0, log_path.read_text()


def test_auto_runs_the_engine_in_its_own_process_where_the_model_runs_on_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_process_mode(Settings()) == "separate"
    assert engine_process_mode(Settings(device="cpu")) == "in-process"
    assert engine_process_mode(Settings(engine_process="in-process")) == "in-process"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_process_mode(Settings()) == "in-process"
    assert engine_process_mode(Settings(device="cpu", engine_process="separate")) == "separate"
