"""Observability routes: ``GET /metrics`` (Prometheus), ``GET /scheduler/stats`` (JSON) and
``GET /telemetry/tail`` (live NDJSON feed of telemetry events).

The tail subscribes to the telemetry actor with a bounded feed (``TAIL_CAPACITY`` events): a reader that
falls behind loses events rather than slowing anything, and is told how many with a line
``{"event": "lost", "events": N, "total": M}`` before the next events it does get. The first line,
``{"event": "subscribed", ...}``, says the feed is live. Query parameters: ``session_id``, ``trace_id``
(filters) and ``steps`` (``0`` hides step lines).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio
from quart import Response, request

from inference_server.actors.telemetry import Subscription
from inference_server.http.errors import ApiError
from inference_server.http.responses import json_response
from inference_server.http.sse import dumps
from inference_server.http.state import AppState
from inference_server.telemetry.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from inference_server.telemetry.tail_filter import TailFilter

TAIL_CAPACITY = 1024
NDJSON_CONTENT_TYPE = "application/x-ndjson"
MAX_LINES_PER_CHUNK = 256


class ObservabilityRoutes:
    def __init__(self, state: AppState) -> None:
        self.state = state

    async def metrics(self) -> Response:
        """``GET /metrics``: every family in Prometheus' text format."""
        return Response(self.state.observability.metrics.exposition(), content_type=METRICS_CONTENT_TYPE)

    async def stats(self) -> Response:
        """``GET /scheduler/stats``: windowed percentiles, throughput, queue, KV and drop counts."""
        return json_response(self.state.observability.stats_document())

    async def tail(self) -> Response:
        """``GET /telemetry/tail``: NDJSON, one line per event, until the client leaves or the engine stops."""
        args = request.args
        steps = args.get("steps", "1")
        if steps not in ("0", "1"):
            raise ApiError(400, "steps must be 0 or 1", "invalid_request_error", "invalid_value", "steps")
        tail_filter = TailFilter(args.get("session_id") or None, args.get("trace_id") or None, steps == "1")
        subscription = self.state.engine.telemetry.subscribe(TAIL_CAPACITY)
        response = Response(_tail_body(subscription, tail_filter), content_type=NDJSON_CONTENT_TYPE,
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response.timeout = None  # type: ignore[assignment]
        return response


async def _tail_body(subscription: Subscription, tail_filter: TailFilter) -> AsyncIterator[bytes]:
    """Lines for each event, several per chunk when they are already buffered; yields outside any cancel
    scope (trio's rule for async generators) and unsubscribes in ``finally``."""
    reported = 0
    try:
        yield _line({"event": "subscribed", "capacity": TAIL_CAPACITY, "session_id": tail_filter.session_id,
                     "trace_id": tail_filter.trace_id})
        async for event in subscription:
            events = [event]
            while len(events) < MAX_LINES_PER_CHUNK:
                try:
                    events.append(subscription.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break  # nothing more buffered (or the feed ended): write what we have
            lines = []
            if subscription.dropped > reported:
                lines.append(_line({"event": "lost", "events": subscription.dropped - reported,
                                    "total": subscription.dropped}))
                reported = subscription.dropped
            lines += [_line(line) for line in map(tail_filter.line, events) if line is not None]
            if lines:
                yield b"".join(lines)
    finally:
        subscription.close()


def _line(payload: dict) -> bytes:
    return dumps(payload).encode("utf-8", "replace") + b"\n"
