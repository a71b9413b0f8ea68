"""Per-request output streams: bounded, coalescing, and closed after exactly one terminal item.

Each request's consumer (an HTTP handler, the offline API) reads a bounded memory channel. The engine never
waits on a consumer: when a stream is full, updates are merged into one pending update (tokens concatenated)
and delivered as soon as there is room, so a slow client receives the same tokens in fewer, larger events.
A consumer that closed its end (client gone) is reported back, and the scheduler aborts the request.
The last slot of every buffer is reserved for the terminal update, so the one terminal item is never lost to
backpressure.

All methods are synchronous and called from tasks of the one trio thread, so there are no races.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import attrs
import trio

from inference_server.core.request import RequestUpdate
from inference_server.messages import Admitted, Rejected

StreamItem = Admitted | Rejected | RequestUpdate
STREAM_CAPACITY = 32  # updates a consumer may lag before further tokens are coalesced into one update


def merge(first: RequestUpdate, second: RequestUpdate) -> RequestUpdate:
    """One update carrying both updates' tokens (and the second's finish, if any)."""
    return attrs.evolve(second, tokens=first.tokens + second.tokens)


class RequestStreams:
    """The send ends of every live request stream, with their coalesced pending updates."""

    def __init__(self, capacity: int = STREAM_CAPACITY) -> None:
        self.capacity = capacity
        self._streams: dict[int, trio.MemorySendChannel[StreamItem]] = {}
        self._pending: dict[int, RequestUpdate] = {}

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: int) -> trio.MemoryReceiveChannel[StreamItem]:
        send, receive = trio.open_memory_channel[StreamItem](self.capacity)
        self._streams[request_id] = send
        return receive

    def reject(self, request_id: int, rejection: Rejected) -> None:
        """Deliver the only item of a refused request and close its stream."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                stream.send_nowait(rejection)  # the first item of a fresh stream: never WouldBlock
            stream.close()

    def admitted(self, request_id: int, prompt_tokens: int) -> bool:
        """Tell the consumer its request is queued; False when the consumer is already gone."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        try:
            stream.send_nowait(Admitted(request_id, prompt_tokens))
            return True
        except trio.WouldBlock:  # cannot happen on a fresh stream; treat as gone rather than block
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False

    def deliver(self, update: RequestUpdate) -> bool:
        """Send (or coalesce) an update; returns False when the consumer closed its end."""
        pending = self._pending.pop(update.request_id, None)
        if pending is not None:
            update = merge(pending, update)
        return self._try_send(update)

    def flush_pending(self) -> list[int]:
        """Retry coalesced updates; returns ids of requests whose consumer is gone."""
        gone = []
        for update in list(self._pending.values()):
            del self._pending[update.request_id]
            if not self._try_send(update):
                gone.append(update.request_id)
        return gone

    def has_pending(self) -> bool:
        return bool(self._pending)

    def abandoned(self, request_ids: Iterable[int]) -> list[int]:
        """Those of ``request_ids`` whose consumer closed its end of the stream (client gone)."""
        gone = []
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None and stream.statistics().open_receive_channels == 0:
                gone.append(request_id)
        return gone

    def _try_send(self, update: RequestUpdate) -> bool:
        stream = self._streams.get(update.request_id)
        if stream is None:
            return False
        if not update.finished and stream.statistics().current_buffer_used >= self.capacity - 1:
            self._pending[update.request_id] = update  # keep the last slot for the terminal update
            return True
        try:
            stream.send_nowait(update)
        except trio.WouldBlock:
            self._pending[update.request_id] = update
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._close(update.request_id)
            return False
        if update.finished:
            self._close(update.request_id)
        return True

    def _close(self, request_id: int) -> None:
        stream = self._streams.pop(request_id, None)
        self._pending.pop(request_id, None)
        if stream is not None:
            stream.close()

    def fail_all(self, message: str) -> None:
        """Give every live stream a terminal error (engine failure or shutdown) and close it; pending
        tokens travel in the same terminal update (the reserved last slot always has room for it)."""
        for request_id in list(self._streams):
            stream = self._streams[request_id]
            pending = self._pending.pop(request_id, None)
            final = RequestUpdate(request_id=request_id, finish_reason="error", error=message)
            if pending is not None:
                final = merge(pending, final)
            # The reserved last slot always has room; a closed or broken stream means the consumer is gone.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                stream.send_nowait(final)
            self._close(request_id)
