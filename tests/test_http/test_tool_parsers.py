"""Tool-call and reasoning parsers on recorded model outputs (Qwen3 Hermes-style, Gemma 4's own format), whole and
streamed, split at every boundary; malformed outputs stay text. Cases follow the categories of SGLang's
``test_function_call_parser.py`` (Qwen25Detector: single, several, text around, ``parameters``, unknown name,
bad JSON, streaming increments) and vLLM's Hermes/Gemma 4 parser tests (nested values, strings holding the
format's punctuation, empty arguments, a call cut off by ``max_tokens``), written for our parsers."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from inference_server.http import reasoning_parsers, tool_parsers
from inference_server.http.chat_output import (
    ChatOutputSpec,
    auto_reasoning_parser,
    auto_tool_parser,
    join_deltas,
)
from inference_server.http.tool_parsers import gemma4_to_json

HERMES, GEMMA4 = tool_parsers.HERMES, tool_parsers.GEMMA4
QWEN3_THINK, GEMMA4_THINK = reasoning_parsers.FORMATS["qwen3"], reasoning_parsers.FORMATS["gemma4"]
NAMES = frozenset({"get_weather", "get_time", "search"})


def whole(spec: ChatOutputSpec, text: str) -> dict[str, Any]:
    return spec.processor().message(text)


def streamed(spec: ChatOutputSpec, pieces: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The message a client rebuilds from the deltas (as the OpenAI SDK accumulates them), and the deltas."""
    output = spec.processor()
    deltas = [output.feed(p) for p in pieces] + [output.finish()]
    deltas = [d for d in deltas if d]
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for entry in delta.get("tool_calls", []):
            call = calls.get(entry["index"])
            if call is None:
                assert {"id", "type", "function"} <= set(entry), "a call's first delta names it"
                assert entry["type"] == "function" and entry["function"]["name"]
                call = calls[entry["index"]] = {"id": entry["id"], "type": "function",
                                                "function": {"name": entry["function"]["name"], "arguments": ""}}
            else:
                assert "name" not in entry["function"] and "id" not in entry
            call["function"]["arguments"] += entry["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if spec.reasoning is not None:
        message["reasoning_content"] = reasoning or None
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, deltas


def splits(text: str) -> list[list[str]]:
    """The text one character at a time, in two, and in random pieces of 1-7 characters."""
    rng = random.Random(len(text))
    out = [list(text), [text[: len(text) // 2], text[len(text) // 2:]]]
    for _ in range(5):
        pieces, i = [], 0
        while i < len(text):
            size = rng.randint(1, 7)
            pieces.append(text[i:i + size])
            i += size
        out.append(pieces)
    return out


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    message = json.loads(json.dumps(message))
    for call in message.get("tool_calls", []):
        assert call.pop("id").startswith("call_")
    return message


def check_all_ways(spec: ChatOutputSpec, text: str) -> dict[str, Any]:
    """The whole message, checked equal to the streamed one however the text is split."""
    expected = without_ids(whole(spec, text))
    for pieces in splits(text):
        message, _ = streamed(spec, pieces)
        assert without_ids(message) == expected, pieces
    return expected


def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# -- Hermes (Qwen3) ------------------------------------------------------------------------------------------

QWEN = ChatOutputSpec(HERMES, NAMES, True, QWEN3_THINK)
HERMES_ONLY = ChatOutputSpec(HERMES, NAMES, True, None)


def test_hermes_single_call_with_reasoning() -> None:
    text = ('<think>\nThe user asks for the weather in Paris; I should call get_weather.\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    assert check_all_ways(QWEN, text) == {
        "role": "assistant", "content": None,
        "reasoning_content": "The user asks for the weather in Paris; I should call get_weather.",
        "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})]}


def test_hermes_parallel_calls_with_text_before() -> None:
    text = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo", '
            '"format": 24, "dst": false, "extra": null, "scale": -1.5e3}}\n</tool_call>')
    message = check_all_ways(HERMES_ONLY, text)
    assert message["content"] == "I will look both up."
    assert message["tool_calls"] == [
        call("get_weather", {"city": "Tokyo"}),
        call("get_time", {"timezone": "Asia/Tokyo", "format": 24, "dst": False, "extra": None, "scale": -1500.0})]


def test_hermes_parameters_key_nested_values_and_unicode() -> None:
    arguments = {"query": "naïve \"quoted\" {braces} </tool_call-ish> 中文 😀", "filters": {"years": [2024, 2025],
                 "tags": []}, "limit": 10}
    text = '<tool_call>\n' + json.dumps({"name": "search", "parameters": arguments}, ensure_ascii=False) \
        + '\n</tool_call>'
    assert check_all_ways(HERMES_ONLY, text)["tool_calls"] == [
        {"type": "function", "function": {"name": "search",
                                          "arguments": json.dumps(arguments, ensure_ascii=False)}}]


def test_hermes_empty_arguments_and_text_after() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone.'
    message = check_all_ways(HERMES_ONLY, text)
    assert message["tool_calls"] == [call("get_time", {})]
    assert message["content"] == "\nDone."


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not one of the tools
    'Use the <tool_call tag like this.',
])
def test_hermes_malformed_output_stays_text(text: str) -> None:
    message = check_all_ways(HERMES_ONLY, text)
    assert message == {"role": "assistant", "content": text}


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',  # bad JSON
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    '<tool_call>\n{"name": "get_weather" "arguments": {}}\n</tool_call>',  # a comma missing
])
def test_hermes_malformed_after_the_name(text: str) -> None:
    """Whole, the block is text. Streamed, the call was announced once its name was complete: it ends with
    the arguments sent so far, a prefix of what the model wrote (vLLM's streaming parsers do the same)."""
    check_announced_then_malformed(HERMES_ONLY, text)


def check_announced_then_malformed(spec: ChatOutputSpec, text: str) -> None:
    assert whole(spec, text) == {"role": "assistant", "content": text}
    for pieces in splits(text):
        message, _ = streamed(spec, pieces)
        if "tool_calls" not in message:  # pieces so large that the block was whole when it arrived
            assert message == {"role": "assistant", "content": text}
            continue
        [only] = message["tool_calls"]
        assert only["function"]["name"] == "get_weather" and message["content"] is None
        assert '{"city": "Paris"}'.startswith(only["function"]["arguments"]) or only["function"]["arguments"] == ""


def test_hermes_call_cut_off_after_a_complete_body_counts() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    assert check_all_ways(HERMES_ONLY, text)["tool_calls"] == [call("get_weather", {"city": "Oslo"})]


def test_hermes_good_and_bad_blocks_together() -> None:
    bad = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n' + bad
    message = check_all_ways(HERMES_ONLY, text)
    assert message["tool_calls"] == [call("get_time", {"tz": "UTC"})]
    assert message["content"] == bad


def test_no_parallel_calls_keeps_the_first() -> None:
    spec = ChatOutputSpec(HERMES, NAMES, False, None)
    text = ('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert check_all_ways(spec, text)["tool_calls"] == [call("get_time", {"tz": "UTC"})]


def test_streamed_arguments_arrive_in_pieces_and_the_name_first() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "San Francisco", "days": 14}}\n</tool_call>'
    _, deltas = streamed(HERMES_ONLY, list(text))
    entries = [e for d in deltas for e in d["tool_calls"]]
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""} and entries[0]["index"] == 0
    fragments = [e["function"]["arguments"] for e in entries[1:]]
    assert len(fragments) > 3, "arguments stream as they arrive, not at the end"
    assert "".join(fragments) == '{"city": "San Francisco", "days": 14}'


def test_plain_text_passes_through_unchanged() -> None:
    text = "  Hello there!\n\nNo tools needed.  \n"
    assert check_all_ways(HERMES_ONLY, text) == {"role": "assistant", "content": text}
    assert check_all_ways(QWEN, text) == {"role": "assistant", "content": text, "reasoning_content": None}


# -- Gemma 4 -------------------------------------------------------------------------------------------------

GEMMA = ChatOutputSpec(GEMMA4, NAMES, True, GEMMA4_THINK)
Q = '<|"|>'


def test_gemma4_call_with_thinking() -> None:
    text = (f'<|channel>thought\nThe user wants the weather.<channel|><|tool_call>call:get_weather{{city:{Q}Paris, '
            f'FR{Q},days:3,metric:true,hours:[9,12.5,-3],opts:{{unit:{Q}C{Q},note:{Q}a:b{{c}}{Q}}}}}<tool_call|>')
    assert check_all_ways(GEMMA, text) == {
        "role": "assistant", "content": None, "reasoning_content": "The user wants the weather.",
        "tool_calls": [call("get_weather", {"city": "Paris, FR", "days": 3, "metric": True, "hours": [9, 12.5, -3],
                                            "opts": {"unit": "C", "note": "a:b{c}"}})]}


def test_gemma4_parallel_calls_empty_arguments_and_text() -> None:
    text = (f"Checking.<|tool_call>call:get_time{{}}<tool_call|><|tool_call>call:search{{query:{Q}x{Q},"
            f"missing:null}}<tool_call|>")
    message = check_all_ways(ChatOutputSpec(GEMMA4, NAMES, True, None), text)
    assert message["content"] == "Checking."
    assert message["tool_calls"] == [call("get_time", {}), call("search", {"query": "x", "missing": None})]


@pytest.mark.parametrize("body", [
    "call:get_weather{city:Paris}",  # a bare word that is no JSON value
    f"call:get_weather{{city:{Q}Paris}}",  # an open string
])
def test_gemma4_malformed_after_the_name(body: str) -> None:
    check_announced_then_malformed(ChatOutputSpec(GEMMA4, NAMES, True, None), f"<|tool_call>{body}<tool_call|>")


@pytest.mark.parametrize("body", [
    "get_weather{}",  # no call: prefix
    "call:unknown{}",  # not one of the tools
])
def test_gemma4_malformed_output_stays_text(body: str) -> None:
    text = f"<|tool_call>{body}<tool_call|>"
    spec = ChatOutputSpec(GEMMA4, NAMES, True, None)
    assert check_all_ways(spec, text) == {"role": "assistant", "content": text}


def test_gemma4_syntax_to_json() -> None:
    assert gemma4_to_json(f"{{a:{Q}x, y{Q},b:[1,true],c:{{d:null}}}}") == ('{"a":"x, y","b":[1,true],"c":{"d":null}}',
                                                                       False)
    assert gemma4_to_json(f"{{a:{Q}unfinished") == ('{"a":"unfinished', True)
    assert gemma4_to_json(f"{{a:{Q}x<|") == ('{"a":"x', True)  # half of a closing quote is not text


# -- reasoning -----------------------------------------------------------------------------------------------


def test_qwen3_reasoning_split_and_truncated() -> None:
    spec = ChatOutputSpec(reasoning=QWEN3_THINK)
    assert check_all_ways(spec, "<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer is 4.") == {
        "role": "assistant", "content": "The answer is 4.", "reasoning_content": "Step 1.\nStep 2."}
    assert check_all_ways(spec, "<think>\nStill thinking when max_tokens") == {
        "role": "assistant", "content": "", "reasoning_content": "Still thinking when max_tokens"}
    # A think tag later in the answer is the answer's text.
    assert check_all_ways(spec, "Sure: <think> is Qwen's tag.") == {
        "role": "assistant", "content": "Sure: <think> is Qwen's tag.", "reasoning_content": None}
    assert check_all_ways(spec, "<thi") == {"role": "assistant", "content": "<thi", "reasoning_content": None}


def test_gemma4_thinking_channel() -> None:
    spec = ChatOutputSpec(reasoning=GEMMA4_THINK)
    assert check_all_ways(spec, "<|channel>thought\nLet me add.<channel|>4") == {
        "role": "assistant", "content": "4", "reasoning_content": "Let me add."}


def test_join_deltas_merges_a_calls_fragments() -> None:
    first = {"content": "a", "tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                             "function": {"name": "f", "arguments": "{"}}]}
    second = {"content": "b", "tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    assert join_deltas(first, second) == {"content": "ab", "tool_calls": [
        {"index": 0, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


# -- auto selection by template ------------------------------------------------------------------------------


def test_auto_parsers_follow_the_served_template(chat_template_text: Any) -> None:
    from inference_server.models.chat_templates import GEMMA_TURNS

    assert (auto_tool_parser(chat_template_text("qwen3")), auto_reasoning_parser(chat_template_text("qwen3"))) \
        == ("hermes", "qwen3")
    assert (auto_tool_parser(chat_template_text("gemma4")), auto_reasoning_parser(chat_template_text("gemma4"))) \
        == ("gemma4", "gemma4")
    assert (auto_tool_parser(GEMMA_TURNS), auto_reasoning_parser(GEMMA_TURNS)) == ("hermes", None)
    assert (auto_tool_parser(None), auto_reasoning_parser(None)) == (None, None)


@pytest.fixture
def chat_template_text() -> Any:
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
    return lambda name: (folder / f"{name}.jinja").read_text()
