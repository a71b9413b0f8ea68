"""``/metrics``, ``/scheduler/stats`` and ``/telemetry/tail`` against a fake engine under the mock clock:
every metric family is present and moves during a run, the stats document adds up, and a tail reader that
falls behind is told how many events it lost."""

from __future__ import annotations

import json

import pytest
import trio
from http_testkit import MODEL_NAME, MOVING_FAMILIES, post_stream, word_engine
from prometheus_client.parser import text_string_to_metric_families

from inference_server.telemetry.events import RequestStarted

PROMPT = [2, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]  # 12 token ids: three full 4-token blocks



async def scrape(client) -> dict[str, dict[str, float]]:
    """family -> {sample name + labels: value} (the sum over label sets is what the tests compare)."""
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    text = (await response.get_data()).decode()
    families: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL_NAME, sample
            samples[sample.name + json.dumps(sample.labels, sort_keys=True)] = sample.value
    return families


def total(families: dict[str, dict[str, float]], family: str, suffix: str) -> float:
    return sum(v for k, v in families.get(family, {}).items() if k.startswith(family + suffix + "{"))


def peak(families: dict[str, dict[str, float]], family: str, suffix: str) -> float:
    return max((v for k, v in families.get(family, {}).items() if k.startswith(family + suffix + "{")), default=0.0)


async def test_every_metric_family_is_present_and_moves_during_a_run(serve, autojump_clock) -> None:
    # 24 blocks of 4 tokens: three requests of 12 + 40 tokens cannot all run to the end (preemption).
    async with serve(word_engine(step_seconds=0.01), num_blocks=24) as served:
        client = served.client
        before = await scrape(client)
        assert set(MOVING_FAMILIES) <= set(before), set(MOVING_FAMILIES) - set(before)
        seen_gauges: dict[str, float] = {}

        async def one(session: str, max_tokens: int) -> None:
            result = await post_stream(client, "/generate", {"prompt_token_ids": PROMPT, "max_tokens": max_tokens,
                                                             "ignore_eos": True, "stream": True,
                                                             "session_id": session})
            assert result.status == 200

        async def watch_gauges() -> None:
            for _ in range(40):
                await trio.sleep(0.02)
                families = await scrape(client)
                for family in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                               "inference_server:kv_cache_usage_perc", "inference_server:num_requests_preempted"):
                    seen_gauges[family] = max(seen_gauges.get(family, 0.0), peak(families, family, ""))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_gauges)
            for i in range(4):
                nursery.start_soon(one, f"tenant-{i % 2}", 40)
        rejected = await client.post("/generate", json={"prompt_token_ids": [2] * 500, "max_tokens": 4})
        assert rejected.status_code == 400
        after = await scrape(client)

    for family, suffix in MOVING_FAMILIES.items():
        if suffix == "":
            assert seen_gauges.get(family, 0.0) > 0, family
        else:
            assert total(after, family, suffix) > total(before, family, suffix), family
    assert total(after, "vllm:request_success", "_total") == 4
    assert total(after, "vllm:generation_tokens", "_total") == 4 * 40
    sessions = {k for k in after["inference_server:session_tokens"] if "tenant-" in k}
    assert len(sessions) == 2
    assert after["inference_server:telemetry_dropped_events"]  # present (inbox, subscribers)


async def test_stats_document(serve, autojump_clock) -> None:
    async with serve(word_engine(step_seconds=0.01)) as served:
        for _ in range(3):  # the same prompt three times: the later ones hit the prefix cache
            result = await post_stream(served.client, "/generate", {"prompt_token_ids": PROMPT, "max_tokens": 10,
                                                                    "ignore_eos": True, "stream": True})
            assert result.status == 200
        await served.client.post("/generate", json={"prompt_token_ids": [2] * 500, "max_tokens": 4})
        response = await served.client.get("/scheduler/stats")
        stats = await response.get_json()
    assert stats["model"] == MODEL_NAME
    for window in ("window_last_60s", "window_last_1000_requests"):
        latency = stats[window]["latency_seconds"]
        assert latency["e2e"]["count"] == 3 and latency["ttft"]["count"] == 3 and latency["queue_time"]["count"] == 3
        assert latency["itl"]["count"] == 3 * 9  # 10 tokens: 9 gaps each
        assert latency["itl"]["p50"] == pytest.approx(0.01, rel=0.02)  # one fake step per token
        assert latency["e2e"]["p50"] <= latency["e2e"]["p99"]
    assert stats["window_last_60s"]["throughput_tokens_per_second"]["output"] > 0
    assert stats["requests"]["finished_by_reason"] == {"length": 3}
    assert stats["requests"]["running"] == 0 and stats["requests"]["waiting"] == 0
    prefix = stats["kv_cache"]["prefix_cache"]
    assert prefix["queried_tokens"] == 3 * len(PROMPT) and prefix["hit_tokens"] == 2 * 8  # 2 reusable blocks
    assert stats["rejections_by_reason"] == {"context_length_exceeded": 1}
    assert stats["telemetry"]["dropped"]["inbox"] == 0


async def read_lines(connection, count: int) -> list[dict]:
    """``count`` NDJSON lines from a streaming test-client connection."""
    lines: list[dict] = []
    buffer = b""
    while len(lines) < count:
        buffer += await connection.receive()
        *complete, buffer = buffer.split(b"\n")
        lines += [json.loads(line) for line in complete if line]
    return lines


async def test_tail_filters_by_trace_id(serve, autojump_clock) -> None:
    async with serve(word_engine(step_seconds=0.01)) as served:
        connection = served.client.request("/telemetry/tail?trace_id=wanted&steps=0", method="GET")
        lines: list[dict] = []
        with trio.move_on_after(30):  # the Quart test client hangs on exit after a mid-stream disconnect
            async with connection:
                await connection.send_complete()
                assert (await read_lines(connection, 1))[0]["event"] == "subscribed"
                for trace in ("other", "wanted"):
                    await post_stream(served.client, "/generate", {"prompt_token_ids": PROMPT, "max_tokens": 3,
                                                                   "stream": True}, headers={"X-Trace-Id": trace})
                lines += await read_lines(connection, 4)
                await connection.disconnect()
    assert [line["event"] for line in lines] == ["queued", "started", "first_token", "finished"]
    assert lines[0]["trace_id"] == lines[3]["trace_id"] == "wanted"
    assert lines[3]["output_tokens"] == 3


async def test_slow_tail_reader_loses_events_and_is_told_how_many(serve, autojump_clock) -> None:
    async with serve() as served:
        connection = served.client.request("/telemetry/tail", method="GET")
        emitted = 3000  # more than the tail's 1024-event feed, while the reader does not read
        lines: list[dict] = []
        with trio.move_on_after(30):  # the Quart test client hangs on exit after a mid-stream disconnect
            async with connection:
                await connection.send_complete()
                assert (await read_lines(connection, 1))[0]["event"] == "subscribed"
                for i in range(emitted):
                    served.engine.telemetry.emit(RequestStarted(float(i), i, 0))
                await trio.sleep(1)
                lines += await read_lines(connection, 1)
                while sum(1 for line in lines if line["event"] == "started") < emitted - sum(
                        line["events"] for line in lines if line["event"] == "lost"):
                    lines += await read_lines(connection, 1)
                await connection.disconnect()
    lost = [line for line in lines if line["event"] == "lost"]
    started = [line["request_id"] for line in lines if line["event"] == "started"]
    assert lost and sum(line["events"] for line in lost) == emitted - len(started) > 0
    assert started == sorted(started)
