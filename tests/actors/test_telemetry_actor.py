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


async def test_a_burst_of_events_is_delivered_in_one_turn_of_the_actor() -> None:
    """The actor drains what its inbox holds when it wakes, instead of one trio turn per event (while producers
    run on, the inbox and what its events hold would pile up)."""
    telemetry = Telemetry()
    turns = 0
    seen_at: list[int] = []
    telemetry.sinks.append(lambda _: seen_at.append(turns))
    async with trio.open_nursery() as nursery:
        await nursery.start(telemetry.run)

        async def ticker() -> None:  # counts trio turns: it runs once in each
            nonlocal turns
            while len(seen_at) < 50:
                turns += 1
                await trio.lowlevel.checkpoint()

        for i in range(50):
            telemetry.emit(event(i))
        nursery.start_soon(ticker)
        await trio.testing.wait_all_tasks_blocked()
        telemetry.close()
    assert len(seen_at) == 50 and len(set(seen_at)) == 1, seen_at
