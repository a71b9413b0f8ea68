"""A lean streaming HTTP/1.1 client for load generators: raw trio sockets, keep-alive, SSE events handed over as
they arrive.

Why not httpx or aiohttp: a load generator must not be the bottleneck of what it measures, and at thousands of
SSE events a second the per-event cost of a general client (h11 state machine, anyio/asyncio layers, line
iterators) is a large share of a core. Here one ``receive_some`` feeds a byte buffer that is split on the chunk
and event markers with ``bytes.find``; nothing else runs per event but the caller's callback.

Scope: plain HTTP/1.1 over TCP (no TLS, no redirects), a ``POST`` with a JSON body, a response that is either
chunked (a stream) or ``Content-Length``-delimited (an error body). Used by ``serve_bench.py`` and
``http_overhead.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

READ_SIZE = 65536


@attrs.frozen
class Response:
    """What came back besides the events: the status line's code, the lower-cased head, and the body of a
    response that was not a stream (an error's JSON), else ``b""``."""

    status: int
    head: bytes
    body: bytes = b""


class SSEConnection:
    """One keep-alive HTTP/1.1 connection, reopened on demand after the server closes it.

    ``post`` sends one request and calls ``on_event(payload)`` for every ``data: `` event of a streamed
    response, in order, as soon as the bytes that complete it arrive (``payload`` excludes the ``data: `` prefix
    and the blank line). ``rcvbuf`` and ``read_interval`` make a slow client (a small receive window, read in
    small pieces at intervals) for backpressure experiments.
    """

    def __init__(self, host: str, port: int, *, read_interval: float = 0.0, rcvbuf: int = 0,
                 read_size: int = READ_SIZE) -> None:
        self.host, self.port = host, port
        self.read_interval, self.rcvbuf, self.read_size = read_interval, rcvbuf, read_size
        self.stream: trio.SocketStream | None = None
        self.buffer = b""

    async def _connect(self) -> trio.SocketStream:
        if not self.rcvbuf:
            stream = await trio.open_tcp_stream(self.host, self.port)
        else:
            sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, self.rcvbuf)
            await sock.connect((self.host, self.port))
            stream = trio.SocketStream(sock)
        stream.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, True)
        return stream

    async def _read_more(self) -> None:
        assert self.stream is not None
        if self.read_interval:
            await trio.sleep(self.read_interval)
        data = await self.stream.receive_some(self.read_size)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buffer += data

    async def _read_until(self, marker: bytes) -> bytes:
        while (index := self.buffer.find(marker)) < 0:
            await self._read_more()
        head, self.buffer = self.buffer[:index], self.buffer[index + len(marker):]
        return head

    async def _read_exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self._read_more()
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    async def post(self, path: str, body: bytes, on_event: Callable[[bytes], None]) -> Response:
        """Send ``POST path`` with the JSON ``body``; stream its events into ``on_event``. Raises
        ``ConnectionError`` (or trio's ``BrokenResourceError``) when the connection breaks; the connection is
        then closed and the next ``post`` opens a new one."""
        if self.stream is None:
            self.stream = await self._connect()
            self.buffer = b""
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                   f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
        try:
            await self.stream.send_all(request)
            head = (await self._read_until(b"\r\n\r\n")).lower()
            status = int(head.split(b" ", 2)[1])
            if b"transfer-encoding: chunked" in head:
                await self._read_chunked(on_event)
                response = Response(status, head)
            else:
                length = _content_length(head)
                response = Response(status, head, await self._read_exactly(length))
        except BaseException:
            await self.close()
            raise
        if b"connection: close" in head:
            await self.close()
        return response

    async def _read_chunked(self, on_event: Callable[[bytes], None]) -> None:
        pending = b""
        while True:
            size = int((await self._read_until(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await self._read_until(b"\r\n")  # no trailers: the empty line that ends the body
                break
            pending += await self._read_exactly(size)
            await self._read_exactly(2)
            if b"\n\n" not in pending:
                continue
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    on_event(event[6:])
                elif event.startswith(b"data:"):
                    on_event(event[5:])

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip() == b"content-length":
            return int(value)
    return 0
