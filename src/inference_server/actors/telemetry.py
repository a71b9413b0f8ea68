"""Telemetry actor: drains the event inbox and fans events out to subscribers and sinks.

Producers call ``Telemetry.emit`` (``send_nowait``): when the inbox is full the event is dropped and counted,
never awaited. Each subscriber gets its own bounded channel and, like the inbox, loses events rather than
slowing the actor: a slow subscriber loses events, not the engine. Sinks (metrics, SQLite, timeline) are
plain callables run in the actor's task.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from inference_server.telemetry.events import TelemetryEvent

INBOX_CAPACITY = 4096  # about a second of events at full load; beyond that we drop rather than block
SUBSCRIBER_CAPACITY = 1024  # a subscriber (e.g. a tail over HTTP) may lag this far before losing events

Sink = Callable[[TelemetryEvent], None]


class Telemetry:
    """Owns the event inbox, the drop counters and the subscriber list. Only its ``run`` task consumes."""

    def __init__(self, inbox_capacity: int = INBOX_CAPACITY) -> None:
        self._send, self._receive = trio.open_memory_channel[TelemetryEvent](inbox_capacity)
        self._subscribers: list[trio.MemorySendChannel[TelemetryEvent]] = []
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

    def subscribe(self, capacity: int = SUBSCRIBER_CAPACITY) -> trio.MemoryReceiveChannel[TelemetryEvent]:
        """A new bounded feed of every later event; close it to unsubscribe."""
        send, receive = trio.open_memory_channel[TelemetryEvent](capacity)
        self._subscribers.append(send)
        return receive

    def close(self) -> None:
        """Stop accepting events; ``run`` returns once the inbox is drained."""
        self._send.close()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self._receive:
            async for event in self._receive:
                self._deliver(event)
        for subscriber in self._subscribers:
            subscriber.close()

    def _deliver(self, event: TelemetryEvent) -> None:
        self.events_seen += 1
        for sink in self.sinks:
            sink(event)
        alive = []
        for subscriber in self._subscribers:
            try:
                subscriber.send_nowait(event)
            except trio.WouldBlock:
                self.subscriber_drops += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                continue  # the subscriber went away
            alive.append(subscriber)
        self._subscribers = alive
