"""Scheduler actor: the step loop around the trio-free ``core.scheduler.Scheduler``.

One iteration: take new requests and aborts (without waiting when there is work), end requests whose
admission deadline passed, send one demand to the KV allocator and await its grant, send the plan to the
executor, then receive a result and turn its tokens into per-request updates. Tokens go to the per-request
streams with ``send_nowait`` (coalescing when a consumer lags) so no client can stall the loop.

Overlap (``depth`` 1, ``OVERLAP``, the default): the executor launches step N+1 before it collects step N,
so the result received after sending plan N+1 is step N's; its tokens are delivered at once (step N+1 is
already on the device) and plan N+2 is made while step N+1 runs. A request whose token is still in flight
is planned with ``PENDING_TOKEN`` in its place (``core/request.py``); one that stops on that token wastes
one token of work, discarded on arrival. When nothing more can be planned, a ``Drain`` collects the step
in flight. Without overlap (``depth`` 0) each plan's own result comes back, and step N's tokens are
delivered only *after* plan N+1 has gone to the executor, so the HTTP writers they wake run while the device
computes. Either way the loop holds at most ``depth + 1`` steps between plan and result.

Aborts arrive on their own channel (``Engine`` sends one when a caller closes its handle) and are taken
before every plan, so an aborted request is computed in no step that starts after its caller left. An idle
loop wakes on the first of: a new request, an abort, the next admission deadline. Deadlines are checked
between steps, so one fires within one step time of its value.

KV backpressure: a new request whose prompt the KV cache cannot take before its admission deadline, at the
rate the cache has been turning over (``core/kv_backlog.py``), is refused at once as ``overloaded`` with a
retry hint rather than queued to time out.

Output backpressure (``before_plan``): an engine whose updates leave through a bounded channel (the engine
process, ``ipc/engine_server.py``) passes a hook the loop awaits before each plan; it returns at once unless the
reader has fallen several steps behind, so the GPU then runs at the reader's pace instead of piling up tokens.

Shutdown is by closing: when the inbox closes, the loop finishes the work it has, then returns and closes
its outgoing channels, which ends the KV allocator and the executor.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Awaitable, Callable

import attrs
import trio

from inference_server.actors.executor import Drain
from inference_server.actors.request_streams import RequestStreams
from inference_server.core.kv_backlog import KVTurnover, estimated_wait
from inference_server.core.kv_grants import StepDemand, StepGrant
from inference_server.core.request import Request
from inference_server.core.scheduler import Scheduler
from inference_server.records.requests import Abort, FinishReason, Rejected, RequestUpdate
from inference_server.records.steps import StepPlan, StepResult
from inference_server.telemetry import profiler_ranges
from inference_server.telemetry.events import (
    FirstToken,
    RequestFinished,
    RequestQueued,
    RequestRejected,
    RequestStarted,
    StepCompleted,
    TelemetryEvent,
)

RETRY_SECONDS = 0.05
"""When no step runs, how often to retry a coalesced update held back by a slow reader's full stream, or
work that the KV allocator could not place."""


@attrs.frozen
class _InFlight:
    """A plan sent to the executor whose result has not come back, with what its step report needs."""

    plan: StepPlan
    grant: StepGrant
    schedule_seconds: float
    began: float
    waiting: int  # the queue right after this step's grant: what the step's report shows (not the later state)
    running: int


class SchedulerActor:
    def __init__(
        self,
        core: Scheduler,
        inbox: trio.MemoryReceiveChannel[Request],
        aborts: trio.MemoryReceiveChannel[Abort],
        demands: trio.MemorySendChannel[StepDemand],
        grants: trio.MemoryReceiveChannel[StepGrant],
        plans: trio.MemorySendChannel[StepPlan | Drain],
        results: trio.MemoryReceiveChannel[StepResult],
        streams: RequestStreams,
        emit: Callable[[TelemetryEvent], None],
        *,
        max_queued_tokens: int,
        kv_capacity_tokens: int = 0,
        admission_timeout: float = 0.0,
        depth: int = 0,
        before_plan: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.core = core
        self.before_plan = before_plan
        """Awaited before each plan (the module docstring's output backpressure); None: never waits."""
        self.inbox = inbox
        self.aborts = aborts
        self.demands = demands
        self.grants = grants
        self.plans = plans
        self.results = results
        self.streams = streams
        self.emit = emit
        self.max_queued_tokens = max_queued_tokens
        self.kv_capacity_tokens = kv_capacity_tokens
        self.admission_timeout = admission_timeout
        self.inbox_closed = False
        self.last_step_end: float | None = None
        self.kv_free_tokens = kv_capacity_tokens  # as of the last grant
        self.kv_turnover = KVTurnover()
        self.depth = depth
        self._undelivered: list[RequestUpdate] = []  # received updates not yet sent to their streams
        self._in_flight: collections.deque[_InFlight] = collections.deque()  # plans sent, results not received
        self._last_deliver_seconds = 0.0
        self._undelivered_step = 0  # the step whose tokens ``_undelivered`` holds (its profiler range's key)

    # -- the loop ------------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox, self.aborts, self.demands, self.grants, self.plans, self.results:
            while True:
                self._take_messages()
                self._deliver_all(self.core.expire(trio.current_time()))
                for request_id in self.streams.flush_pending():
                    self._abort(request_id)
                if self._busy and await self._step():
                    continue
                if self._in_flight:  # nothing more to plan: collect the steps still running
                    await self.plans.send(Drain())
                    while self._in_flight:
                        await self._receive_result()
                    continue
                self.flush_deliveries()
                if self.inbox_closed and not self._busy:
                    return
                await self._wait_for_message()

    @property
    def _busy(self) -> bool:
        return self.core.has_work or self.core.has_pending_releases

    def _take_messages(self) -> None:
        """Every abort and new request already sent (aborts first: they only free room)."""
        while True:
            try:
                abort = self.aborts.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            self._abort(abort.request_id, abort.reason)
        while not self.inbox_closed:
            try:
                request = self.inbox.receive_nowait()
            except trio.WouldBlock:
                return
            except trio.EndOfChannel:
                self.inbox_closed = True
                return
            self._handle(request)

    async def _wait_for_message(self) -> None:
        """Sleep until a request or an abort arrives, or the next admission deadline passes (a pending
        coalesced update is retried on the next step or message)."""
        with trio.move_on_at(self._next_deadline()):
            async with trio.open_nursery() as nursery:
                if not self.inbox_closed:
                    nursery.start_soon(self._receive_request, nursery.cancel_scope)
                nursery.start_soon(self._receive_abort, nursery.cancel_scope)

    async def _receive_request(self, done: trio.CancelScope) -> None:
        try:
            request = await self.inbox.receive()
        except trio.EndOfChannel:
            self.inbox_closed = True
        else:
            self._handle(request)
        done.cancel()

    async def _receive_abort(self, done: trio.CancelScope) -> None:
        try:
            abort = await self.aborts.receive()
        except trio.EndOfChannel:
            await trio.sleep_forever()  # no more aborts can come; wait for the other wake-ups
        else:
            self._abort(abort.request_id, abort.reason)
        done.cancel()

    def _next_deadline(self) -> float:
        deadlines = [r.deadline for r in self.core.waiting if r.deadline is not None and not r.started]
        wake = min(deadlines, default=math.inf)
        if self.streams.has_pending() or self.core.has_work:
            # A held-back update for a slow reader, or work the last grant could not place (only possible
            # when the allocator refused: nothing running frees KV by itself): retry shortly.
            wake = min(wake, trio.current_time() + RETRY_SECONDS)
        return wake

    def _abort(self, request_id: int, reason: FinishReason = "abort") -> None:
        """The caller is gone (or asked to stop; ``stop``: a separate front matched a stop string): end the
        request and free its KV with the next demand."""
        update = self.core.abort(request_id, reason)
        if update is not None:
            self._report_update(update, trio.current_time())
            self.streams.deliver(update)  # removes the entry if the caller is still there

    def _handle(self, request: Request) -> None:
        if not self.streams.is_live(request.request_id):
            return  # the caller left before its request was queued
        rejection = self._overload(request)
        if rejection is not None:
            self.streams.reject(request.request_id, rejection)
            self.emit(RequestRejected(trio.current_time(), rejection.code, rejection.message, request.trace_id))
            return
        if not self.streams.admitted(request.request_id, request.prompt_ids):
            return
        self.core.add(request)
        self.emit(RequestQueued(trio.current_time(), request.request_id, len(request.prompt_ids),
                                request.session_id, request.trace_id, request.priority))

    def _overload(self, request: Request) -> Rejected | None:
        """``overloaded`` when the queue holds too many prompt tokens, or the KV cache cannot take this
        prompt before its admission deadline (see ``core/kv_backlog.py``). The queued-token cap bounds what
        waits behind others: a request that finds nothing queued passes it whatever its length, since a
        429 (retry later) must be an answer that a later retry can change."""
        queued = self.core.waiting_prompt_tokens
        if queued and queued + len(request.prompt_ids) > self.max_queued_tokens:
            return Rejected("overloaded", f"the server has {queued} prompt tokens queued; retry later",
                            retry_after=1.0)
        if not self.admission_timeout or not self.kv_capacity_tokens:
            return None
        now = trio.current_time()
        wait = estimated_wait(free_tokens=self.kv_free_tokens, queued_tokens=queued,
                              new_tokens=len(request.prompt_ids), rate=self.kv_turnover.rate(now))
        if wait <= self.admission_timeout:
            return None
        retry = max(1.0, math.ceil(wait - self.admission_timeout)) if math.isfinite(wait) else None
        return Rejected("overloaded", f"the KV cache is full and {queued} prompt tokens are queued ahead: this "
                        f"request would wait about {wait:.0f} s, longer than the {self.admission_timeout:g} s "
                        "admission timeout; retry later", retry_after=retry)

    async def _step(self) -> bool:
        """Plan and send one step, and receive the result due (see the module docstring); False when nothing
        was planned (the caller then drains or waits for a message)."""
        if self.before_plan is not None:
            await self.before_plan()
            self._take_messages()  # what arrived while it waited (aborts first of all)
        scheduling_began = trio.current_time()
        with profiler_ranges.phase("schedule", self.core.next_step_id):
            await self.demands.send(self.core.demand())
            grant = await self.grants.receive()
            self.kv_free_tokens = round(grant.free_fraction * self.kv_capacity_tokens)
            plan = self.core.apply_grant(grant)
        if plan is None:
            return False
        now = trio.current_time()
        for request_id in self.core.last_started:
            request = self.core.requests[request_id]
            self.emit(RequestStarted(now, request_id, request.num_cached_prompt_tokens))
        await self.plans.send(plan)
        self._in_flight.append(_InFlight(plan, grant, now - scheduling_began, scheduling_began,
                                         len(self.core.waiting), len(self.core.running)))
        if self.depth == 0:
            self.flush_deliveries()  # the previous step's tokens reach clients while this step runs
        if len(self._in_flight) > self.depth:
            await self._receive_result()
        return bool(plan.sequences)

    async def _receive_result(self) -> None:
        """Receive the oldest step's result, turn it into updates and report the step. With overlap the
        updates go out at once (the next step is already on the device)."""
        result = await self.results.receive()
        step = self._in_flight.popleft()
        if result.step_id != step.plan.step_id:
            raise RuntimeError(f"the executor answered step {result.step_id}, expected {step.plan.step_id}")
        stepping_began = max(step.began, self.last_step_end or step.began)
        self.last_step_end = trio.current_time()
        self.kv_turnover.step(self.last_step_end, self.last_step_end - stepping_began)
        updates = self.core.on_step_result(result)
        now = trio.current_time()
        for update in updates:
            self._report_update(update, now)
        self._undelivered.extend(updates)
        self._undelivered_step = result.step_id
        self._report_step(step, result, self._last_deliver_seconds,
                          num_generated=sum(len(u.tokens) for u in updates), updates=updates)
        if self.depth > 0:
            self.flush_deliveries()

    def flush_deliveries(self) -> None:
        """Send the updates received and not yet delivered (see the module docstring)."""
        if not self._undelivered:
            return
        began = trio.current_time()
        with profiler_ranges.phase("deliver", self._undelivered_step):
            updates, self._undelivered = self._undelivered, []
            self._send(updates)
        self._last_deliver_seconds = trio.current_time() - began

    # -- delivery ------------------------------------------------------------------------------------
    def _deliver_all(self, updates: list[RequestUpdate]) -> None:
        now = trio.current_time()
        for update in updates:
            self._report_update(update, now)
        self._send(updates)

    def _send(self, updates: list[RequestUpdate]) -> None:
        """Updates to their streams; a request whose caller is gone is aborted (unless it just ended)."""
        now = trio.current_time()  # one clock read for the step: its updates arrive together
        deliver = self.streams.deliver
        for update in updates:
            if not deliver(update, now) and not update.finished:
                self._abort(update.request_id)

    def _report_update(self, update: RequestUpdate, now: float) -> None:
        request = self.core.requests.get(update.request_id) or self._finished_request(update)
        if request is None:
            return
        if update.tokens and request.first_token_time is None:
            request.first_token_time = now
            self.emit(FirstToken(now, request.request_id, now - request.arrival_time))
        if update.finish_reason is not None:
            if request.started:  # its KV goes back to the cache: the turnover that admits new requests
                self.kv_turnover.record(now, update.prompt_tokens + update.completion_tokens)
            self.emit(RequestFinished(
                now, update.request_id, update.finish_reason, update.prompt_tokens, update.completion_tokens,
                update.cached_prompt_tokens, now - request.arrival_time,
                (request.first_token_time or now) - request.arrival_time, request.session_id, request.trace_id,
                update.error, request.num_preemptions))

    def _finished_request(self, update: RequestUpdate) -> Request | None:
        return self.core.last_finished.get(update.request_id)

    def _report_step(self, step: _InFlight, result: StepResult, deliver_seconds: float, *, num_generated: int,
                     updates: list[RequestUpdate]) -> None:
        plan, grant = step.plan, step.grant
        discarded: tuple[int, ...] = ()
        if num_generated != len(result.tokens):  # rare: a sampled token was dropped (its request ended or was
            kept = {u.request_id for u in updates if u.tokens}  # preempted while the step ran, with overlap)
            discarded = tuple(t.request_id for t in result.tokens if t.request_id not in kept)
        decode = sum(1 for s in plan.sequences if len(s.token_ids) == 1 and s.cached_len >= s.prompt_len)
        sliding_free = grant.sliding_free_fraction
        self.emit(StepCompleted(
            time=trio.current_time(), step_id=plan.step_id, num_sequences=len(plan.sequences),
            num_prefill_tokens=plan.num_tokens - decode, num_decode_tokens=decode, seconds=result.seconds,
            num_waiting=len(self.core.waiting), num_running=len(self.core.running),
            kv_usage=1.0 - grant.free_fraction, num_preempted=len(grant.preempted), plan=plan,
            preempted=grant.preempted, kv_usage_sliding=None if sliding_free is None else 1.0 - sliding_free,
            schedule_seconds=step.schedule_seconds, deliver_seconds=deliver_seconds, num_generated=num_generated,
            discarded=discarded, step_waiting=step.waiting, step_running=step.running))


