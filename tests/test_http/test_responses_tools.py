"""Function tools and reasoning items on ``POST /v1/responses``, through the official OpenAI SDK over a real
socket, on the fake engine with a tokenizer serving the real Qwen3 chat template: the fake model writes a
recorded Qwen3 reply (reasoning, then a Hermes call) token by token, so the SDK parses our ``reasoning`` and
``function_call`` items and their stream events; a follow-up request sends the items back with a
``function_call_output`` and must render the same prompt as the chat route's agent history."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from http_testkit import MODEL_NAME, SocketServer, assert_engine_clean, serving_on_socket, word_engine
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
)
from test_tool_calls_http import MESSAGES, TOOLS, prompt_len, qwen_tokenizer, scripted  # noqa: F401 (a fixture)

from inference_server.models.tokenizer import Tokenizer
from inference_server.records.constraints import Constraint

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
"""``TOOLS`` in the Responses API's shape."""
QUESTION = MESSAGES[0]["content"]


def sdk(server: SocketServer) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=server.url + "/v1", max_retries=0)


@pytest.fixture
def replying(qwen_tokenizer: Tokenizer):  # noqa: F811 (the imported fixture)
    """A server whose fake model writes the recorded reply to ``MESSAGES`` rendered with ``TOOLS``."""
    model = scripted(qwen_tokenizer, prompt_len(qwen_tokenizer, tools=TOOLS))
    with serving_on_socket(model, tokenizer=qwen_tokenizer) as served:
        yield served
        served.call(assert_engine_clean, served.engine)


def test_whole_response_has_a_reasoning_item_then_a_function_call(replying: SocketServer,
                                                                  qwen_tokenizer: Tokenizer) -> None:  # noqa: F811
    response = sdk(replying).responses.create(model=MODEL_NAME, input=QUESTION, tools=FLAT_TOOLS,
                                              max_output_tokens=40)
    assert response.status == "completed"
    reasoning, call = response.output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.id.startswith("rs_")
    assert reasoning.summary == [] and reasoning.content is not None
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "I need the weather tool.")]
    assert isinstance(call, ResponseFunctionToolCall)
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3} and call.status == "completed"
    assert response.output_text == ""  # no message item: the reply is only a call
    assert response.tool_choice == "auto" and response.parallel_tool_calls is True
    assert [t.name for t in response.tools] == ["get_weather"]
    assert response.usage is not None
    assert response.usage.input_tokens == len(qwen_tokenizer.apply_chat_template(MESSAGES, tools=TOOLS))


def test_streamed_items_and_argument_deltas(replying: SocketServer) -> None:
    events = list(sdk(replying).responses.create(model=MODEL_NAME, input=QUESTION, tools=FLAT_TOOLS,
                                                 max_output_tokens=40, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning_deltas = [e.delta for e in events if isinstance(e, ResponseReasoningTextDeltaEvent)]
    assert "".join(reasoning_deltas) == "I need the weather tool."
    argument_deltas = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)]
    assert len(argument_deltas) > 1, "the arguments stream in fragments"
    [done] = [e for e in events if isinstance(e, ResponseFunctionCallArgumentsDoneEvent)]
    assert "".join(e.delta for e in argument_deltas) == done.arguments
    assert json.loads(done.arguments) == {"city": "Paris", "days": 3}
    added = [e for e in events if isinstance(e, ResponseOutputItemAddedEvent)]
    closed = [e for e in events if isinstance(e, ResponseOutputItemDoneEvent)]
    assert [(e.output_index, e.item.type) for e in added] == [(0, "reasoning"), (1, "function_call")]
    assert [(e.output_index, e.item.type) for e in closed] == [(0, "reasoning"), (1, "function_call")]
    assert added[1].item.arguments == "" and added[1].item.status == "in_progress"
    assert {e.item_id for e in argument_deltas} == {closed[1].item.id} == {done.item_id}
    # Each item's events lie between its added and done events; the response events frame them all.
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types.index("response.reasoning_text.done") < types.index("response.output_item.done")
    assert types.index("response.output_item.done") < types.index("response.function_call_arguments.delta")
    final = events[-1]
    assert isinstance(final, ResponseCompletedEvent)
    [reasoning, call] = final.response.output
    assert isinstance(call, ResponseFunctionToolCall) and call.arguments == done.arguments
    assert call.call_id == closed[1].item.call_id and reasoning.id == closed[0].item.id


def test_follow_up_renders_the_agent_history_as_chat(qwen_tokenizer: Tokenizer) -> None:  # noqa: F811
    """Passing the output items back with a ``function_call_output`` builds the prompt the chat route builds
    from the same history (an assistant turn with the reasoning and the call, then the tool result)."""
    model = scripted(qwen_tokenizer, prompt_len(qwen_tokenizer, tools=TOOLS))
    with serving_on_socket(model, tokenizer=qwen_tokenizer) as served:
        client = sdk(served)
        first = client.responses.create(model=MODEL_NAME, input=QUESTION, tools=FLAT_TOOLS, max_output_tokens=40)
        call = first.output[1]
        assert isinstance(call, ResponseFunctionToolCall)
        items: list[Any] = [{"role": "user", "content": QUESTION}, *first.output,
                            {"type": "function_call_output", "call_id": call.call_id, "output": "days 3"}]
        second = client.responses.create(model=MODEL_NAME, input=items, tools=FLAT_TOOLS, max_output_tokens=1)
        history = [MESSAGES[0],
                   {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
                    "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                        "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
                   {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "days 3"}]
        assert second.usage is not None
        assert second.usage.input_tokens == len(qwen_tokenizer.apply_chat_template(history, tools=TOOLS))
        served.call(assert_engine_clean, served.engine)


def test_reasoning_effort_sets_enable_thinking(qwen_tokenizer: Tokenizer) -> None:  # noqa: F811
    with serving_on_socket(word_engine(), tokenizer=qwen_tokenizer) as served:
        client = sdk(served)
        off = client.responses.create(model=MODEL_NAME, input=QUESTION, reasoning={"effort": "none"},
                                      max_output_tokens=1)
        on = client.responses.create(model=MODEL_NAME, input=QUESTION, reasoning={"effort": "high"},
                                     max_output_tokens=1)
        assert off.usage is not None and on.usage is not None
        assert off.usage.input_tokens == len(qwen_tokenizer.apply_chat_template(MESSAGES, enable_thinking=False))
        assert on.usage.input_tokens == len(qwen_tokenizer.apply_chat_template(MESSAGES, enable_thinking=True))
        assert off.usage.input_tokens > on.usage.input_tokens  # the empty think block closed in the prompt
        assert off.reasoning is not None and off.reasoning.effort == "none"


def test_tool_choice_auto_with_an_empty_tools_list_is_no_tools(qwen_tokenizer: Tokenizer) -> None:  # noqa: F811
    """As on chat: ``tools: []`` with ``tool_choice: "auto"`` renders no tools (the prompt is the plain chat's)."""
    with serving_on_socket(word_engine(), tokenizer=qwen_tokenizer) as served:
        response = sdk(served).responses.create(model=MODEL_NAME, input=QUESTION, tools=[], tool_choice="auto",
                                                max_output_tokens=1)
        assert response.usage is not None
        assert response.usage.input_tokens == len(qwen_tokenizer.apply_chat_template(MESSAGES))


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"tools": [{"type": "function"}]}, "tools[0].name", "missing_field"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "invalid_value"),
    ({"tools": FLAT_TOOLS + FLAT_TOOLS}, "tools[1].name", "invalid_value"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name",
     "invalid_value"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice", "invalid_value"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": FLAT_TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice",
     "invalid_value"),
    ({"tools": [{"type": "function", "name": "f", "bogus": 1}]}, "tools[0].bogus", "unknown_field"),
    ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input[0].name", "missing_field"),
])
def test_bad_tool_fields_are_400s_naming_the_field(qwen_tokenizer: Tokenizer, fields: dict[str, Any],  # noqa: F811
                                                   param: str, code: str) -> None:
    with serving_on_socket(word_engine(), tokenizer=qwen_tokenizer) as served, \
            pytest.raises(openai.BadRequestError) as refused:
        sdk(served).responses.create(model=MODEL_NAME, **{"input": QUESTION, "max_output_tokens": 2, **fields})
    assert refused.value.status_code == 400
    assert (refused.value.body["param"], refused.value.body["code"]) == (param, code), refused.value.body


# -- structured output after the reasoning section (both routes; the Qwen3 template has a reasoning parser) --

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}


@pytest.mark.parametrize(("route", "fields", "thinking"), [
    ("/v1/chat/completions", {"response_format": RESPONSE_FORMAT}, True),
    ("/v1/chat/completions", {"response_format": RESPONSE_FORMAT, "chat_template_kwargs": {"enable_thinking": False}},
     False),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "c", "schema": SCHEMA}}}, True),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "c", "schema": SCHEMA}},
                       "reasoning": {"effort": "none"}}, False),
])
async def test_the_constraint_starts_after_the_reasoning_section(serve, qwen_tokenizer: Tokenizer,  # noqa: F811
                                                                 route: str, fields: dict[str, Any],
                                                                 thinking: bool) -> None:
    """The compiled constraint is the schema after an optional ``<think>…</think>`` unless thinking is off
    (the compiler's cache holds exactly the constraint the request was admitted with)."""
    plain = Constraint.json_schema(SCHEMA, strict=False)  # OpenAI's default
    wrapped = plain.after_reasoning("<think>", "</think>")
    async with serve(tokenizer=qwen_tokenizer) as served:
        body = {"messages": MESSAGES} if route.endswith("completions") else {"input": QUESTION}
        response = await served.client.post(route, json={**body, **fields, "max_tokens" if "messages" in body
                                                         else "max_output_tokens": 5})
        assert response.status_code == 200, await response.get_json()
        grammar = served.engine.parts.grammar
        assert (grammar.cached(wrapped), grammar.cached(plain)) == (thinking, not thinking)
