"""vLLM and SGLang request fields beyond issue 39's first two passes, against the fake model: vLLM's
``request_id`` (the response's id and the trace id); SGLang's ``stop_regex``; vLLM's ``bad_words``; the fields the
server refuses with a 400 that says so (vLLM's request-level ``chat_template``, ``use_beam_search``); and the
message rules (unknown keys and roles are 400s, as OpenAI's). ``include_reasoning`` and the ``reasoning``
message key need a reasoning template: ``test_tool_calls_http``."""

from __future__ import annotations

import re
from typing import Any

import pytest
from http_testkit import assert_error, post_stream, word_engine

from inference_server.models.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = [{"role": "user", "content": "the capital of france ?"}]


def body_for(path: str, **fields: Any) -> dict[str, Any]:
    if path == "/generate":
        return {"prompt": "hello world", "max_tokens": 2, **fields}
    return ({"messages": MESSAGES} if path == CHAT else {"prompt": "hello world"}) | {"max_tokens": 2, **fields}


def prefix_of(path: str) -> str:
    return "chatcmpl" if path == CHAT else "cmpl"


# -- vLLM's request_id (ChatCompletionRequest / CompletionRequest; serving's _base_request_id) ------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_request_id_names_the_response_and_the_trace(serve, path: str) -> None:
    prefix = prefix_of(path)
    async with serve() as served:
        response = await served.client.post(path, json=body_for(path, request_id="job-7:a"))
        assert response.status_code == 200, await response.get_data()
        assert (await response.get_json())["id"] == f"{prefix}-job-7:a"
        assert response.headers["X-Request-Id"] == response.headers["X-Trace-Id"] == "job-7:a"
        streamed = await post_stream(served.client, path, body_for(path, request_id="job-8", stream=True))
        assert {event["id"] for event in streamed.events[:-1]} == {f"{prefix}-job-8"}
        assert streamed.headers["X-Request-Id"] == "job-8"
        if path == COMPLETIONS:  # echo builds its whole response on its own path
            echoed = await served.client.post(path, json=body_for(path, request_id="job-9", echo=True))
            assert (await echoed.get_json())["id"] == "cmpl-job-9"
        # vLLM's order: an X-Request-Id header names the response (and the trace) over the body
        header = await served.client.post(path, json=body_for(path, request_id="body-id"),
                                          headers={"X-Request-Id": "header-id"})
        assert (await header.get_json())["id"] == f"{prefix}-header-id"
        assert header.headers["X-Trace-Id"] == "header-id"
        # an X-Trace-Id header keeps the trace; the body still names the response
        traced = await served.client.post(path, json=body_for(path, request_id="body-id"),
                                          headers={"X-Trace-Id": "trace-id"})
        assert (await traced.get_json())["id"] == f"{prefix}-body-id"
        assert traced.headers["X-Trace-Id"] == traced.headers["X-Request-Id"] == "trace-id"
        plain = await served.client.post(path, json=body_for(path))
        assert re.fullmatch(f"{prefix}-[0-9a-f]{{32}}", (await plain.get_json())["id"])
        assert plain.headers["X-Request-Id"] != "body-id"
        assert served.kv_is_idle()


@pytest.mark.parametrize("request_id", ["", "a b", "x" * 129, "é", "line\nbreak"])
async def test_request_id_follows_the_header_id_rule(serve, request_id: str) -> None:
    async with serve() as served:
        for path in (CHAT, COMPLETIONS):
            response = await served.client.post(path, json=body_for(path, request_id=request_id))
            error = await assert_error(response, 400, "invalid_value", "request_id")
            assert "1 to 128 visible ASCII characters" in error["message"]
            # even where a header names the trace: the body's id still names the response
            with_header = await served.client.post(path, json=body_for(path, request_id=request_id),
                                                   headers={"X-Trace-Id": "t"})
            await assert_error(with_header, 400, "invalid_value", "request_id")
        await assert_error(await served.client.post("/generate", json=body_for("/generate", request_id="r")),
                           400, "unknown_field", "request_id")  # /generate names its trace with trace_id


# -- SGLang's rid (ChatCompletionRequest / CompletionRequest; serving_base's _generate_request_id) -------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_rid_is_the_response_id_as_sent_and_the_trace(serve, path: str) -> None:
    """SGLang returns the request's ``rid`` as the response's ``id`` (no ``chatcmpl-`` prefix, unlike vLLM's
    ``request_id``); it names the trace unless a header does, and a header does not rename the response."""
    async with serve() as served:
        response = await served.client.post(path, json=body_for(path, rid="job-7:a"))
        assert response.status_code == 200, await response.get_data()
        assert (await response.get_json())["id"] == "job-7:a"
        assert response.headers["X-Request-Id"] == response.headers["X-Trace-Id"] == "job-7:a"
        streamed = await post_stream(served.client, path, body_for(path, rid="job-8", stream=True))
        assert {event["id"] for event in streamed.events[:-1]} == {"job-8"}
        assert streamed.headers["X-Trace-Id"] == "job-8"
        if path == COMPLETIONS:  # echo builds its whole response on its own path
            echoed = await served.client.post(path, json=body_for(path, rid="job-9", echo=True))
            assert (await echoed.get_json())["id"] == "job-9"
        header = await served.client.post(path, json=body_for(path, rid="body-id"),
                                          headers={"X-Request-Id": "header-id"})
        assert (await header.get_json())["id"] == "body-id"
        assert header.headers["X-Trace-Id"] == "header-id"
        assert served.kv_is_idle()


@pytest.mark.parametrize("rid, code, says", [
    ("a b", "invalid_value", "1 to 128 visible ASCII characters"), ("", "invalid_value", "1 to 128"),
    (["a", "b"], "unsupported_parameter", "send rid as a string"), (7, "invalid_value", "a string or a list")])
async def test_bad_rid_is_a_400_naming_it(serve, rid: Any, code: str, says: str) -> None:
    async with serve() as served:
        for path in (CHAT, COMPLETIONS):
            error = await assert_error(await served.client.post(path, json=body_for(path, rid=rid)), 400, code, "rid")
            assert says in error["message"]
        both = await served.client.post(CHAT, json=body_for(CHAT, rid="a", request_id="a"))
        assert "not both" in (await assert_error(both, 400, "invalid_value", "rid"))["message"]
        await assert_error(await served.client.post("/generate", json=body_for("/generate", rid="r")),
                           400, "unknown_field", "rid")


# -- vLLM's request_id on /v1/responses (ResponsesRequest: the response's id as sent) ------------------------------


async def test_responses_request_id_is_the_response_id_and_the_trace(serve) -> None:
    body = {"input": "hello", "max_output_tokens": 2}
    async with serve() as served:
        response = await served.client.post(RESPONSES, json={**body, "request_id": "resp_job-7"})
        assert response.status_code == 200, await response.get_data()
        assert (await response.get_json())["id"] == "resp_job-7"
        assert response.headers["X-Trace-Id"] == response.headers["X-Request-Id"] == "resp_job-7"
        streamed = await post_stream(served.client, RESPONSES, {**body, "request_id": "job-8", "stream": True})
        ids = {event["response"]["id"] for event in streamed.events if isinstance(event, dict) and "response" in event}
        assert ids == {"job-8"}
        traced = await served.client.post(RESPONSES, json={**body, "request_id": "body-id"},
                                          headers={"X-Trace-Id": "trace-id"})
        assert (await traced.get_json())["id"] == "body-id" and traced.headers["X-Trace-Id"] == "trace-id"
        plain = await served.client.post(RESPONSES, json=body)
        assert re.fullmatch("resp-[0-9a-f]{32}", (await plain.get_json())["id"])
        error = await assert_error(await served.client.post(RESPONSES, json={**body, "request_id": "a b"}),
                                   400, "invalid_value", "request_id")
        assert "1 to 128 visible ASCII characters" in error["message"]
        assert served.kv_is_idle()


# -- vLLM's request-level chat_template (refused unless --trust-request-chat-template) -----------------------------


async def test_a_request_level_chat_template_is_refused_saying_why(serve) -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    async with serve() as served:
        for path, body in ((CHAT, body_for(CHAT)), ("/tokenize", {"messages": MESSAGES})):
            response = await served.client.post(path, json={**body, "chat_template": template})
            error = await assert_error(response, 400, "unsupported_parameter", "chat_template")
            assert "--trust-request-chat-template" in error["message"] and "chat_template_kwargs" in error["message"]
            for empty in ("", " "):  # a template, if an empty one: vLLM refuses any non-null value
                refused = await served.client.post(path, json={**body, "chat_template": empty})
                await assert_error(refused, 400, "unsupported_parameter", "chat_template")
            assert (await served.client.post(path, json={**body, "chat_template": None})).status_code == 200
            nested = await served.client.post(path, json={**body, "chat_template_kwargs": {"chat_template": template}})
            error = await assert_error(nested, 400, "unsupported_parameter", "chat_template_kwargs.chat_template")
            assert "--trust-request-chat-template" in error["message"]
        await assert_error(await served.client.post(COMPLETIONS, json=body_for(COMPLETIONS, chat_template=template)),
                           400, "unknown_field", "chat_template")  # vLLM's completions have no such field
        assert served.kv_is_idle()


# -- SGLang's stop_regex (CompletionRequest / ChatCompletionRequest / sampling params) ------------------------------


def text_of(path: str, payload: dict) -> str:
    if path == "/generate":
        return payload["text"]
    choice = payload["choices"][0]
    return choice["message"]["content"] if path == CHAT else choice["text"]


def streamed_text(path: str, events: list[Any]) -> tuple[str, dict]:
    """The streamed text and the last event (the one with the finish reason)."""
    assert events[-1] == "[DONE]"
    events = [event for event in events[:-1] if path == "/generate" or event.get("choices")]
    if path == "/generate":
        return "".join(event["text"] for event in events), events[-1]
    if path == CHAT:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events), events[-1]["choices"][0]
    return "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]


def first_match_prefix(text: str, pattern: str) -> re.Match[str]:
    """The match in the shortest prefix of ``text`` that has one (the server's rule), brute force."""
    for end in range(1, len(text) + 1):
        match = re.search(pattern, text[:end])
        if match:
            return match
    raise AssertionError(f"{pattern!r} never matches {text!r}")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/generate"])
async def test_stop_regex_ends_the_output_before_the_first_match(serve, path: str) -> None:
    pattern = r"w\d*7\b"  # the fake model writes w<n> words: stop before the first one ending in 7
    async with serve(coalesce=False) as served:
        plain = await served.client.post(path, json=body_for(path, max_tokens=16, temperature=0))
        text = text_of(path, await plain.get_json())
        match = first_match_prefix(text, pattern)
        assert 0 < match.start() < len(text) - 3
        for include, expected in ((False, text[:match.start()]), (True, text[:match.end()])):
            body = body_for(path, max_tokens=16, temperature=0, stop_regex=[pattern, "never+"],
                            include_stop_str_in_output=include)
            whole = await (await served.client.post(path, json=body)).get_json()
            assert text_of(path, whole) == expected
            finish = whole if path == "/generate" else whole["choices"][0]
            assert (finish["finish_reason"], finish["stop_reason"]) == ("stop", pattern)
            if path != "/generate":
                assert finish["matched_stop"] == pattern  # SGLang's: the pattern that matched
            streamed = await post_stream(served.client, path, {**body, "stream": True})
            joined, last = streamed_text(path, streamed.events)
            assert joined == expected and (last["finish_reason"], last["stop_reason"]) == ("stop", pattern)
        one = await served.client.post(path, json=body_for(path, max_tokens=16, temperature=0, stop_regex=pattern))
        assert text_of(path, await one.get_json()) == text[:match.start()]  # a single pattern as a string
        assert served.kv_is_idle()


@pytest.mark.parametrize("value, code, says", [("(", "invalid_request", "is not a valid regular expression"),
                                               (["ok", "x*"], "invalid_request", "matches the empty string"),
                                               ([""], "invalid_request", "non-empty strings"),
                                               (5, "invalid_value", "a string or a list of strings")])
async def test_bad_stop_regex_is_a_400_naming_it(serve, value: Any, code: str, says: str) -> None:
    async with serve() as served:
        for path in (CHAT, COMPLETIONS, "/generate"):
            response = await served.client.post(path, json=body_for(path, stop_regex=value))
            error = await assert_error(response, 400, code, "stop_regex")
            assert says in error["message"], error
        both = await served.client.post(COMPLETIONS, json=body_for(COMPLETIONS, stop_regex="a", min_tokens=1))
        error = await assert_error(both, 400, "invalid_request", "stop_regex")
        assert "min_tokens" in error["message"]
        assert served.kv_is_idle()


# -- SGLang's no_stop_trim (CompletionRequest / ChatCompletionRequest; the detokenizer's trim_matched_stop) ---------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_no_stop_trim_keeps_the_stop_string_and_the_stop_token(serve, path: str) -> None:
    async with serve(coalesce=False) as served:
        plain = await (await served.client.post(path, json=body_for(
            path, max_tokens=8, temperature=0, return_token_ids=True))).get_json()
        text, ids = text_of(path, plain), plain["choices"][0]["token_ids"]
        stop = text.split()[2]
        start = text.index(stop)
        assert start > 0 and start + len(stop) < len(text)
        for no_trim, expected in ((False, text[:start]), (True, text[:start + len(stop)])):
            body = body_for(path, max_tokens=8, temperature=0, stop=[stop], no_stop_trim=no_trim)
            whole = await (await served.client.post(path, json=body)).get_json()
            assert text_of(path, whole) == expected
            assert (whole["choices"][0]["finish_reason"], whole["choices"][0]["matched_stop"]) == ("stop", stop)
            streamed = await post_stream(served.client, path, {**body, "stream": True})
            joined, last = streamed_text(path, streamed.events)
            assert joined == expected and last["matched_stop"] == stop
        # a stop token: its own text is dropped unless no_stop_trim (SGLang's trim of the matched token id)
        texts = {}
        for no_trim in (False, True):
            body = body_for(path, max_tokens=8, temperature=0, stop_token_ids=[ids[2]], no_stop_trim=no_trim,
                            return_token_ids=True)
            whole = await (await served.client.post(path, json=body)).get_json()
            assert whole["choices"][0]["token_ids"] == ids[:3] and whole["choices"][0]["matched_stop"] == ids[2]
            texts[no_trim] = text_of(path, whole)
        assert texts[True].startswith(texts[False]) and len(texts[True]) > len(texts[False])
        # both peers' names: either true keeps the stop; true against an explicit false is a 400
        same = await served.client.post(path, json=body_for(path, max_tokens=8, temperature=0, stop=[stop],
                                                             no_stop_trim=True, include_stop_str_in_output=True))
        assert text_of(path, await same.get_json()) == text[:start + len(stop)]
        for include in (True, False):
            clash = await served.client.post(path, json=body_for(path, stop=[stop], no_stop_trim=not include,
                                                                 include_stop_str_in_output=include))
            await assert_error(clash, 400, "invalid_value", "no_stop_trim")
        assert served.kv_is_idle()


async def test_no_stop_trim_is_not_a_generate_field(serve) -> None:
    async with serve() as served:
        await assert_error(await served.client.post("/generate", json=body_for("/generate", no_stop_trim=True)),
                           400, "unknown_field", "no_stop_trim")


# -- vLLM's bad_words (ChatCompletionRequest / CompletionRequest / SamplingParams) ------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/generate"])
async def test_bad_words_are_never_sampled(serve, tokenizer: Tokenizer, path: str) -> None:
    """A word the model favours is not sampled where it is banned (the fake model's real sampler; words of
    several tokens are banned after their prefix: ``tests/backends``), and the rest of the reply is unchanged."""
    async with serve(word_engine(use_sampler=True)) as served:
        body = body_for(path, max_tokens=4, temperature=0, return_token_ids=True)
        if path == "/generate":
            body.pop("return_token_ids")
        plain = await (await served.client.post(path, json=body)).get_json()
        ids = plain["token_ids"] if path == "/generate" else plain["choices"][0]["token_ids"]
        word = tokenizer.decode([ids[1]]).strip()
        assert word and tokenizer.encode(word, add_special_tokens=False) == [ids[1]]
        response = await served.client.post(path, json={**body, "bad_words": [word]})
        banned = await response.get_json()
        assert response.status_code == 200, banned
        out = banned["token_ids"] if path == "/generate" else banned["choices"][0]["token_ids"]
        assert ids[1] not in out and out[0] == ids[0] and out[2:] == ids[2:]
        assert word not in text_of(path, banned).split()
        for bad, code, says in (([" "], "invalid_request", "not blank"), (["ok", ""], "invalid_request", "not blank"),
                                ("w5", "invalid_value", "expected an array")):
            refused = await served.client.post(path, json={**body, "bad_words": bad})
            error = await assert_error(refused, 400, code, "bad_words")
            assert says in error["message"], error
        assert served.kv_is_idle()


# -- beam search: refused, saying so -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/generate"])
@pytest.mark.parametrize("field, value, empty, says", [
    ("use_beam_search", True, False, "beam search is not supported"),
])
async def test_unimplemented_peer_fields_are_refused_saying_so(serve, path: str, field: str, value: Any,
                                                                empty: Any, says: str) -> None:
    async with serve() as served:
        response = await served.client.post(path, json=body_for(path, **{field: value}))
        error = await assert_error(response, 400, "unsupported_parameter", field)
        assert says in error["message"]
        # sent empty (false, [], null: what vLLM's and SGLang's clients send by default) it asks for nothing
        ok = await served.client.post(path, json=body_for(path, **{field: empty}))
        assert ok.status_code == 200, await ok.get_data()
        assert served.kv_is_idle()


# -- messages: unknown keys and roles (OpenAI 400s both; SGLang refuses unknown roles) ------------------------------


@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
async def test_unknown_message_keys_and_roles_are_400s_naming_them(serve, path: str) -> None:
    async with serve() as served:
        extra_key = [{"role": "user", "content": "hi", "mood": "curious"}]
        error = await assert_error(await served.client.post(path, json={"messages": extra_key}),
                                   400, "unknown_field", "messages[0].mood")
        assert "'mood'" in error["message"]
        for role in ("narrator", "function", "User", "model"):
            custom = [{"role": "system", "content": "be brief"}, {"role": role, "content": "hi"}]
            error = await assert_error(await served.client.post(path, json={"messages": custom}),
                                       400, "invalid_value", "messages[1].role")
            assert f"unknown role {role!r}" in error["message"] and "developer" in error["message"]
