"""``OutboxStreams``: the engine process's request streams, which write into the front's outbox instead of
memory channels read by callers in the same process.

``serve_engine`` installs one as ``Engine.streams`` before the engine runs. Everything ``RequestStreams`` does
stays (one owner and one end per entry, the stream interval, ``is_live``), but where it would send an item
into a request's memory channel it hands it to ``sink`` with the front's id of the request: ``Admitted`` and
``Rejected`` become ``Admission``s, ``RequestUpdate``s become ``Tokens`` (ids and logprobs, no text) named with
the front's id. Nothing reads a
channel in the engine process, so there is no task per request, and no item waits here: the sink's outbox is
unbounded (a lagging front gets fewer, larger messages), so a stream here is never full and never coalesces
(the front's own ``RequestStreams`` coalesce behind a slow client).

The front detokenises and matches stop strings (docs/ipc.md, decision 1): it may end a request on a stop
string before the engine's terminal update, so each request's first update carries its
``cached_prompt_tokens`` (``cached_tokens``, asked of the engine then), which the front's terminal reports.

The front's id of the request being submitted is set (``submitting``) just before ``Engine.submit``, which
opens the entry synchronously.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import trio

from inference_server.actors.request_streams import RequestStreams, _Entry
from inference_server.ipc.messages import Admission, Tokens
from inference_server.records.requests import Admitted, Rejected, RequestUpdate, StreamItem

Sink = Callable[[Admission | Tokens], None]


class _Statistics:
    current_buffer_used = 0  # the outbox never fills: a stream here is never full


_EMPTY = _Statistics()


class _OutboxSend:
    """Stands in for one request's memory channel send end (what ``RequestStreams`` calls on it)."""

    __slots__ = ("cached_tokens", "closed", "front_id", "on_close", "sink")

    def __init__(self, front_id: int, sink: Sink, on_close: Callable[[int], None],
                 cached_tokens: Callable[[int], int] | None) -> None:
        self.front_id = front_id
        self.sink = sink
        self.on_close = on_close
        self.closed = False
        self.cached_tokens = cached_tokens  # None once the first update went out

    def send_nowait(self, item: StreamItem) -> None:
        if isinstance(item, RequestUpdate):
            if self.cached_tokens is not None and item.finish_reason is None:
                cached, self.cached_tokens = self.cached_tokens(item.request_id), None
                self.sink(Tokens.of(item, self.front_id, cached))
            else:
                self.sink(Tokens.of(item, self.front_id))
        elif isinstance(item, Admitted):
            self.sink(Admission(self.front_id, item.prompt_token_ids))
        elif isinstance(item, Rejected):
            self.sink(Admission(self.front_id, rejected=item))

    def statistics(self) -> _Statistics:
        return _EMPTY

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.on_close(self.front_id)


class OutboxStreams(RequestStreams):
    """See the module docstring. ``on_end(front_id)``: the request's entry was removed (ended, refused, or its
    caller left)."""

    def __init__(self, sink: Sink, on_end: Callable[[int], None], *, interval_tokens: int = 1,
                 max_hold: float = 0.1, cached_tokens: Callable[[int], int] | None = None) -> None:
        super().__init__(interval_tokens=interval_tokens, max_hold=max_hold)
        self.sink = sink
        self.on_end = on_end
        self.cached_tokens = cached_tokens
        """The engine's request id -> its prompt tokens found in the prefix cache (sent on its first update)."""
        self.submitting = 0
        """The front's id of the request ``Engine.submit`` opens next."""
        send, self._nothing = trio.open_memory_channel[StreamItem](0)
        send.close()  # every handle's stream: nothing is read from it (the handle only aborts)

    def open(self, request_id: int) -> trio.MemoryReceiveChannel[StreamItem]:
        send = _OutboxSend(self.submitting, self.sink, self.on_end, self.cached_tokens)
        # RequestStreams only calls send_nowait, statistics and close on an entry's send end
        self._entries[request_id] = _Entry(cast(Any, send))
        return self._nothing
