"""Telemetry actor: drains the event inbox and fans events out to subscribers and sinks.

Producers call ``Telemetry.emit`` (``send_nowait``): when the inbox is full the event is dropped and counted,
never awaited. Each subscriber gets its own bounded channel and, like the inbox, loses events rather than
slowing the actor: a slow subscriber loses events, not the engine, and its ``Subscription.dropped`` says how
many (``GET /telemetry/tail`` reports it to the reader). Sinks are plain callables run in the actor's task:
the server attaches one, ``telemetry.tracker.RequestTracker``, which feeds the stats, Prometheus, SQLite and
timeline consumers (``telemetry/observability.py``; docs/observability.md).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from inference_server.telemetry.events import TelemetryEvent

INBOX_CAPACITY = 4096  # about a second of events at full load; beyond that we drop rather than block
SUBSCRIBER_CAPACITY = 1024  # a subscriber (e.g. a tail over HTTP) may lag this far before losing events

Sink = Callable[[TelemetryEvent], None]


class Subscription:
    """A bounded feed of telemetry events (``async for``); ``dropped`` counts the events it lost because
    its reader fell ``capacity`` events behind. ``aclose()`` (or ``close()``) unsubscribes."""

    def __init__(self, capacity: int) -> None:
        self._send, self._receive = trio.open_memory_channel[TelemetryEvent](capacity)
        self.dropped = 0

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> TelemetryEvent:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def receive(self) -> TelemetryEvent:
        return await self._receive.receive()

    def receive_nowait(self) -> TelemetryEvent:
        return self._receive.receive_nowait()

    def close(self) -> None:
        self._receive.close()

    async def aclose(self) -> None:
        self.close()

    def _offer(self, event: TelemetryEvent) -> bool:
        """Deliver without waiting; False once the reader went away (the actor then forgets it)."""
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            self.dropped += 1
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True


class Telemetry:
    """Owns the event inbox, the drop counters and the subscriber list. Only its ``run`` task consumes."""

    def __init__(self, inbox_capacity: int = INBOX_CAPACITY) -> None:
        self._send, self._receive = trio.open_memory_channel[TelemetryEvent](inbox_capacity)
        self._subscribers: list[Subscription] = []
        self.sinks: list[Sink] = []
        self.dropped_events = 0
        self.subscriber_drops = 0
        self.events_seen = 0

    def emit(self, event: TelemetryEvent) -> None:
        """Report an event without ever blocking; counts a drop when the inbox is full or closed."""
        try:
            self._send.send_nowait(event)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self.dropped_events += 1

    def subscribe(self, capacity: int = SUBSCRIBER_CAPACITY) -> Subscription:
        """A new bounded feed of every later event; close it to unsubscribe."""
        subscription = Subscription(capacity)
        self._subscribers.append(subscription)
        return subscription

    def close(self) -> None:
        """Stop accepting events; ``run`` returns once the inbox is drained."""
        self._send.close()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._receive:
            async for event in self._receive:
                self._deliver(event)
                self._deliver_waiting()
        for subscriber in self._subscribers:
            subscriber._send.close()

    def _deliver_waiting(self) -> None:
        """Every event already in the inbox, in this same turn: one wake-up of the actor per burst (a step's
        events, a request's end) instead of a trio turn per event, so the inbox never lags behind the producers
        holding what its events hold (a step's plan) alive."""
        receive = self._receive.receive_nowait
        while True:
            try:
                event = receive()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            self._deliver(event)

    def _deliver(self, event: TelemetryEvent) -> None:
        self.events_seen += 1
        for sink in self.sinks:
            sink(event)
        if not self._subscribers:
            return
        alive = []
        for subscriber in self._subscribers:
            before = subscriber.dropped
            if subscriber._offer(event):  # False: the subscriber went away
                alive.append(subscriber)
                self.subscriber_drops += subscriber.dropped - before
        self._subscribers = alive
