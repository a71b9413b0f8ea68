"""``POST /v1/responses`` driven by the official OpenAI SDK over a real socket (typed ``Response`` objects and
stream events), the raw SSE framing, the refusals of what needs stored state, and failures mid-stream."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from http_testkit import MODEL_NAME, SocketServer, assert_engine_clean, serving_on_socket, word_engine
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseErrorEvent,
    ResponseFailedEvent,
    ResponseIncompleteEvent,
    ResponseTextDeltaEvent,
)

from inference_server.models.tokenizer import Tokenizer

RESPONSES = "/v1/responses"
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
CLOSING_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
HELLO_PROMPT_TOKENS = 7
"""``<bos><start_of_turn>user\\nhello<end_of_turn>\\n<start_of_turn>model\\n`` in the test kit's word tokenizer."""


@pytest.fixture
def server(tokenizer: Tokenizer):
    with serving_on_socket(tokenizer=tokenizer) as served:
        yield served
        served.call(assert_engine_clean, served.engine)  # every request ended and freed its KV blocks


def sdk(server: SocketServer) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=server.url + "/v1", max_retries=0)


def chat_prompt_tokens(server: SocketServer, messages: list[dict[str, Any]]) -> int:
    completion = sdk(server).chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert completion.usage is not None
    return completion.usage.prompt_tokens


def test_sdk_reads_a_whole_response(server: SocketServer) -> None:
    client = sdk(server)
    response = client.responses.create(model=MODEL_NAME, input="hello", max_output_tokens=3)
    assert isinstance(response, Response)
    assert response.object == "response" and response.id.startswith("resp-") and response.model == MODEL_NAME
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    (part,) = message.content
    assert part.type == "output_text" and part.text == " w7 w8 w9" and part.annotations == []
    assert response.output_text == " w7 w8 w9"
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        HELLO_PROMPT_TOKENS, 3, HELLO_PROMPT_TOKENS + 3)
    assert response.max_output_tokens == 3 and response.tools == [] and response.error is None


def test_input_items_and_instructions_use_the_chat_template(server: SocketServer) -> None:
    """``instructions`` is a system message and input items are chat messages: the prompt is exactly the one
    chat completions builds from the same messages."""
    client = sdk(server)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "the capital"},
                                          {"type": "input_text", "text": "of france"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "paris"}]},
             {"role": "developer", "content": "hello"}]
    response = client.responses.create(input=items, instructions="a b c", max_output_tokens=2, temperature=0)
    chat = [{"role": "system", "content": "a b c"}, {"role": "user", "content": "the capital\nof france"},
            {"role": "assistant", "content": "paris"}, {"role": "system", "content": "hello"}]
    assert response.usage is not None
    assert response.usage.input_tokens == chat_prompt_tokens(server, chat)
    assert response.instructions == "a b c" and response.temperature == 0


def test_a_natural_stop_is_completed(server: SocketServer) -> None:
    server.run_sync(setattr, server.model, "eos_at_length", HELLO_PROMPT_TOKENS + 2)
    response = sdk(server).responses.create(input="hello", max_output_tokens=10)
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == " w7 w8" and response.output[0].status == "completed"
    assert response.usage is not None and response.usage.output_tokens == 3  # the EOS counts, as on chat


def test_sdk_reads_the_stream_event_sequence(server: SocketServer) -> None:
    client = sdk(server)
    events = list(client.responses.create(input="hello", max_output_tokens=4, stream=True))
    types = [e.type for e in events]
    deltas = types[len(STREAM_EVENTS):-len(CLOSING_EVENTS) - 1]
    assert types[:len(STREAM_EVENTS)] == STREAM_EVENTS
    assert types[-len(CLOSING_EVENTS) - 1:] == [*CLOSING_EVENTS, "response.incomplete"]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    assert text == " w7 w8 w9 w10"
    created, final = events[0], events[-1]
    assert created.response.status == "in_progress" and created.response.output == []
    assert isinstance(final, ResponseIncompleteEvent) and final.response.id == created.response.id
    assert final.response.output_text == text
    assert final.response.usage is not None and final.response.usage.output_tokens == 4
    item_ids = {getattr(e, "item_id", None) for e in events} - {None}
    assert item_ids == {final.response.output[0].id}
    whole = client.responses.create(input="hello", max_output_tokens=4)
    assert whole.output_text == text

    server.run_sync(setattr, server.model, "eos_at_length", HELLO_PROMPT_TOKENS + 1)
    completed = list(client.responses.create(input="hello", max_output_tokens=4, stream=True))
    assert isinstance(completed[-1], ResponseCompletedEvent) and completed[-1].response.status == "completed"
    assert completed[-1].response.output_text == " w7"


def test_stream_framing_names_each_event(server: SocketServer) -> None:
    """Each SSE event has an ``event:`` line equal to its data's ``type``; no ``[DONE]`` follows."""
    with httpx.Client(base_url=server.url) as http:
        reply = http.post(RESPONSES, json={"input": "hello", "max_output_tokens": 2, "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in reply.text.split("\n\n") if b]
    assert b"[DONE]" not in reply.content
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == event_line.removeprefix("event: ")


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
])
def test_what_needs_storage_or_tools_is_refused_by_name(server: SocketServer, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(server).responses.create(input="hello", max_output_tokens=2, extra_body=extra)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == param and refused.value.body["code"] == "unsupported_parameter"
    assert refused.value.body["type"] == "invalid_request_error" and refused.value.body["message"]


def test_accepted_flags_and_bad_input(server: SocketServer) -> None:
    client = sdk(server)
    stored = client.responses.create(input="hello", max_output_tokens=1, store=True, metadata={"k": "v"},
                                     text={"format": {"type": "text"}}, truncation="disabled", background=False)
    assert stored.metadata == {"k": "v"} and stored.output_text == " w7"
    with httpx.Client(base_url=server.url) as http:
        cases = [
            ({"input": "hello", "bogus": 1}, 400, "unknown_field", "bogus"),
            ({"max_output_tokens": 2}, 400, "missing_field", "input"),
            ({"input": []}, 400, "invalid_value", "input"),
            ({"input": 5}, 400, "invalid_value", "input"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
             "unsupported_parameter", "input[0].content[0]"),
            ({"input": [{"role": "critic", "content": "x"}]}, 400, "invalid_value", "input[0].role"),
            ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, 400,
             "unsupported_parameter", "input[0].type"),
            ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "missing_field", "input[0].call_id"),
            ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, 400, "invalid_value",
             "input[0].output"),
            ({"input": "hi", "reasoning": {"effort": "extreme"}}, 400, "invalid_value", "reasoning.effort"),
            ({"input": "hello", "max_output_tokens": 0}, 400, "invalid_request", "max_output_tokens"),
            ({"input": "hello", "temperature": -1}, 400, "invalid_request", "temperature"),
            ({"input": "hello", "model": "other"}, 404, "model_not_found", "model"),
        ]
        for body, status, code, param in cases:
            reply = http.post(RESPONSES, json=body)
            assert reply.status_code == status, reply.text
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert (error["code"], error["param"]) == (code, param), error


def test_a_client_that_leaves_mid_stream_aborts_its_request(tokenizer: Tokenizer) -> None:
    with serving_on_socket(word_engine(step_seconds=0.2), tokenizer=tokenizer) as server:
        events = sdk(server).responses.create(input="hello", max_output_tokens=120, stream=True)
        for event in events:
            if event.type == "response.output_text.delta":
                break
        events.close()
        server.call(assert_engine_clean, server.engine)
        assert server.model.tokens_emitted < 120  # (120 tokens would take 24 s)


def test_a_failure_mid_stream_is_an_error_and_a_failed_response(tokenizer: Tokenizer) -> None:
    with serving_on_socket(word_engine(fail_at=2), tokenizer=tokenizer) as server:
        events = list(sdk(server).responses.create(input="hello", max_output_tokens=20, stream=True))
    error, failed = events[-2:]
    assert isinstance(error, ResponseErrorEvent) and error.code == "engine_failure"
    assert isinstance(failed, ResponseFailedEvent) and failed.response.status == "failed"
    assert failed.response.error is not None and failed.response.error.code == "server_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:len(STREAM_EVENTS)]] == STREAM_EVENTS
