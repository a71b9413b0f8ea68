"""Every HTTP error in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

``ApiError`` is the one exception handlers raise for an expected failure; the app's error handlers turn it
(and framework errors: 404, 405, 408, 413, ..., and any unexpected exception as a 500) into a JSON response,
so no route ever answers HTML. 429, 503 and 504 carry ``Retry-After``. ``type`` and ``code`` are strings
(the SDK coerces either way); ``param`` names the offending field when one is known.

The mapping of engine outcomes (a ``RequestError`` from a handle's admission, a terminal update with
``finish_reason`` ``error`` / ``timeout`` / ``abort``) to errors lives here too, so the native and OpenAI routes
report them alike.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from inference_server.records.errors import RequestError
from inference_server.records.requests import RequestUpdate
from inference_server.records.stop_patterns import STOP_REGEX_TOO_SLOW

RETRY_AFTER_OVERLOADED_SECONDS = 1
"""``Retry-After`` on 429 (queue full): the queue moves quickly."""
RETRY_AFTER_UNAVAILABLE_SECONDS = 5
"""``Retry-After`` on 503 (starting, draining, failed) and 504 (queue timeout)."""


@attrs.define(eq=False)
class ApiError(Exception):
    """An expected failure with its HTTP status and OpenAI error fields (mutable: Python sets attributes
    such as ``__notes__`` on exceptions in flight)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after_seconds: int | None = None  # overrides the status's default ``Retry-After``

    def __str__(self) -> str:
        return f"{self.status} {self.type}/{self.code}: {self.message}"

    @property
    def retry_after(self) -> int | None:
        """Seconds for the ``Retry-After`` header, or None when the error is not worth retrying as is."""
        if self.retry_after_seconds is not None:
            return self.retry_after_seconds
        if self.status == 429:
            return RETRY_AFTER_OVERLOADED_SECONDS
        if self.status in (503, 504):
            return RETRY_AFTER_UNAVAILABLE_SECONDS
        return None

    def body(self) -> dict[str, Any]:
        """The OpenAI error object (also the payload of an SSE error event)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        retry_after = self.retry_after
        return {} if retry_after is None else {"Retry-After": str(retry_after)}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()


# -- constructors for the common cases ------------------------------------------------------------------


def invalid_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found", "model")


def unavailable(message: str, code: str = "unavailable") -> ApiError:
    return ApiError(503, message, "unavailable_error", code)


def internal_error(message: str = "internal server error") -> ApiError:
    return ApiError(500, message, "server_error", "internal_error")


_REQUEST_ERROR_STATUS = {
    "invalid_request": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "kv_capacity_exceeded": (400, "invalid_request_error"),
    "overloaded": (429, "rate_limit_error"),
    "unavailable": (503, "unavailable_error"),
    "internal": (500, "server_error"),
}


def from_request_error(error: RequestError, renames: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP error for an engine ``RequestError`` (400 / 429 / 503 / 500): the one place engine errors
    become OpenAI errors. ``renames`` maps engine field names to the route's wire names (for example the
    chat route's ``max_tokens`` -> ``max_completion_tokens``, ``prompt`` -> ``messages``)."""
    status, error_type = _REQUEST_ERROR_STATUS[error.code]
    param, message = error.param, error.message
    if renames and param is not None and param in renames:
        wire = renames[param]
        message = message.replace(param, wire, 1) if message.startswith(param) else message
        param = wire
    retry_after = None if error.retry_after is None else max(1, math.ceil(error.retry_after))
    return ApiError(status, message, error_type, error.code, param, retry_after)


def from_unsuccessful_finish(update: RequestUpdate, *, engine_failed: bool) -> ApiError:
    """The error for a terminal update that is not ``stop``/``length``.

    ``timeout``: the request waited longer than ``ADMISSION_TIMEOUT`` to start (504, ``queue_timeout``).
    ``error``: the request's ``stop_regex`` patterns took too long to search its output (400, ``stop_regex_too_slow``,
    ``stop_reason`` ``STOP_REGEX_TOO_SLOW``), the engine failed (500, ``engine_failure``) or shut down before the
    request finished (503, ``shutdown``). ``abort``: the request was ended on the server's side (503, ``aborted``).
    """
    message = update.error or f"the request ended with finish_reason {update.finish_reason!r}"
    if update.finish_reason == "timeout":
        return ApiError(504, message, "timeout_error", "queue_timeout")
    if update.finish_reason == "error" and update.stop_reason == STOP_REGEX_TOO_SLOW:
        return ApiError(400, message, "invalid_request_error", "stop_regex_too_slow", "stop_regex")
    if update.finish_reason == "error" and engine_failed:
        return ApiError(500, message, "server_error", "engine_failure")
    if update.finish_reason == "error":
        return unavailable(message, "shutdown")
    return unavailable(message, "aborted")


_HTTP_ERROR_CODES = {
    400: ("invalid_request_error", "bad_request"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("timeout_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    431: ("invalid_request_error", "headers_too_large"),
}


def from_http_status(status: int, description: str) -> ApiError:
    """The error for a framework ``HTTPException`` (routing, body limits, body timeout, ...)."""
    error_type, code = _HTTP_ERROR_CODES.get(status, ("server_error" if status >= 500 else "invalid_request_error",
                                                      f"http_{status}"))
    return ApiError(status, description, error_type, code)
