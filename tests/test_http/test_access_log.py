"""The access log: one line per request once its response is sent (streams included), with tokens in / out,
TTFT and the trace id; ``ACCESS_LOG=false`` turns it off."""

from __future__ import annotations

import logging
import re

import pytest
import trio
from http_testkit import word_engine

from inference_server.config import Settings
from inference_server.http.access_log import AccessRecord
from inference_server.records.requests import RequestUpdate, TokenOutput

LINE = re.compile(r"(?P<method>\S+) (?P<path>\S+) (?P<status>\S+) trace=(?P<trace>\S+) in=(?P<in>\S+) "
                  r"out=(?P<out>\S+) ttft=(?P<ttft>\S+) total=(?P<total>[0-9.]+)s$")


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, str]]:
    lines = [r.getMessage() for r in caplog.records if r.name == "inference_server.access"]
    matches = [LINE.match(line) for line in lines]
    assert all(matches), lines
    return [m.groupdict() for m in matches if m]


async def test_one_line_per_request_with_tokens_and_trace(serve, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inference_server.access")
    async with serve() as served:
        await served.client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 3, "n": 2},
                                 headers={"X-Trace-Id": "trace-1"})
        streamed = await served.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True},
            headers={"X-Trace-Id": "trace-2"})
        await streamed.get_data()
        await served.client.get("/health", headers={"X-Trace-Id": "trace-3"})
        await served.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 0},
                                 headers={"X-Trace-Id": "trace-4"})
    lines = {line["trace"]: line for line in access_lines(caplog)}
    completion = lines["trace-1"]
    assert (completion["method"], completion["path"], completion["status"]) == ("POST", "/v1/completions", "200")
    assert completion["in"] == "6" and completion["out"] == "6"  # 2 choices x (3 prompt, 3 generated)
    assert completion["ttft"].endswith("s") and float(completion["ttft"][:-1]) <= float(completion["total"])
    chat = lines["trace-2"]
    assert chat["status"] == "200" and chat["in"] == "7" and chat["out"] == "4"
    health = lines["trace-3"]
    assert (health["path"], health["in"], health["out"], health["ttft"]) == ("/health", "-", "-", "-")
    assert lines["trace-4"]["status"] == "400" and lines["trace-4"]["in"] == "-"
    assert len(lines) == 4


async def test_access_log_off(serve, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="inference_server.access")
    async with serve(settings=Settings(access_log=False)) as served:
        assert (await served.client.get("/health")).status_code == 200
    assert not [r for r in caplog.records if r.name == "inference_server.access"]


def test_record_line_format() -> None:
    record = AccessRecord(started=10.0)
    record.admitted(5)
    record.observe(RequestUpdate(1, ()))
    assert record.first_token_at is None and record.completion_tokens == 0
    record.observe(RequestUpdate(1, (TokenOutput(7, "x", -0.1), TokenOutput(8, "y", -0.2))))
    record.first_token_at = 10.25
    assert record.line("POST", "/generate", 200, "t", 12.5) == \
        "POST /generate 200 trace=t in=5 out=2 ttft=0.250s total=2.500s"


async def test_a_client_that_leaves_before_the_answer_is_logged_with_its_trace(
        serve, caplog: pytest.LogCaptureFixture) -> None:
    """A non-streamed request whose client leaves before the response starts has no response headers to read
    the trace id from: its line used to say ``trace=-``, so the one request an operator looks for (an abort)
    could not be matched with its telemetry. The trace id is taken from the request as it is admitted."""
    caplog.set_level(logging.INFO, logger="inference_server.access")
    async with serve(word_engine(step_seconds=0.1)) as served:
        with trio.move_on_after(0.5):
            await served.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 40},
                                     headers={"X-Trace-Id": "left-1"})
        with trio.fail_after(30):
            while not any(r.name == "inference_server.access" for r in caplog.records):
                await trio.sleep(0.01)
    (line,) = access_lines(caplog)
    assert (line["status"], line["trace"], line["in"]) == ("-", "left-1", "2")
