"""Reading a JSON request body and building JSON and SSE responses (the handlers' common plumbing)."""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import trio
from quart import Response, current_app, request

from inference_server.http.body import receive_body
from inference_server.http.body_parser import parse_body
from inference_server.http.errors import ApiError
from inference_server.http.generation import Generation
from inference_server.http.sse import DONE, SSE_CONTENT_TYPE, SSE_HEADERS, EventEncoder, dumps, sse_body

Record = TypeVar("Record")
JSON_CONTENT_TYPE = "application/json"
MAX_BODY_BYTES_KEY = "MAX_BODY_BYTES"
"""The app config key of the body size limit (Quart's own ``MAX_CONTENT_LENGTH`` stays unset: see ``body.py``)."""


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(payload), status=status, content_type=JSON_CONTENT_TYPE, headers=headers)


def error_response(error: ApiError) -> Response:
    return Response(error.json_bytes(), status=error.status, content_type=JSON_CONTENT_TYPE,
                    headers=error.headers())


async def read_body(record_type: type[Record]) -> Record:
    """The request body as ``record_type``: JSON (any ``*/json`` or ``+json`` type, or none given), parsed
    strictly; 415 for another media type, 413 beyond ``MAX_BODY_BYTES``, 408 after ``BODY_TIMEOUT``, 400 for
    anything malformed (including strings that are not valid Unicode)."""
    mimetype = request.mimetype
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json"):
        raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), not {mimetype}",
                       "invalid_request_error", "unsupported_media_type")
    raw = await receive_body(current_app.config[MAX_BODY_BYTES_KEY])
    return parse_body(raw, record_type)


def sse_response(generation: Generation, encoder: EventEncoder, *, coalesce: bool,
                 terminator: bytes = DONE) -> Response:
    """A 200 ``text/event-stream`` response streaming ``generation`` through ``encoder`` and ending with
    ``terminator``; never times out.

    ``generation`` is closed when the body ends or is closed, or, should Quart never start the body (client
    gone first), when the body is garbage-collected.
    """
    nursery: trio.Nursery = current_app.nursery  # type: ignore[attr-defined]
    body: AsyncIterator[bytes] = sse_body(generation.source(nursery), encoder, coalesce=coalesce,
                                               terminator=terminator)
    weakref.finalize(body, generation.close).atexit = False  # only while the event loop runs
    response = Response(body, status=200, content_type=SSE_CONTENT_TYPE, headers=SSE_HEADERS)
    response.timeout = None  # type: ignore[assignment]
    return response
