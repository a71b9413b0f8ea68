"""Fake-model replicas for the front's tests: an engine and the single server's app under Hypercorn on a
loopback port, each in its own thread and trio loop, that a test can stop abruptly (``kill``: every task of
the replica is cancelled at once, connections drop without a last event, as when a process dies). Also what
the front's tests and the Ray tests share: serving a ``Front`` on a loopback port, waiting on a condition,
reading a replica's prefix-cache hits."""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import httpx
import trio
from http_testkit import make_parts, run_trio_in_thread, word_engine
from hypercorn.config import Config
from hypercorn.trio import serve
from tests.fake_engine import FakeEngine

from control_plane.front import Front
from control_plane.front_app import create_front_app
from inference_server.config import Settings
from inference_server.http import create_app
from inference_server.server import _hypercorn_config, supervise_engine
from inference_server.supervisor import Engine

START_TIMEOUT = 60.0


@attrs.define(eq=False)
class FakeReplica:
    url: str
    engine: Engine
    model: FakeEngine
    token: trio.lowlevel.TrioToken
    scope: trio.CancelScope
    thread: threading.Thread

    def kill(self) -> None:
        """Cancel everything the replica runs, now (from the test's thread or loop)."""
        self.token.run_sync_soon(self.scope.cancel)
        self.thread.join(START_TIMEOUT)


@contextmanager
def fake_replica(model: FakeEngine | None = None, **overrides: Any) -> Iterator[FakeReplica]:
    model = model or word_engine()
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

    replica, thread = run_trio_in_thread(main, started, "fake-replica", START_TIMEOUT)
    try:
        yield replica
    finally:
        if thread.is_alive():
            if model.gate is not None:
                model.gate.set()
            replica.kill()


async def wait_until(condition: Callable[[], bool], seconds: float) -> None:
    """Poll ``condition`` until it holds; fail after ``seconds`` (generous: the machine may be busy)."""
    with trio.fail_after(seconds):
        while not condition():
            await trio.sleep(0.02)


@asynccontextmanager
async def serving_front(front: Front, wait_seconds: float) -> AsyncIterator[httpx.AsyncClient]:
    """``front`` running and its app under Hypercorn on a loopback port, once every replica is healthy: a client
    for it. The front and the server stop when the block ends."""
    async with trio.open_nursery() as nursery:
        await nursery.start(front.run)
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        binds = await nursery.start(serve, create_front_app(front), config)
        async with httpx.AsyncClient(base_url=binds[0], timeout=wait_seconds) as client:
            await wait_until(lambda: all(r.healthy for r in front.replicas), wait_seconds)
            yield client
        nursery.cancel_scope.cancel()


async def prefix_hits(url: str, wait_seconds: float) -> float:
    """Prompt tokens a replica found in its prefix cache so far (its ``/metrics``)."""
    async with httpx.AsyncClient(timeout=wait_seconds) as client:
        text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))
