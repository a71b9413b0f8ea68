"""Per-request output streams: bounded, coalescing, one owner and one end for every entry.

Each request's caller reads a bounded memory channel through its ``RequestHandle``. The engine never waits
on a caller: when a stream is full, updates are merged into one pending update (tokens concatenated) and
delivered as soon as there is room, so a slow client receives the same tokens in fewer, larger events. The
last slot of every buffer is reserved for the terminal update, so the one terminal item is never lost to
backpressure.

**Stream interval** (``interval_tokens`` > 1, SGLang's ``--stream-interval``): after a request's first token
(always sent at once), its tokens are *held* here and sent as one update once ``interval_tokens`` of them
are held, so every consumer (the SSE writer, ``result()``) wakes once per interval instead of once per
token, and a held token costs no event-loop work at all. No token is held longer than ``max_hold``
seconds: the held tokens go out early when waiting for the next one (expected as far away as the last
gap between two tokens) would take the oldest past the bound, so tokens that come ``max_hold`` or more
apart (slow steps) are never held; and a stream that stops producing (a preempted request, a stalled
step) is flushed by the first ``flush_pending`` pass at or after the bound (the scheduler calls it once per
loop and wakes itself within ``RETRY_SECONDS`` while ``has_pending``; a step in progress delays it to that
step's end). A finishing update, an error, an abort and ``fail_all`` send held tokens at once, in the
same update.

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
import itertools

import trio

from inference_server.records.requests import (
    Admitted,
    PromptTokenLogprob,
    Rejected,
    RequestUpdate,
    StreamItem,
    TokenOutput,
)

STREAM_CAPACITY = 32  # updates a consumer may lag before further tokens are coalesced into one update


def merge(first: RequestUpdate, second: RequestUpdate) -> RequestUpdate:
    """One update carrying both updates' tokens and prompt logprobs (and the second's finish, if any)."""
    prompt_logprobs = second.prompt_logprobs if second.prompt_logprobs is not None else first.prompt_logprobs
    return second.with_tokens(first.tokens + second.tokens, prompt_logprobs)


def merge_all(updates: list[RequestUpdate]) -> RequestUpdate:
    """``merge`` folded over ``updates`` (at least one) in one pass: one tuple and one record built."""
    last = updates[-1]
    if len(updates) == 1:
        return last
    prompt_logprobs = next((u.prompt_logprobs for u in reversed(updates) if u.prompt_logprobs is not None), None)
    return last.with_tokens(tuple(itertools.chain.from_iterable(update.tokens for update in updates)),
                            prompt_logprobs)


class _Entry:
    """One live stream: its send end and the updates the stream interval holds back.

    Held updates are folded as they arrive (their tokens into one list, the latest prompt logprobs, the latest update
    for the other fields), so releasing them builds one tuple and one record (what ``merge_all`` of them gives)
    without another pass over them."""

    __slots__ = ("answered", "held", "held_logprobs", "held_since", "held_tokens", "last_arrival", "send", "started")

    def __init__(self, send: trio.MemorySendChannel[StreamItem]) -> None:
        self.send = send
        # The stream's first item (its Admitted) has gone out: until then the caller waits in admission(),
        # which takes an Admitted or a Rejected and nothing else, so an end must come as a Rejected.
        self.answered = False
        self.started = False  # a token has gone out (the first one is never held)
        self.held: RequestUpdate | None = None  # the latest held update; None: nothing is held
        self.held_tokens: list[TokenOutput] = []  # the held updates' tokens, in order
        self.held_logprobs: tuple[PromptTokenLogprob, ...] | None = None  # the latest held prompt logprobs
        self.held_since = 0.0  # when the first held update arrived
        self.last_arrival = -float("inf")  # when the last non-terminal update arrived

    def hold(self, update: RequestUpdate) -> None:
        """Add ``update`` to the held ones."""
        self.held = update
        self.held_tokens.extend(update.tokens)
        if update.prompt_logprobs is not None:
            self.held_logprobs = update.prompt_logprobs

    def release(self, update: RequestUpdate | None = None) -> RequestUpdate:
        """Every held update (and ``update``) as one; nothing is held afterwards."""
        if update is not None:
            self.hold(update)
        last = self.held
        assert last is not None, "release() with nothing held"
        merged = last.with_tokens(tuple(self.held_tokens), self.held_logprobs)
        self.held, self.held_tokens, self.held_logprobs = None, [], None
        return merged


class RequestStreams:
    """The send ends of every live request stream, with their held and coalesced pending updates."""

    def __init__(self, capacity: int = STREAM_CAPACITY, *, interval_tokens: int = 1, max_hold: float = 0.1) -> None:
        if interval_tokens < 1 or max_hold <= 0:
            raise ValueError("the stream interval needs interval_tokens >= 1 and max_hold > 0")
        self.capacity = capacity
        self.interval_tokens = interval_tokens
        self.max_hold = max_hold
        self._entries: dict[int, _Entry] = {}
        self._pending: dict[int, RequestUpdate] = {}  # coalesced behind a full stream (backpressure)
        self._holding: dict[int, _Entry] = {}  # entries with held updates, oldest hold first

    def __len__(self) -> int:
        return len(self._entries)

    def is_live(self, request_id: int) -> bool:
        """Whether the request still has a caller waiting for it."""
        return request_id in self._entries

    def open(self, request_id: int) -> trio.MemoryReceiveChannel[StreamItem]:
        send, receive = trio.open_memory_channel[StreamItem](self.capacity)
        self._entries[request_id] = _Entry(send)
        return receive

    def reject(self, request_id: int, rejection: Rejected) -> None:
        """Deliver the only item of a refused request and remove its entry."""
        entry = self._entries.get(request_id)
        if entry is not None:
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                entry.send.send_nowait(rejection)  # the first item of a fresh stream
            self._remove(request_id)

    def admitted(self, request_id: int, prompt_ids: tuple[int, ...]) -> bool:
        """Tell the caller its request is queued; False (and the entry removed) when the caller is gone."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        try:
            entry.send.send_nowait(Admitted(request_id, len(prompt_ids), prompt_ids))
            entry.answered = True
            return True
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._remove(request_id)  # a fresh stream cannot be full: its reader is gone
            return False

    def deliver(self, update: RequestUpdate, now: float | None = None) -> bool:
        """Send, hold (stream interval) or coalesce an update; False when the caller is gone (the entry is
        then removed). ``now``: the current time, when the caller delivers many updates at once (one clock read
        for a whole step's updates instead of one per token); read here when None."""
        request_id = update.request_id
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        if self.interval_tokens > 1 and update.finish_reason is None:
            if now is None:
                now = trio.current_time()
            if entry.started and request_id not in self._pending:
                if self._hold(entry, request_id, update, now):
                    return True
                update = entry.release()
            else:
                entry.last_arrival = now
        elif entry.held is not None:
            del self._holding[request_id]
            update = entry.release(update)
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            update = merge(pending, update)
        return self._try_send(update)

    def _hold(self, entry: _Entry, request_id: int, update: RequestUpdate, now: float) -> bool:
        """Add ``update`` (arrived at ``now``) to the held ones; False when they must all go out now, in which
        case the caller releases them: ``interval_tokens`` are held, or holding them until the next token
        (expected as far away as this one came after the last) would take the oldest past ``max_hold``."""
        gap, entry.last_arrival = now - entry.last_arrival, now
        was_holding = entry.held is not None
        since = entry.held_since if was_holding else now
        entry.hold(update)
        if len(entry.held_tokens) < self.interval_tokens and now - since + gap < self.max_hold:
            if not was_holding:
                entry.held_since = now
                self._holding[request_id] = entry
            return True
        if was_holding:
            del self._holding[request_id]
        return False

    def flush_pending(self) -> list[int]:
        """Send held updates whose hold reached ``max_hold`` and retry coalesced ones; returns ids of requests
        whose caller is gone."""
        gone = []
        if self._holding:
            deadline = trio.current_time() - self.max_hold
            due = []
            for request_id, entry in self._holding.items():
                if entry.held_since > deadline:
                    break  # oldest first: the rest are younger
                due.append(request_id)
            for request_id in due:
                update = self._holding.pop(request_id).release()
                pending = self._pending.pop(request_id, None)
                if not self._try_send(update if pending is None else merge(pending, update)):
                    gone.append(request_id)
        for update in list(self._pending.values()):
            del self._pending[update.request_id]
            if not self._try_send(update):
                gone.append(update.request_id)
        return gone

    def has_pending(self) -> bool:
        """Whether updates wait here (held or behind a full stream): the scheduler then wakes to retry."""
        return bool(self._pending) or bool(self._holding)

    def client_left(self, request_id: int) -> bool:
        """The caller closed its handle: remove the entry now; True when it was still live."""
        if request_id not in self._entries:
            return False
        self._remove(request_id)
        return True

    def fail_all(self, message: str) -> None:
        """Give every live stream a terminal error (engine failure or shutdown) and remove it; held and pending
        tokens travel in the same terminal update (the reserved last slot always has room for it). A request
        not yet admitted (still in admission, or queued for the scheduler) is refused as ``unavailable``
        instead: its caller waits for an admission, and an update there read as a malformed stream (a 500
        ``internal`` instead of a retryable 503; nothing was computed for it)."""
        for request_id in list(self._entries):
            entry = self._entries[request_id]
            if not entry.answered:
                self.reject(request_id, Rejected("unavailable", message))
                continue
            final = RequestUpdate(request_id=request_id, finish_reason="error", error=message)
            if entry.held is not None:
                final = entry.release(final)
            pending = self._pending.pop(request_id, None)
            if pending is not None:
                final = merge(pending, final)
            with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                entry.send.send_nowait(final)
            self._remove(request_id)

    def check_integrity(self) -> None:
        """Pending and held updates belong to live entries only."""
        stray = (set(self._pending) | set(self._holding)) - set(self._entries)
        assert not stray, f"pending or held updates for removed streams: {sorted(stray)}"
        unlisted = [i for i, e in self._entries.items() if e.held is not None and i not in self._holding]
        assert not unlisted, f"held updates not listed for flushing: {unlisted}"

    def _try_send(self, update: RequestUpdate) -> bool:
        entry = self._entries.get(update.request_id)
        if entry is None:
            return False
        stream = entry.send
        if update.finish_reason is None and stream.statistics().current_buffer_used >= self.capacity - 1:
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
        entry.answered = True  # a stream fed updates with no Admitted before them (tests) keeps ending with one
        if update.tokens:
            entry.started = True
        if update.finish_reason is not None:
            self._remove(update.request_id)
        return True

    def _remove(self, request_id: int) -> None:
        entry = self._entries.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._holding.pop(request_id, None)
        if entry is not None:
            entry.send.close()
