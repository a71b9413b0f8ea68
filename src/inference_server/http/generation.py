"""From an HTTP handler to the engine and back: submit, wait for admission, read, and always close.

``admit`` submits every request of one HTTP call (n choices, several prompts) at once, so they can share
a step, then awaits each handle's admission: a refusal (``RequestError``) becomes the call's ``ApiError``
(400 / 429 / 503) after every handle is closed. Only then does a streaming route send its 200
headers, so validation and overload errors are plain HTTP errors, never half-open streams.

The returned ``Generation`` owns the request handles. ``close()`` is idempotent and synchronous; it closes
every handle (an unfinished request is aborted at once: the scheduler computes it in no later step and frees
its KV) and tells the
``ResponseTracker``. Handlers call it in ``finally``; streaming bodies call it in their ``finally`` and a
weak-reference finaliser calls it too, for a body that Quart never started (client gone right after the
handler returned). ``collect`` reads non-streaming results; ``source`` gives the streaming body's
``UpdateSource``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import attrs
import trio
from quart import has_request_context, request

from inference_server.actors.request_handle import RequestHandle
from inference_server.actors.request_streams import merge
from inference_server.engine_surface import ServingEngine
from inference_server.http.access_log import record_for
from inference_server.http.errors import from_request_error, from_unsuccessful_finish
from inference_server.http.sse import SUCCESSFUL_FINISHES
from inference_server.records.errors import RequestError
from inference_server.records.requests import GenerationRequest, RequestUpdate

log = logging.getLogger(__name__)

MERGED_CAPACITY_PER_CHOICE = 4  # updates a multi-choice stream buffers per choice before its pumps wait


class ResponseTracker:
    """Counts generation responses still open, with their clients' addresses, so shutdown can wait for their
    last events to be sent and then close the connections of the clients that did not read them."""

    def __init__(self) -> None:
        self.active = 0
        self._peers: collections.Counter[tuple[str, int]] = collections.Counter()
        self._idle = trio.Event()
        self._idle.set()

    def opened(self, peer: tuple[str, int] | None = None) -> Callable[[], None]:
        """Count one response open, to the client at ``peer`` (the ASGI scope's ``client``; None: unknown);
        returns the callable that counts it closed (call it exactly once)."""
        self.active += 1
        if peer is not None:
            self._peers[peer] += 1
        if self._idle.is_set():
            self._idle = trio.Event()
        return partial(self._closed, peer)

    def _closed(self, peer: tuple[str, int] | None) -> None:
        self.active -= 1
        if peer is not None:
            self._peers[peer] -= 1
            if not self._peers[peer]:
                del self._peers[peer]
        if self.active == 0:
            self._idle.set()

    def open_peers(self) -> set[tuple[str, int]]:
        """The clients with a response still open (those whose address is known)."""
        return set(self._peers)

    async def wait_idle(self) -> None:
        await self._idle.wait()


@attrs.define(eq=False)
class Generation:
    """The admitted requests of one HTTP call, in choice order."""

    handles: list[RequestHandle]
    prompt_tokens: list[int]
    prompt_token_ids: list[tuple[int, ...]] = attrs.field(factory=list, kw_only=True)
    _on_close: Callable[[], None] | None = None
    _closed: bool = attrs.field(default=False, init=False)
    _extra_close: list[Callable[[], None]] = attrs.field(factory=list, init=False)

    def close(self) -> None:
        """Close every handle (idempotent; safe from a finaliser: no awaiting)."""
        if self._closed:
            return
        self._closed = True
        for handle in self.handles:
            handle.close()
        for extra in self._extra_close:
            extra()
        if self._on_close is not None:
            self._on_close()

    async def collect(self) -> list[RequestUpdate]:
        """Each choice's whole result: one update with all its tokens and the terminal fields."""
        results: list[RequestUpdate | None] = [None] * len(self.handles)

        async def read(index: int) -> None:
            results[index] = await _result(self.handles[index])

        if len(self.handles) == 1:
            await read(0)
        else:
            async with trio.open_nursery() as nursery:
                for index in range(len(self.handles)):
                    nursery.start_soon(read, index)
        return [r for r in results if r is not None]

    async def successful_results(self, engine: ServingEngine) -> list[RequestUpdate]:
        """``collect``, then ``close``; raises the error of the first choice that did not end with ``stop`` or
        ``length`` (what every non-streaming route answers)."""
        try:
            results = await self.collect()
        finally:
            self.close()
        for result in results:
            if result.finish_reason not in SUCCESSFUL_FINISHES:
                raise from_unsuccessful_finish(result, engine_failed=engine.failed)
        return results

    def source(self, nursery: trio.Nursery) -> SingleSource | MergedSource:
        """The streaming body's reader; several choices are merged by pump tasks run in ``nursery``."""
        if len(self.handles) == 1:
            return SingleSource(self.handles[0], self.close)
        merged = MergedSource(self.handles, nursery, self.close)
        self._extra_close.append(merged.stop)
        return merged


async def _result(handle: RequestHandle) -> RequestUpdate:
    """An admitted request's whole result (its engine errors surface as 500s: a bug, not the client's)."""
    try:
        return await handle.result()
    except RequestError as error:
        raise from_request_error(error) from None


class SingleSource:
    """One request read directly (the common case: no extra task, no extra hop)."""

    def __init__(self, handle: RequestHandle, close: Callable[[], None]) -> None:
        self.handle = handle
        self.indexes = range(1)
        self.close = close

    async def receive_batch(self) -> list[tuple[int, RequestUpdate]]:
        try:
            return [(0, await self.handle.__anext__())]
        except StopAsyncIteration:
            raise trio.EndOfChannel from None
        except RequestError as error:
            raise from_request_error(error) from None


class MergedSource:
    """Several requests forwarded by one pump task each into a single channel, read as one."""

    def __init__(self, handles: Sequence[RequestHandle], nursery: trio.Nursery, close: Callable[[], None]) -> None:
        self.indexes = range(len(handles))
        self.close = close
        send, self._receive = trio.open_memory_channel[tuple[int, RequestUpdate]](
            MERGED_CAPACITY_PER_CHOICE * len(handles))
        self._scopes = [trio.CancelScope() for _ in handles]
        with send:
            for index, handle in enumerate(handles):
                nursery.start_soon(_pump, index, handle, send.clone(), self._scopes[index])

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


async def _pump(index: int, handle: RequestHandle, send: trio.MemorySendChannel[tuple[int, RequestUpdate]],
                scope: trio.CancelScope) -> None:
    """Forward one request's updates; never raises (it runs in the app's nursery)."""
    try:
        with scope, send:
            async for update in handle:
                await send.send((index, update))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the reader went away or closed the stream: the request is being aborted
    except Exception:
        log.exception("stream pump %d failed", index)
    finally:
        handle.close()


def _client(scope: Mapping[str, Any]) -> tuple[str, int] | None:
    """The client's (host, port) from an ASGI scope (None where the server does not say, or not over TCP)."""
    client = scope.get("client")
    return (str(client[0]), int(client[1])) if client else None


async def admit(engine: ServingEngine, requests: Sequence[GenerationRequest], tracker: ResponseTracker, *,
                renames: Mapping[str, str] | None = None) -> Generation:
    """Submit ``requests`` and wait until each is admitted; raises the first refusal as ``ApiError``
    (engine field names mapped to the route's through ``renames``)."""
    try:
        await engine.compile_constraints(requests)
    except RequestError as error:
        raise from_request_error(error, renames) from None
    handles = [engine.submit(request) for request in requests]
    access = record_for(request.scope) if has_request_context() else None
    if access is not None:
        access.trace_id = next((r.trace_id for r in requests if r.trace_id), access.trace_id)
        for handle in handles:
            handle.observer = access.observe
    generation = Generation(handles, [], tracker.opened(_client(request.scope) if has_request_context() else None))
    try:
        for handle in handles:
            generation.prompt_tokens.append(await handle.admission())
            generation.prompt_token_ids.append(handle.prompt_token_ids)
            if access is not None:
                access.admitted(generation.prompt_tokens[-1])
    except RequestError as error:
        generation.close()
        raise from_request_error(error, renames) from None
    except BaseException:
        generation.close()
        raise
    return generation
