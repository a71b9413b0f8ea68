"""Receiving a request body under the size and time limits, so that a refused body leaves the connection
in a known state.

The limits are ``MAX_BODY_BYTES`` (413) and ``BODY_TIMEOUT`` (408, the whole upload). A body over the size
limit is read to its end and discarded (never stored), up to ``DISCARD_LIMIT_BYTES``, before the 413 is sent:
a client such as httpx or the OpenAI SDK writes the whole body before it reads the response, so a server
that answered early and closed would show it a broken pipe instead of the 413; once the body is read the
connection is also reusable. A body declared or found larger than ``DISCARD_LIMIT_BYTES``, and a 408, are
answered at once: the body is then unread and the connection policy (``http/connection.py``) adds
``Connection: close``; Hypercorn closes the connection after the response.
"""

from __future__ import annotations

import trio
from quart import current_app, request

from inference_server.http.errors import ApiError, from_http_status

DISCARD_LIMIT_BYTES = 64 * 1024 * 1024
"""Most bytes of an over-limit body read and thrown away so the client sees the 413 (see the module
docstring); beyond it the 413 is sent at once and the connection closed."""


def too_large(limit: int) -> ApiError:
    return from_http_status(413, f"the request body is larger than the limit of {limit} bytes (MAX_BODY_BYTES)")


def too_slow(timeout: float) -> ApiError:
    return from_http_status(408, f"the request body did not arrive within {timeout:g} s")


async def receive_body(limit: int) -> bytes:
    """The request body, at most ``limit`` bytes within the app's ``BODY_TIMEOUT`` seconds; ``ApiError``
    413 or 408 otherwise (see the module docstring)."""
    timeout = current_app.config["BODY_TIMEOUT"]
    declared = request.content_length
    if declared is not None and declared > DISCARD_LIMIT_BYTES:
        raise too_large(limit)
    oversized = declared is not None and declared > limit
    chunks: list[bytes] = []
    received = 0
    with trio.move_on_after(timeout) as deadline:
        async for chunk in request.body:
            received += len(chunk)
            if received > DISCARD_LIMIT_BYTES:
                raise too_large(limit)
            if received > limit:
                oversized = True
                chunks.clear()
            if not oversized:
                chunks.append(chunk)
    if deadline.cancelled_caught:
        raise too_slow(timeout)
    if oversized:
        raise too_large(limit)
    return b"".join(chunks)
