"""``RequestHandle``: a caller's one object for one submitted request.

``Engine.submit`` returns a handle; the caller

1. awaits ``admission()`` — the prompt's token count once the request is queued, or the typed
   ``RequestError`` that refused it (invalid input, overload with a retry hint, engine unavailable);
2. iterates the handle (``async for update in handle``) for ``RequestUpdate`` s, the last one terminal
   (``finish_reason`` set), or awaits ``result()`` for everything merged into one update;
3. closes it (``abort()``, or leaving ``async with handle``) — always, even after the terminal update.

Closing a handle whose request has not ended removes the request's stream entry and sends ``Abort`` to the
scheduler at once (no polling), so the request is computed in no step that starts afterwards and its KV is
freed. Closing is synchronous and idempotent, so it is safe from ``finally`` blocks and finalisers.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from inference_server.actors.request_streams import merge_all
from inference_server.records.errors import RequestError
from inference_server.records.requests import Admitted, Rejected, RequestUpdate, StreamItem


def rejection_error(rejection: Rejected) -> RequestError:
    return RequestError(rejection.code, rejection.message, rejection.param, retry_after=rejection.retry_after)


class RequestHandle:
    """See the module docstring. Not shareable between tasks reading it concurrently."""

    def __init__(self, request_id: int, stream: trio.MemoryReceiveChannel[StreamItem],
                 on_close: Callable[[int], None]) -> None:
        self.request_id = request_id
        self._stream = stream
        self._on_close = on_close
        self._prompt_tokens: int | None = None
        self.prompt_token_ids: tuple[int, ...] = ()
        """The prompt's token ids, once ``admission()`` has returned."""
        self._finished = False
        self._closed = False
        self.observer: Callable[[RequestUpdate], None] | None = None
        """Called with each update as it is read (the HTTP access log counts tokens and the first token's
        time with it); must not raise or block."""

    @property
    def finished(self) -> bool:
        """Whether the terminal update (or a rejection) has been read."""
        return self._finished

    async def admission(self) -> int:
        """The prompt's token count once queued; raises ``RequestError`` if the request was refused."""
        if self._prompt_tokens is not None:
            return self._prompt_tokens
        try:
            item = await self._stream.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self._finished = True
            raise RequestError("internal", "the engine ended the request before admitting it") from None
        if isinstance(item, Rejected):
            self._finished = True
            raise rejection_error(item)
        if not isinstance(item, Admitted):
            raise RequestError("internal", f"unexpected first stream item {type(item).__name__}")
        self._prompt_tokens = item.prompt_tokens
        self.prompt_token_ids = item.prompt_token_ids
        return item.prompt_tokens

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> RequestUpdate:
        """The next update (several coalesced ones merged into one when they are already buffered)."""
        if self._finished:
            raise StopAsyncIteration
        if self._prompt_tokens is None:
            await self.admission()
        try:
            item = await self._stream.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self._finished = True
            raise RequestError("internal", "the engine stream ended without a terminal update") from None
        update = self._checked(item)
        if not update.finished:
            buffered = [update]  # merged once at the end: one tuple and one record however many there are
            while not update.finished:
                try:
                    item = self._stream.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                update = self._checked(item)
                buffered.append(update)
            update = merge_all(buffered)
        self._finished = update.finished
        if self.observer is not None:
            self.observer(update)
        return update

    def _checked(self, item: StreamItem) -> RequestUpdate:
        if not isinstance(item, RequestUpdate):
            raise RequestError("internal", f"unexpected stream item {type(item).__name__}")
        return item

    async def result(self) -> RequestUpdate:
        """Every update to the terminal one, merged (tokens concatenated, terminal fields of the last)."""
        updates = [update async for update in self]
        if not updates:
            raise RequestError("internal", "the request has no updates left to read")
        return merge_all(updates)

    def abort(self) -> None:
        """Stop reading: an unfinished request is aborted at once. Idempotent, never blocks."""
        if self._closed:
            return
        self._closed = True
        self._stream.close()
        if not self._finished:
            self._on_close(self.request_id)

    close = abort

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()
