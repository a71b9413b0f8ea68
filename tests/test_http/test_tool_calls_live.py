"""Tool calls forced by the grammar on a live ``inference-server serve`` of the embedded *base* model (Gemma 3
270M, whose served template renders tools in the Hermes style): with ``tool_choice`` ``required`` or a named
function, only the constraint makes a base model answer with a valid call, so every test checks the call's
``arguments`` against the tool's ``parameters`` (``jsonschema``), plain and streamed, through the OpenAI SDK.

Our own versions of vLLM's tool-use OpenAI tests (``tests/tool_use/test_tool_calls.py``,
``test_chat_completions.py``, ``test_parallel_tool_calls.py``, ``test_tool_choice_required.py``): the same
questions (a call's shape, streamed deltas rebuilt into the same call, ``finish_reason``, a tool result
turned into an answer), asked of this server.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

REQUEST_TIMEOUT = 300.0

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Za-z/]{1,20}$"}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def sdk(embedded_server: tuple[int, str]) -> openai.OpenAI:
    """A client of the session's embedded-model server (``tests/conftest.py``)."""
    client = openai.OpenAI(base_url=embedded_server[1] + "/v1", api_key="none", timeout=REQUEST_TIMEOUT,
                           max_retries=0)
    MODEL.append(client.models.list().data[0].id)
    return client


MODEL: list[str] = []  # the served name, once the server is up


def check_call(call: Any, names: set[str]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_required_returns_a_valid_call(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model=MODEL[0], messages=QUESTION, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call, {"get_weather", "get_time"})


def test_named_function_streamed_rebuilds_the_same_call(sdk: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    plain = sdk.chat.completions.create(model=MODEL[0], messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                        temperature=0, max_tokens=60)
    [call] = plain.choices[0].message.tool_calls
    expected = check_call(call, {"get_time"})
    stream = sdk.chat.completions.create(model=MODEL[0], messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                         temperature=0, max_tokens=60, stream=True)
    name, arguments, finish, ids = None, "", None, set()
    for chunk in stream:
        delta = chunk.choices[0].delta
        for entry in delta.tool_calls or []:
            assert entry.index == 0
            if entry.id:
                ids.add(entry.id)
                name = entry.function.name
            arguments += entry.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_time" and len(ids) == 1 and finish == "tool_calls"
    assert json.loads(arguments) == expected  # greedy: the same call, streamed


def test_required_with_parallel_calls_are_each_valid(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(model=MODEL[0], messages=QUESTION, tools=TOOLS, tool_choice="required",
                                        temperature=1.0, seed=3, max_tokens=120)
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason in ("tool_calls", "length")
    if reply.choices[0].finish_reason == "tool_calls":
        for call in calls:
            check_call(call, {"get_weather", "get_time"})
        assert len({c.id for c in calls}) == len(calls)


def test_agent_loop_tool_result_then_answer(sdk: openai.OpenAI) -> None:
    """The docs' agent loop: a forced call, its result as a tool message, then a plain answer."""
    messages: list[Any] = list(QUESTION)
    first = sdk.chat.completions.create(model=MODEL[0], messages=messages, tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=0, max_tokens=60)
    [call] = first.choices[0].message.tool_calls
    check_call(call, {"get_weather"})
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})})
    answer = sdk.chat.completions.create(model=MODEL[0], messages=messages, tools=TOOLS, tool_choice="none",
                                         temperature=0, max_tokens=20)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


CLIENTS_DOC = Path(__file__).parents[2] / "docs" / "clients.md"


def run_documented(sdk: openai.OpenAI, name: str) -> tuple[list[str], list[str]]:
    """docs/clients.md's script marked ``<!-- executed: NAME -->``, run as written (only the server's address
    and model name swapped): (the lines it printed, the lines the doc says it printed)."""
    found = re.search(rf"<!-- executed: {name} -->\n```python\n(.*?)```\n```\n(.*?)```", CLIENTS_DOC.read_text(),
                      re.DOTALL)
    assert found is not None
    script = found.group(1).replace("http://127.0.0.1:8000/v1", str(sdk.base_url).rstrip("/"))
    script = script.replace('"gemma-3-270m"', repr(MODEL[0]))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(script, "docs/clients.md", "exec"), {"__name__": name.replace(" ", "_")})
    print(printed.getvalue())
    return printed.getvalue().splitlines(), found.group(2).splitlines()


def test_the_documented_agent_loop_runs_as_written(sdk: openai.OpenAI) -> None:
    """docs/clients.md's agent loop, run as written."""
    (first, second), (documented_first, documented_second) = run_documented(sdk, "agent loop")
    assert first.split(" ", 2)[:2] == ["tool_calls", "get_weather"] == documented_first.split(" ", 2)[:2]
    arguments = json.loads(first.split(" ", 2)[2])
    assert arguments["unit"] in ("celsius", "fahrenheit") and len(arguments["city"]) <= 20
    assert first == documented_first and second == documented_second  # greedy on CPU: the documented run


# -- the Responses API (client.responses.create), the same server -------------------------------------------

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
"""``TOOLS`` in the Responses API's shape."""


def check_function_call(item: Any, names: set[str]) -> dict[str, Any]:
    assert item.type == "function_call" and item.call_id.startswith("call_") and item.id.startswith("fc_")
    assert item.name in names and item.status == "completed"
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, SCHEMAS[item.name])
    return arguments


def test_responses_required_returns_a_valid_function_call(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model=MODEL[0], input=QUESTION[0]["content"], tools=FLAT_TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_output_tokens=60)
    assert response.status == "completed"
    [item] = response.output
    check_function_call(item, {"get_weather", "get_time"})


def test_responses_named_function_streamed_rebuilds_the_same_call(sdk: openai.OpenAI) -> None:
    choice = {"type": "function", "name": "get_time"}
    whole = sdk.responses.create(model=MODEL[0], input=QUESTION[0]["content"], tools=FLAT_TOOLS,
                                 tool_choice=choice, temperature=0, max_output_tokens=60)
    [item] = whole.output
    expected = check_function_call(item, {"get_time"})
    events = list(sdk.responses.create(model=MODEL[0], input=QUESTION[0]["content"], tools=FLAT_TOOLS,
                                       tool_choice=choice, temperature=0, max_output_tokens=60, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments and json.loads(deltas) == expected  # greedy: the same call, streamed
    assert events[-1].type == "response.completed"
    [final] = events[-1].response.output
    assert final.name == "get_time" and final.arguments == done.arguments


def test_responses_agent_loop_function_call_output_then_answer(sdk: openai.OpenAI) -> None:
    items: list[Any] = [{"role": "user", "content": QUESTION[0]["content"]}]
    first = sdk.responses.create(model=MODEL[0], input=items, tools=FLAT_TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=60)
    [call] = first.output
    check_function_call(call, {"get_weather"})
    items += first.output
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature_c": 21})})
    answer = sdk.responses.create(model=MODEL[0], input=items, tools=FLAT_TOOLS, tool_choice="none",
                                  temperature=0, max_output_tokens=20)
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text and answer.status in ("completed", "incomplete")


def test_the_documented_responses_agent_loop_runs_as_written(sdk: openai.OpenAI) -> None:
    """docs/clients.md's Responses agent loop: a forced function_call item, its output passed back, an answer
    streamed as a message item; greedy on CPU, so exactly the documented run."""
    printed, documented = run_documented(sdk, "responses agent loop")
    first = printed[0].split(" ", 2)
    assert first[:2] == ["function_call", "get_weather"]
    arguments = json.loads(first[2])
    assert arguments["unit"] in ("celsius", "fahrenheit") and len(arguments["city"]) <= 20
    assert printed[1:3] == ["response.output_item.added message", "response.output_item.done message"]
    assert printed == documented
