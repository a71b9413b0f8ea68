"""Cross-origin access for browser clients (CORS): an ASGI middleware around the app, off unless configured.

A web page served from another origin (a chat UI, a notebook front end) may call the API only if the server
says so: browsers first send a preflight ``OPTIONS`` with ``Access-Control-Request-Method`` for a JSON POST,
then read ``Access-Control-Allow-Origin`` on the real response. ``ALLOWED_ORIGINS`` names the origins
(``https://app.example.com,http://localhost:3000``) or ``*`` for any; empty (the default), no CORS header is
ever written and browsers keep blocking cross-origin calls. Why not ``*`` by default, as vLLM does: the server
listens on localhost for its own user, and any web page that user opens could otherwise drive it (Ollama
restricts origins by default for the same reason).

For an allowed origin:

* a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered here, 204, with
  the methods the API serves, the headers the browser asked to send, and ``Access-Control-Max-Age``; the app
  never sees it (it has no ``OPTIONS`` routes);
* every other response (JSON, errors, SSE streams) gets ``Access-Control-Allow-Origin`` and
  ``Access-Control-Expose-Headers`` (the trace id and ``Retry-After``, which a client may read).

An origin that is not allowed gets no CORS headers (the browser refuses the response; non-browser clients are
unaffected: CORS binds browsers only). A listed origin is echoed with ``Vary: Origin`` so caches keep one
answer per origin; with ``*`` the answer is the same for all. No credentials are allowed: the API has no
cookies.
"""

from __future__ import annotations

from inference_server.http.connection import ASGIApp, Message, Receive, Scope, Send

ALLOWED_METHODS = b"GET, POST, DELETE, OPTIONS"
EXPOSED_HEADERS = b"X-Trace-Id, Retry-After"
PREFLIGHT_MAX_AGE_SECONDS = 600


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


class CorsPolicy:
    """See the module docstring. ``allowed``: ``config.parse_allowed_origins``' result (not empty: an empty set needs
    no middleware)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app = app
        self.any_origin = "*" in allowed
        self.allowed = frozenset(origin.encode("latin-1") for origin in allowed)

    def _allow_origin(self, origin: bytes | None) -> bytes | None:
        """The ``Access-Control-Allow-Origin`` value for a request from ``origin``; None: no CORS headers."""
        if origin is None:
            return None
        if self.any_origin:
            return b"*"
        return origin if origin in self.allowed else None

    def _origin_headers(self, allow: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"access-control-allow-origin", allow)]
        if not self.any_origin:
            headers.append((b"vary", b"Origin"))
        return headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        allow = self._allow_origin(_header(scope, b"origin"))
        if allow is None:
            await self.app(scope, receive, send)
            return
        requested_method = _header(scope, b"access-control-request-method")
        if scope["method"] == "OPTIONS" and requested_method is not None:
            await self._preflight(scope, send, allow)
            return
        added = [*self._origin_headers(allow), (b"access-control-expose-headers", EXPOSED_HEADERS)]

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *added]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, scope: Scope, send: Send, allow: bytes) -> None:
        headers = [*self._origin_headers(allow),
                   (b"access-control-allow-methods", ALLOWED_METHODS),
                   (b"access-control-max-age", str(PREFLIGHT_MAX_AGE_SECONDS).encode()),
                   (b"content-length", b"0")]
        requested_headers = _header(scope, b"access-control-request-headers")
        if requested_headers:
            headers.append((b"access-control-allow-headers", requested_headers))
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
