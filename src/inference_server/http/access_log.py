"""One access-log line per HTTP request, written when the response has been sent in full (a stream included):

    POST /v1/chat/completions 200 trace=5f0c... in=14 out=40 ttft=0.412s total=5.871s

``in``/``out`` are the prompt and generated tokens of the request (summed over its choices), ``ttft`` the
time from the request's arrival to the first generated token the server read; ``-`` where a route generates
nothing. The lines go to the ``inference_server.access`` logger at INFO; ``ACCESS_LOG=false`` turns them off.

``AccessLog`` is ASGI middleware: it reads the status and ``X-Trace-Id`` from the response start, and leaves
an ``AccessRecord`` in the ASGI scope for the generation routes to fill (``record_for(scope)``). A generation
route also records its request's trace id as it is submitted: a client that leaves before the response starts
gets no response headers, and its line still names the trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import attrs

from inference_server.records.requests import RequestUpdate

log = logging.getLogger("inference_server.access")

SCOPE_KEY = "inference_server.access"
Scope = MutableMapping[str, Any]  # an ASGI scope (Quart types its own as TypedDicts)
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


@attrs.define
class AccessRecord:
    """What a request did, filled in as it runs (times from ``time.perf_counter``)."""

    started: float = attrs.Factory(time.perf_counter)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    trace_id: str | None = None  # the request's, set as it is submitted (the response may never start)

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens = (self.prompt_tokens or 0) + prompt_tokens
        self.completion_tokens = self.completion_tokens or 0

    def observe(self, update: RequestUpdate) -> None:
        """A generation update was read (``RequestHandle.observer``)."""
        if update.tokens:
            self.completion_tokens = (self.completion_tokens or 0) + len(update.tokens)
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()

    def line(self, method: str, path: str, status: int | None, trace_id: str | None, ended: float) -> str:
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - self.started:.3f}s"
        return (f"{method} {path} {status if status is not None else '-'} trace={trace_id or '-'} "
                f"in={_count(self.prompt_tokens)} out={_count(self.completion_tokens)} ttft={ttft} "
                f"total={ended - self.started:.3f}s")


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def record_for(scope: Mapping[str, Any] | Any) -> AccessRecord | None:
    """The request's record (``scope``: the ASGI scope, ``quart.request.scope``), when the access log is on."""
    record = scope.get(SCOPE_KEY)
    return record if isinstance(record, AccessRecord) else None


class AccessLog:
    """ASGI middleware writing one line per HTTP request (see the module docstring)."""

    def __init__(self, app: ASGIApp, trace_header: str) -> None:
        self.app = app
        self.trace_header = trace_header.lower().encode()

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord()
        scope[SCOPE_KEY] = record
        status: int | None = None
        trace_id: str | None = None

        async def observed_send(message: Message) -> None:
            nonlocal status, trace_id
            if message["type"] == "http.response.start":
                status = message["status"]
                trace_id = next((value.decode("latin-1") for name, value in message.get("headers", ())
                                 if name.lower() == self.trace_header), None)
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            log.info("%s", record.line(scope.get("method", "-"), scope.get("path", "-"), status,
                                        trace_id or record.trace_id, time.perf_counter()))
