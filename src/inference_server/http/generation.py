"""From an HTTP handler to the engine and back: submit, wait for admission, read, and always close.

``admit`` submits every request of one HTTP call (n choices, several prompts) at once, so they can share
a step, then awaits each stream's first item: ``Admitted``, or ``Rejected`` which becomes the call's
``ApiError`` (400 / 429 / 503) after every stream is closed. Only then does a streaming route send its 200
headers, so validation and overload errors are plain HTTP errors, never half-open streams.

The returned ``Generation`` owns the streams. ``close()`` is idempotent and synchronous; it closes every
stream (aborting unfinished requests within one engine step and freeing their KV) and tells the
``ResponseTracker``. Handlers call it in ``finally``; streaming bodies call it in their ``finally`` and a
weak-reference finaliser calls it too, for a body that Quart never started (client gone right after the
handler returned). ``collect`` reads non-streaming results; ``source`` gives the streaming body's
``UpdateSource``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import reduce

import attrs
import trio

from inference_server.actors.request_streams import StreamItem, merge
from inference_server.core.request import RequestUpdate
from inference_server.http.errors import from_rejection, internal_error
from inference_server.messages import Admitted, GenerationRequest, Rejected
from inference_server.supervisor import Engine

log = logging.getLogger(__name__)

Stream = trio.MemoryReceiveChannel[StreamItem]
MERGED_CAPACITY_PER_CHOICE = 4  # updates a multi-choice stream buffers per choice before its pumps wait


class ResponseTracker:
    """Counts generation responses still open, so shutdown can wait for their last events to be sent."""

    def __init__(self) -> None:
        self.active = 0
        self._idle = trio.Event()
        self._idle.set()

    def opened(self) -> None:
        self.active += 1
        if self._idle.is_set():
            self._idle = trio.Event()

    def closed(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


@attrs.define(eq=False)
class Generation:
    """The admitted engine streams of one HTTP call, in choice order."""

    streams: list[Stream]
    prompt_tokens: list[int]
    _on_close: Callable[[], None] | None = None
    _closed: bool = attrs.field(default=False, init=False)
    _extra_close: list[Callable[[], None]] = attrs.field(factory=list, init=False)

    def close(self) -> None:
        """Close every stream (idempotent; safe from a finaliser: no awaiting)."""
        if self._closed:
            return
        self._closed = True
        for stream in self.streams:
            stream.close()
        for extra in self._extra_close:
            extra()
        if self._on_close is not None:
            self._on_close()

    async def collect(self) -> list[RequestUpdate]:
        """Each choice's whole result: one update with all its tokens and the terminal fields."""
        results: list[RequestUpdate | None] = [None] * len(self.streams)

        async def read(index: int) -> None:
            results[index] = await collect_stream(self.streams[index])

        if len(self.streams) == 1:
            await read(0)
        else:
            async with trio.open_nursery() as nursery:
                for index in range(len(self.streams)):
                    nursery.start_soon(read, index)
        return [r for r in results if r is not None]

    def source(self, nursery: trio.Nursery) -> SingleSource | MergedSource:
        """The streaming body's reader; several choices are merged by pump tasks run in ``nursery``."""
        if len(self.streams) == 1:
            return SingleSource(self.streams[0], self.close)
        merged = MergedSource(self.streams, nursery, self.close)
        self._extra_close.append(merged.stop)
        return merged


async def collect_stream(stream: Stream) -> RequestUpdate:
    """Read an admitted stream to its terminal update, merging everything into it."""
    updates: list[RequestUpdate] = []
    async for item in stream:
        if not isinstance(item, RequestUpdate):
            raise internal_error(f"unexpected stream item {type(item).__name__}")
        updates.append(item)
        if item.finished:
            return reduce(merge, updates)
    raise internal_error("the engine stream ended without a final update")


def _drain_available(stream: Stream, first: RequestUpdate) -> RequestUpdate:
    """``first`` merged with every update already buffered behind it (never awaits)."""
    update = first
    while not update.finished:
        try:
            item = stream.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            break
        if isinstance(item, RequestUpdate):
            update = merge(update, item)
    return update


class SingleSource:
    """One stream read directly (the common case: no extra task, no extra hop)."""

    def __init__(self, stream: Stream, close: Callable[[], None]) -> None:
        self.stream = stream
        self.indexes = range(1)
        self.close = close

    async def receive_batch(self) -> list[tuple[int, RequestUpdate]]:
        item = await self.stream.receive()
        if not isinstance(item, RequestUpdate):
            raise internal_error(f"unexpected stream item {type(item).__name__}")
        return [(0, _drain_available(self.stream, item))]


class MergedSource:
    """Several streams forwarded by one pump task each into a single channel, read as one."""

    def __init__(self, streams: Sequence[Stream], nursery: trio.Nursery, close: Callable[[], None]) -> None:
        self.indexes = range(len(streams))
        self.close = close
        send, self._receive = trio.open_memory_channel[tuple[int, RequestUpdate]](
            MERGED_CAPACITY_PER_CHOICE * len(streams))
        self._scopes = [trio.CancelScope() for _ in streams]
        with send:
            for index, stream in enumerate(streams):
                nursery.start_soon(_pump, index, stream, send.clone(), self._scopes[index])

    async def receive_batch(self) -> list[tuple[int, RequestUpdate]]:
        batch: dict[int, RequestUpdate] = {}
        index, update = await self._receive.receive()
        batch[index] = update
        while True:
            try:
                index, update = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            batch[index] = merge(batch[index], update) if index in batch else update
        return list(batch.items())

    def stop(self) -> None:
        """Cancel the pumps and close the merged channel (part of ``Generation.close``)."""
        for scope in self._scopes:
            scope.cancel()
        self._receive.close()


async def _pump(index: int, stream: Stream, send: trio.MemorySendChannel[tuple[int, RequestUpdate]],
                scope: trio.CancelScope) -> None:
    """Forward one stream's updates; never raises (it runs in the app's nursery)."""
    try:
        with scope, send:
            async for item in stream:
                if isinstance(item, RequestUpdate):
                    await send.send((index, item))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the reader went away or closed the stream: the request is being aborted
    except Exception:
        log.exception("stream pump %d failed", index)
    finally:
        stream.close()


async def admit(engine: Engine, requests: Sequence[GenerationRequest], tracker: ResponseTracker) -> Generation:
    """Submit ``requests`` and wait until each is admitted; raises the first rejection as ``ApiError``."""
    streams = [engine.submit(request)[1] for request in requests]
    tracker.opened()
    generation = Generation(streams, [], tracker.closed)
    try:
        for stream in streams:
            generation.prompt_tokens.append(await _admission(stream))
    except BaseException:
        generation.close()
        raise
    return generation


async def _admission(stream: Stream) -> int:
    """The prompt length from a stream's first item, or the rejection raised."""
    try:
        item = await stream.receive()
    except trio.EndOfChannel:
        raise internal_error("the engine closed the stream before admitting the request") from None
    if isinstance(item, Rejected):
        raise from_rejection(item)
    if not isinstance(item, Admitted):
        raise internal_error(f"unexpected first stream item {type(item).__name__}")
    return item.prompt_tokens
