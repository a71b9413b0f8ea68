"""The connection policy: an ASGI middleware around the Quart app that keeps HTTP/1.1 keep-alive honest.

A client that reuses a connection must be told when the server will close it, or it sends its next request
into a closing socket and sees "server disconnected without sending a response". Hypercorn (h11) recycles a
connection only when the request body was read to its end and the response was complete; otherwise it closes
the connection after the response, but without saying so. This middleware therefore adds
``Connection: close`` to a response when

* the app has not received the whole request body when the response starts (an error raised before or while
  reading it: 404, 405, 408, 413 beyond the discard limit, 415, 503 ``draining``, ...), because Hypercorn is
  then going to close the connection; or
* the server is draining (``draining()`` is true: after a signal, or once the engine failed and the process is
  about to exit), so that clients and load balancers open fresh connections (to another instance, or to this
  one's ``/health`` until HTTP stops) instead of reusing this one.

It also shields the app's final ``send`` (the end of the response body) from the app's own cancellation.
Why: Hypercorn reacts to that send by delivering ``http.disconnect`` to the app and then recycling or
closing the connection, all inside the same call; Quart-Trio cancels the app as soon as it sees
``http.disconnect``, and that cancellation used to interrupt Hypercorn half-way (at the first checkpoint of
the socket's ``send_eof``): the socket was never closed and the connection never recycled, so the next
request on it waited forever (the 413 keep-alive hang) and the idle timeout was never re-armed. Every await
in that path is bounded (the socket write is already shielded by Hypercorn; the rest are in-memory).

That final send may also find Hypercorn closing the connection under it: when the client leaves in the middle
of a request body (it read an early error and closed), Hypercorn's reader closes the connection with a
``send_eof`` that does not take the send lock the app's writes hold, so the app's last write of the response
(already delivered: only its empty end is left) raises ``trio.BusyResourceError``. The connection is being
closed for a client that is gone, so the middleware ends the response quietly instead of letting Hypercorn
log an "Error in ASGI Framework" traceback for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CONNECTION_CLOSE = (b"connection", b"close")


def _declares_a_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request carries a body: a ``Transfer-Encoding`` or a non-zero ``Content-Length``."""
    for name, value in headers:
        name = name.lower()
        if name == b"transfer-encoding":
            return True
        if name == b"content-length" and value.strip() not in (b"0", b""):
            return True
    return False


class ConnectionPolicy:
    """ASGI middleware: ``Connection: close`` when the connection will not (or should not) be reused, and a
    shielded end of response (see the module docstring)."""

    def __init__(self, app: ASGIApp, draining: Callable[[], bool]) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_received = not _declares_a_body(list(scope.get("headers", ())))

        async def tracking_receive() -> Message:
            nonlocal body_received
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_received = True
            return message

        async def policed_send(message: Message) -> None:
            if message["type"] == "http.response.start" and (not body_received or self.draining()):
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"connection" for name, _ in headers):
                    message = {**message, "headers": [*headers, CONNECTION_CLOSE]}
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # BusyResourceError: Hypercorn is closing the connection of a client that left (module docstring).
                with trio.CancelScope(shield=True), contextlib.suppress(trio.BusyResourceError):
                    await send(message)
                return
            await send(message)

        await self.app(scope, tracking_receive, policed_send)
