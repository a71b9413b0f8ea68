"""A Hypothesis fuzz of every POST route over real sockets, against one real Hypercorn server for the run.

Each example is a valid-ish request for ``/generate``, ``/v1/completions`` or ``/v1/chat/completions`` with
random JSON values of random types put into its fields (and unknown fields added), sent on the wire in one
of several ways: as JSON (strings may hold unpaired surrogate escapes), under a wrong or missing
``Content-Type``, as bytes that are not JSON, as JSON cut short, as a body over ``MAX_BODY_BYTES``, cut off
by a client that leaves mid-upload, or complete but abandoned by a client that leaves without reading.

Every answer must be: no 5xx; an error is JSON in the OpenAI shape ``{"error": {"message", "type", "param",
"code"}}``; a 200 is a complete JSON result or a complete SSE stream ending in ``[DONE]`` with no error
event. After each answer the connection either serves the next request (a ``GET /health`` on the same
connection, and the next example reuses it: keep-alive after every error) or said ``Connection: close`` and
is closed by the server. After the run the engine is idle and holds nothing (``assert_engine_clean``).

Reproducible: ``derandomize=True`` and no example database. 162 examples (3 routes x 9 ways, 6 each), one
server for the module; about 5 s on a 2-core machine (plus 10 s for each case finding 4 fails).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from http_testkit import (
    MODEL_NAME,
    RawConnection,
    RawResponse,
    SocketServer,
    assert_engine_clean,
    parse_sse,
    serving_on_socket,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_server.config import Settings
from inference_server.models.tokenizer import Tokenizer

MAX_BODY = 16 * 1024
EXAMPLES_PER_CASE = 6
"""Three routes times nine ways on the wire: 162 examples in all."""
SOCKET_TIMEOUT = 20.0
CLEAN_TIMEOUT = 10.0
"""Seconds the engine gets to become idle after a case (the fake model finishes a request in milliseconds)."""
ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]

# -- values -------------------------------------------------------------------------------------------------

any_text = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=12)  # with lone surrogates
words = st.lists(st.sampled_from(["hello", "world", "the", "capital", "of", "france", "is", "w7", "zz"]),
                 min_size=1, max_size=6).map(" ".join)
any_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | any_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(any_text, children, max_size=4),
    max_leaves=10)
token_ids = st.lists(st.integers(0, 520), min_size=1, max_size=8)

sampling_fields = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**32), "stop": st.lists(words, max_size=2) | words,
    "ignore_eos": st.booleans(), "repetition_penalty": st.floats(0.5, 2), "priority": st.integers(-5, 5),
    "stop_token_ids": st.lists(st.integers(0, 511), max_size=3), "include_stop_str_in_output": st.booleans(),
})
def _stream_options_need_stream(body: dict[str, Any]) -> dict[str, Any]:
    """A valid body sends ``stream_options`` only with ``stream: true`` (vLLM's rule)."""
    return {**body, "stream": True} if "stream_options" in body else body


generate_bodies = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 12)},
    optional={"stream": st.booleans(), "logprobs": st.integers(0, 3),
              "session_id": words, "add_special_tokens": st.booleans(), "cache_salt": words})
completion_bodies = st.fixed_dictionaries(
    {"prompt": words | st.lists(words, min_size=1, max_size=2) | token_ids | st.lists(token_ids, min_size=1,
                                                                                      max_size=2),
     "max_tokens": st.integers(1, 12)},
    optional={"model": st.just(MODEL_NAME), "n": st.integers(1, 3), "stream": st.booleans(),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
              "logprobs": st.integers(0, 3), "user": words, "echo": st.just(False)}).map(
    lambda body: _stream_options_need_stream(body))
messages = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]),
    "content": words | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}), min_size=1,
                                max_size=2)}), min_size=1, max_size=3)
chat_bodies = st.fixed_dictionaries(
    {"messages": messages, "max_completion_tokens": st.integers(1, 12)},
    optional={"model": st.just(MODEL_NAME), "n": st.integers(1, 3), "stream": st.booleans(),
              "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
              "logprobs": st.booleans(), "user": words}).map(lambda body: _stream_options_need_stream(body))
VALID = {"/generate": generate_bodies, "/v1/completions": completion_bodies, "/v1/chat/completions": chat_bodies}
SHARED_PATHS = ["max_tokens", "stream", "logprobs", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                "stop.0", "stop_token_ids", "ignore_eos", "priority", "repetition_penalty"]
FIELD_PATHS = {
    "/generate": [*SHARED_PATHS, "prompt", "prompt_token_ids", "prompt_token_ids.0", "session_id", "trace_id",
                  "cache_salt", "add_special_tokens"],
    "/v1/completions": [*SHARED_PATHS, "prompt", "prompt.0", "n", "stream_options", "stream_options.include_usage",
                        "model", "user", "echo", "suffix", "best_of"],
    "/v1/chat/completions": [*SHARED_PATHS, "messages", "messages.0", "messages.0.role", "messages.0.content",
                             "messages.0.content.0", "messages.0.content.0.text", "max_completion_tokens", "n",
                             "stream_options", "stream_options.include_usage", "top_logprobs", "model", "user"],
}
"""Where random values go: each route's own fields (nested ones included)."""
OTHER_PATHS = ["tools", "response_format", "min_tokens", "logit_bias", "allowed_token_ids", "prompt", "messages",
               "functions"]
"""Fields of another route, or known to be unsupported."""


def _put(body: dict[str, Any], path: str, value: Any) -> None:
    """Set ``value`` at a dotted path (list indices as numbers) when its container exists."""
    *parents, last = path.split(".")
    node: Any = body
    for step in parents:
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = value


@st.composite
def valid_bodies(draw: st.DrawFn, route: str) -> dict[str, Any]:
    """A body for ``route`` that is valid but for what the engine may refuse (a prompt or output too long)."""
    body = {**draw(VALID[route]), **draw(sampling_fields)}
    if route == "/generate":  # exactly one of the two prompt fields (both or neither: a 400 on its own)
        body.update(draw(st.fixed_dictionaries({"prompt": words}) | st.fixed_dictionaries({"prompt_token_ids":
                                                                                           token_ids})))
    return body


@st.composite
def mutated_bodies(draw: st.DrawFn, route: str) -> dict[str, Any]:
    """A valid body for ``route`` with random values of random types put into some of its fields (or fields
    of another route, or unsupported ones), and sometimes unknown fields added."""
    body = draw(valid_bodies(route))
    for path in draw(st.lists(st.sampled_from(FIELD_PATHS[route] + OTHER_PATHS), min_size=1, max_size=3)):
        _put(body, path, draw(any_json | any_text))
    if draw(st.booleans()):
        body.update(draw(st.dictionaries(any_text, any_json, min_size=1, max_size=2)))
    return body


# -- the wire -----------------------------------------------------------------------------------------------

WIRES = ["valid", "mutated", "surrogate", "content_type", "not_json", "cut_json", "oversized", "left_mid_upload",
         "left_without_reading"]
"""How an example goes on the wire: a valid body; random values in its fields; an unpaired surrogate in a
value or a key; a wrong or missing ``Content-Type``; bytes that are not JSON; JSON cut short (the length
honest); a body over ``MAX_BODY_BYTES``; a client that leaves mid-upload; a client that sends a valid request
and leaves without reading the answer."""
CONTENT_TYPES = [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=utf-8", "application/vnd.api+json", "application/octet-stream", "json"]


@attrs.frozen
class Example:
    route: str
    wire: str
    body: bytes
    content_type: str | None
    cut: int

    def __repr__(self) -> str:  # what Hypothesis prints for a falsifying example
        return f"Example({self.route} {self.wire} {self.content_type!r} cut={self.cut} body={self.body[:300]!r})"


@st.composite
def examples(draw: st.DrawFn, route: str, wire: str) -> Example:
    fields = draw(valid_bodies(route) if wire in ("valid", "left_without_reading") else mutated_bodies(route))
    if wire == "surrogate":  # an unpaired surrogate in some field's value, or in a key
        lone = draw(st.characters(categories=["Cs"]))
        if draw(st.booleans()):
            _put(fields, draw(st.sampled_from(FIELD_PATHS[route])), draw(words) + lone)
        else:
            fields[draw(words) + lone] = draw(any_json)
    body = json.dumps(fields).encode()  # ensure_ascii: surrogates travel as \uXXXX escapes, as clients send them
    content_type: str | None = "application/json"
    if wire == "content_type":
        content_type = draw(st.sampled_from(CONTENT_TYPES))
    elif wire == "not_json":
        body = draw(st.binary(max_size=64) | st.sampled_from([b"prompt=x", b"{'prompt': 'x'}", b"\xff\xfe{}",
                                                             b'{"prompt": "x",}', b"[1, 2", b"null", b"\x00"]))
    elif wire == "oversized":
        body = json.dumps({"prompt": "hello " * (MAX_BODY // 6 + draw(st.integers(1, 40_000)))}).encode()
    return Example(route, wire, body, content_type, draw(st.integers(0, max(0, len(body) - 1))))


# -- the run ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tokenizer: Tokenizer) -> Iterator[SocketServer]:
    with serving_on_socket(tokenizer=tokenizer, settings=Settings(max_body_bytes=MAX_BODY),
                           app_config={"BODY_TIMEOUT": 5}) as served:
        yield served


class Client:
    """One keep-alive connection reused across examples, reopened only after the server closed it."""

    def __init__(self, server: SocketServer) -> None:
        self.server = server
        self.connection: RawConnection | None = None

    def open(self) -> RawConnection:
        if self.connection is None:
            self.connection = RawConnection(self.server, timeout=SOCKET_TIMEOUT)
        return self.connection

    def drop(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


def check_answer(example: Example, response: RawResponse) -> None:
    assert response.status < 500, (response.status, response.body[:500])
    if response.status >= 400:
        response.error()
        return
    assert response.status == 200, response
    if response.headers["content-type"].startswith("text/event-stream"):
        events = parse_sse(response.body)
        assert events and events[-1] == "[DONE]", events[-3:]
        assert not any("error" in event for event in events[:-1]), events
    else:
        payload = json.loads(response.body)
        assert "error" not in payload, payload


def send_and_check(client: Client, example: Example) -> None:
    connection = client.open()
    headers = {} if example.content_type is None else {"Content-Type": example.content_type}
    if example.wire == "left_mid_upload":  # declares the whole body, sends part of it, leaves
        connection.request("POST", example.route, example.body[:example.cut], headers, content_length=len(example.body))
        client.drop()
        return
    body = example.body[:example.cut] if example.wire == "cut_json" else example.body
    connection.request("POST", example.route, body, headers)
    if example.wire == "left_without_reading":
        connection.socket.shutdown(socket.SHUT_RDWR)
        client.drop()
        return
    response = connection.response()
    assert response is not None, "the server closed the connection without answering"
    check_answer(example, response)
    if response.closes:
        assert connection.closed_by_server(), "said Connection: close but kept the connection open"
        client.drop()
        return
    connection.request("GET", "/health")  # the same connection serves the next request
    follow_up = connection.response()
    assert follow_up is not None and follow_up.status == 200, follow_up


CASES = [pytest.param(route, wire, id=f"{wire}-{route}") for wire in WIRES for route in ROUTES]
"""Every (route, way on the wire), in ``WIRES`` order (one server is shared by all of them)."""


@pytest.mark.parametrize(("route", "wire"), CASES)
def test_fuzz_every_post_route_over_a_socket(server: SocketServer, route: str, wire: str) -> None:
    """``EXAMPLES_PER_CASE`` examples of one route and one way on the wire; then the engine is clean."""
    client = Client(server)

    @settings(max_examples=EXAMPLES_PER_CASE, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(example=examples(route, wire))
    def run(example: Example) -> None:
        try:
            send_and_check(client, example)
        except BaseException:
            client.drop()  # a failing example must not leave a half-read connection to the next one
            raise

    try:
        run()
    finally:
        client.drop()
    server.call(assert_engine_clean, server.engine, CLEAN_TIMEOUT)
    assert not server.failures, "the engine failed during the fuzz"
