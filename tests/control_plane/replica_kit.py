"""Fake-model replicas for the front's tests: an engine and the single server's app under Hypercorn on a
loopback port, each in its own thread and trio loop, that a test can stop abruptly (``kill``: every task of
the replica is cancelled at once, connections drop without a last event, as when a process dies)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import trio
from http_testkit import FakeModel, make_parts

from inference_server.config import Settings
from inference_server.http import create_app
from inference_server.server import _hypercorn_config, supervise_engine
from inference_server.supervisor import Engine

START_TIMEOUT = 60.0


@attrs.define(eq=False)
class FakeReplica:
    url: str
    engine: Engine
    model: FakeModel
    token: trio.lowlevel.TrioToken
    scope: trio.CancelScope
    thread: threading.Thread

    def kill(self) -> None:
        """Cancel everything the replica runs, now (from the test's thread or loop)."""
        self.token.run_sync_soon(self.scope.cancel)
        self.thread.join(START_TIMEOUT)


@contextmanager
def fake_replica(model: FakeModel | None = None, **overrides: Any) -> Iterator[FakeReplica]:
    model = model or FakeModel()
    started: queue.Queue[FakeReplica | BaseException] = queue.Queue()

    async def main() -> None:
        from hypercorn.trio import serve

        async with trio.open_nursery() as nursery:
            engine = await nursery.start(supervise_engine, Engine(make_parts(model, None, **overrides)),
                                         lambda code: None)
            config = _hypercorn_config(Settings())
            config.bind = ["127.0.0.1:0"]
            binds = await nursery.start(serve, create_app(engine, Settings()), config)
            started.put(FakeReplica(binds[0], engine, model, trio.lowlevel.current_trio_token(),
                                    nursery.cancel_scope, threading.current_thread()))

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as error:
            started.put(error)

    thread = threading.Thread(target=run, name="fake-replica", daemon=True)
    thread.start()
    replica = started.get(timeout=START_TIMEOUT)
    if isinstance(replica, BaseException):
        raise replica
    try:
        yield replica
    finally:
        if thread.is_alive():
            model.release.set()
            replica.kill()
