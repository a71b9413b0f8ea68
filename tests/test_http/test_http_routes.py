"""Every route through the Quart test client against a fake engine: the shapes of successful responses,
trace and session ids, and the official OpenAI SDK reading our non-streamed responses in process."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio
from http_testkit import MODEL_NAME, assert_error, fake_token, word_engine

from inference_server.telemetry.events import RequestQueued


async def test_index_lists_every_route(serve) -> None:
    async with serve() as served:
        response = await served.client.get("/")
        assert response.status_code == 200
        payload = await response.get_json()
        assert payload["model"] == MODEL_NAME
        registered = {(rule.rule, method) for rule in served.app.url_map.iter_rules()
                      for method in rule.methods - {"HEAD", "OPTIONS"} if rule.endpoint != "static"}
        listed = {(line.split()[1], line.split()[0]) for line in payload["routes"]}
        assert listed == registered


async def test_health_and_ready(serve) -> None:
    async with serve() as served:
        health = await served.client.get("/health")
        assert health.status_code == 200 and await health.get_json() == {"status": "ok"}
        ready = await served.client.get("/ready")
        assert ready.status_code == 200 and (await ready.get_json())["status"] == "ready"


async def test_models(serve) -> None:
    async with serve() as served:
        response = await served.client.get("/v1/models")
        payload = await response.get_json()
        assert payload["object"] == "list"
        assert [m["id"] for m in payload["data"]] == [MODEL_NAME]
        assert payload["data"][0]["object"] == "model" and payload["data"][0]["max_model_len"] == 128
        card = await served.client.get(f"/v1/models/{MODEL_NAME}")
        assert (await card.get_json())["id"] == MODEL_NAME


async def test_generate_text_prompt(serve) -> None:
    async with serve() as served:
        response = await served.client.post("/generate", json={"prompt": "hello world", "max_tokens": 4})
        assert response.status_code == 200
        payload = await response.get_json()
        # "hello world" is <bos> hello world: 3 tokens, so the fake model answers w3 w4 w5 w6.
        assert payload["token_ids"] == [fake_token(n) for n in (3, 4, 5, 6)]
        assert payload["text"] == " w3 w4 w5 w6"
        assert payload["finish_reason"] == "length" and payload["stop_reason"] is None
        assert payload["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                    "prompt_tokens_details": {"cached_tokens": 0}}
        assert payload["id"].startswith("gen-")
        assert "logprobs" not in payload
        assert served.kv_is_idle()


async def test_generate_token_ids_logprobs_and_stops(serve) -> None:
    async with serve() as served:
        body = {"prompt_token_ids": [2, 9, 10], "max_tokens": 10, "logprobs": 2, "stop_token_ids": [fake_token(5)]}
        payload = await (await served.client.post("/generate", json=body)).get_json()
        assert payload["token_ids"] == [fake_token(3), fake_token(4), fake_token(5)]
        assert payload["finish_reason"] == "stop" and payload["stop_reason"] == fake_token(5)
        assert payload["logprobs"] == [-0.25] * 3
        assert payload["top_logprobs"][0] == [[fake_token(3), -0.5], [fake_token(4), -1.0]]
        stop = await (await served.client.post("/generate", json={"prompt": "hello", "stop": "w4",
                                                                    "max_tokens": 10})).get_json()
        assert stop["text"] == " w2 w3 " and stop["stop_reason"] == "w4"


async def test_generate_eos_finishes_with_stop(serve) -> None:

    async with serve(word_engine(eos_at_length=5)) as served:
        payload = await (await served.client.post("/generate", json={"prompt": "hello", "max_tokens": 10})).get_json()
        assert payload["finish_reason"] == "stop" and payload["usage"]["completion_tokens"] == 4
        ignored = await (await served.client.post("/generate", json={"prompt": "hello", "max_tokens": 10,
                                                                       "ignore_eos": True})).get_json()
        assert ignored["finish_reason"] == "length"


async def test_completions_prompt_forms_and_choice_indexes(serve) -> None:
    async with serve() as served:
        for prompt, expected_prompts in [("hello", 1), (["hello", "hello world"], 2), ([2, 9], 1),
                                         ([[2, 9], [2, 9, 10]], 2)]:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "n": 2}
            response = await served.client.post("/v1/completions", json=body)
            assert response.status_code == 200, await response.get_data()
            payload = await response.get_json()
            assert payload["object"] == "text_completion" and payload["model"] == MODEL_NAME
            assert [c["index"] for c in payload["choices"]] == list(range(2 * expected_prompts))
            assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in payload["choices"])
            assert payload["usage"]["completion_tokens"] == 3 * 2 * expected_prompts
        two = await (await served.client.post("/v1/completions", json={"prompt": ["hello", "hello world"],
                                                                        "max_tokens": 1})).get_json()
        assert [c["text"] for c in two["choices"]] == [" w2", " w3"]
        assert two["usage"]["prompt_tokens"] == 2 + 3


async def test_completions_logprobs_shape(serve) -> None:
    async with serve() as served:
        body = {"prompt": "hello", "max_tokens": 2, "logprobs": 1}
        choice = (await (await served.client.post("/v1/completions", json=body)).get_json())["choices"][0]
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == ["w2", "w3"]
        assert logprobs["token_logprobs"] == [-0.25, -0.25]
        assert logprobs["top_logprobs"][0] == {"w2": -0.5}
        assert logprobs["text_offset"] == [0, 3]


async def test_chat_completion_and_defaults(serve) -> None:
    async with serve() as served:
        body = {"model": MODEL_NAME, "messages": [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": [{"type": "text", "text": "hello"}],
                                                   "name": "", "type": "text"}],
                "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2, "seed": 7}
        response = await served.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, await response.get_data()
        payload = await response.get_json()
        assert payload["object"] == "chat.completion"
        choice = payload["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert len(content) == 3 and content[0]["logprob"] == -0.25
        assert content[0]["bytes"] == list(content[0]["token"].encode())
        assert len(content[0]["top_logprobs"]) == 2
        # Without max tokens, the reply may use the rest of the context (128 - prompt tokens).
        default = await (await served.client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hello"}]})).get_json()
        assert default["usage"]["total_tokens"] == 128 and default["choices"][0]["finish_reason"] == "length"


async def test_content_parts_marked_with_cache_control_are_plain_text_parts(serve) -> None:
    """LiteLLM and other clients send Anthropic's ``cache_control`` on OpenAI-style text parts: accepted and
    ignored, the prompt is the one without it."""
    marked = [{"role": "system", "content": [{"type": "text", "text": "be brief",
                                              "cache_control": {"type": "ephemeral"}}]},
              {"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral",
                                                                                                "ttl": "5m"}},
                                           {"type": "text", "text": "world", "cache_control": None}]}]
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nworld"}]
    async with serve() as served:
        replies = []
        for messages in (marked, plain):
            response = await served.client.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": 2, "return_token_ids": True})
            assert response.status_code == 200, await response.get_data()
            replies.append(await response.get_json())
        assert replies[0]["prompt_token_ids"] == replies[1]["prompt_token_ids"]
        assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]


async def test_trace_and_session_ids_reach_the_engine(serve) -> None:
    async with serve() as served:
        events = served.engine.telemetry.subscribe()
        response = await served.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1,
                                                                      "user": "alice"},
                                            headers={"X-Trace-Id": "trace-123"})
        assert response.headers["X-Trace-Id"] == "trace-123"
        await served.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 1, "user": "alice"},
                                 headers={"X-Session-Id": "bob"})
        generated = await served.client.post("/generate", json={"prompt": "hi", "max_tokens": 1, "session_id": "carol",
                                                                 "trace_id": "body-trace"})
        await served.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 1, "safety_identifier": "dave"})
        assert generated.headers["X-Trace-Id"] == "body-trace"
        fresh = await served.client.get("/health")
        assert len(fresh.headers["X-Trace-Id"]) == 32
        queued = []
        with trio.move_on_after(1):
            async for event in events:
                if isinstance(event, RequestQueued):
                    queued.append((event.trace_id, event.session_id))
                if len(queued) == 4:
                    break
        assert queued[0] == ("trace-123", "alice")
        assert queued[1][1] == "bob"
        assert queued[2] == ("body-trace", "carol")
        assert queued[3][1] == "dave"  # safety_identifier, user's successor in OpenAI's API, keys the session


async def test_x_request_id_is_read_as_the_trace_id_and_echoed(serve) -> None:
    """OpenAI's request-id header: sent without ``X-Trace-Id`` it is the trace id (and beats ``/generate``'s body
    field, as the trace header does); every response echoes the trace id under both names, so the OpenAI SDK's
    ``request_id`` finds the server's telemetry key."""
    async with serve() as served:
        events = served.engine.telemetry.subscribe()
        sent = await served.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1},
                                        headers={"X-Request-Id": "req-42"})
        assert sent.headers["X-Trace-Id"] == sent.headers["X-Request-Id"] == "req-42"
        both = await served.client.post("/generate", json={"prompt": "hi", "max_tokens": 1, "trace_id": "body"},
                                        headers={"X-Request-Id": "req-43", "X-Trace-Id": "trace-43"})
        assert both.headers["X-Trace-Id"] == both.headers["X-Request-Id"] == "trace-43"
        native = await served.client.post("/generate", json={"prompt": "hi", "max_tokens": 1, "trace_id": "body"},
                                          headers={"X-Request-Id": "req-44"})
        assert native.headers["X-Request-Id"] == "req-44"
        fresh = await served.client.get("/health")
        assert fresh.headers["X-Request-Id"] == fresh.headers["X-Trace-Id"]
        bad = await served.client.post("/v1/completions", json={"prompt": "hello"}, headers={"X-Request-Id": "a b"})
        await assert_error(bad, 400, "invalid_value", "X-Request-Id")
        queued = []
        with trio.move_on_after(30):
            async for event in events:
                if isinstance(event, RequestQueued):
                    queued.append(event.trace_id)
                if len(queued) == 3:
                    break
        assert queued == ["req-42", "trace-43", "req-44"]


@pytest.fixture
async def sdk_client():
    """``sdk_client(app)``: an ``openai.AsyncOpenAI`` talking to ``app`` in process (httpx's ASGI transport)."""
    clients: list[httpx.AsyncClient] = []

    def make(app) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        clients.append(http)
        return openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http, max_retries=0)

    yield make
    for http in clients:
        await http.aclose()


async def test_openai_sdk_reads_non_streamed_responses(serve, sdk_client) -> None:
    async with serve() as served:
        client = sdk_client(served.app)
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL_NAME]
        completion = await client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, n=2, logprobs=1)
        assert [c.index for c in completion.choices] == [0, 1]
        assert completion.choices[0].logprobs.tokens == ["w2", "w3", "w4"]
        assert completion.usage.total_tokens == 2 + 6
        chat = await client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                    max_completion_tokens=2, logprobs=True, top_logprobs=1)
        assert chat.choices[0].message.content.split() == ["w7", "w8"]
        assert chat.choices[0].logprobs.content[0].top_logprobs[0].logprob == -0.5
