"""Every error case of the HTTP contract: status, OpenAI-shaped JSON body, code, param, Retry-After.

Never HTML, never a 500 for bad input.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from http_testkit import MODEL_NAME, assert_error, word_engine

from inference_server.config import Settings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]

BAD_REQUESTS: list[tuple[str, Any, str, str | None]] = [
    # malformed or non-object JSON
    ("/generate", b"{", "invalid_json", None),
    ("/generate", b"", "invalid_json", None),
    ("/generate", b"[]", "invalid_json", None),
    (COMPLETIONS, b'"just a string"', "invalid_json", None),
    (CHAT, b"\xff\xfe\x00", "invalid_json", None),
    # strings that are not valid Unicode (unpaired surrogate escapes), anywhere: a 400 before the tokenizer
    ("/generate", {"prompt": "\ud800 x"}, "invalid_unicode", "prompt"),
    (COMPLETIONS, {"prompt": "\ud800 x"}, "invalid_unicode", "prompt"),
    (COMPLETIONS, {"prompt": ["fine", "a\udfff"]}, "invalid_unicode", "prompt[1]"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "invalid_unicode", "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "invalid_unicode",
     "messages[0].content[0].text"),
    (CHAT, {"messages": HELLO, "stop": ["ok", "\udbff"]}, "invalid_unicode", "stop[1]"),
    ("/generate", {"prompt": "x", "\ud800": 1}, "invalid_unicode", "\\ud800"),
    (COMPLETIONS, {"prompt": "x", "user": "\ud83d"}, "invalid_unicode", "user"),
    # NaN / Infinity / overflowing numbers
    ("/generate", b'{"prompt": "x", "temperature": NaN}', "invalid_json", None),
    (COMPLETIONS, b'{"prompt": "x", "top_p": Infinity}', "invalid_json", None),
    (CHAT, b'{"messages": [], "temperature": -Infinity}', "invalid_json", None),
    ("/generate", b'{"prompt": "x", "temperature": 1e400}', "invalid_json", None),
    # wrong types: no coercion
    ("/generate", {"prompt": "x", "stream": "yes"}, "invalid_value", "stream"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 3.7}, "invalid_value", "max_tokens"),
    (COMPLETIONS, {"prompt": 5}, "invalid_value", "prompt"),
    (COMPLETIONS, {"prompt": []}, "invalid_value", "prompt"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a", 1]}, "invalid_value", "stop"),
    ("/generate", {"prompt_token_ids": "123"}, "invalid_value", "prompt_token_ids"),
    ("/generate", {"prompt_token_ids": [1, True]}, "invalid_value", "prompt_token_ids[1]"),
    (CHAT, {"messages": "hello"}, "invalid_value", "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 3}]}, "invalid_value", "messages[0].content"),
    (CHAT, {"messages": HELLO, "logprobs": 1}, "invalid_value", "logprobs"),
    (CHAT, {"messages": HELLO, "stream_options": {"include_usage": "yes"}}, "invalid_value",
     "stream_options.include_usage"),
    # missing and unknown fields
    (COMPLETIONS, {"max_tokens": 3}, "missing_field", "prompt"),
    (CHAT, {}, "missing_field", "messages"),
    (CHAT, {"messages": [{"content": "x"}]}, "missing_field", "messages[0].role"),
    ("/generate", {"prompt": "x", "bogus": 1}, "unknown_field", "bogus"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"bogus": True}}, "unknown_field", "stream_options.bogus"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "bogus": 1}]}, "unknown_field", "messages[0].bogus"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": "yes"}]}]},
     "invalid_value", "messages[0].content[0].cache_control"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache": {}}]}]},
     "unknown_field", "messages[0].content[0].cache"),
    # recognised but unsupported
    (CHAT, {"messages": HELLO, "tools": [{"type": "function"}]}, "unsupported_parameter", "tools"),
    (CHAT, {"messages": HELLO, "response_format": {"type": "xml"}}, "invalid_value", "response_format.type"),
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}},
     "invalid_value", "response_format.json_schema.schema"),
    (COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "invalid_value",
     "structured_outputs"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "invalid_value", "guided_choice"),
    # structured-output values of the wrong type (vLLM's test_guided_decoding_type_error asks the same)
    (COMPLETIONS, {"prompt": "x", "guided_json": 42}, "invalid_value", "guided_json"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": {"1": "Pikachu"}}, "invalid_value", "guided_regex"),
    (CHAT, {"messages": HELLO, "guided_choice": "yes"}, "invalid_value", "guided_choice"),
    (CHAT, {"messages": HELLO, "structured_outputs": {"bogus": 1}}, "invalid_value", "structured_outputs.bogus"),
    (CHAT, {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "strict": "yes"}}}, "invalid_value", "response_format.json_schema.strict"),
    ("/generate", {"prompt": "x", "ebnf": ["root ::= x"]}, "invalid_value", "ebnf"),
    (COMPLETIONS, {"prompt": "x", "response_format": {"type": "text", "kind": 1}}, "unknown_field",
     "response_format.kind"),
    (CHAT, {"messages": HELLO, "prompt_logprobs": 1, "stream": True}, "unsupported_parameter", "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "unsupported_parameter", "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "unsupported_parameter", "suffix"),
    (COMPLETIONS, {"prompt": "x", "best_of": 2}, "unsupported_parameter", "best_of"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "unsupported_parameter", "messages[0].content[0]"),
    # out-of-range values
    ("/generate", {"prompt": "x", "temperature": -1}, "invalid_request", "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, "invalid_request", "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "invalid_request", "top_p"),
    ("/generate", {"prompt": "x", "top_k": -2}, "invalid_request", "top_k"),
    ("/generate", {"prompt": "x", "min_p": 2}, "invalid_request", "min_p"),
    ("/generate", {"prompt": "x", "repetition_penalty": 0}, "invalid_request", "repetition_penalty"),
    (CHAT, {"messages": HELLO, "presence_penalty": 3}, "invalid_request", "presence_penalty"),
    (CHAT, {"messages": HELLO, "frequency_penalty": -2.5}, "invalid_request", "frequency_penalty"),
    ("/generate", {"prompt": "x", "seed": -(2**64)}, "invalid_value", "seed"),
    ("/generate", {"prompt": "x", "max_tokens": 0}, "invalid_request", "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "invalid_request", "logprobs"),
    # ("stream": False: with stream, prompt_logprobs is refused as unsupported before any value)
    (COMPLETIONS, {"prompt": "x", "echo": True, "logprobs": 21, "stream": False}, "invalid_request", "logprobs"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21, "stream": False}, "invalid_request", "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": -1, "stream": False}, "invalid_request", "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": "1"}, "invalid_value", "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "invalid_request", "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1, "echo": True, "stream": False}, "invalid_request", "max_tokens"),
    ("/generate", {"prompt": "x", "prompt_logprobs": 21}, "invalid_request", "prompt_logprobs"),
    (CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "invalid_request", "top_logprobs"),
    (CHAT, {"messages": HELLO, "top_logprobs": 2}, "invalid_value", "top_logprobs"),
    (CHAT, {"messages": HELLO, "max_completion_tokens": 0}, "invalid_request", "max_completion_tokens"),
    (CHAT, {"messages": HELLO, "max_tokens": 3, "max_completion_tokens": 4}, "invalid_value",
     "max_completion_tokens"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, "invalid_value", "n"),
    (CHAT, {"messages": HELLO, "n": 17}, "invalid_value", "n"),
    ("/generate", {"prompt": "x", "stop": [""]}, "invalid_request", "stop"),
    ("/generate", {"prompt": "x", "stop_token_ids": [-1]}, "invalid_request", "stop_token_ids"),
    ("/generate", {"prompt": "x", "stop_token_ids": [512]}, "invalid_request", "stop_token_ids"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"512": 1.0}}, "invalid_request", "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"abc": 1.0}}, "invalid_value", "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, "invalid_request", "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": "high"}}, "invalid_value", "logit_bias"),
    (CHAT, {"messages": HELLO, "logit_bias": [5]}, "invalid_value", "logit_bias"),
    (CHAT, {"messages": HELLO, "allowed_token_ids": [3, 9999]}, "invalid_request", "allowed_token_ids"),
    (CHAT, {"messages": HELLO, "allowed_token_ids": []}, "invalid_request", "allowed_token_ids"),
    (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, "invalid_request", "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "invalid_request", "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 0}, "invalid_request", "truncate_prompt_tokens"),
    # prompts the engine refuses
    ("/generate", {"prompt": "x", "prompt_token_ids": [1]}, "invalid_value", "prompt"),
    ("/generate", {"max_tokens": 3}, "invalid_value", "prompt"),
    ("/generate", {"prompt_token_ids": [2, 600]}, "invalid_request", "prompt"),
    (COMPLETIONS, {"prompt": [[]]}, "invalid_request", "prompt"),
    (CHAT, {"messages": []}, "invalid_value", "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "invalid_value", "messages[0].role"),
    # context limits (128 tokens): prompt too long, max_tokens too large
    ("/generate", {"prompt": "hello " * 130}, "context_length_exceeded", "prompt"),
    (COMPLETIONS, {"prompt": "hello " * 120, "max_tokens": 16}, "context_length_exceeded", "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 130}], "max_tokens": 4}, "context_length_exceeded",
     "messages"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 130}]}, "context_length_exceeded", "messages"),
    ("/generate", {"prompt": "x", "max_tokens": 200}, "invalid_request", "max_tokens"),
]


@pytest.mark.parametrize(("path", "body", "code", "param"), BAD_REQUESTS,
                         ids=[f"{p}-{i}" for i, (p, *_rest) in enumerate(BAD_REQUESTS)])
async def test_bad_request_is_a_400(serve, path: str, body: Any, code: str, param: str | None) -> None:
    async with serve() as served:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        for stream in (False, True):  # a streaming request fails the same way, before any event
            if stream and isinstance(body, dict) and "stream" not in body:
                raw = json.dumps({**body, "stream": True}).encode()
            response = await served.client.post(path, data=raw, headers={"Content-Type": "application/json"})
            error = await assert_error(response, 400, code, param)
            assert error["type"] == "invalid_request_error"
        assert served.kv_is_idle()


async def test_unknown_model_is_404(serve) -> None:
    async with serve() as served:
        for path, body in [(COMPLETIONS, {"model": "gpt-4", "prompt": "x"}),
                           (CHAT, {"model": "gpt-4", "messages": HELLO})]:
            error = await assert_error(await served.client.post(path, json=body), 404, "model_not_found", "model")
            assert "gpt-4" in error["message"]
        await assert_error(await served.client.get("/v1/models/gpt-4"), 404, "model_not_found", "model")
        ok = await served.client.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200


async def test_unknown_route_and_wrong_method_are_json(serve) -> None:
    async with serve() as served:
        await assert_error(await served.client.get("/nope"), 404, "not_found")
        await assert_error(await served.client.post("/v1/nope", json={}), 404, "not_found")
        wrong = await served.client.get("/v1/chat/completions")
        await assert_error(wrong, 405, "method_not_allowed")
        assert "POST" in wrong.headers["Allow"]
        await assert_error(await served.client.delete("/health"), 405, "method_not_allowed")


async def test_wrong_media_type_is_415(serve) -> None:
    async with serve() as served:
        response = await served.client.post("/generate", data=b"prompt=x", headers={
            "Content-Type": "application/x-www-form-urlencoded"})
        await assert_error(response, 415, "unsupported_media_type")
        untyped = await served.client.post("/generate", data=b'{"prompt": "x", "max_tokens": 1}')
        assert untyped.status_code == 200  # no Content-Type at all: read as JSON


async def test_body_too_large_is_413(serve) -> None:
    async with serve(settings=Settings(max_body_bytes=1024)) as served:
        body = {"prompt": "hello " * 400}
        await assert_error(await served.client.post("/generate", json=body), 413, "request_too_large")
        await assert_error(await served.client.post(CHAT, json={"messages": [{"role": "user", "content": "x" * 2000}]}),
                           413, "request_too_large")


async def test_slow_body_is_408(serve, autojump_clock) -> None:
    async with serve() as served:
        connection = served.client.request("/generate", method="POST", headers={"Content-Type": "application/json"})
        async with connection:
            await connection.send(b'{"prompt": ')
            await trio.sleep(31)  # BODY_TIMEOUT is 30 s
            body = b""
            while True:
                try:
                    body += await connection.receive()
                except trio.EndOfChannel:
                    break
        assert connection.status_code == 408
        assert json.loads(body)["error"]["code"] == "request_timeout"


async def test_invalid_trace_id_header_is_400(serve) -> None:
    async with serve() as served:
        for value in ["has space", "x" * 129]:
            response = await served.client.get("/health", headers={"X-Trace-Id": value})
            await assert_error(response, 400, "invalid_value", "X-Trace-Id")
        await assert_error(await served.client.post(COMPLETIONS, json={"prompt": "x"},
                                                    headers={"X-Session-Id": "a b"}), 400, "invalid_value",
                           "X-Session-Id")


async def test_queue_full_is_429_with_retry_after(serve) -> None:
    """One request runs (its step blocks), the next fill the scheduler inbox and the admission queue
    (``MAX_QUEUE_SIZE=1``); then the queue is full and the answer is 429 at once."""
    model = word_engine(gate=trio.Event())
    async with serve(model, max_queue_size=1, max_batch_size=1) as served:
        statuses: list[int] = []

        async def request() -> None:
            response = await served.client.post("/generate", json={"prompt": "hello", "max_tokens": 1})
            statuses.append(response.status_code)

        async with trio.open_nursery() as nursery:
            rejected = None
            for _ in range(8):
                nursery.start_soon(request)
                await trio.testing.wait_all_tasks_blocked()
                if statuses:
                    rejected = len(statuses)
                    break
            assert statuses == [429], statuses
            overloaded = await served.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
            error = await assert_error(overloaded, 429, "overloaded")
            assert error["type"] == "rate_limit_error"
            assert overloaded.headers["Retry-After"] == "1"
            model.gate.set()
        assert rejected is not None and statuses.count(200) == len(statuses) - 1


async def test_draining_is_503_with_retry_after(serve) -> None:
    async with serve() as served:
        served.state.begin_drain()
        for path, body in [("/generate", {"prompt": "x"}), (COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": HELLO})]:
            error = await assert_error(await served.client.post(path, json=body), 503, "draining")
            assert error["type"] == "unavailable_error"
        ready = await served.client.get("/ready")
        await assert_error(ready, 503, "draining")
        assert (await ready.get_json())["status"] == "draining"
        assert (await served.client.get("/health")).status_code == 200


async def test_closed_engine_is_503(serve) -> None:
    async with serve() as served:
        served.engine.close()  # idle, so it stops at once
        await assert_error(await served.client.post("/generate", json={"prompt": "x"}), 503, "unavailable")
        await assert_error(await served.client.get("/ready"), 503, "stopped")


async def test_model_without_tokenizer_needs_token_ids(serve) -> None:
    async with serve(tokenizer=None) as served:
        await assert_error(await served.client.post("/generate", json={"prompt": "hello"}), 400, "invalid_request",
                           "prompt")
        await assert_error(await served.client.post(CHAT, json={"messages": HELLO}), 400, "invalid_request",
                           "messages")
        ok = await served.client.post("/v1/completions", json={"prompt": [2, 3], "max_tokens": 2, "logprobs": 0})
        assert ok.status_code == 200
        assert (await ok.get_json())["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


async def test_unexpected_exception_is_a_json_500(serve, monkeypatch: pytest.MonkeyPatch) -> None:
    import inference_server.http.native as native

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(native, "sampling_params", broken)
    async with serve() as served:
        error = await assert_error(await served.client.post("/generate", json={"prompt": "x"}), 500, "internal_error")
        assert error["type"] == "server_error"
        assert (await served.client.get("/health")).status_code == 200
