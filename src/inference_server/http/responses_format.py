"""Bodies and stream events of ``POST /v1/responses``, in the shapes of openai-python's
``openai.types.responses`` (``Response``, the ``Response*Event`` types); the output items themselves are
``responses_items``'s (reasoning, message, function calls).

``status`` is ``completed``, ``incomplete`` (the output was cut by ``max_output_tokens`` or the context:
``finish_reason`` ``length``; ``incomplete_details.reason`` is ``max_output_tokens``) or ``failed`` (only in a
stream's ``response.failed`` event; a non-streamed failure is an HTTP error in the OpenAI error shape).

A stream is ``event: <type>`` + ``data: <json>`` SSE events, each with a ``sequence_number`` counting from 0:
``response.created``, ``response.in_progress``, then each output item's events (``responses_items``), then
``response.completed`` (or ``response.incomplete``). A failure once the stream has started is an ``error``
event (our error ``code``, ``message``, ``param``) followed by ``response.failed``, whose ``response.error``
has OpenAI's ``server_error`` code (``rate_limit_exceeded`` for an overload). No ``data: [DONE]`` follows:
the OpenAI API sends none on this route.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs

from inference_server.http.chat_output import ChatOutputSpec
from inference_server.http.errors import ApiError, from_unsuccessful_finish
from inference_server.http.responses_items import OutputItemStream, whole_output
from inference_server.http.sse import dumps
from inference_server.http.state import AppState
from inference_server.records.requests import RequestUpdate


@attrs.frozen(kw_only=True)
class ResponseEcho:
    """The request settings a ``response`` object repeats back (as the OpenAI API does)."""

    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    metadata: dict[str, str]
    user: str | None
    tools: list[dict[str, Any]] = attrs.Factory(list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """``ResponseUsage``. ``cache_write_tokens`` is 0: the prefix cache is not an explicit, billed cache."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def finish_status(finish_reason: str | None) -> str:
    """``completed`` for a natural stop, ``incomplete`` for an output cut at its token cap."""
    return "incomplete" if finish_reason == "length" else "completed"


@attrs.define
class ResponseHead:
    """What every ``response`` object of one request shares."""

    response_id: str
    created_at: int
    model: str
    echo: ResponseEcho

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, *,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        echo = self.echo
        finished = status in ("completed", "incomplete")
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "completed_at": int(time.time()) if finished else None, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": echo.instructions, "max_output_tokens": echo.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": echo.parallel_tool_calls, "previous_response_id": None,
            "temperature": echo.temperature, "top_p": echo.top_p, "text": {"format": {"type": "text"}},
            "tool_choice": echo.tool_choice, "tools": echo.tools, "truncation": "disabled",
            "metadata": echo.metadata, "user": echo.user, "usage": usage, "reasoning": echo.reasoning,
        }


def whole_response(head: ResponseHead, result: RequestUpdate, prompt_tokens: int,
                   output_spec: ChatOutputSpec) -> dict[str, Any]:
    """The non-streamed ``response`` of a successful request."""
    status = finish_status(result.finish_reason)
    output = whole_output(output_spec.processor(), "".join(t.text for t in result.tokens), status)
    return head.body(status, output, response_usage(prompt_tokens, len(result.tokens),
                                                    result.cached_prompt_tokens))


def response_error(error: ApiError) -> dict[str, Any]:
    """``ResponseError`` for ``response.failed``: OpenAI's code for the class of failure, our detail kept in
    ``message``, ``type`` and ``param``."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {"code": code, "message": error.message, "type": error.type, "param": error.param}


class ResponsesEncoder:
    """The SSE events of one streamed response (one choice)."""

    def __init__(self, state: AppState, head: ResponseHead, prompt_tokens: Sequence[int],
                 output_spec: ChatOutputSpec) -> None:
        self.state = state
        self.head = head
        self.prompt_tokens = prompt_tokens[0]
        self.sequence_number = 0
        self._pending: list[bytes] = []
        self.items = OutputItemStream(output_spec.processor(), self._queue)
        self.output_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None

    def _event(self, type_: str, payload: dict[str, Any]) -> bytes:
        data = {"type": type_, **payload, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {type_}\ndata: {dumps(data)}\n\n".encode("utf-8", "replace")

    def _queue(self, type_: str, payload: dict[str, Any]) -> None:
        self._pending.append(self._event(type_, payload))

    def _flush(self) -> bytes:
        out, self._pending = b"".join(self._pending), []
        return out

    def opening(self) -> bytes:
        started = self.head.body("in_progress", [], None)
        return b"".join((self._event("response.created", {"response": started}),
                         self._event("response.in_progress", {"response": started})))

    def update(self, index: int, update: RequestUpdate) -> bytes:
        self.output_tokens += len(update.tokens)
        if update.finished:
            self.finish_reason = update.finish_reason
            self.cached_tokens = update.cached_prompt_tokens
        delta = "".join(t.text for t in update.tokens)
        if delta:
            self.items.feed(delta)
        return self._flush()

    def closing(self) -> bytes:
        status = finish_status(self.finish_reason)
        output = self.items.finish(status)
        usage = response_usage(self.prompt_tokens, self.output_tokens, self.cached_tokens)
        final = "response.incomplete" if status == "incomplete" else "response.completed"
        self._queue(final, {"response": self.head.body(status, output, usage)})
        return self._flush()

    def failure(self, index: int, update: RequestUpdate) -> bytes:
        return self.error(from_unsuccessful_finish(update, engine_failed=self.state.engine.failed))

    def error(self, error: ApiError) -> bytes:
        usage = response_usage(self.prompt_tokens, self.output_tokens, self.cached_tokens)
        self._queue("error", {"code": error.code, "message": error.message, "param": error.param})
        self._queue("response.failed", {"response": self.head.body("failed", self.items.abandon(), usage,
                                                                    error=response_error(error))})
        return self._flush()
