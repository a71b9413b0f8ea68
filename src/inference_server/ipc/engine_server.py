"""The engine process's side of the split: serve an engine to one front over a :class:`SocketChannel`.

:func:`serve_engine` runs the engine, sends ``Hello`` once it is ready, then

* a **receiver** applies each ``ToEngine`` (submits, then aborts: ``engine.submit`` never blocks), ``Call``
  (counts and the prefix cache's snapshot answered at once; compiling constraints in a task of its own) and
  ``Drain`` (``engine.drain`` in a task of its own): it never awaits a send, so no cycle with the front can
  deadlock (docs/ipc.md, decision 3);
* a telemetry **sink** on the engine's telemetry actor appends every event to the outbox (past
  ``EVENT_BACKLOG`` unsent events they are dropped and counted, as the telemetry inbox does): the front's
  ``Observability`` consumes them, so the engine process runs no stats, metrics or file sinks; a step's plan
  goes as its ``PlanDigest`` (what the sinks read, pickled as columns);
* the engine's request streams are ``OutboxStreams``: admission and the scheduler append each request's
  admission and updates (after the stream interval) to the outbox synchronously, as they would deliver them
  to a caller's stream, with no task per request (the outbox is unbounded, at most a request's tokens deep);
* a **sender** sends everything in the outbox as one ``StepOutput`` whenever it has something and the channel
  has credit: a lagging front gets fewer, larger messages, never one per token;
* the scheduler awaits :meth:`_EngineServer.before_plan` before each plan: while more than ``UNSENT_STEPS``
  steps were planned since the last message went out and requests' output waits in the outbox (the front reads
  slower than the engine steps, and the channel's credit is spent), it waits for the next send, so the GPU runs
  at the front's pace instead of piling tokens into the outbox (docs/ipc.md, decision 3). Telemetry events alone
  never make it wait.

When the engine stops (after a drain, or failing), every request has had its terminal update, the outbox is
sent, then ``Stopped``; the caller closes the channel. When the front is gone (``EndOfChannel`` or
``BrokenResourceError`` on receive), the engine is drained at once (``drain(0)``) and what it sends is dropped.

The engine is today's in-process ``Engine`` (anything with its ``submit``/``run``/``drain``/``info``/``streams``
surface), admission included, with ``text_in_front`` set: no detokenizer and no stop strings (the front runs
them, docs/ipc.md decision 1), so updates carry token ids with empty text. A request's ``RequestHandle`` is kept
only to abort it; an ``Abort(reason="stop")`` (a stop string matched in the front) ends it as a ``stop``
(``Engine.end_on_stop``), and its terminal update still goes to the front, which drops it.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import attrs
import trio

from inference_server.actors.request_handle import RequestHandle
from inference_server.actors.request_streams import RequestStreams
from inference_server.actors.telemetry import Telemetry
from inference_server.ipc.channel import SocketChannel
from inference_server.ipc.messages import (
    Admission,
    CacheSnapshot,
    Call,
    Drain,
    Hello,
    Reply,
    StepOutput,
    Stopped,
    ToEngine,
    Tokens,
)
from inference_server.ipc.outbox_streams import OutboxStreams
from inference_server.records.errors import RequestError
from inference_server.records.requests import GenerationRequest, Rejected
from inference_server.records.steps import PlanDigest
from inference_server.supervisor import EngineCounts, EngineInfo, KVCacheSnapshot
from inference_server.telemetry.events import StepCompleted, TelemetryEvent

UNSENT_STEPS = 4
"""Steps the scheduler may plan past the last message sent while requests' output waits unsent."""
EVENT_BACKLOG = 4096
"""Most telemetry events waiting for the front; beyond it they are dropped and counted (never awaited)."""


class ServedEngine(Protocol):
    """What :func:`serve_engine` needs of an engine (``supervisor.Engine`` has it)."""

    telemetry: Telemetry
    streams: RequestStreams
    text_in_front: bool
    before_plan: Callable[[], Awaitable[None]] | None

    def cached_prompt_tokens(self, request_id: int) -> int: ...

    def end_on_stop(self, request_id: int) -> None: ...

    def submit(self, request: GenerationRequest) -> RequestHandle: ...

    def counts(self) -> EngineCounts: ...

    def kv_cache_snapshot(self) -> KVCacheSnapshot: ...

    async def compile_constraints(self, requests: Sequence[GenerationRequest]) -> None: ...

    @property
    def info(self) -> EngineInfo: ...

    @property
    def failed(self) -> bool: ...

    async def run(self, *, task_status: trio.TaskStatus[object] = ...) -> None: ...

    async def drain(self, timeout: float) -> None: ...


def hello(info: EngineInfo) -> Hello:
    """The engine's first message: ``info`` without the tokenizer (the front loads its own)."""
    return Hello(info.model_name, info.max_model_len, info.vocab_size, sorted(info.eos_token_ids),
                 info.default_max_tokens, info.model_root, info.tokenizer_folder, os.getpid(),
                 trio.current_time() - time.monotonic())


class _EngineServer:
    def __init__(self, engine: ServedEngine, channel: SocketChannel) -> None:
        self.engine = engine
        self.channel = channel
        self.handles: dict[int, RequestHandle] = {}  # front request id -> handle (to abort), until its end
        # Before the engine runs: its actors write each request's items into the outbox (no task per request).
        self.streams = OutboxStreams(self._append_item, self._ended, interval_tokens=engine.streams.interval_tokens,
                                     max_hold=engine.streams.max_hold, cached_tokens=engine.cached_prompt_tokens)
        engine.streams = self.streams
        engine.text_in_front = True  # the front detokenises and matches stop strings (docs/ipc.md, decision 1)
        engine.before_plan = self.before_plan
        self.planned_since_send = 0  # plans since the last message went out (or the front went)
        self.sent = trio.Event()  # set (and replaced) whenever a message went out
        self.admissions: list[Admission] = []
        self.updates: list[Tokens] = []
        self.replies: list[Reply] = []
        self.events: list[TelemetryEvent] = []
        self.events_dropped = 0  # by the backlog bound here
        self.events_reported_dropped = 0  # both sides' drops already reported to the front
        engine.telemetry.sinks.append(self._on_event)
        self.outbox_ready = trio.Event()
        self.failure: BaseException | None = None
        self.failure_reported = False
        self.finishing = False
        self.front_gone = False

    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            engine_done = trio.Event()

            async def run_engine(task_status: trio.TaskStatus[object] = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await self.engine.run(task_status=task_status)
                except Exception as error:  # the engine already ended every request with an error update
                    self.failure = error
                finally:
                    engine_done.set()

            await nursery.start(run_engine)
            if self.failure is None:
                await self._send_quietly(hello(self.engine.info))
            receiver = trio.CancelScope()
            nursery.start_soon(self._sender)
            nursery.start_soon(self._receiver, receiver, nursery)
            await engine_done.wait()  # every request has had its terminal item (the engine ends them all)
            receiver.cancel()
            self.finishing = True  # the sender sends what is left, then Stopped, and returns
            self.outbox_ready.set()

    async def _send_quietly(self, message: object) -> None:
        """Send unless the front is gone (its requests are being drained; nobody reads the rest)."""
        if self.front_gone:
            return
        try:
            await self.channel.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.front_gone = True

    async def _receiver(self, scope: trio.CancelScope, nursery: trio.Nursery) -> None:
        with scope:
            async with trio.open_nursery() as calls:  # compiles end with the receiver: nobody awaits them then
                await self._receive(nursery, calls)

    async def _receive(self, nursery: trio.Nursery, calls: trio.Nursery) -> None:
        try:
            async for message in self.channel:
                if isinstance(message, ToEngine):
                    # submits first: an abort may name a request submitted in the same message
                    for submit in message.submits:
                        self.streams.submitting = submit.request_id
                        handle = self.engine.submit(submit.request)
                        if self.streams.is_live(handle.request_id):  # else refused at once, its Admission queued
                            self.handles[submit.request_id] = handle
                    for abort in message.aborts:
                        aborted = self.handles.get(abort.request_id)
                        if aborted is not None:
                            if abort.reason == "stop":  # a stop string in the front: ends as a stop
                                self.engine.end_on_stop(aborted.request_id)
                            else:
                                aborted.abort()
                elif isinstance(message, Call):
                    self._answer(message, calls)
                elif isinstance(message, Drain):
                    nursery.start_soon(self.engine.drain, message.timeout)
        except trio.BrokenResourceError:
            pass
        self.front_gone = True
        # the front closed its end or died: nobody is left to read the requests
        await self.engine.drain(0)

    def _answer(self, call: Call, nursery: trio.Nursery) -> None:
        """Answer ``call`` (counts and the snapshot at once, without a checkpoint; a compile in a task)."""
        if call.kind == "counts":
            self._append_reply(Reply(call.call_id, counts=attrs.asdict(self.engine.counts())))
        elif call.kind == "kv_cache_snapshot":
            snapshot = self.engine.kv_cache_snapshot()
            self._append_reply(Reply(call.call_id, snapshot=CacheSnapshot(snapshot.seq, snapshot.block_size,
                                                                          list(snapshot.hashes))))
        else:
            nursery.start_soon(self._compile, call)

    async def _compile(self, call: Call) -> None:
        try:
            await self.engine.compile_constraints(call.requests)
        except RequestError as error:
            self._append_reply(Reply(call.call_id, error=Rejected(error.code, error.message, error.param)))
        else:
            self._append_reply(Reply(call.call_id))

    def _on_event(self, event: TelemetryEvent) -> None:
        """The engine's telemetry sink (runs in its telemetry actor): queue the event for the front."""
        if len(self.events) >= EVENT_BACKLOG:
            self.events_dropped += 1
            return
        if isinstance(event, StepCompleted) and event.plan is not None:
            event = attrs.evolve(event, plan=PlanDigest.of(event.plan))
        self.events.append(event)
        self.outbox_ready.set()

    def _append_item(self, item: Admission | Tokens) -> None:
        """The outbox streams' sink: a request's admission or update, already named with the front's id."""
        if isinstance(item, Admission):
            self.admissions.append(item)
        else:
            self.updates.append(item)
        self.outbox_ready.set()

    def _ended(self, request_id: int) -> None:
        """A request's entry was removed (its end was queued, or the front's abort reached it)."""
        self.handles.pop(request_id, None)

    def _append_reply(self, reply: Reply) -> None:
        self.replies.append(reply)
        self.outbox_ready.set()

    def _take_outbox(self, state: str | None = None) -> tuple[StepOutput, list[Reply]]:
        if state is None and self.engine.failed and not self.failure_reported:
            state = "failed"  # with the first terminal updates of the failure: the front reads them as such
        self.failure_reported = self.failure_reported or state == "failed"
        dropped = self.events_dropped + self.engine.telemetry.dropped_events
        events = pickle.dumps(self.events, protocol=pickle.HIGHEST_PROTOCOL) if self.events else b""
        output = StepOutput(self.admissions, self.updates, state, events, dropped - self.events_reported_dropped)
        self.events_reported_dropped = dropped
        replies = self.replies
        self.admissions, self.updates, self.events, self.replies = [], [], [], []
        self.outbox_ready = trio.Event()
        return output, replies

    async def _send_outbox(self, state: str | None = None) -> None:
        """The outbox's step output (unless empty), then its replies: a reply follows the updates and events
        that were ready before it."""
        output, replies = self._take_outbox(state)
        if output.admissions or output.updates or output.events or output.events_dropped or state is not None:
            await self._send_quietly(output)
            self.planned_since_send = 0
            self.sent.set()  # a scheduler waiting in before_plan goes on
            self.sent = trio.Event()
        for reply in replies:
            await self._send_quietly(reply)

    async def before_plan(self) -> None:
        """The scheduler's hook before each plan (the module docstring): returns at once unless more than
        ``UNSENT_STEPS`` plans went by since the last send and requests' output waits in the outbox."""
        self.planned_since_send += 1
        while (self.planned_since_send > UNSENT_STEPS and (self.updates or self.admissions)
               and not self.front_gone):
            await self.sent.wait()

    async def _sender(self) -> None:
        """Send the outbox as one message whenever it holds something (never cancelled: a message taken from
        the outbox is always sent); when finishing, the rest with the final state, then ``Stopped``."""
        while True:
            await self.outbox_ready.wait()
            await trio.lowlevel.checkpoint()  # let whatever the same wake-up readies append too
            if self.finishing:
                await self._send_outbox("failed" if self.failure is not None else "stopped")
                message = f"engine failure: {self.failure!r}" if self.failure is not None else "the engine stopped"
                await self._send_quietly(Stopped(self.failure is not None, message))
                return
            await self._send_outbox()


async def serve_engine(engine: ServedEngine, channel: SocketChannel) -> bool:
    """Serve ``engine`` to the front at the other end of ``channel`` until the engine stops (see the module
    docstring); returns whether it failed. The caller owns the channel (and closes it after this returns)."""
    server = _EngineServer(engine, channel)
    await server.serve()
    return server.failure is not None
