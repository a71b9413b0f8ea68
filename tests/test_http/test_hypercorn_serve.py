"""``hypercorn_serve``: Hypercorn on connections the server owns, so a stop can close the ones whose client stopped
reading. Real loopback sockets; the app streams an endless body, so a client that does not read always ends up
with the server's write blocked on its full TCP window (where Hypercorn's shielded write ignores cancellation)."""

from __future__ import annotations

import logging
import sys
import time
from functools import partial
from typing import Any

import pytest
import trio
from hypercorn.config import Config

from inference_server.hypercorn_serve import Connections, serve_http
from kit.stuck_reader import StuckReader, stuck_when

BOUND = 60.0
"""Seconds any awaited condition may take on a loaded machine (none is a timing assertion)."""
CHUNK = b"x" * 1024  # small: the first chunks fit in the socket buffers, later ones block


class EndlessApp:
    """An ASGI app whose every response is an endless body, until the client is gone; ``chunks`` counts the body
    chunks handed over."""

    def __init__(self) -> None:
        self.chunks = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._until_disconnect, receive, nursery.cancel_scope)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            while True:
                await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
                self.chunks += 1

    @staticmethod
    async def _until_disconnect(receive: Any, scope: trio.CancelScope) -> None:
        """Stop the response once the client is gone (as Quart does): writes to a closed stream are dropped."""
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()


def config(graceful: float) -> Config:
    result = Config()
    result.bind = ["127.0.0.1:0"]
    result.graceful_timeout = graceful
    result.accesslog = None
    result.errorlog = logging.getLogger("hypercorn.error")
    return result


async def wait_for(condition: Any, what: str) -> None:
    with trio.move_on_after(BOUND):
        while not condition():
            await trio.sleep(0.01)  # a poll interval: the loop ends on the condition
        return
    pytest.fail(f"{what} did not happen within {BOUND} s")


async def returns_or_fail(stopped: trio.Event, reader: StuckReader, after: str) -> None:
    """Wait up to ``BOUND`` for ``serve_http`` to return (``stopped``); else close ``reader`` (a reset unblocks the
    server's write, so the test fails instead of hanging) and fail."""
    with trio.move_on_after(BOUND):
        await stopped.wait()
    if not stopped.is_set():
        reader.close()
        await stopped.wait()
        pytest.fail(f"serve_http still running {BOUND} s after {after}")


async def serve(app: EndlessApp, connections: Connections, stop: trio.Event, stopped: trio.Event, *,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """``serve_http`` (graceful timeout 0.5 s) until ``stop``; sets ``stopped`` once it returned."""
    await serve_http(app, config(0.5), connections, shutdown_trigger=stop.wait, task_status=task_status)
    stopped.set()


async def test_a_client_that_does_not_read_cannot_hold_the_server_past_its_graceful_timeout() -> None:
    app, connections, stop, stopped = EndlessApp(), Connections(), trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        [url] = await nursery.start(serve, app, connections, stop, stopped)
        reader = StuckReader(url, "/", {})
        try:
            await wait_for(lambda: app.chunks >= 1, "the first chunk")
            stop.set()  # the endless body goes on until its write blocks on the full window
            await returns_or_fail(stopped, reader, "its shutdown trigger")
            _, ending = await trio.to_thread.run_sync(reader.read_all, BOUND)
        finally:
            reader.close()
    assert ending == "reset"
    assert len(connections) == 0


async def test_abort_closes_only_the_connections_of_the_given_peers() -> None:
    app, connections, stop, stopped = EndlessApp(), Connections(), trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        [url] = await nursery.start(serve, app, connections, stop, stopped)
        first, second = StuckReader(url, "/", {}), StuckReader(url, "/", {})
        try:
            await wait_for(lambda: len(connections) == 2 and app.chunks >= 2, "two connections streaming")
            assert connections.abort({first.sock.getsockname()[:2]}) == 1
            _, ending = await trio.to_thread.run_sync(first.read_all, BOUND)
            assert ending == "reset"
            await wait_for(lambda: len(connections) == 1, "the aborted connection's end")  # the other one stays
            stop.set()  # the second is closed when the graceful timeout ends
            _, ending = await trio.to_thread.run_sync(second.read_all, BOUND)
            assert ending == "reset"
        finally:
            first.close()
            second.close()



@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp (the stuck write)")
async def test_a_client_that_does_not_read_cannot_hold_a_cancelled_server() -> None:
    """Cancelled from outside (another task of the server failed: no shutdown trigger), ``serve_http`` closes its
    connections too: a write blocked on a client that does not read would hold its nursery, and the process, for
    ever."""
    app, connections, stopped = EndlessApp(), Connections(), trio.Event()
    scope = trio.CancelScope()

    async def serve_until_cancelled(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await serve_http(app, config(0.5), connections, shutdown_trigger=trio.sleep_forever,
                             task_status=task_status)
        stopped.set()

    async with trio.open_nursery() as nursery:
        [url] = await nursery.start(serve_until_cancelled)
        reader = StuckReader(url, "/", {})
        try:
            # the server's send queue to the reader holds data and has not moved for half a second: its write is
            # blocked on the full window (inside Hypercorn's shielded write, where the cancellation cannot reach)
            assert await trio.to_thread.run_sync(partial(stuck_when, [reader], time.monotonic, min_progress=0.5,
                                                         timeout=BOUND)), "the server's write never blocked"
            scope.cancel()
            await returns_or_fail(stopped, reader, "it was cancelled")
            _, ending = await trio.to_thread.run_sync(reader.read_all, BOUND)
        finally:
            reader.close()
    assert ending == "reset"
    assert len(connections) == 0
