"""A SocketChannel pair over ``socket.socketpair()`` in one trio run: the memory channel contract.

Waits are events (``wait_all_tasks_blocked``: a socketpair's bytes are readable as soon as they are written,
and trio polls for I/O before it calls the tasks blocked) under generous ``fail_after`` bounds.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import trio
import trio.testing

from inference_server.ipc.channel import SocketChannel, open_socket_channel
from inference_server.ipc.frames import (
    DataFrameEncoder,
    MessageTooLargeError,
    UnsendableMessageError,
    credit_frame,
)

BOUND_S = 30


class TokenEvent(msgspec.Struct):
    request_id: int
    token_ids: list[int]
    finish_reason: str | None = None


@asynccontextmanager
async def channel_pair(
    capacity_a: int = 8, capacity_b: int = 8, **options: object
) -> AsyncIterator[tuple[SocketChannel, SocketChannel]]:
    sock_a, sock_b = socket.socketpair()
    async with (
        open_socket_channel(sock_a, capacity_a, **options) as a,  # type: ignore[arg-type]
        open_socket_channel(sock_b, capacity_b, **options) as b,  # type: ignore[arg-type]
    ):
        yield a, b


async def test_many_messages_arrive_in_order_both_ways() -> None:
    count = 3000
    received: dict[str, list[TokenEvent]] = {"a": [], "b": []}
    sent = [TokenEvent(i, list(range(i % 8 + 1)), "length" if i % 7 == 0 else None) for i in range(count)]
    with trio.fail_after(BOUND_S):
        async with channel_pair(4, 16, receive_type=TokenEvent) as (a, b), trio.open_nursery() as nursery:

            async def pump(src: SocketChannel) -> None:
                for event in sent:
                    await src.send(event)

            async def drain(dst: SocketChannel, name: str) -> None:
                for _ in range(count):
                    received[name].append(await dst.receive())

            nursery.start_soon(pump, a)
            nursery.start_soon(pump, b)
            nursery.start_soon(drain, a, "a")
            nursery.start_soon(drain, b, "b")
    assert received["a"] == sent
    assert received["b"] == sent


async def test_send_blocks_at_capacity_and_resumes_when_one_is_taken() -> None:
    capacity = 5
    with trio.fail_after(BOUND_S):
        async with channel_pair(capacity_b=capacity) as (a, b), trio.open_nursery() as nursery:
            for i in range(capacity):
                await a.send(i)
            done: list[int] = []

            async def send_more() -> None:
                for i in range(capacity, capacity + 2):
                    await a.send(i)
                    done.append(i)

            nursery.start_soon(send_more)
            await trio.testing.wait_all_tasks_blocked()
            assert done == []  # the capacity+1-th send waits for a credit
            assert await b.receive() == 0
            await trio.testing.wait_all_tasks_blocked()
            assert done == [capacity]  # one taken, one more sent; the next waits again
            assert await b.receive() == 1
            await trio.testing.wait_all_tasks_blocked()
            assert done == [capacity, capacity + 1]
            assert [await b.receive() for _ in range(capacity)] == list(range(2, capacity + 2))


async def test_a_cancelled_blocked_send_sends_nothing_and_keeps_the_channel() -> None:
    with trio.fail_after(BOUND_S):
        async with channel_pair(capacity_b=1) as (a, b):
            await a.send("first")
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def blocked_send() -> None:
                    with scope:
                        await a.send("dropped")

                nursery.start_soon(blocked_send)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
            assert scope.cancelled_caught
            assert await b.receive() == "first"
            await a.send("second")
            assert await b.receive() == "second"


async def test_clean_close_delivers_what_was_sent_then_end_of_channel() -> None:
    with trio.fail_after(BOUND_S):
        async with channel_pair(capacity_b=8) as (a, b):
            for i in range(6):
                await a.send(i)
            await a.aclose()
            assert [message async for message in b] == list(range(6))
            with pytest.raises(trio.EndOfChannel):
                await b.receive()
            with pytest.raises(trio.BrokenResourceError, match="closed its end"):
                await b.send("late")


async def test_clean_close_crossing_the_receivers_grants_is_still_clean() -> None:
    """With capacity 1 every message taken sends a grant, so the receiver's writes meet the sender's closed
    socket (EPIPE); the close frame already in the receiver's socket still makes it a clean end."""
    for _ in range(20):
        with trio.fail_after(BOUND_S):
            async with channel_pair(capacity_b=1) as (a, b), trio.open_nursery() as nursery:

                async def send_then_close() -> None:
                    for i in range(5):
                        await a.send(i)
                    await a.aclose()

                nursery.start_soon(send_then_close)
                assert [message async for message in b] == list(range(5))
                with pytest.raises(trio.BrokenResourceError, match="closed its end"):
                    await b.send("late")


async def test_clean_close_wakes_a_peer_blocked_in_receive_and_in_send() -> None:
    outcomes: dict[str, type[BaseException]] = {}
    with trio.fail_after(BOUND_S):
        async with channel_pair(capacity_a=1) as (a, b):
            await b.send("fills a")

            async def expect(name: str, call: object) -> None:
                try:
                    await call()  # type: ignore[operator]
                except (trio.EndOfChannel, trio.BrokenResourceError) as exc:
                    outcomes[name] = type(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(expect, "receive", b.receive)
                nursery.start_soon(expect, "send", lambda: b.send("blocked"))
                await trio.testing.wait_all_tasks_blocked()
                assert outcomes == {}
                await a.aclose()
    assert outcomes == {"receive": trio.EndOfChannel, "send": trio.BrokenResourceError}


async def test_own_closed_end_raises_closed_resource_error() -> None:
    with trio.fail_after(BOUND_S):
        async with channel_pair() as (a, _b):
            blocked: list[type[BaseException]] = []

            async def receive_blocked() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await a.receive()
                blocked.append(trio.ClosedResourceError)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_blocked)
                await trio.testing.wait_all_tasks_blocked()
                await a.aclose()
            assert blocked == [trio.ClosedResourceError]
            with pytest.raises(trio.ClosedResourceError):
                await a.send(1)
            with pytest.raises(trio.ClosedResourceError):
                await a.receive()
            await a.aclose()  # idempotent


async def test_unsendable_messages_raise_at_send_and_the_channel_still_works() -> None:
    with trio.fail_after(BOUND_S):
        async with channel_pair(max_message_bytes=64) as (a, b):
            with pytest.raises(UnsendableMessageError, match="cannot encode a object"):
                await a.send(object())
            with pytest.raises(MessageTooLargeError, match="limit of 64"):
                await a.send("x" * 100)
            await a.send({"ok": [1, 2]})
            assert await b.receive() == {"ok": [1, 2]}


async def test_peer_death_without_close_is_broken_after_the_messages_that_arrived() -> None:
    """The peer's socket closes with no close frame (as when its process dies): receive gives what fully
    arrived, then BrokenResourceError; send raises it too."""
    sock_a, sock_peer = socket.socketpair()
    raw_peer = trio.socket.from_stdlib_socket(sock_peer)
    with trio.fail_after(BOUND_S):
        async with open_socket_channel(sock_a, 4) as a:
            assert await raw_peer.recv(64) == credit_frame(4)  # the opening grant
            await raw_peer.send(bytes(DataFrameEncoder().encode("last words")) + b"\0\0")  # then a torn frame
            raw_peer.close()
            assert await a.receive() == "last words"
            with pytest.raises(trio.BrokenResourceError, match="gone"):
                await a.receive()
            with pytest.raises(trio.BrokenResourceError, match="gone"):
                await a.send("anyone?")


async def test_garbage_from_the_peer_breaks_the_channel() -> None:
    sock_a, raw_peer = socket.socketpair()
    with trio.fail_after(BOUND_S):
        async with open_socket_channel(sock_a, 4) as a:
            raw_peer.sendall(b"\0\0\0\0\x09")  # a frame of an unknown kind
            with pytest.raises(trio.BrokenResourceError):
                await a.receive()
            raw_peer.close()


async def test_typed_receive_rejects_a_mistyped_message_as_broken() -> None:
    with trio.fail_after(BOUND_S):
        async with channel_pair(receive_type=TokenEvent) as (a, b):
            await a.send(TokenEvent(1, [2]))
            await a.send({"request_id": "not an int"})
            assert await b.receive() == TokenEvent(1, [2])
            with pytest.raises(trio.BrokenResourceError):
                await b.receive()


async def test_a_channel_over_a_connected_socket_path(tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(path)
    listener.listen(1)
    with trio.fail_after(BOUND_S):
        client = await trio.open_unix_socket(path)
        accepted, _ = await listener.accept()
        listener.close()
        async with (
            open_socket_channel(client, 2) as front,
            open_socket_channel(trio.SocketStream(accepted), 2) as engine,
        ):
            await front.send({"prompt": [1, 2, 3]})
            assert await engine.receive() == {"prompt": [1, 2, 3]}
            await engine.send("done")
            assert await front.receive() == "done"
