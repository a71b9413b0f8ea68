"""Wire records of ``POST /v1/responses`` (the OpenAI Responses API), parsed by the same strict converter as
every other body (``body_parser.structure``: unknown fields are 400 ``unknown_field``, no type coercion).

Only what a stateless server can honour is modelled. Fields that need stored state (``previous_response_id``,
``conversation``, ``background``, ``prompt``) and ``include`` are accepted as fields so that the route can
refuse them with a 400 naming the field (``responses_api.refuse_unsupported``); sent empty they are ignored.
Function tools (``tools``, ``tool_choice``, ``parallel_tool_calls``) and the items of an agent loop
(``function_call``, ``function_call_output``, ``reasoning``) are modelled in full (``responses_input``).
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_server.http.body_parser import CONVERTER


@attrs.frozen(kw_only=True)
class InputContentPart:
    """One part of an input message's content: ``input_text`` (or ``output_text``, an earlier answer passed
    back as an assistant message). Other part types (images, files, audio) are refused by the route."""

    type: str
    text: str | None = None
    annotations: Any = None
    logprobs: Any = None
    image_url: Any = None
    file_id: Any = None
    detail: Any = None


ItemContent = str | list[InputContentPart] | None


@attrs.frozen(kw_only=True)
class ResponseInputItem:
    """An input item. ``type`` absent or ``message``: a message ``{"role", "content"}``. An earlier output item
    passed back: ``function_call`` (``call_id``, ``name``, ``arguments``), ``reasoning`` (``content`` of
    ``reasoning_text`` parts, ``summary``); and a tool result, ``function_call_output`` (``call_id``,
    ``output``). ``id`` and ``status`` are accepted (output items carry them) and ignored; which fields each
    type needs is checked by ``responses_input``."""

    type: str | None = None
    role: str | None = None
    content: ItemContent = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Any = None
    summary: list[Any] | None = None
    encrypted_content: str | None = None


ResponseInput = str | list[ResponseInputItem]


@attrs.frozen(kw_only=True)
class ResponseTool:
    """One of ``tools``, the Responses API's flat shape: ``{"type": "function", "name", "description",
    "parameters", "strict"}``. Other tool types (``web_search``, ``file_search``, ...) parse and are refused
    by name (``tools[i].type``)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


@attrs.frozen(kw_only=True)
class ReasoningConfig:
    """``reasoning``: ``effort`` (``none`` turns the template's thinking off, any other level on) and
    ``summary`` (accepted; no summaries are written: the reasoning text is the item's ``content``)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


@attrs.frozen(kw_only=True)
class TextFormat:
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields beside ``type``."""

    type: str
    name: str | None = None
    schema: Any = None
    strict: bool | None = None
    description: str | None = None


@attrs.frozen(kw_only=True)
class TextConfig:
    """``text``: its ``format`` (plain text, the default, or structured output)."""

    format: TextFormat | None = None
    verbosity: str | None = None


@attrs.frozen(kw_only=True)
class ResponseStreamOptions:
    """``stream_options``: OpenAI's ``include_obfuscation`` (``convert.refuse_obfuscation``), and chat's
    ``include_usage``, which SGLang's clients send here: accepted and changes nothing (the final
    ``response.completed`` / ``response.incomplete`` event always carries ``usage``)."""

    include_obfuscation: bool | None = None
    include_usage: bool | None = None


@attrs.frozen(kw_only=True)
class ResponsesRequest:
    """``POST /v1/responses``."""

    input: ResponseInput
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # The sampling extensions chat takes (vLLM's and SGLang's; not OpenAI's), which SGLang's Responses tests send.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    truncation: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    service_tier: str | None = None  # one tier here: auto or default (``convert.refuse_service_tier``)
    prompt_cache_key: str | None = None  # the prefix cache needs no key: accepted, unused
    safety_identifier: str | None = None  # keys the session when ``user`` is absent
    request_id: str | None = None
    """vLLM's: the response's ``id`` as sent (vLLM's default is ``resp_<uuid>``), and the trace id unless an
    ``X-Trace-Id`` / ``X-Request-Id`` header names one (``ResponsesRoutes._response_id``)."""
    # Refused unless empty (they need stored state or output this server does not produce).
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _register_hooks() -> None:
    """Teach the shared strict converter the two "a string or a list" unions of this API."""
    def text_or_list(list_type: Any, expected: str) -> Any:
        def structure(value: Any, _: Any) -> Any:
            if isinstance(value, str):
                return value
            if isinstance(value, list):
                return CONVERTER.structure(value, list_type)
            raise TypeError(f"expected {expected}, got {_json_type(value)}")

        return structure

    content = text_or_list(list[InputContentPart], "a string or a list of content parts")
    CONVERTER.register_structure_hook(ItemContent, lambda value, t: None if value is None else content(value, t))
    CONVERTER.register_structure_hook(
        ResponseInput, text_or_list(list[ResponseInputItem], "a string or a list of input items"))


_register_hooks()
