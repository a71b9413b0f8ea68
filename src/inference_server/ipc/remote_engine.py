"""``RemoteEngine``: the front process's engine, whose requests run in the engine process across a channel.

``submit`` keeps ``Engine.submit``'s contract (synchronous, never blocks; returns a ``RequestHandle`` whose
stream is an admission then updates ending in exactly one terminal one, or one ``Rejected``): it opens the
request's ``RequestStreams`` entry and queues a ``Submit`` that a **forwarder** task sends with the aborts queued
since, as one ``ToEngine`` per wake-up. A handle closed before its terminal update queues an ``Abort`` (the
list is unbounded: at most one per request, and closing never blocks). ``run`` reads the engine's messages
and routes each ``StepOutput``'s admissions and updates into the streams; it never awaits a send to the
engine, so the two directions cannot deadlock (docs/ipc.md, decision 3).

When the engine process stops (``Stopped``, then its clean close) every request has had its terminal update;
when it dies (``BrokenResourceError``), every open handle ends at once -- a request not yet admitted with
``Rejected("unavailable")``, an admitted one with a terminal error update -- the state turns ``FAILED``, new
requests are refused as unavailable, and ``run`` raises.
"""

from __future__ import annotations

import itertools
import time

import trio

from inference_server.actors.request_handle import RequestHandle
from inference_server.actors.request_streams import RequestStreams
from inference_server.actors.scheduler import RETRY_SECONDS
from inference_server.ipc.channel import SocketChannel
from inference_server.ipc.frames import ProtocolError
from inference_server.ipc.messages import Abort, Drain, Hello, StepOutput, Stopped, Submit, ToEngine
from inference_server.records.requests import GenerationRequest, Rejected
from inference_server.supervisor import EngineState


class RemoteEngine:
    """See the module docstring. ``max_queue_size`` bounds the submits not yet sent (beyond it ``submit``
    refuses with ``overloaded`` at once, as the in-process engine's admission queue does)."""

    def __init__(self, channel: SocketChannel, *, max_queue_size: int) -> None:
        self.channel = channel
        self.max_queue_size = max_queue_size
        self.streams = RequestStreams()
        self.state = EngineState.STARTING
        self.hello: Hello | None = None
        """The engine's ``Hello`` (what it serves), once ``run`` has started."""
        self.stopped: Stopped | None = None
        self._ids = itertools.count(1)
        self._submits: list[Submit] = []
        self._aborts: list[Abort] = []
        self._drain: Drain | None = None
        self._unadmitted: set[int] = set()  # submitted, no admission yet: refused (not failed) if the engine dies
        self._wake = trio.Event()
        self._pending_wake = trio.Event()  # set when updates wait behind a slow reader's full stream

    # -- client API ----------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request for the engine process and return its handle (see ``Engine.submit``)."""
        request_id = next(self._ids)
        handle = RequestHandle(request_id, self.streams.open(request_id), self._client_left)
        if self.state is not EngineState.READY:
            self.streams.reject(request_id, Rejected("unavailable", f"the engine is {self.state.value}"))
        elif len(self._submits) >= self.max_queue_size:
            self.streams.reject(request_id, Rejected("overloaded", "the admission queue is full; retry later",
                                                     retry_after=1.0))
        else:
            self._submits.append(Submit(request_id, request, time.monotonic()))
            self._unadmitted.add(request_id)
            self._wake.set()
        return handle

    def _client_left(self, request_id: int) -> None:
        """A handle closed before its terminal update: drop its stream and tell the engine."""
        if self.streams.client_left(request_id):
            self._unadmitted.discard(request_id)
            self._aborts.append(Abort(request_id))
            self._wake.set()

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def failed(self) -> bool:
        """Whether the engine process failed or died (every open request was then ended)."""
        return self.state is EngineState.FAILED

    def drain(self, timeout: float) -> None:
        """Ask the engine to stop admitting and end in-flight requests within ``timeout`` seconds; ``run``
        returns once it has stopped."""
        if self.state is EngineState.READY:
            self.state = EngineState.DRAINING
        self._drain = Drain(timeout)
        self._wake.set()

    # -- lifecycle -----------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[RemoteEngine] = trio.TASK_STATUS_IGNORED) -> None:
        """Wait for the engine's ``Hello`` (then report started), forward submits and aborts, and route its
        messages until it stops; raises ``trio.BrokenResourceError`` when the engine process died."""
        try:
            hello = await self.channel.receive()
            if not isinstance(hello, Hello):
                raise ProtocolError(f"the engine's first message is a {type(hello).__name__}, not Hello")
            self.hello = hello
            if self.state is EngineState.STARTING:
                self.state = EngineState.READY
            task_status.started(self)
            death: trio.BrokenResourceError | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._forward)
                nursery.start_soon(self._flush_pending)
                try:
                    await self._route()
                except trio.BrokenResourceError as error:
                    death = error  # raised below, not inside this nursery's exception group
                nursery.cancel_scope.cancel()
            if death is not None:
                raise death
        except BaseException as error:
            self.state = EngineState.FAILED
            self._end_all(f"the engine process is gone: {error!r}")
            raise
        failed = self.stopped is None or self.stopped.failed
        self.state = EngineState.FAILED if failed else EngineState.STOPPED
        self._end_all(self.stopped.message if self.stopped is not None else "the engine closed without stopping")

    async def _route(self) -> None:
        """Deliver each message's admissions, then its updates; return at ``Stopped`` or a clean close."""
        async for message in self.channel:
            if isinstance(message, StepOutput):
                for admission in message.admissions:
                    self._unadmitted.discard(admission.request_id)
                    if admission.rejected is not None:
                        self.streams.reject(admission.request_id, admission.rejected)
                    else:
                        self.streams.admitted(admission.request_id, admission.prompt_token_ids)
                for update in message.updates:
                    self.streams.deliver(update)  # False: the client left, and its abort is already queued
                if self.streams.has_pending():
                    self._pending_wake.set()
                if message.state == "draining" and self.state is EngineState.READY:
                    self.state = EngineState.DRAINING
            elif isinstance(message, Stopped):
                self.stopped = message
                return

    async def _forward(self) -> None:
        """Send what queued since the last wake-up as one ``ToEngine`` (and a ``Drain`` when asked)."""
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                if self._submits or self._aborts:
                    batch = ToEngine(self._submits, self._aborts)
                    self._submits, self._aborts = [], []
                    await self.channel.send(batch)
                if self._drain is not None:
                    drain, self._drain = self._drain, None
                    await self.channel.send(drain)
        except trio.BrokenResourceError:
            return  # the engine is gone: the router sees it too and ends every request

    async def _flush_pending(self) -> None:
        """Retry updates coalesced behind a slow reader's full stream (the scheduler does it in one process)."""
        while True:
            await self._pending_wake.wait()
            self._pending_wake = trio.Event()
            while self.streams.has_pending():
                await trio.sleep(RETRY_SECONDS)
                self.streams.flush_pending()  # a caller found gone here has already queued its abort

    def _end_all(self, message: str) -> None:
        """Exactly one end for every open request: refused if it was never admitted, else an error update."""
        for request_id in sorted(self._unadmitted):
            self.streams.reject(request_id, Rejected("unavailable", message))
        self._unadmitted.clear()
        self._submits.clear()
        self.streams.fail_all(message)
