"""Server-sent events: framing, and the one body generator every streaming route uses.

Framing: each event is ``data: <one JSON object>\\n\\n`` (compact JSON, so it holds no raw newline); the
stream ends with ``data: [DONE]\\n\\n``. An error during a stream is an event whose object has an OpenAI
``error`` member, followed by ``[DONE]``.

Coalescing: the body awaits the engine for the next update, then takes every further update already
buffered (``receive_nowait``) and writes them as one chunk, merging the updates of a choice into one event.
It never waits for more tokens to arrive, so a client that keeps up gets one event per engine step, and one
that falls behind (its socket write was slow, so updates piled up meanwhile) gets fewer, larger events:
the per-event cost (~50 µs on this stack) is paid once for many tokens. The engine side never waits for the
writer (its per-request buffers coalesce too, see ``actors/request_streams.py``), and groups a request's
tokens after the first before this body ever wakes (``STREAM_INTERVAL``: one update per that many tokens).

Encoders splice the common event (text and ids only) from parts encoded once per request (``json_string``
for the varying text) instead of building and dumping a dict per event.

Cancellation: the body yields outside any cancel scope or nursery (a trio rule for async generators), and
``source.close()`` runs in ``finally`` whether the body ends, fails, is cancelled (client gone while we
await the engine) or is closed at a ``yield`` (client gone while Quart sends). Closing the source closes
the engine streams, which aborts their requests.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from inference_server.http.errors import ApiError, internal_error
from inference_server.records.requests import RequestUpdate

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
SUCCESSFUL_FINISHES = frozenset({"stop", "length"})
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def dumps(payload: Any) -> str:
    """Compact JSON, non-ASCII kept as is."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


json_string: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]
"""A JSON string literal for ``text``, exactly as ``dumps(text)`` writes it (non-ASCII kept): for events
spliced from pre-encoded parts."""


def event(payload: Any) -> bytes:
    """One SSE event carrying ``payload`` as JSON."""
    return b"data: " + dumps(payload).encode("utf-8", "replace") + b"\n\n"


def raw_event(json_text: str) -> bytes:
    """One SSE event carrying already-encoded JSON."""
    return b"data: " + json_text.encode("utf-8", "replace") + b"\n\n"


class UpdateSource(Protocol):
    """The engine streams of one HTTP request, read together (see ``generation.py``)."""

    @property
    def indexes(self) -> range: ...

    async def receive_batch(self) -> list[tuple[int, RequestUpdate]]:
        """At least one ``(choice index, update)``, awaiting the first; merged per index. Raises
        ``trio.EndOfChannel`` when every stream has ended."""
        ...

    def close(self) -> None:
        """Close every stream (aborting unfinished requests); idempotent."""
        ...


class EventEncoder(Protocol):
    """Turns one route's updates into its SSE events."""

    def opening(self) -> bytes:
        """Events sent before the first token (may be empty)."""
        ...

    def update(self, index: int, update: RequestUpdate) -> bytes:
        """Events for one successful update of choice ``index`` (may be empty, e.g. no text yet)."""
        ...

    def failure(self, index: int, update: RequestUpdate) -> bytes:
        """The error event for a terminal update that is not ``stop``/``length``."""
        ...

    def closing(self) -> bytes:
        """Events after every choice finished, before ``[DONE]`` (e.g. the usage chunk)."""
        ...

    def error(self, error: ApiError) -> bytes:
        """The error event for a failure of the server itself."""
        ...


def split_tokens(update: RequestUpdate) -> list[RequestUpdate]:
    """One update per token (the finish stays on the last): how events look without coalescing."""
    if len(update.tokens) <= 1:
        return [update]
    parts = [RequestUpdate(request_id=update.request_id, tokens=(token,)) for token in update.tokens[:-1]]
    parts[0] = RequestUpdate(request_id=update.request_id, tokens=parts[0].tokens,
                             prompt_logprobs=update.prompt_logprobs)  # they go out with the first token
    last = RequestUpdate(
        request_id=update.request_id, tokens=update.tokens[-1:], finish_reason=update.finish_reason,
        stop_reason=update.stop_reason, error=update.error, prompt_tokens=update.prompt_tokens,
        completion_tokens=update.completion_tokens, cached_prompt_tokens=update.cached_prompt_tokens)
    return [*parts, last]


async def sse_body(source: UpdateSource, encoder: EventEncoder, *, coalesce: bool = True,
                   terminator: bytes = DONE) -> AsyncIterator[bytes]:
    """The response body of a streaming route; see the module docstring. ``coalesce=False`` writes one event
    (and one chunk) per token, for measuring what coalescing buys. ``terminator`` ends every stream
    (``data: [DONE]``; empty for the Responses API, which sends none)."""
    try:
        opening = encoder.opening()
        if opening:
            yield opening
        running = set(source.indexes)
        while running:
            batch = await source.receive_batch()
            chunks: list[bytes] = []
            for index, update in batch:
                if update.finished and update.finish_reason not in SUCCESSFUL_FINISHES:
                    yield b"".join(chunks) + encoder.failure(index, update) + terminator
                    return
                for part in (split_tokens(update) if not coalesce else (update,)):
                    chunks.append(encoder.update(index, part))
                if update.finished:
                    running.discard(index)
            if coalesce:
                yield b"".join(chunks)
            else:
                for chunk in chunks:
                    yield chunk
        yield encoder.closing() + terminator
    except Exception as error:  # a bug or a stream that ended without its terminal update
        log.exception("streaming response failed")
        yield encoder.error(error if isinstance(error, ApiError) else internal_error(f"stream failed: {error!r}"))
        if terminator:
            yield terminator
    finally:
        source.close()
