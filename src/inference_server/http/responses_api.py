"""``POST /v1/responses``: the OpenAI Responses API over the chat path, without stored state.

The request becomes one chat ``GenerationRequest``: ``instructions`` is a leading system message, ``input``
a string (one user message) or a list of items (``responses_input``: messages, ``function_call``,
``function_call_output`` and ``reasoning`` items of an agent loop). ``max_output_tokens`` caps the output
(absent: ``DEFAULT_MAX_TOKENS``, at most the rest of the context, as on chat); ``temperature`` and ``top_p``
sample. It is admitted,
collected or streamed by the same code as chat (``generation.admit``, ``sse.sse_body``); ``responses_format``
builds the bodies and events, ``responses_items`` the output items.

Tools are chat's (``chat_tools``): ``tools`` (flat function tools), ``tool_choice`` and
``parallel_tool_calls`` render through the template, calls are parsed into ``function_call`` items, and
``required`` / a named function are forced by the grammar. ``reasoning.effort``: ``none`` renders the template
with ``enable_thinking: false``, any other level with ``enable_thinking: true`` (the templates have no
graded budget); absent, the template's default. With a reasoning parser the reasoning section becomes a
``reasoning`` item. ``text.format`` json_schema / json_object constrain the output (``constraint_fields``).

vLLM's ``request_id`` is the response's ``id`` as sent, and the trace id unless a header names one.

Nothing is stored: ``store`` is accepted (either value) but no response can be retrieved later. What needs
stored state or features this server lacks is a 400 ``unsupported_parameter`` naming the field:
``previous_response_id``, ``conversation``, ``background: true``, ``prompt``, ``include``, ``top_logprobs``,
``max_tool_calls``, ``truncation: "auto"``, tools that are not functions, and input items or content parts
that are not text.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
from quart import Response, g, request

from inference_server.http.chat_tools import ToolRequest, effort_template_kwargs, forced_call_constraint
from inference_server.http.constraint_fields import after_reasoning, from_text_format
from inference_server.http.convert import (
    SESSION_ID_HEADER,
    client_trace_id,
    header_id,
    refuse_obfuscation,
    refuse_service_tier,
    sampling_params,
)
from inference_server.http.errors import invalid_request
from inference_server.http.generation import admit
from inference_server.http.openai import keep_marker_tokens
from inference_server.http.openai_format import new_id
from inference_server.http.responses import json_response, read_body, sse_response
from inference_server.http.responses_format import ResponseEcho, ResponseHead, ResponsesEncoder, whole_response
from inference_server.http.responses_input import input_messages, responses_tool_request
from inference_server.http.responses_schema import ReasoningConfig, ResponsesRequest
from inference_server.http.schemas import SamplingFields
from inference_server.http.state import AppState
from inference_server.records.requests import ChatMessage, GenerationRequest

STATEFUL_FIELDS = {
    "previous_response_id": "previous_response_id needs stored responses, and this server stores none: send the "
                            "whole conversation in input",
    "conversation": "conversation needs stored conversations, and this server stores none: send the whole "
                    "conversation in input",
    "background": "background responses need stored responses, and this server stores none",
    "prompt": "stored prompt templates are not supported: send the prompt in input and instructions",
    "include": "include is not supported (reasoning comes back as text in reasoning items; no logprobs or "
               "encrypted content to include)",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
    "max_tool_calls": "max_tool_calls is not supported: send parallel_tool_calls: false for at most one call",
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
        response_id = self._response_id(body.request_id)  # before the engine request: it carries the trace id
        tools = responses_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_format,
                                       state.reasoning_format)
        generation_request = self._generation_request(body, tools)
        generation = await admit(state.engine, [generation_request], state.tracker, renames=RENAMES)
        params = generation_request.params
        head = ResponseHead(response_id, int(time.time()), state.model_name, ResponseEcho(
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            temperature=params.temperature, top_p=params.top_p, metadata=body.metadata or {}, user=body.user,
            tools=[attrs.asdict(t, filter=lambda a, v: v is not None) for t in body.tools or ()],
            tool_choice=body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none"),
            parallel_tool_calls=body.parallel_tool_calls is not False,
            reasoning=attrs.asdict(body.reasoning) if body.reasoning is not None else None))
        output = tools.output
        if body.stream:
            encoder = ResponsesEncoder(state, head, generation.prompt_tokens, output)
            return sse_response(generation, encoder, coalesce=state.coalesce, terminator=b"")
        (result,) = await generation.successful_results(state.engine)
        return json_response(whole_response(head, result, generation.prompt_tokens[0], output))

    @staticmethod
    def _response_id(request_id: str | None) -> str:
        """vLLM's ``request_id``: the response's ``id`` as sent (vLLM's ``ResponsesResponse`` takes it whole; no
        header changes it), held to ``header_id``'s rule, and the trace id unless a header names one; absent, a
        fresh ``resp-`` id."""
        body_id = header_id(request_id, "request_id")
        if body_id is None:
            return new_id("resp")
        if client_trace_id(request.headers) is None:
            g.trace_id = body_id
        return body_id

    def _generation_request(self, body: ResponsesRequest, tools: ToolRequest) -> GenerationRequest:
        refuse_unsupported(body)
        messages = input_messages(body.input)
        if body.instructions:
            messages.insert(0, ChatMessage("system", body.instructions))
        if not messages:
            raise invalid_request("input must not be empty", "input")
        fmt = body.text.format if body.text is not None else None
        constraint = from_text_format(attrs.asdict(fmt, filter=lambda a, v: v is not None)) if fmt else None
        forced = forced_call_constraint(tools)
        if forced is not None and constraint is not None:
            raise invalid_request("tool_choice required or a named tool cannot be combined with text.format",
                                  "tool_choice")
        # A reply ends at the chat template's turn markers, as on the chat route.
        params = self.state.chat_stops.apply(sampling_params(
            SamplingFields(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                           frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                           repetition_penalty=body.repetition_penalty, seed=body.seed),
            max_tokens=body.max_output_tokens,
            logprobs=None, constraint=forced or constraint))
        kwargs = reasoning_kwargs(body.reasoning)
        params = keep_marker_tokens(after_reasoning(params, tools.output.reasoning, kwargs), tools.output)
        session = (header_id(request.headers.get(SESSION_ID_HEADER), SESSION_ID_HEADER) or body.user
                   or body.safety_identifier)
        return GenerationRequest(params=params, messages=tuple(messages), session_id=session, trace_id=g.trace_id,
                                 tools=tools.template_tools, chat_template_kwargs=kwargs)


def _is_empty(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 ``unsupported_parameter`` naming the first field this stateless, text-only server cannot honour."""
    for name, reason in STATEFUL_FIELDS.items():
        if not _is_empty(getattr(body, name)):
            raise invalid_request(reason, name, "unsupported_parameter")
    if body.truncation not in (None, "disabled"):
        raise invalid_request("only truncation: \"disabled\" is supported (a prompt over the context is a 400)",
                              "truncation", "unsupported_parameter")
    if body.stream_options is not None:
        refuse_obfuscation(body.stream_options.include_obfuscation)
    refuse_service_tier(body.service_tier)


def reasoning_kwargs(reasoning: ReasoningConfig | None) -> dict[str, Any] | None:
    """``reasoning.effort`` as the template's ``enable_thinking`` (see the module docstring)."""
    return effort_template_kwargs(reasoning.effort if reasoning is not None else None, "reasoning.effort")
