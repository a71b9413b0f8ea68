"""Per-request output streams: bounded, coalescing, one owner and one end for every entry.

Each request's caller reads a bounded memory channel through its ``RequestHandle``. The engine never waits
on a caller: when a stream is full, updates are merged into one pending update (tokens concatenated) and
delivered as soon as there is room, so a slow client receives the same tokens in fewer, larger events. The
last slot of every buffer is reserved for the terminal update, so the one terminal item is never lost to
backpressure.

**Lifecycle of an entry** (the invariant ``check_integrity`` relies on): an entry is created by ``open``
when the request is submitted and removed exactly once, by whichever comes first of

* ``reject`` (the request was refused, at any stage before it was queued),
* the delivery of its terminal update (``deliver`` / ``fail_all``),
* ``client_left`` (the caller closed its handle: at any stage, queued or not).

Whoever holds a request afterwards (admission, the scheduler) asks ``is_live`` before doing work for it, so
a request whose caller left is dropped wherever it is.

All methods are synchronous and called from tasks of the one trio thread, so there are no races.
"""

from __future__ import annotations

import contextlib

import attrs
import trio

from inference_server.records.requests import Admitted, Rejected, RequestUpdate, StreamItem

STREAM_CAPACITY = 32  # updates a consumer may lag before further tokens are coalesced into one update


def merge(first: RequestUpdate, second: RequestUpdate) -> RequestUpdate:
    """One update carrying both updates' tokens and prompt logprobs (and the second's finish, if any)."""
    prompt_logprobs = second.prompt_logprobs if second.prompt_logprobs is not None else first.prompt_logprobs
    return attrs.evolve(second, tokens=first.tokens + second.tokens, prompt_logprobs=prompt_logprobs)


class RequestStreams:
    """The send ends of every live request stream, with their coalesced pending updates."""

    def __init__(self, capacity: int = STREAM_CAPACITY) -> None:
        self.capacity = capacity
        self._streams: dict[int, trio.MemorySendChannel[StreamItem]] = {}
        self._pending: dict[int, RequestUpdate] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def is_live(self, request_id: int) -> bool:
        """Whether the request still has a caller waiting for it."""
        return request_id in self._streams

    def open(self, request_id: int) -> trio.MemoryReceiveChannel[StreamItem]:
        send, receive = trio.open_memory_channel[StreamItem](self.capacity)
        self._streams[request_id] = send
        return receive

    def reject(self, request_id: int, rejection: Rejected) -> None:
        """Deliver the only item of a refused request and remove its entry."""
        stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                stream.send_nowait(rejection)  # the first item of a fresh stream
            self._remove(request_id)

    def admitted(self, request_id: int, prompt_ids: tuple[int, ...]) -> bool:
        """Tell the caller its request is queued; False (and the entry removed) when the caller is gone."""
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        try:
            stream.send_nowait(Admitted(request_id, len(prompt_ids), prompt_ids))
            return True
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._remove(request_id)  # a fresh stream cannot be full: its reader is gone
            return False

    def deliver(self, update: RequestUpdate) -> bool:
        """Send (or coalesce) an update; False when the caller is gone (the entry is then removed)."""
        pending = self._pending.pop(update.request_id, None)
        if pending is not None:
            update = merge(pending, update)
        return self._try_send(update)

    def flush_pending(self) -> list[int]:
        """Retry coalesced updates; returns ids of requests whose caller is gone."""
        gone = []
        for update in list(self._pending.values()):
            del self._pending[update.request_id]
            if not self._try_send(update):
                gone.append(update.request_id)
        return gone

    def has_pending(self) -> bool:
        return bool(self._pending)

    def client_left(self, request_id: int) -> bool:
        """The caller closed its handle: remove the entry now; True when it was still live."""
        if request_id not in self._streams:
            return False
        self._remove(request_id)
        return True

    def fail_all(self, message: str) -> None:
        """Give every live stream a terminal error (engine failure or shutdown) and remove it; pending
        tokens travel in the same terminal update (the reserved last slot always has room for it)."""
        for request_id in list(self._streams):
            stream = self._streams[request_id]
            pending = self._pending.pop(request_id, None)
            final = RequestUpdate(request_id=request_id, finish_reason="error", error=message)
            if pending is not None:
                final = merge(pending, final)
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                stream.send_nowait(final)
            self._remove(request_id)

    def check_integrity(self) -> None:
        """Pending updates belong to live entries only."""
        stray = set(self._pending) - set(self._streams)
        assert not stray, f"pending updates for removed streams: {sorted(stray)}"

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
            self._remove(update.request_id)
            return False
        if update.finished:
            self._remove(update.request_id)
        return True

    def _remove(self, request_id: int) -> None:
        stream = self._streams.pop(request_id, None)
        self._pending.pop(request_id, None)
        if stream is not None:
            stream.close()
