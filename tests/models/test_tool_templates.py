"""Tools and an agent loop's history through the real Qwen3 and Gemma 4 chat templates (llama.cpp's copies in
tests/fixtures/chat_templates/) and the embedded Gemma 3 template, as admission renders them
(``ChatMessage.template_dict`` + ``tools=`` + template variables)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from inference_server.http import reasoning_parsers, tool_parsers
from inference_server.http.chat_output import ChatOutputSpec
from inference_server.http.chat_tools import decoded_arguments
from inference_server.http.openai import keep_marker_tokens
from inference_server.models.chat_templates import GEMMA_TURNS
from inference_server.models.tokenizer import Tokenizer
from inference_server.records.requests import ChatMessage
from inference_server.records.sampling_params import SamplingParams

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "days": {"type": "integer"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": decoded_arguments('{"city": "Paris", "days": 2}')}}
HISTORY = [ChatMessage("system", "Be brief."), ChatMessage("user", "Weather in Paris?"),
           ChatMessage("assistant", "", tool_calls=(CALL,)), ChatMessage("tool", '{"temp": 21}', tool_call_id="call_1")]


def render(template: str, messages: list[ChatMessage], **kwargs: object) -> str:
    backend = BackendTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tokenizer = Tokenizer(backend, special_tokens={"bos_token": "<bos>"}, eos_token_ids=frozenset(),
                          chat_template=template, name="fixture")
    return tokenizer.apply_chat_template([m.template_dict() for m in messages], tokenize=False, **kwargs)


def test_qwen3_renders_tools_calls_and_results() -> None:
    text = render((TEMPLATES / "qwen3.jinja").read_text(), HISTORY, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Weather' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
            '\n</tool_call><|im_end|>\n') in text
    assert text.endswith('<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
                         '<|im_start|>assistant\n')


def test_qwen3_enable_thinking_false_and_earlier_reasoning() -> None:
    template = (TEMPLATES / "qwen3.jinja").read_text()
    closed = render(template, HISTORY[1:2], enable_thinking=False)
    assert closed.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    answered = [*HISTORY[1:2], ChatMessage("assistant", "Sunny.", reasoning_content="Look it up.")]
    assert render(template, answered, add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\nSunny.<|im_end|>\n")


def test_gemma4_renders_tool_declarations_calls_and_thinking() -> None:
    template = (TEMPLATES / "gemma4.jinja").read_text()
    text = render(template, HISTORY, tools=TOOLS)
    assert text.startswith("<bos><|turn>system\nBe brief.<|tool>declaration:get_weather{description:<|\"|>Weather")
    assert "<|turn>model\n<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:2}<tool_call|><turn|>\n" in text
    assert text.endswith("<|turn>model\n<|channel>thought\n<channel|>")  # thinking off: an empty channel
    assert render(template, HISTORY[1:2], enable_thinking=True).startswith("<bos><|turn>system\n<|think|>")


def test_embedded_gemma3_template_renders_tools_in_hermes_style() -> None:
    text = render(GEMMA_TURNS, HISTORY, tools=TOOLS)
    assert text.startswith("<bos><start_of_turn>user\nYou can call these functions:\n<tools>\n{\"type\": \"function\"")
    assert "Be brief.\n\nWeather in Paris?<end_of_turn>\n" in text
    assert ('<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '</tool_call><end_of_turn>\n') in text
    assert text.endswith('<start_of_turn>user\n<tool_response>\n{"temp": 21}\n</tool_response><end_of_turn>\n'
                         '<start_of_turn>model\n')
    # Without tools the template is the plain Gemma turn format it always was.
    assert render(GEMMA_TURNS, HISTORY[:2]) == (
        "<bos><start_of_turn>user\nBe brief.\n\nWeather in Paris?<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize(("tools", "reasoning", "skip"), [
    (tool_parsers.GEMMA4, None, False), (None, reasoning_parsers.FORMATS["gemma4"], False),
    (tool_parsers.HERMES, reasoning_parsers.FORMATS["qwen3"], True), (None, None, True)])
def test_gemma4_parsers_keep_special_tokens(tools: object, reasoning: object, skip: bool) -> None:
    spec = ChatOutputSpec(tools=tools, reasoning=reasoning)  # type: ignore[arg-type]
    assert keep_marker_tokens(SamplingParams(), spec).skip_special_tokens is skip
