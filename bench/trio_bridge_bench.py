#!/usr/bin/env python3
"""How to run trio inside a Ray actor: a dedicated thread (``trio.run``) beside the actor's asyncio loop, or
trio's guest mode on that loop. Measures what the engine's event loop does all the time, in three hosts:

* ``main``: ``trio.run`` in the main thread (what ``inference-server serve`` does; the baseline);
* ``thread``: ``trio.run`` in its own thread while the main thread runs an asyncio loop (a Ray async actor's
  loop) that wakes every millisecond;
* ``guest``: ``trio.lowlevel.start_guest_run`` on that asyncio loop (trio's scheduling batches and I/O
  waits are handed over through ``call_soon_threadsafe`` and trio's I/O thread).

Workloads: task-to-task round trips over memory channels (the actors' channels), and 64-byte round trips
over a loopback TCP connection (the HTTP side). Prints microseconds per round trip, best of ``--repeat``.

    uv run python bench/trio_bridge_bench.py
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

Workload = Callable[[int], Awaitable[float]]


async def channel_round_trips(count: int) -> float:
    """Seconds for ``count`` send/reply round trips between two tasks over rendezvous channels."""
    requests_send, requests_receive = trio.open_memory_channel[int](0)
    replies_send, replies_receive = trio.open_memory_channel[int](0)

    async def echo() -> None:
        async for value in requests_receive:
            await replies_send.send(value)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo)
        start = time.perf_counter()
        for value in range(count):
            await requests_send.send(value)
            await replies_receive.receive()
        elapsed = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return elapsed


async def tcp_round_trips(count: int) -> float:
    """Seconds for ``count`` 64-byte request/reply round trips over a loopback TCP connection."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def serve_one(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(65536):
            await stream.send_all(data)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve_one, listeners)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        payload = b"x" * 64
        start = time.perf_counter()
        for _ in range(count):
            await client.send_all(payload)
            received = 0
            while received < len(payload):
                received += len(await client.receive_some(65536))
        elapsed = time.perf_counter() - start
        await client.aclose()
        nursery.cancel_scope.cancel()
    return elapsed


def in_main(workload: Workload, count: int) -> float:
    return trio.run(workload, count)


async def _ticking() -> None:
    """An asyncio loop that has something to do every millisecond (a live actor's loop)."""
    while True:
        await asyncio.sleep(0.001)


def in_thread(workload: Workload, count: int) -> float:
    result: list[float] = []

    async def host() -> None:
        ticker = asyncio.ensure_future(_ticking())
        thread = threading.Thread(target=lambda: result.append(trio.run(workload, count)))
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.01)
        ticker.cancel()

    asyncio.run(host())
    return result[0]


def in_guest(workload: Workload, count: int) -> float:
    async def host() -> float:
        loop = asyncio.get_running_loop()
        ticker = asyncio.ensure_future(_ticking())
        done: asyncio.Future[Any] = loop.create_future()
        trio.lowlevel.start_guest_run(workload, count, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                                      run_sync_soon_not_threadsafe=loop.call_soon,
                                      done_callback=done.set_result)
        outcome = await done
        ticker.cancel()
        return float(outcome.unwrap())

    return asyncio.run(host())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channel-trips", type=int, default=20000)
    parser.add_argument("--tcp-trips", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    workloads = {"channel": (channel_round_trips, args.channel_trips), "tcp": (tcp_round_trips, args.tcp_trips)}
    hosts = {"main": in_main, "thread": in_thread, "guest": in_guest}
    print(f"{'round trip (us)':<18}" + "".join(f"{name:>10}" for name in hosts))
    for name, (workload, count) in workloads.items():
        cells = [min(host(workload, count) for _ in range(args.repeat)) / count * 1e6 for host in hosts.values()]
        print(f"{name:<18}" + "".join(f"{cell:>10.1f}" for cell in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
