"""Streaming: chunk formats as the OpenAI SDK parses them, native events, coalescing, errors mid-stream,
client disconnects, admission deadlines, stalls and draining."""

from __future__ import annotations

import json
from functools import partial

import httpx
import openai
import trio
import trio.testing
from http_testkit import MODEL_NAME, assert_error, fake_token, parse_sse, post_stream, word_engine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]


def check_framing(result) -> None:
    assert result.status == 200
    assert result.headers["Content-Type"].startswith("text/event-stream")
    assert result.headers["Cache-Control"] == "no-cache"
    body = result.body
    assert body.endswith(b"data: [DONE]\n\n")
    assert all(block.startswith(b"data: ") and b"\n" not in block for block in body.split(b"\n\n") if block)


async def test_chat_stream_chunks(serve) -> None:
    async with serve() as served:
        body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}
        result = await post_stream(served.client, CHAT, body)
        check_framing(result)
        *chunks, usage_chunk, done = result.events
        assert done == "[DONE]"
        assert {c["id"] for c in result.events[:-1]} == {chunks[0]["id"]}
        assert {c["created"] for c in result.events[:-1]} == {chunks[0]["created"]}
        assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL_NAME for c in result.events[:-1])
        assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}]
        assert all(c["usage"] is None for c in chunks)
        contents = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:]]
        assert "".join(contents) == " w7 w8 w9 w10"
        assert [c["choices"][0]["finish_reason"] for c in chunks[1:]][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[1:-1])
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == 4 and usage_chunk["usage"]["prompt_tokens"] == 7
        plain = await post_stream(served.client, CHAT, {"messages": HELLO, "max_tokens": 2, "stream": True})
        assert all("usage" not in c for c in plain.events[:-1])
        assert served.kv_is_idle()


async def test_completion_stream_chunks(serve) -> None:
    async with serve() as served:
        body = {"prompt": "hello", "max_tokens": 3, "stream": True, "logprobs": 1,
                "stream_options": {"include_usage": True}}
        result = await post_stream(served.client, COMPLETIONS, body)
        check_framing(result)
        *chunks, usage_chunk, _ = result.events
        assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
        choices = [c["choices"][0] for c in chunks]
        assert "".join(c["text"] for c in choices) == " w2 w3 w4"
        assert choices[-1]["finish_reason"] == "length"
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
        offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
        assert tokens == ["w2", "w3", "w4"] and offsets == [0, 3, 6]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 5


async def test_chat_stream_logprobs(serve) -> None:
    async with serve() as served:
        body = {"messages": HELLO, "max_tokens": 3, "stream": True, "logprobs": True, "top_logprobs": 2}
        chunks = (await post_stream(served.client, CHAT, body)).events[1:-1]
        entries = [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]]
        assert [e["token"] for e in entries] == ["w7", "w8", "w9"]
        assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in entries)


async def test_native_stream_events(serve) -> None:
    async with serve() as served:
        result = await post_stream(served.client, "/generate",
                                   {"prompt": "hello", "max_tokens": 3, "stream": True, "logprobs": 1})
        check_framing(result)
        *events, _ = result.events
        assert [t for e in events for t in e["token_ids"]] == [fake_token(2), fake_token(3), fake_token(4)]
        assert "".join(e["text"] for e in events) == " w2 w3 w4"
        assert all(len(e["logprobs"]) == len(e["token_ids"]) == len(e["top_logprobs"]) for e in events)
        final = events[-1]
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 3
        assert final["id"].startswith("gen-")
        assert all("finish_reason" not in e for e in events[:-1])


async def test_several_choices_stream_by_index(serve) -> None:
    async with serve() as served:
        body = {"messages": HELLO, "max_tokens": 3, "n": 3, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        result = await post_stream(served.client, CHAT, body)
        check_framing(result)
        *chunks, usage_chunk, _ = result.events
        texts = {i: "" for i in range(3)}
        finishes = {}
        for chunk in chunks:
            (choice,) = chunk["choices"]
            texts[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
            assert chunk["usage"]["prompt_tokens"] == 7  # continuous usage: every chunk
        assert texts == {i: " w7 w8 w9" for i in range(3)}
        assert finishes == {0: "length", 1: "length", 2: "length"}
        assert usage_chunk["usage"]["completion_tokens"] == 9 and usage_chunk["usage"]["prompt_tokens"] == 7
        two_prompts = await post_stream(served.client, COMPLETIONS, {"prompt": ["hello", "hello world"], "n": 2,
                                                                      "max_tokens": 2, "stream": True})
        indexes = {c["choices"][0]["index"] for c in two_prompts.events[:-1]}
        assert indexes == {0, 1, 2, 3}
        assert served.kv_is_idle()


async def test_openai_sdk_parses_our_streams(serve) -> None:
    async with serve() as served, httpx.AsyncClient(transport=httpx.ASGITransport(app=served.app),
                                                    base_url="http://test") as http:
        client = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http, max_retries=0)
        stream = await client.chat.completions.create(model=MODEL_NAME, messages=HELLO, max_tokens=4, stream=True,
                                                      stream_options={"include_usage": True}, n=2)
        text = {0: "", 1: ""}
        usage = None
        async for chunk in stream:
            for choice in chunk.choices:
                text[choice.index] += choice.delta.content or ""
            usage = chunk.usage or usage
        assert text == {0: " w7 w8 w9 w10", 1: " w7 w8 w9 w10"}
        assert usage is not None and usage.completion_tokens == 8
        completions = await client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, stream=True)
        pieces = [c.choices[0].text async for c in completions]
        assert "".join(pieces) == " w2 w3 w4"


async def test_slow_reader_gets_coalesced_events(serve) -> None:
    """A client that does not read lets tokens pile up; they then arrive many per event, all of them."""
    for coalesce in (True, False):
        async with serve(coalesce=coalesce) as served:
            connection = served.client.request("/generate", method="POST",
                                               headers={"Content-Type": "application/json"})
            async with connection:
                await connection.send(json.dumps({"prompt": "hello", "max_tokens": 100, "stream": True}).encode())
                await connection.send_complete()
                while served.engine.scheduler.requests or served.model.tokens_emitted < 100:
                    await trio.sleep(0.001)  # the engine finishes while nobody reads
                chunks = []
                while True:
                    try:
                        chunks.append(await connection.receive())
                    except trio.EndOfChannel:
                        break
            *events, done = parse_sse(b"".join(chunks))
            assert done == "[DONE]"
            assert sum(len(e["token_ids"]) for e in events) == 100
            if coalesce:
                assert len(events) < 50 and max(len(e["token_ids"]) for e in events) > 10
            else:
                assert len(events) == 100 and all(len(e["token_ids"]) == 1 for e in events)


async def test_engine_failure_mid_stream_is_an_error_event(serve) -> None:
    async with serve(word_engine(fail_at=3)) as served:
        result = await post_stream(served.client, CHAT, {"messages": HELLO, "max_tokens": 50, "stream": True})
        check_framing(result)
        *chunks, error_event, done = result.events
        assert done == "[DONE]"
        assert error_event["error"]["code"] == "engine_failure" and error_event["error"]["type"] == "server_error"
        assert "injected step failure" in error_event["error"]["message"]
        assert sum(len(c["choices"][0]["delta"].get("content", "")) > 0 for c in chunks) >= 2
        assert served.failures == [1]
        await assert_error(await served.client.get("/ready"), 503, "failed")
        await assert_error(await served.client.post("/generate", json={"prompt": "x"}), 503, "unavailable")


async def test_engine_failure_fails_a_non_streamed_request(serve) -> None:
    async with serve(word_engine(fail_at=2)) as served:
        response = await served.client.post("/generate", json={"prompt": "hello", "max_tokens": 50})
        error = await assert_error(response, 500, "engine_failure")
        assert error["type"] == "server_error"
        native = await post_stream(served.client, "/generate", {"prompt": "x", "stream": True})
        await assert_error(_as_response(native), 503, "unavailable")


async def test_after_an_engine_failure_every_response_closes_its_connection(serve) -> None:
    """The process exits within seconds of an engine failure: a response that kept its connection alive then
    invited the client to send its next request into a socket about to close, read as "server disconnected
    without sending a response" (most likely the fault run's one request lost with ``step_error=0.3``: 503s
    answered before the stop sequence had flipped ``draining``). Here nothing flips it (no stop sequence runs),
    so only the engine's failure can say ``Connection: close``."""
    async with serve(word_engine(fail_at=2)) as served:
        response = await served.client.post("/generate", json={"prompt": "hello", "max_tokens": 50})
        await assert_error(response, 500, "engine_failure")
        assert response.headers.get("Connection") == "close"
        refused = await served.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        await assert_error(refused, 503, "unavailable")
        assert refused.headers.get("Connection") == "close"
        assert not served.state.draining  # the engine's failure alone said close


def _as_response(result):  # adapts a StreamResult for assert_error
    class Response:
        status_code = result.status
        headers = result.headers

        @staticmethod
        async def get_data() -> bytes:
            return result.body

        @staticmethod
        async def get_json():
            return json.loads(result.body)

    return Response


async def test_client_disconnect_mid_stream_aborts(serve, autojump_clock) -> None:
    async with serve(word_engine(step_seconds=0.01)) as served:
        connection = served.client.request(CHAT, method="POST", headers={"Content-Type": "application/json"})
        with trio.move_on_after(5):  # the Quart test client hangs on exit after a mid-stream disconnect
            async with connection:
                await connection.send(json.dumps({"messages": HELLO, "max_tokens": 100, "stream": True}).encode())
                await connection.send_complete()
                received = b""
                while received.count(b"data: ") < 4:
                    received += await connection.receive()
                await connection.disconnect()
        await trio.sleep(1)
        assert served.kv_is_idle()
        assert served.model.tokens_emitted < 20
        assert served.state.tracker.active == 0


async def test_client_disconnect_aborts_every_choice(serve, autojump_clock) -> None:
    """With n choices the streams are merged by pump tasks; a disconnect still aborts all of them."""
    async with serve(word_engine(step_seconds=0.01)) as served:
        connection = served.client.request(COMPLETIONS, method="POST", headers={"Content-Type": "application/json"})
        with trio.move_on_after(5):
            async with connection:
                await connection.send(json.dumps({"prompt": "hello", "n": 3, "max_tokens": 100,
                                                  "stream": True}).encode())
                await connection.send_complete()
                received = b""
                while received.count(b"data: ") < 6:
                    received += await connection.receive()
                await connection.disconnect()
        await trio.sleep(1)
        assert served.kv_is_idle()
        assert served.model.tokens_emitted < 60
        assert served.state.tracker.active == 0


async def test_client_disconnect_while_waiting_aborts(serve, autojump_clock) -> None:
    """A non-streamed request is aborted too when its client goes away."""
    async with serve(word_engine(step_seconds=0.01)) as served:
        connection = served.client.request("/generate", method="POST", headers={"Content-Type": "application/json"})
        with trio.move_on_after(5):
            async with connection:
                await connection.send(json.dumps({"prompt": "hello", "max_tokens": 100}).encode())
                await connection.send_complete()
                await trio.sleep(0.1)
                assert served.engine.scheduler.requests
                await connection.disconnect()
        await trio.sleep(1)
        assert served.kv_is_idle() and served.model.tokens_emitted < 20
        assert served.state.tracker.active == 0


async def test_admission_deadline(serve, autojump_clock) -> None:
    """A request that cannot start within ADMISSION_TIMEOUT ends with a timeout: 504 with Retry-After when not
    streamed; an error event ``queue_timeout`` then [DONE] when streamed (its 200 was sent at admission)."""
    async with serve(word_engine(step_seconds=1.0), admission_timeout=2.0, max_batch_size=1) as served:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(served.client.post, "/generate", json={"prompt": "hello", "max_tokens": 10}))
            await trio.sleep(0.5)
            late = await served.client.post("/generate", json={"prompt": "hello", "max_tokens": 1})
            error = await assert_error(late, 504, "queue_timeout")
            assert error["type"] == "timeout_error"
            streamed = await post_stream(served.client, CHAT, {"messages": HELLO, "max_tokens": 1, "stream": True})
            check_framing(streamed)
            *_, error_event, _ = streamed.events
            assert error_event["error"]["code"] == "queue_timeout"
        assert served.kv_is_idle()


async def test_stalled_engine_is_not_ready(serve, autojump_clock) -> None:
    from inference_server.config import Settings

    model = word_engine(gate=trio.Event())
    async with serve(model, settings=Settings(stall_timeout=5.0)) as served:
        assert (await served.client.get("/ready")).status_code == 200
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(served.client.post, "/generate", json={"prompt": "hello", "max_tokens": 1}))
            await trio.sleep(3)
            assert (await served.client.get("/ready")).status_code == 200
            await trio.sleep(3)
            await assert_error(await served.client.get("/ready"), 503, "stalled")
            model.gate.set()
        assert (await served.client.get("/ready")).status_code == 200


async def test_drain_finishes_short_streams_and_ends_long_ones(serve, autojump_clock) -> None:
    async with serve(word_engine(step_seconds=0.1)) as served:
        results = {}

        async def stream(name: str, max_tokens: int) -> None:
            results[name] = await post_stream(served.client, CHAT, {"messages": HELLO, "max_tokens": max_tokens,
                                                                    "stream": True})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, "short", 5)
            nursery.start_soon(stream, "long", 500 // 5)
            await trio.sleep(0.25)
            served.state.begin_drain()
            await served.engine.drain(2.0)
        short, long = results["short"].events, results["long"].events
        assert short[-2]["choices"][0]["finish_reason"] == "length" and short[-1] == "[DONE]"
        assert long[-2]["error"]["code"] == "shutdown" and long[-1] == "[DONE]"
        check_framing(results["long"])


async def test_long_stream_is_not_cut(serve, autojump_clock) -> None:
    """Quart's default RESPONSE_TIMEOUT (60 s) would silently truncate this 90-second stream."""
    async with serve(word_engine(step_seconds=1.0)) as served:
        started = trio.current_time()
        with trio.fail_after(120):  # a cut stream never ends: the test client would wait forever
            result = await post_stream(served.client, "/generate", {"prompt": "hello", "max_tokens": 90,
                                                                    "stream": True})
        assert trio.current_time() - started >= 90
        *events, done = result.events
        assert done == "[DONE]" and sum(len(e["token_ids"]) for e in events) == 90
