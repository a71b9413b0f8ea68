"""The engine split across two processes: ``RemoteEngine`` here, ``serve_engine`` in a child
(tests/ipc/engine_child.py: the real ``Engine`` on the fake step) on an inherited socketpair end.

A drained child stops cleanly (``Stopped``, exit 0); a SIGKILLed child ends every open handle with an error.
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from tests.ipc.split_kit import expected_tokens, ids_request, read_all, run_front

from inference_server.ipc.channel import open_socket_channel
from inference_server.ipc.messages import ENGINE_TO_FRONT
from inference_server.ipc.remote_engine import RemoteEngine
from inference_server.supervisor import EngineState

BOUND_S = 120
REPO_ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def engine_child(step_seconds: float) -> AsyncIterator[tuple[RemoteEngine, trio.Process, list[BaseException]]]:
    """A running child engine and this process's ``RemoteEngine`` for it (its ``run`` in a task; a death it
    raises is collected in the list)."""
    ours, theirs = socket.socketpair()
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tests.ipc.engine_child", str(theirs.fileno()), str(step_seconds)],
            pass_fds=(theirs.fileno(),), cwd=REPO_ROOT)
    finally:
        theirs.close()  # only the child holds its end now: its death is our EOF
    deaths: list[BaseException] = []
    try:
        async with (
            open_socket_channel(ours, 8, receive_type=ENGINE_TO_FRONT) as channel,
            trio.open_nursery() as nursery,
        ):
            remote = RemoteEngine(channel, max_queue_size=256)
            await nursery.start(run_front, remote, deaths)
            yield remote, process, deaths
    finally:
        if process.returncode is None:
            process.kill()
        with trio.move_on_after(BOUND_S):
            await process.wait()


async def test_requests_run_in_the_child_and_a_drain_stops_it_cleanly() -> None:
    requests = [ids_request(3 + i, max_tokens=1 + (i * 11) % 40, length=2 + i % 5) for i in range(24)]
    results: dict[int, tuple[list[int], list[str | None]]] = {}
    with trio.fail_after(BOUND_S):
        async with engine_child(0.0) as (remote, process, deaths):
            assert remote.hello is not None and remote.hello.pid == process.pid
            async with trio.open_nursery() as nursery:

                async def one(i: int) -> None:
                    results[i] = await read_all(remote.submit(requests[i]))

                for i in range(len(requests)):
                    nursery.start_soon(one, i)
            remote.request_drain(BOUND_S)
            assert await process.wait() == 0
    for i, request in enumerate(requests):
        tokens, finishes = results[i]
        assert tokens == expected_tokens(request), i
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1]), i
    assert deaths == [] and remote.state is EngineState.STOPPED
    assert remote.stopped is not None and not remote.stopped.failed


async def test_a_killed_engine_process_ends_every_open_handle_with_an_error() -> None:
    with trio.fail_after(BOUND_S):
        async with engine_child(0.02) as (remote, process, deaths):
            handles = [remote.submit(ids_request(10 + i, max_tokens=1000)) for i in range(8)]
            for handle in handles:  # every request admitted and streaming
                await handle.admission()
                first = await handle.__anext__()
                assert first.finish_reason is None
            process.send_signal(signal.SIGKILL)
            for handle in handles:
                async with handle:
                    rest = [update async for update in handle]
                assert rest[-1].finish_reason == "error" and all(u.finish_reason is None for u in rest[:-1])
                assert rest[-1].error is not None and "engine process is gone" in rest[-1].error
            assert await process.wait() == -signal.SIGKILL
    assert len(deaths) == 1 and remote.failed


def test_the_engine_process_freezes_its_start_up_heap_and_raises_the_young_threshold() -> None:
    import gc

    from inference_server.engine_process import GC_YOUNG_THRESHOLD, settle_heap

    before = gc.get_threshold()
    try:
        settle_heap()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
