"""Telemetry never blocks: a full inbox drops and counts, a slow subscriber loses events, not the engine."""

from __future__ import annotations

import trio

from inference_server.actors.telemetry import Telemetry
from inference_server.telemetry.events import RequestStarted


def event(i: int) -> RequestStarted:
    return RequestStarted(time=float(i), request_id=i, cached_prompt_tokens=0)


async def test_full_inbox_drops_and_counts_without_blocking() -> None:
    telemetry = Telemetry(inbox_capacity=3)
    for i in range(10):  # nobody drains yet: 3 fit, 7 are dropped, and emit never awaits
        telemetry.emit(event(i))
    assert telemetry.dropped_events == 7
    seen = []
    telemetry.sinks.append(seen.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(telemetry.run)
        telemetry.close()
    assert [e.request_id for e in seen] == [0, 1, 2]


async def test_slow_subscriber_loses_events_and_fast_one_gets_all() -> None:
    telemetry = Telemetry()
    slow = telemetry.subscribe(capacity=2)
    fast = telemetry.subscribe(capacity=100)
    received_fast = []
    async with trio.open_nursery() as nursery:
        await nursery.start(telemetry.run)

        async def read_fast() -> None:
            async for e in fast:
                received_fast.append(e.request_id)

        nursery.start_soon(read_fast)
        for i in range(20):
            telemetry.emit(event(i))
        await trio.sleep(0.01)
        telemetry.close()
    received_slow = [e.request_id async for e in slow]
    assert received_fast == list(range(20))
    assert received_slow == [0, 1]
    assert telemetry.subscriber_drops == 18


async def test_a_closed_subscriber_is_forgotten() -> None:
    telemetry = Telemetry()
    feed = telemetry.subscribe()
    await feed.aclose()
    async with trio.open_nursery() as nursery:
        await nursery.start(telemetry.run)
        telemetry.emit(event(1))
        await trio.sleep(0.01)
        telemetry.close()
    assert telemetry.events_seen == 1 and telemetry.subscriber_drops == 0
