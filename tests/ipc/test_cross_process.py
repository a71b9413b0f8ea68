"""A SocketChannel to a real child process (tests/ipc/echo_child.py on an inherited socketpair end): round
trips in order, a clean close seen by the parent, and the child's SIGKILL seen as BrokenResourceError."""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from inference_server.ipc.channel import SocketChannel, open_socket_channel

BOUND_S = 60
CHILD = Path(__file__).with_name("echo_child.py")


@asynccontextmanager
async def echo_child(capacity: int = 8) -> AsyncIterator[tuple[SocketChannel, trio.Process]]:
    ours, theirs = socket.socketpair()
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(CHILD), str(theirs.fileno())], pass_fds=(theirs.fileno(),)
        )
    finally:
        theirs.close()  # only the child holds its end now: its death is our EOF
    try:
        async with open_socket_channel(ours, capacity) as channel:
            yield channel, process
    finally:
        if process.returncode is None:
            process.kill()
        with trio.move_on_after(BOUND_S):
            await process.wait()


async def test_round_trips_in_order_then_a_clean_close() -> None:
    count = 2000
    echoed: list[object] = []
    with trio.fail_after(BOUND_S):
        async with echo_child() as (channel, process):
            async with trio.open_nursery() as nursery:

                async def pump() -> None:
                    for i in range(count):
                        await channel.send({"request_id": i, "token_ids": [i, i + 1], "finish_reason": None})

                nursery.start_soon(pump)
                for _ in range(count):
                    echoed.append(await channel.receive())
            await channel.send("bye")  # the child closes its end cleanly
            with pytest.raises(trio.EndOfChannel):
                await channel.receive()
            with pytest.raises(trio.BrokenResourceError, match="closed its end"):
                await channel.send("late")
            assert await process.wait() == 0
    assert echoed == [{"request_id": i, "token_ids": [i, i + 1], "finish_reason": None} for i in range(count)]


async def test_child_killed_mid_stream_is_broken_resource_on_both_operations() -> None:
    outcomes: dict[str, type[BaseException]] = {}
    with trio.fail_after(BOUND_S):
        async with echo_child() as (channel, process), trio.open_nursery() as nursery:

            async def pump() -> None:
                i = 0
                try:
                    while True:
                        await channel.send(i)
                        i += 1
                except trio.BrokenResourceError as exc:
                    outcomes["send"] = type(exc)

            nursery.start_soon(pump)
            received = 0
            try:
                while True:
                    assert await channel.receive() == received
                    received += 1
                    if received == 100:
                        process.send_signal(signal.SIGKILL)
            except trio.BrokenResourceError as exc:
                outcomes["receive"] = type(exc)
            assert received >= 100
            assert await process.wait() == -signal.SIGKILL
    assert outcomes == {"send": trio.BrokenResourceError, "receive": trio.BrokenResourceError}
