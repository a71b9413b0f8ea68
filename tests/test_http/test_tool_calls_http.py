"""Tool calling and reasoning through the whole chat route, on the fake engine with a tokenizer that serves
the real Qwen3 chat template: the fake model is scripted to write a recorded Qwen3 reply (reasoning, then a
Hermes tool call), token by token, so the parsers run on the engine's own detokenized stream."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from http_testkit import BASE_WORDS, EOS_ID, FAKE_VOCAB_SIZE, SPECIAL_TOKENS, post_stream, word_engine
from tests.fake_engine import FakeEngine
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from inference_server.http.chat_tools import history_calls
from inference_server.http.schemas import FunctionCallInput, ToolCallInput
from inference_server.models.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
# A recorded Qwen3 reply, in the pieces the fake model emits (the WordPiece decoder joins them with a space
# unless a piece starts with ##).
REPLY = ["<think>", "I", "need", "the", "weather", "tool.", "</think>", "<tool_call>", '{"name":', '"get_weather",',
         '"arguments":', '{"city":', '"Par', '##is",', '"days":', "3}}", "</tool_call>"]
PROMPT_WORDS = ["Weather", "in", "Paris", "?", "days", "3"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris ?"}]


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Tokenizer:
    """The test kit's word-level vocabulary (its fake words first, so the fake model's tokens are unchanged),
    with the reply's pieces and a few prompt words at the end, serving the real Qwen3 template."""
    fillers = FAKE_VOCAB_SIZE - len(SPECIAL_TOKENS) - len(BASE_WORDS) - len(REPLY) - len(PROMPT_WORDS)
    words = SPECIAL_TOKENS + BASE_WORDS + [f"w{i}" for i in range(fillers)] + REPLY + PROMPT_WORDS
    words = [w.removeprefix("##") if w.startswith("##") and w.removeprefix("##") in words else w for w in words]
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return Tokenizer(backend, special_tokens={"bos_token": "<bos>", "eos_token": "<eos>"},
                     eos_token_ids=frozenset({EOS_ID}), chat_template=(TEMPLATES / "qwen3.jinja").read_text(),
                     name="qwen3-fixture")


def scripted(tokenizer: Tokenizer, prompt_len: int) -> FakeEngine:
    ids = [tokenizer.token_to_id(piece) for piece in REPLY]
    assert None not in ids
    script = {prompt_len + i: token for i, token in enumerate(ids)}
    script[prompt_len + len(ids)] = EOS_ID
    return word_engine(token_at_length=script)  # type: ignore[arg-type]


def prompt_len(tokenizer: Tokenizer, **kwargs: Any) -> int:
    return len(tokenizer.apply_chat_template(MESSAGES, **kwargs))


async def test_tool_call_and_reasoning_whole(serve, qwen_tokenizer: Tokenizer) -> None:
    model = scripted(qwen_tokenizer, prompt_len(qwen_tokenizer, tools=TOOLS))
    async with serve(model, tokenizer=qwen_tokenizer) as served:
        response = await served.client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "return_token_ids": True})
        body = await response.get_json()
        assert response.status_code == 200, body
        [choice] = body["choices"]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] is None
        assert message["reasoning_content"] == "I need the weather tool."
        [call] = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
        # The tools reached the template as transformers passes them.
        assert body["prompt_token_ids"] == qwen_tokenizer.apply_chat_template(MESSAGES, tools=TOOLS)
        assert len(body["prompt_token_ids"]) > prompt_len(qwen_tokenizer) + 20
        assert served.kv_is_idle()


async def test_tool_call_and_reasoning_streamed(serve, qwen_tokenizer: Tokenizer) -> None:
    model = scripted(qwen_tokenizer, prompt_len(qwen_tokenizer, tools=TOOLS))
    async with serve(model, tokenizer=qwen_tokenizer, coalesce=False) as served:
        events = (await post_stream(served.client, "/v1/chat/completions", {
            "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 40, "stream": True})).events
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0] == {"role": "assistant", "content": ""}
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        assert reasoning == "I need the weather tool."
        assert "".join(d.get("content", "") for d in deltas) == ""
        entries = [e for d in deltas for e in d.get("tool_calls", [])]
        assert entries[0]["index"] == 0 and entries[0]["function"]["name"] == "get_weather"
        assert entries[0]["id"].startswith("call_") and entries[0]["type"] == "function"
        assert all("id" not in e and "name" not in e["function"] for e in entries[1:])
        assert len(entries) > 2, "the arguments stream in fragments"
        arguments = "".join(e["function"].get("arguments", "") for e in entries)
        assert json.loads(arguments) == {"city": "Paris", "days": 3}
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
        assert served.kv_is_idle()


async def test_tool_choice_none_renders_no_tools_and_parses_none(serve, qwen_tokenizer: Tokenizer) -> None:
    model = scripted(qwen_tokenizer, prompt_len(qwen_tokenizer))
    async with serve(model, tokenizer=qwen_tokenizer) as served:
        response = await served.client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 40, "return_token_ids": True})
        body = await response.get_json()
        [choice] = body["choices"]
        assert body["prompt_token_ids"] == qwen_tokenizer.apply_chat_template(MESSAGES)
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        # Reasoning is still split; the call stays text.
        assert choice["message"]["reasoning_content"] == "I need the weather tool."
        assert choice["message"]["content"].startswith('<tool_call> {"name": "get_weather"')


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
async def test_tool_choice_auto_or_none_with_an_empty_tools_list_is_no_tools(
        serve, qwen_tokenizer: Tokenizer, tokenizer: Tokenizer, tool_choice: str) -> None:
    """SDK wrappers send ``tool_choice: "auto"`` whatever their tool list holds, and vLLM accepts ``tools: []``
    with it: no tools are rendered and the reply is not parsed for calls, as without both fields; also where
    the served template has no tool format (tool calling off)."""
    model = scripted(qwen_tokenizer, prompt_len(qwen_tokenizer))
    fields = {"messages": MESSAGES, "tools": [], "tool_choice": tool_choice, "max_tokens": 40,
              "return_token_ids": True}
    async with serve(model, tokenizer=qwen_tokenizer) as served:
        response = await served.client.post("/v1/chat/completions", json=fields)
        body = await response.get_json()
        assert response.status_code == 200, body
        [choice] = body["choices"]
        assert body["prompt_token_ids"] == qwen_tokenizer.apply_chat_template(MESSAGES)
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"].startswith('<tool_call> {"name": "get_weather"')  # text, not a call
    async with serve(tokenizer=tokenizer) as served:
        assert served.state.tool_format is None
        response = await served.client.post("/v1/chat/completions", json={**fields, "max_tokens": 2})
        assert response.status_code == 200, await response.get_json()


async def test_agent_history_and_template_kwargs_reach_the_template(serve, qwen_tokenizer: Tokenizer) -> None:
    call_1 = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call_1]},
               {"role": "tool", "tool_call_id": "call_1", "content": "days 3"}]
    rendered = qwen_tokenizer.apply_chat_template(
        [history[0], {**history[1], "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}, history[2]],
        tools=TOOLS, enable_thinking=False)
    async with serve(tokenizer=qwen_tokenizer) as served:
        response = await served.client.post("/v1/chat/completions", json={
            "messages": history, "tools": TOOLS, "max_tokens": 2, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False}})
        body = await response.get_json()
        assert response.status_code == 200, body
        assert body["prompt_token_ids"] == rendered
        think_close = qwen_tokenizer.token_to_id("</think>")
        assert think_close in rendered, "enable_thinking: false closed an empty think block in the prompt"


async def test_reasoning_effort_on_chat_sets_enable_thinking(serve, qwen_tokenizer: Tokenizer) -> None:
    """Chat's ``reasoning_effort`` renders the template as the Responses API's ``reasoning.effort`` does:
    ``none`` with ``enable_thinking: false``, any other level with ``true``; sent beside a disagreeing
    ``chat_template_kwargs.enable_thinking`` it is a 400 (neither silently wins), an unknown level too."""
    async with serve(tokenizer=qwen_tokenizer) as served:
        for effort, thinking in (("none", False), ("low", True), ("high", True)):
            response = await served.client.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 1, "return_token_ids": True, "reasoning_effort": effort})
            body = await response.get_json()
            assert response.status_code == 200, body
            assert body["prompt_token_ids"] == qwen_tokenizer.apply_chat_template(MESSAGES, enable_thinking=thinking)
        agreeing = await served.client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 1, "reasoning_effort": "none",
            "chat_template_kwargs": {"enable_thinking": False}})
        assert agreeing.status_code == 200, await agreeing.get_data()
        for fields in ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
                       {"reasoning_effort": "extreme"}):
            refused = await served.client.post("/v1/chat/completions", json={"messages": MESSAGES, **fields})
            assert refused.status_code == 400, await refused.get_data()
            assert (await refused.get_json())["error"]["param"] == "reasoning_effort"


async def test_replies_appended_as_the_openai_sdk_sends_them_back_render_as_plain_history(
        serve, qwen_tokenizer: Tokenizer) -> None:
    """The agent loop ``messages.append(completion.choices[0].message)``: the OpenAI SDK writes back every field
    its reply object holds. The ``.parse()`` and ``.stream()`` helpers' messages (recorded from openai-python
    3.57) add ``refusal``, ``annotations``, ``audio``, ``function_call``, ``parsed``, and on each call ``index``
    and ``function.parsed_arguments``; the history must render as the plain one does."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    plain = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "days 3"}]
    echoed_call = {**call, "index": 0, "function": {**call["function"], "parsed_arguments": {"city": "Paris"}}}
    echoed = {"content": "", "refusal": None, "role": "assistant", "annotations": None, "audio": None,
              "function_call": None, "tool_calls": [echoed_call], "parsed": None}
    async with serve(tokenizer=qwen_tokenizer) as served:
        rendered = []
        for history in (plain, [plain[0], echoed, plain[2]]):
            response = await served.client.post("/v1/chat/completions", json={
                "messages": history, "tools": TOOLS, "max_tokens": 2, "return_token_ids": True})
            body = await response.get_json()
            assert response.status_code == 200, body
            rendered.append(body["prompt_token_ids"])
        assert rendered[0] == rendered[1]
        # A structured-output reply written back: its parsed object and refusal are not rendered either.
        parsed_reply = {"role": "assistant", "content": '{"city": "Paris"}', "refusal": None,
                        "parsed": {"city": "Paris"}, "tool_calls": None}
        response = await served.client.post("/v1/chat/completions", json={
            "messages": [*MESSAGES, parsed_reply, *MESSAGES], "max_tokens": 2, "return_token_ids": True})
        body = await response.get_json()
        assert response.status_code == 200, body
        plain_reply = {"role": "assistant", "content": '{"city": "Paris"}'}
        assert body["prompt_token_ids"] == qwen_tokenizer.apply_chat_template([*MESSAGES, plain_reply, *MESSAGES])


async def test_tokenize_gives_the_ids_chat_runs_on_for_an_agent_history_with_tools(
        serve, qwen_tokenizer: Tokenizer) -> None:
    """``/tokenize`` with ``messages`` renders them as chat does (its contract: the ids a generation request
    runs on): an assistant's ``tool_calls`` and a ``tool`` result's id reach the template, and vLLM's ``tools``
    and ``chat_template_kwargs`` are taken as on chat."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "days 3"}]
    kwargs = {"enable_thinking": False}
    async with serve(tokenizer=qwen_tokenizer) as served:
        chat = await (await served.client.post("/v1/chat/completions", json={
            "messages": history, "tools": TOOLS, "chat_template_kwargs": kwargs, "max_tokens": 1,
            "return_token_ids": True})).get_json()
        for body, expected in (({"tools": TOOLS, "chat_template_kwargs": kwargs}, chat["prompt_token_ids"]),
                               ({}, qwen_tokenizer.apply_chat_template(
                                   [history[0], {**history[1], "content": "", "tool_calls": [{**call, "function": {
                                       "name": "get_weather", "arguments": {"city": "Paris"}}}]}, history[2]]))):
            response = await served.client.post("/tokenize", json={"messages": history, **body})
            payload = await response.get_json()
            assert response.status_code == 200, payload
            assert payload["tokens"] == expected
        assert qwen_tokenizer.token_to_id('"get_weather",') in chat["prompt_token_ids"]


@pytest.mark.parametrize("arguments", ["", "  ", None, "{}", {}])
def test_an_earlier_call_without_arguments_reaches_the_template_as_an_empty_object(arguments: Any) -> None:
    """A call to a function without parameters may come back with ``arguments`` empty (``""``: a stream
    accumulator that received no fragment, frameworks that serialise no arguments so): it reaches the template as
    ``{}``, as vLLM passes it, not as an empty string that templates write verbatim (``"arguments": }``, which
    the Qwen3 and embedded templates would render)."""
    call = ToolCallInput(function=FunctionCallInput(name="get_weather", arguments=arguments), id="call_1")
    [entry] = history_calls([call], 1)
    assert entry["function"] == {"name": "get_weather", "arguments": {}}


@pytest.mark.parametrize(("field", "value"), [("audio", {"id": "audio_1"}),
                                              ("function_call", {"name": "f", "arguments": "{}"})])
async def test_a_history_message_with_audio_or_a_legacy_function_call_is_refused(
        serve, qwen_tokenizer: Tokenizer, field: str, value: Any) -> None:
    history = [*MESSAGES, {"role": "assistant", "content": "x", field: value}, *MESSAGES]
    async with serve(tokenizer=qwen_tokenizer) as served:
        response = await served.client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2})
        body = await response.get_json()
        assert response.status_code == 400, body
        assert body["error"]["param"] == f"messages[1].{field}"
        assert body["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),  # needs tools (as vLLM: only an empty list is accepted as none)
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),  # a call that cannot be made
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS + TOOLS}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
async def test_bad_tool_fields_are_400s_naming_the_field(serve, qwen_tokenizer: Tokenizer, fields: dict[str, Any],
                                                         param: str) -> None:
    async with serve(tokenizer=qwen_tokenizer) as served:
        response = await served.client.post("/v1/chat/completions", json={"messages": MESSAGES, **fields})
        body = await response.get_json()
        assert response.status_code == 400, body
        assert body["error"]["param"] == param, body


async def test_embedded_style_template_renders_tools_for_the_hermes_parser(serve, tokenizer: Tokenizer) -> None:
    """The test kit's template has no tool format: auto turns tool parsing off, and a request with tools says so."""
    async with serve(tokenizer=tokenizer) as served:
        assert served.state.tool_format is None and served.state.reasoning_format is None
        response = await served.client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
        body = await response.get_json()
        assert response.status_code == 400 and body["error"]["param"] == "tools"
        # tool_choice none with tools is fine: nothing to parse.
        response = await served.client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
        assert response.status_code == 200


async def test_include_reasoning_false_drops_the_reasoning_whole_and_streamed(serve, qwen_tokenizer: Tokenizer) -> None:
    """vLLM's ``include_reasoning: false`` (Groq's and OpenRouter's clients send it too): the reply keeps its
    answer and tool calls but not the reasoning section, whole (``reasoning_content`` null) and streamed (no
    ``reasoning_content`` delta); the choices' ``logprobs`` and ``token_ids`` would show the dropped reasoning,
    so, as vLLM, they are withheld (``prompt_token_ids`` stays). ``true`` is the default."""
    model = scripted(qwen_tokenizer, prompt_len(qwen_tokenizer, tools=TOOLS))
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "logprobs": True, "return_token_ids": True}
    async with serve(model, tokenizer=qwen_tokenizer, coalesce=False) as served:
        shown = await (await served.client.post("/v1/chat/completions", json={**body, "include_reasoning": True}))\
            .get_json()
        hidden_response = await served.client.post("/v1/chat/completions", json={**body, "include_reasoning": False})
        hidden = await hidden_response.get_json()
        assert hidden_response.status_code == 200, hidden
        [shown_choice], [hidden_choice] = shown["choices"], hidden["choices"]
        assert shown_choice["message"]["reasoning_content"] == "I need the weather tool."
        assert shown_choice["logprobs"] is not None and shown_choice["token_ids"]
        assert hidden_choice["message"]["reasoning_content"] is None
        assert [c["function"] for c in hidden_choice["message"]["tool_calls"]] == \
            [c["function"] for c in shown_choice["message"]["tool_calls"]]  # (call ids are fresh per reply)
        assert hidden_choice["finish_reason"] == "tool_calls"
        assert hidden_choice["logprobs"] is None and "token_ids" not in hidden_choice
        assert hidden["prompt_token_ids"] == shown["prompt_token_ids"]
        # the reasoning tokens were generated: they still count
        assert hidden["usage"]["completion_tokens"] == shown["usage"]["completion_tokens"] == len(REPLY) + 1

        streamed = await post_stream(served.client, "/v1/chat/completions",
                                     {**body, "stream": True, "include_reasoning": False})
        chunks = streamed.events[:-1]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert not any("reasoning_content" in d for d in deltas)
        assert all(c["choices"][0]["logprobs"] is None and "token_ids" not in c["choices"][0] for c in chunks)
        entries = [e for d in deltas for e in d.get("tool_calls", [])]
        assert json.loads("".join(e["function"].get("arguments", "") for e in entries)) == {"city": "Paris", "days": 3}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert chunks[0]["prompt_token_ids"] == shown["prompt_token_ids"]
        shown_stream = await post_stream(served.client, "/v1/chat/completions", {**body, "stream": True})
        reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in shown_stream.events[:-1])
        assert reasoning == "I need the weather tool."
        assert served.kv_is_idle()


async def test_include_reasoning_false_without_a_reasoning_parser_changes_nothing(serve, tokenizer: Tokenizer) -> None:
    """Where the served model has no reasoning section (the embedded Gemma 3 template), there is nothing to drop:
    the reply, its logprobs and its token ids are as without the field."""
    async with serve(tokenizer=tokenizer) as served:
        assert served.state.reasoning_format is None
        body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logprobs": True, "return_token_ids": True}
        plain = await (await served.client.post("/v1/chat/completions", json=body)).get_json()
        hidden = await (await served.client.post("/v1/chat/completions", json={**body, "include_reasoning": False}))\
            .get_json()
        assert hidden["choices"] == plain["choices"]
        refused = await served.client.post("/v1/chat/completions", json={**body, "include_reasoning": "no"})
        assert refused.status_code == 400
        assert (await refused.get_json())["error"]["param"] == "include_reasoning"


async def test_reasoning_message_key_is_reasoning_content(serve, qwen_tokenizer: Tokenizer) -> None:
    """vLLM's newer (and OpenRouter's) name of an earlier reply's reasoning, ``reasoning``, renders as
    ``reasoning_content`` (Qwen3's template writes it back in a think block); both sent must agree."""
    def history(**reasoning: str) -> list[dict[str, Any]]:
        return [*MESSAGES, {"role": "assistant", "content": "Sunny.", **reasoning}]

    async with serve(tokenizer=qwen_tokenizer) as served:
        async def tokens(messages: list[dict[str, Any]]) -> list[int]:
            response = await served.client.post("/tokenize", json={"messages": messages})
            assert response.status_code == 200, await response.get_data()
            return (await response.get_json())["tokens"]

        named = await tokens(history(reasoning="I need the weather tool."))
        assert named == await tokens(history(reasoning_content="I need the weather tool."))
        assert named != await tokens(history())
        assert named == await tokens(history(reasoning="I need the weather tool.",
                                             reasoning_content="I need the weather tool."))
        response = await served.client.post("/v1/chat/completions", json={
            "messages": history(reasoning="one", reasoning_content="two"), "max_tokens": 1})
        assert response.status_code == 400
        assert (await response.get_json())["error"]["param"] == "messages[1].reasoning"


async def test_separate_reasoning_false_keeps_the_reasoning_in_content(serve, qwen_tokenizer: Tokenizer) -> None:
    """SGLang's ``separate_reasoning: false``: no reasoning parser runs, so the section stays in ``content`` as the
    model wrote it (markers included), whole and streamed; tool calls are still parsed (from the whole text, as
    SGLang's); nothing is hidden, so logprobs and token ids stay. With ``include_reasoning: false`` it is a 400."""
    model = scripted(qwen_tokenizer, prompt_len(qwen_tokenizer, tools=TOOLS))
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "logprobs": True, "return_token_ids": True}
    async with serve(model, tokenizer=qwen_tokenizer, coalesce=False) as served:
        separate = await (await served.client.post("/v1/chat/completions", json=body)).get_json()
        kept_response = await served.client.post("/v1/chat/completions", json={**body, "separate_reasoning": False})
        kept = await kept_response.get_json()
        assert kept_response.status_code == 200, kept
        [choice], [separate_choice] = kept["choices"], separate["choices"]
        assert separate_choice["message"]["reasoning_content"] == "I need the weather tool."
        assert choice["message"].get("reasoning_content") is None
        content = choice["message"]["content"]
        assert content.lstrip().startswith("<think> I need the weather tool. </think>"), content
        assert [c["function"] for c in choice["message"]["tool_calls"]] == \
            [c["function"] for c in separate_choice["message"]["tool_calls"]]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["logprobs"] == separate_choice["logprobs"] and choice["token_ids"] == separate_choice["token_ids"]

        streamed = await post_stream(served.client, "/v1/chat/completions",
                                     {**body, "stream": True, "separate_reasoning": False})
        deltas = [c["choices"][0]["delta"] for c in streamed.events[:-1]]
        assert not any("reasoning_content" in d for d in deltas)
        assert "".join(d.get("content", "") for d in deltas) == content
        entries = [e for d in deltas for e in d.get("tool_calls", [])]
        assert json.loads("".join(e["function"].get("arguments", "") for e in entries)) == {"city": "Paris", "days": 3}

        clash = await served.client.post("/v1/chat/completions", json={
            **body, "separate_reasoning": False, "include_reasoning": False})
        assert clash.status_code == 400
        assert (await clash.get_json())["error"]["param"] == "separate_reasoning"
        assert served.kv_is_idle()
    # without tools no parser runs at all: the content is the text as generated
    async with serve(scripted(qwen_tokenizer, prompt_len(qwen_tokenizer)), tokenizer=qwen_tokenizer) as served:
        no_tools = await (await served.client.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 40, "separate_reasoning": False})).get_json()
        assert no_tools["choices"][0]["message"]["content"].lstrip().startswith(
            "<think> I need the weather tool. </think> <tool_call>")


async def test_stream_reasoning_false_sends_the_reasoning_whole_when_it_closes(serve,
                                                                              qwen_tokenizer: Tokenizer) -> None:
    """SGLang's ``stream_reasoning: false``: a stream holds the reasoning back and sends it in one
    ``reasoning_content`` delta when its section closes (the chunk of ``</think>``), or at the end when the output
    stops inside it (``max_tokens``); the default streams it as written. Whole replies are the same either way."""
    model = scripted(qwen_tokenizer, prompt_len(qwen_tokenizer, tools=TOOLS))
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, "stream": True}
    async with serve(model, tokenizer=qwen_tokenizer, coalesce=False) as served:
        async def reasoning_deltas(**fields: Any) -> tuple[list[str], list[dict[str, Any]]]:
            chunks = (await post_stream(served.client, "/v1/chat/completions", {**body, **fields})).events[:-1]
            return [c["choices"][0]["delta"]["reasoning_content"] for c in chunks
                    if "reasoning_content" in c["choices"][0]["delta"]], chunks

        streamed, _ = await reasoning_deltas()
        assert len(streamed) > 1 and "".join(streamed) == "I need the weather tool."
        held, chunks = await reasoning_deltas(stream_reasoning=False, logprobs=True)  # logprobs: a chunk per token
        assert held == ["I need the weather tool."]
        # it went out with the token that closed the section (the chunks before it carry only logprobs)
        closing = next(i for i, c in enumerate(chunks) if "reasoning_content" in c["choices"][0]["delta"])
        assert closing == REPLY.index("</think>") + 1  # after the opening chunk
        assert chunks[closing]["choices"][0]["logprobs"]["content"][-1]["token"] == "</think>"
        assert all(c["choices"][0]["delta"] == {} for c in chunks[1:closing])
        entries = [e for c in chunks for e in c["choices"][0]["delta"].get("tool_calls", [])]
        assert json.loads("".join(e["function"].get("arguments", "") for e in entries)) == {"city": "Paris", "days": 3}

        cut, chunks = await reasoning_deltas(stream_reasoning=False, max_tokens=4)
        assert cut == ["I need the"]
        assert "reasoning_content" in chunks[-1]["choices"][0]["delta"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        whole = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40}
        plain = await (await served.client.post("/v1/chat/completions", json=whole)).get_json()
        unstreamed = await (await served.client.post("/v1/chat/completions", json={
            **whole, "stream_reasoning": False})).get_json()
        assert unstreamed["choices"][0]["message"]["reasoning_content"] == "I need the weather tool."
        assert unstreamed["choices"][0]["message"]["tool_calls"][0]["function"] == \
            plain["choices"][0]["message"]["tool_calls"][0]["function"]
        for field in ("separate_reasoning", "stream_reasoning"):  # SGLang's CompletionRequest has neither
            refused = await served.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, field: False})
            assert refused.status_code == 400 and (await refused.get_json())["error"]["param"] == field
        assert served.kv_is_idle()
