"""Hypercorn's trio worker loop, with the server owning its connections so a stop can close the stuck ones.

Why not ``hypercorn.trio.serve``: Hypercorn writes to a connection inside a cancel scope shielded from
cancellation (``TCPServer.protocol_send``), so a response whose client stopped reading (its TCP window full)
blocks in ``send_all`` for as long as the client pleases, and ``graceful_timeout``, which only cancels, cannot end
it: the worker, and ``trio.run`` with it, never returns. Closing the connection's socket wakes that write at once
(trio raises ``ClosedResourceError`` in it; Hypercorn treats that as the client gone), which needs the socket:
``serve_http`` runs Hypercorn's own per-connection server (``TCPServer``) on connections it accepted itself and
keeps in a ``Connections`` registry.

What ``serve_http`` does is ``hypercorn.trio.run.worker_serve`` for plain TCP (no TLS, QUIC, statsd or
``max_requests``: the server uses none of them), with one change at the end: after ``shutdown_trigger`` returns,
idle connections close at once (Hypercorn's own rule), the others get ``config.graceful_timeout`` seconds to
finish, and every connection still open then is closed (``Connections.abort``) before the rest is cancelled. Every
connection is closed too when ``serve_http`` is cancelled or fails from outside before that.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Collection
from functools import partial

import trio
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, Framework
from hypercorn.utils import repr_socket_addr, wrap_app

log = logging.getLogger(__name__)

RESET_ON_CLOSE = struct.pack("ii", 1, 0)
"""``SO_LINGER`` on, 0 seconds: closing the socket resets the connection instead of queueing a FIN."""
Peer = tuple[str, int]
"""A client's address as the ASGI scope's ``client`` gives it: host and port."""


class Connections:
    """The HTTP connections open now, each with its client's address; ``abort`` closes them."""

    def __init__(self) -> None:
        self._open: dict[trio.SocketStream, Peer | None] = {}
        self._empty = trio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._open)

    async def serve(self, handle: Callable[[trio.SocketStream], Awaitable[None]], stream: trio.SocketStream) -> None:
        """Run ``handle(stream)`` (one connection's whole life) with ``stream`` registered."""
        self._open[stream] = _peer(stream)
        self._empty = trio.Event() if self._empty.is_set() else self._empty
        try:
            await handle(stream)
        finally:
            del self._open[stream]
            if not self._open:
                self._empty.set()

    async def wait_empty(self) -> None:
        """Return once no connection is open."""
        await self._empty.wait()

    def abort(self, peers: Collection[Peer] | None = None) -> int:
        """Close the connections from ``peers`` (every one: ``None``) at once, without waiting for their
        responses; how many. A write blocked on a client that does not read fails in its task (Hypercorn then
        ends the connection as if the client had left), and the client gets a reset (``SO_LINGER`` 0): nothing
        queued for it is sent any more, and the kernel frees the connection's buffers now rather than
        retrying a zero window for minutes."""
        closed = 0
        for stream, peer in list(self._open.items()):
            if peers is not None and peer not in peers:
                continue
            sock = stream.socket
            if sock.fileno() == -1:
                continue  # already closed by its own task, which has not finished unwinding yet
            with contextlib.suppress(OSError):  # the peer reset it already: a plain close is as good
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
            sock.close()  # trio wakes every task waiting on this socket with ClosedResourceError
            closed += 1
        return closed


def _peer(stream: trio.SocketStream) -> Peer | None:
    """The client's (host, port), as Hypercorn puts it in the scope (``hypercorn.utils.parse_socket_addr``)."""
    try:
        address = stream.socket.getpeername()
    except OSError:
        return None  # already reset by the client
    return (address[0], address[1]) if isinstance(address, tuple) else None


async def serve_http(app: Framework, config: Config, connections: Connections, *,
                     shutdown_trigger: Callable[[], Awaitable[None]],
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``config.bind`` until ``shutdown_trigger()`` returns, then stop as the module docstring
    says; reports the bound URLs through ``task_status``."""
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, object] = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        sockets = config.create_sockets()
        if sockets.secure_sockets or sockets.quic_sockets:
            raise ValueError("serve_http serves plain TCP only (no TLS or QUIC is configured by the server)")
        listeners = []
        binds = []
        for sock in sockets.insecure_sockets:
            sock.listen(config.backlog)
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
            binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            await config.log.info(f"Running on {binds[-1]} (CTRL + C to quit)")
        handle = partial(TCPServer, wrapped, config, context, ConnectionState(lifespan_state.copy()))
        async with trio.open_nursery() as server_nursery:
            try:
                task_status.started(binds)
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(partial(trio.serve_listeners, partial(connections.serve, handle),
                                                 listeners, handler_nursery=server_nursery))
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()  # the listeners close: no new connection from here on
                await context.terminated.set()  # idle connections close now, busy ones after their response
                with trio.move_on_after(config.graceful_timeout):
                    await connections.wait_empty()
                if len(connections):
                    log.warning("%d HTTP connections still open %g s after HTTP began to stop: closing them",
                                len(connections), config.graceful_timeout)
            finally:
                # also when cancelled or failed from outside (another task of the server failed): a connection
                # blocked writing to a client that does not read would otherwise hold this nursery for ever
                connections.abort()
            server_nursery.cancel_scope.cancel()
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


__all__ = ["Connections", "Peer", "serve_http"]
