"""``POST /v1/responses``: the OpenAI Responses API over the chat path, without stored state.

The request becomes one chat ``GenerationRequest``: ``instructions`` is a leading system message, ``input``
a string (one user message) or a list of message items (``role`` ``user``, ``system``, ``developer`` (as
``system``) or ``assistant``; ``content`` a string or ``input_text`` / ``output_text`` parts, joined with
newlines). ``max_output_tokens`` caps the output (absent: the rest of the context, as on chat);
``temperature`` and ``top_p`` sample. It is admitted, collected or streamed by the same code as chat
(``generation.admit``, ``sse.sse_body``); ``responses_format`` builds the bodies and events.

Nothing is stored: ``store`` is accepted (either value) but no response can be retrieved later. What needs
stored state or features this server lacks is a 400 ``unsupported_parameter`` naming the field:
``previous_response_id``, ``conversation``, ``background: true``, ``prompt``, ``include``, ``reasoning``,
``top_logprobs``, ``max_tool_calls``, tools (``tools``, ``tool_choice``, ``parallel_tool_calls``: through
the shared unsupported-field list), ``truncation: "auto"``, and input
items or content parts that are not text messages. ``text.format`` json_schema / json_object constrain the
output (``constraint_fields``).
"""

from __future__ import annotations

import time
from typing import Any

import attrs
from quart import Response, g, request

from inference_server.http.constraint_fields import from_text_format
from inference_server.http.convert import SESSION_ID_HEADER, header_id, sampling_params
from inference_server.http.errors import invalid_request
from inference_server.http.generation import admit
from inference_server.http.openai_format import new_id
from inference_server.http.responses import json_response, read_body, sse_response
from inference_server.http.responses_format import ResponseEcho, ResponseHead, ResponsesEncoder, whole_response
from inference_server.http.responses_schema import ResponseInput, ResponsesRequest
from inference_server.http.schemas import SamplingFields
from inference_server.http.state import AppState
from inference_server.records.requests import ChatMessage, GenerationRequest

INPUT_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PART_TYPES = frozenset({"input_text", "output_text"})
STATEFUL_FIELDS = {
    "previous_response_id": "previous_response_id needs stored responses, and this server stores none: send the "
                            "whole conversation in input",
    "conversation": "conversation needs stored conversations, and this server stores none: send the whole "
                    "conversation in input",
    "background": "background responses need stored responses, and this server stores none",
    "prompt": "stored prompt templates are not supported: send the prompt in input and instructions",
    "include": "include is not supported (no tool outputs, reasoning or logprobs to include)",
    "reasoning": "reasoning options are not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "tool calling is not supported on /v1/responses yet: use /v1/chat/completions",
    "tools": "tool calling is not supported on /v1/responses yet: use /v1/chat/completions",
}
"""Fields refused unless sent empty, with the reason."""
RENAMES = {"max_tokens": "max_output_tokens", "prompt": "input"}
"""Engine field names in admission errors -> this route's."""


class ResponsesRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def create(self) -> Response:
        """``POST /v1/responses``."""
        state = self.state
        state.check_accepting()
        body = await read_body(ResponsesRequest)
        state.check_model(body.model)
        generation_request = self._generation_request(body)
        generation = await admit(state.engine, [generation_request], state.tracker, renames=RENAMES)
        params = generation_request.params
        head = ResponseHead(new_id("resp"), int(time.time()), state.model_name, ResponseEcho(
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            temperature=params.temperature, top_p=params.top_p, metadata=body.metadata or {}, user=body.user))
        if body.stream:
            encoder = ResponsesEncoder(state, head, generation.prompt_tokens)
            return sse_response(generation, encoder, coalesce=state.coalesce, terminator=b"")
        (result,) = await generation.successful_results(state.engine)
        return json_response(whole_response(head, result, generation.prompt_tokens[0]))

    def _generation_request(self, body: ResponsesRequest) -> GenerationRequest:
        refuse_unsupported(body)
        messages = input_messages(body.input)
        if body.instructions:
            messages.insert(0, ChatMessage("system", body.instructions))
        if not messages:
            raise invalid_request("input must not be empty", "input")
        # A reply ends at the chat template's turn markers, as on the chat route.
        fmt = body.text.format if body.text is not None else None
        constraint = from_text_format(attrs.asdict(fmt, filter=lambda a, v: v is not None)) if fmt else None
        params = self.state.chat_stops.apply(sampling_params(
            SamplingFields(temperature=body.temperature, top_p=body.top_p), max_tokens=body.max_output_tokens,
            logprobs=None, constraint=constraint))
        session = header_id(request.headers.get(SESSION_ID_HEADER), SESSION_ID_HEADER) or body.user
        return GenerationRequest(params=params, messages=tuple(messages), session_id=session, trace_id=g.trace_id)


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 ``unsupported_parameter`` naming the first field this stateless, text-only server cannot honour."""
    for name, reason in STATEFUL_FIELDS.items():
        if not _is_empty(getattr(body, name)):
            raise invalid_request(reason, name, "unsupported_parameter")
    if body.tool_choice not in (None, "none", "auto"):  # without tools (refused above) none and auto mean nothing
        raise invalid_request("tool calling is not supported on /v1/responses yet: use /v1/chat/completions",
                              "tool_choice", "unsupported_parameter")
    if body.truncation not in (None, "disabled"):
        raise invalid_request("only truncation: \"disabled\" is supported (a prompt over the context is a 400)",
                              "truncation", "unsupported_parameter")


def input_messages(items: ResponseInput) -> list[ChatMessage]:
    """``input`` as chat messages (a string is one user message)."""
    if isinstance(items, str):
        return [ChatMessage("user", items)]
    messages = []
    for index, item in enumerate(items):
        if item.type not in (None, "message"):
            raise invalid_request(f"input items of type {item.type!r} are not supported; only messages are",
                                  f"input[{index}].type", "unsupported_parameter")
        role = INPUT_ROLES.get(item.role)
        if role is None:
            raise invalid_request(f"unknown role {item.role!r}; expected one of {', '.join(INPUT_ROLES)}",
                                  f"input[{index}].role")
        messages.append(ChatMessage(role, _content_text(item.content, index)))
    return messages


def _content_text(content: str | list, index: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part_index, part in enumerate(content):
        if part.type not in TEXT_PART_TYPES or part.text is None:
            raise invalid_request(f"content part of type {part.type!r} is not supported; only input_text parts are",
                                  f"input[{index}].content[{part_index}]", "unsupported_parameter")
        texts.append(part.text)
    return "\n".join(texts)

