"""``RemoteEngine``: the front process's engine, whose requests run in the engine process across a channel.

``submit`` keeps ``Engine.submit``'s contract (synchronous, never blocks; returns a ``RequestHandle`` whose
stream is an admission then updates ending in exactly one terminal one, or one ``Rejected``): it opens the
request's ``RequestStreams`` entry and queues a ``Submit`` that a **forwarder** task sends with the aborts queued
since, as one ``ToEngine`` per wake-up. A handle closed before its terminal update queues an ``Abort`` (the
list is unbounded: at most one per request, and closing never blocks). ``run`` reads the engine's messages
and routes each ``StepOutput``'s admissions and updates into the streams; it never awaits a send to the
engine, so the two directions cannot deadlock (docs/ipc.md, decision 3).

Prompts are tokenised here (admission's tokenisation and chat templates, docs/ipc.md): a text or chat request is
validated as admission validates its sampling values, then turned into token ids with the front's tokenizer
before it is queued, and one the tokenizer or template refuses is rejected here (as admission would, with its
``RequestRejected`` event) without reaching the engine; the engine process gets ``prompt_ids`` and
``tokenized_from`` (the field errors name) and runs the rest of admission.

Text is made here (docs/ipc.md, decision 1): the engine's updates carry token ids with empty text; each admitted
request gets an ``ipc/front_text.RequestText`` (detokenizer and stop checker with the strings) that rewrites
its updates as the in-process scheduler builds them. A stop string ends the client's stream at once and queues
``Abort(reason="stop")``; the engine's later updates for that request, its terminal one included, are dropped.

The rest of the ``ServingEngine`` surface (``engine_surface.py``): ``info`` is the engine's ``Hello`` with the
front's own tokenizer (loaded from the same settings, for chat templates and the tokenizer routes);
``read_counts``, ``read_kv_cache_snapshot`` and ``compile_constraints`` are ``Call``s answered by a ``Reply``;
``telemetry`` is a telemetry actor in this process fed with the engine's events (``StepOutput.events``, their
times mapped onto this process's trio clock), so the observability sinks, ``/telemetry/tail`` and ``/kv/events``
live here; ``seconds_since_progress`` is measured here (the oldest open request's submit time against the last
message that carried updates or events), so a wedged channel or engine process reads as a stall too.

When the engine process stops (``Stopped``, then its clean close) every request has had its terminal update;
when it dies (``BrokenResourceError``), every open handle ends at once -- a request not yet admitted with
``Rejected("unavailable")``, an admitted one with a terminal error update -- the state turns ``FAILED``, new
requests are refused as unavailable, and ``run`` raises. An engine process that does not answer a drain
(stopped, or hung in a step: its socket stays open, so no death is seen) is treated the same way once the
drain's timeout plus ``STOP_GRACE_SECONDS`` has passed: ``run`` raises ``EngineStopTimeout``, so the server's
stop goes on (open streams get their terminal error, the exit status is 1) instead of waiting for its hard-exit
watchdog.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
from collections.abc import Sequence

import attrs
import trio

from inference_server.actors.request_handle import RequestHandle
from inference_server.actors.request_streams import RequestStreams
from inference_server.actors.scheduler import RETRY_SECONDS
from inference_server.actors.telemetry import Telemetry
from inference_server.core.validation import PromptTokenizer, tokenize
from inference_server.ipc.channel import SocketChannel
from inference_server.ipc.frames import ProtocolError
from inference_server.ipc.front_text import RequestText
from inference_server.ipc.messages import (
    Abort,
    Call,
    CallKind,
    Drain,
    Hello,
    Reply,
    StepOutput,
    Stopped,
    Submit,
    ToEngine,
)
from inference_server.records.errors import RequestError
from inference_server.records.requests import GenerationRequest, Rejected
from inference_server.records.sampling_params import SamplingParams
from inference_server.supervisor import EngineCounts, EngineInfo, EngineState, KVCacheSnapshot
from inference_server.telemetry.events import RequestRejected, TelemetryEvent

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 3.0
"""How long past a drain's timeout the engine process may take to say ``Stopped`` (its last step, on a slow
device, may still be running when its drain ends the requests) before it is taken for hung. The server's
hard-exit watchdog fires ``HARD_EXIT_GRACE_SECONDS`` (10 s) past the drain's timeout: this leaves the open
responses time to write their terminal errors (``HTTP_FLUSH_SECONDS``) and HTTP time to stop before it."""


class EngineStopTimeout(trio.BrokenResourceError):
    """The engine process did not stop within a drain's timeout plus ``STOP_GRACE_SECONDS``: it is hung."""


class RemoteEngine:
    """See the module docstring. ``max_queue_size`` bounds the submits not yet sent (beyond it ``submit``
    refuses with ``overloaded`` at once, as the in-process engine's admission queue does); ``tokenizer`` is what
    ``info`` serves to the HTTP layer and what tokenises text and chat requests before they are sent (None: the
    engine process's admission answers them, as it would in process)."""

    def __init__(self, channel: SocketChannel, *, max_queue_size: int, tokenizer: PromptTokenizer | None = None
                 ) -> None:
        self.channel = channel
        self.max_queue_size = max_queue_size
        self.tokenizer = tokenizer
        self.streams = RequestStreams()
        self.telemetry = Telemetry()
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
        self._calls: list[Call] = []  # queued for the forwarder
        self._replies: dict[int, trio.MemorySendChannel[Reply | None]] = {}  # call id -> its waiter (None: gone)
        self._call_ids = itertools.count(1)
        self._open_since: dict[int, float] = {}  # open request id -> trio time of its submit
        self._last_progress: float | None = None  # trio time of the last message with updates
        self._clock_shift = 0.0  # add to an engine telemetry time to get this process's trio time
        self._stopped = trio.Event()
        self._run_scope = trio.CancelScope()  # cancelled by a drain that finds the engine process hung
        self._hung: str | None = None  # why, then
        # Text in the front (docs/ipc.md, decision 1): each request's params until its admission, then its
        # detokenizer and stop checker until its end; requests ended here on a stop string whose engine-side
        # end has not arrived yet (their later updates are dropped).
        self._params: dict[int, SamplingParams] = {}
        self._texts: dict[int, RequestText] = {}
        self._ended_here: set[int] = set()
        self._eos_token_ids: frozenset[int] = frozenset()  # the engine's (its Hello)

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
            # counted as the in-process engine's full admission queue is (rejections in /metrics, /scheduler/stats)
            self.telemetry.emit(RequestRejected(trio.current_time(), "overloaded", "admission queue full",
                                                request.trace_id))
        else:
            try:
                request = self._tokenized(request)
            except RequestError as error:
                self._refuse(request_id, request, error)
                return handle
            except Exception as error:  # a bug triggered by this request's input: fail it, not the front
                log.exception("tokenising request %d failed", request_id)
                self._refuse(request_id, request,
                             RequestError("internal", f"the request could not be prepared: {error!r}"))
                return handle
            self._submits.append(Submit(request_id, request, time.monotonic()))
            self._unadmitted.add(request_id)
            self._params[request_id] = request.params
            self._open_since[request_id] = trio.current_time()
            self._wake.set()
        return handle

    def _tokenized(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with its prompt as token ids (the module docstring), or as it is when it has ids already
        or this front has no tokenizer. Raises admission's ``RequestError``s in admission's order: the sampling
        values first, then the prompt."""
        if request.prompt_ids is not None or self.tokenizer is None:
            return request
        assert self.hello is not None  # READY: the engine said Hello
        request.params.validate()
        request.params.validate_vocabulary(self.hello.vocab_size)
        prompt_ids = tokenize(request, self.tokenizer)
        return attrs.evolve(request, prompt=None, messages=None, prompt_ids=prompt_ids,
                            tokenized_from="messages" if request.messages is not None else "prompt")

    def _refuse(self, request_id: int, request: GenerationRequest, error: RequestError) -> None:
        """Reject a request before it was sent, as admission would (its rejection and telemetry event)."""
        self.streams.reject(request_id, Rejected(error.code, error.message, error.param))
        self.telemetry.emit(RequestRejected(trio.current_time(), error.code, error.message, request.trace_id))

    def _client_left(self, request_id: int) -> None:
        """A handle closed before its terminal update: drop its stream and tell the engine."""
        if self.streams.client_left(request_id):
            self._unadmitted.discard(request_id)
            self._open_since.pop(request_id, None)
            self._params.pop(request_id, None)
            self._texts.pop(request_id, None)
            self._aborts.append(Abort(request_id))
            self._wake.set()

    @property
    def info(self) -> EngineInfo:
        """What the engine serves (its ``Hello``) with this process's tokenizer; only once ``run`` started."""
        hello = self.hello
        if hello is None:
            raise RuntimeError("the engine process has not said Hello yet")
        return EngineInfo(hello.model_name, hello.max_model_len, hello.vocab_size, self.tokenizer,
                          frozenset(hello.eos_token_ids), hello.default_max_tokens, hello.model_root,
                          hello.tokenizer_folder)

    async def compile_constraints(self, requests: Sequence[GenerationRequest]) -> None:
        """Compile the requests' constraints in the engine process (``Engine.compile_constraints``, which
        bounds each compile); raises its ``RequestError``. Costs nothing when no request has a constraint."""
        constrained = [r for r in requests if r.params.constraint is not None]
        if not constrained:
            return
        reply = await self._call("compile_constraints", constrained)
        if reply is None:
            raise RequestError("unavailable", f"the engine is {self.state.value}")
        if reply.error is not None:
            raise RequestError(reply.error.code, reply.error.message, reply.error.param)

    async def read_counts(self) -> EngineCounts:
        """What the engine holds now, with this process's open streams added to ``stream_entries``; an
        engine that is gone holds nothing."""
        reply = await self._call("counts")
        counts = EngineCounts(0, 0, 0, 0, 0) if reply is None or reply.counts is None else EngineCounts(
            **reply.counts)
        return attrs.evolve(counts, stream_entries=counts.stream_entries + len(self.streams))

    async def read_kv_cache_snapshot(self) -> KVCacheSnapshot:
        """The prefix cache's block hashes in the engine (empty, ``seq`` 0, once the engine is gone)."""
        reply = await self._call("kv_cache_snapshot")
        if reply is None or reply.snapshot is None:
            return KVCacheSnapshot(0, 0, ())
        return KVCacheSnapshot(reply.snapshot.seq, reply.snapshot.block_size, tuple(reply.snapshot.hashes))

    async def _call(self, kind: CallKind, requests: Sequence[GenerationRequest] = ()) -> Reply | None:
        """Ask the engine and wait for its reply; None when the engine is not (or no longer) running."""
        if self.state not in (EngineState.READY, EngineState.DRAINING):
            return None
        call_id = next(self._call_ids)
        send, receive = trio.open_memory_channel[Reply | None](1)
        self._replies[call_id] = send
        self._calls.append(Call(call_id, kind, list(requests)))
        self._wake.set()
        try:
            return await receive.receive()
        finally:
            self._replies.pop(call_id, None)

    def seconds_since_progress(self) -> float | None:
        """How long open requests have waited without news from the engine (None when none is open): from
        the last message that carried updates or telemetry events (each step's ``StepCompleted``, so a long
        chunked prefill is progress) or, if later, the oldest open request's submit."""
        if not self._open_since:
            return None
        oldest = min(self._open_since.values())
        since = oldest if self._last_progress is None else max(self._last_progress, oldest)
        return trio.current_time() - since

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def failed(self) -> bool:
        """Whether the engine process failed or died (every open request was then ended)."""
        return self.state is EngineState.FAILED

    def request_drain(self, timeout: float) -> None:
        """Ask the engine to stop admitting and end in-flight requests within ``timeout`` seconds (never
        blocks); ``run`` returns once it has stopped."""
        if self.state is EngineState.READY:
            self.state = EngineState.DRAINING
        self._drain = Drain(timeout)
        self._wake.set()

    async def drain(self, timeout: float) -> None:
        """``request_drain(timeout)``, then wait until the engine has stopped (``run`` has ended every
        request)."""
        if not self._stopped.is_set():
            self.request_drain(timeout)
        with trio.move_on_after(timeout + STOP_GRACE_SECONDS):
            await self._stopped.wait()
            return
        # Hung (see the module docstring): end the open requests here, then stop ``run``, which raises.
        self._hung = f"the engine process did not stop within {timeout + STOP_GRACE_SECONDS:g} s of its drain"
        log.error("%s: taking it for hung", self._hung)
        self.state = EngineState.FAILED
        self._end_all(self._hung)
        self._run_scope.cancel()
        await self._stopped.wait()

    # -- lifecycle -----------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[RemoteEngine] = trio.TASK_STATUS_IGNORED) -> None:
        """Wait for the engine's ``Hello`` (then report started), forward submits, aborts and calls, and route
        its messages until it stops; raises ``trio.BrokenResourceError`` when the engine process died."""
        try:
            with self._run_scope:
                await self._run(task_status)
            if self._hung is not None:
                raise EngineStopTimeout(self._hung)
        finally:
            self._stopped.set()

    async def _run(self, task_status: trio.TaskStatus[RemoteEngine]) -> None:
        try:
            hello = await self.channel.receive()
            if not isinstance(hello, Hello):
                raise ProtocolError(f"the engine's first message is a {type(hello).__name__}, not Hello")
            self.hello = hello
            self._eos_token_ids = frozenset(hello.eos_token_ids)
            self._clock_shift = (trio.current_time() - time.monotonic()) - hello.clock_offset
            if self.state is EngineState.STARTING:
                self.state = EngineState.READY
            task_status.started(self)
            death: trio.BrokenResourceError | None = None
            async with trio.open_nursery() as outer:
                await outer.start(self.telemetry.run)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._forward)
                    nursery.start_soon(self._flush_pending)
                    try:
                        await self._route()
                    except trio.BrokenResourceError as error:
                        death = error  # raised below, not inside this nursery's exception group
                    nursery.cancel_scope.cancel()
                self.telemetry.close()  # its run delivers the events already routed, then returns
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
                if message.state == "failed":  # before the updates: their readers see a failed engine
                    self.state = EngineState.FAILED
                for admission in message.admissions:
                    self._unadmitted.discard(admission.request_id)
                    params = self._params.pop(admission.request_id, None)
                    if admission.rejected is not None:
                        self._open_since.pop(admission.request_id, None)
                        self.streams.reject(admission.request_id, admission.rejected)
                    else:
                        if params is not None:  # else the client left: its abort is queued
                            self._texts[admission.request_id] = RequestText(
                                params, admission.prompt_token_ids, self.tokenizer, self._eos_token_ids)
                        self.streams.admitted(admission.request_id, admission.prompt_token_ids)
                now = trio.current_time()  # one clock read for the message's deliveries, as the scheduler's per step
                for tokens in message.updates:
                    request_id = tokens.request_id
                    text = self._texts.get(request_id)
                    if text is not None:
                        update, ended_here = text.apply(tokens)
                        if update.finish_reason is not None:
                            del self._texts[request_id]
                        if ended_here:  # a stop string: the client's stream ends now, the engine's soon
                            self._ended_here.add(request_id)
                            self._aborts.append(Abort(request_id, "stop", str(update.stop_reason),
                                                      update.completion_tokens))
                            self._wake.set()
                    elif request_id in self._ended_here:  # ended here on a stop string: the engine's tail
                        if tokens.finish_reason is not None:
                            self._ended_here.discard(request_id)
                        continue
                    else:  # no text made here (its client left): the update as the engine built it
                        update = tokens.update()
                    if update.finish_reason is not None:
                        self._open_since.pop(request_id, None)
                    self.streams.deliver(update, now)  # False: the client left, and its abort is already queued
                if message.updates or message.events:  # events: a step completed (a prefill chunk has no update)
                    self._last_progress = now
                if message.events:
                    self._emit(pickle.loads(message.events))  # the engine process is this program: trusted
                self.telemetry.dropped_events += message.events_dropped
                if self.streams.has_pending():
                    self._pending_wake.set()
                if message.state == "draining" and self.state is EngineState.READY:
                    self.state = EngineState.DRAINING
            elif isinstance(message, Reply):
                waiter = self._replies.pop(message.call_id, None)
                if waiter is not None:
                    waiter.send_nowait(message)
            elif isinstance(message, Stopped):
                self.stopped = message
                return

    def _emit(self, events: list[TelemetryEvent]) -> None:
        """The engine's events into this process's telemetry, their times on this process's trio clock."""
        shift = self._clock_shift
        for event in events:
            self.telemetry.emit(attrs.evolve(event, time=event.time + shift))

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
                while self._calls:
                    await self.channel.send(self._calls.pop(0))
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
        self._open_since.clear()
        self._params.clear()
        self._texts.clear()
        self._ended_here.clear()
        self._calls.clear()
        for waiter in self._replies.values():
            waiter.send_nowait(None)  # a waiting call learns that the engine is gone
        self._replies.clear()
        self.streams.fail_all(message)
