"""Wire records of ``POST /v1/responses`` (the OpenAI Responses API), parsed by the same strict converter as
every other body (``schemas.structure``: unknown fields are 400 ``unknown_field``, no type coercion).

Only what a stateless server can honour is modelled. Fields that need stored state (``previous_response_id``,
``conversation``, ``background``, ``prompt``), tools, and ``include`` are accepted as fields so that the route
can refuse them with a 400 naming the field (``responses_api.refuse_stateful``); sent empty they are ignored.
"""

from __future__ import annotations

from typing import Any

import attrs

from inference_server.http.schemas import CONVERTER


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


ResponseContentInput = str | list[InputContentPart]


@attrs.frozen(kw_only=True)
class ResponseInputItem:
    """An input item: a message ``{"role", "content"}`` with an optional ``"type": "message"``; ``id`` and
    ``status`` are accepted (an output item passed back as input carries them) and ignored."""

    role: str
    content: ResponseContentInput
    type: str | None = None
    id: str | None = None
    status: str | None = None


ResponseInput = str | list[ResponseInputItem]


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
class ResponsesRequest:
    """``POST /v1/responses``."""

    input: ResponseInput
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None
    truncation: str | None = None
    # Refused unless empty (they need stored state, tools or output this server does not produce).
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    include: list[str] | None = None
    reasoning: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


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

    CONVERTER.register_structure_hook(
        ResponseContentInput, text_or_list(list[InputContentPart], "a string or a list of content parts"))
    CONVERTER.register_structure_hook(
        ResponseInput, text_or_list(list[ResponseInputItem], "a string or a list of input items"))


_register_hooks()
