"""Scheduler actor: the step loop around the trio-free ``core.scheduler.Scheduler``.

One iteration: take new requests and aborts from the inbox (without waiting when there is work), end
requests whose admission deadline passed, send one demand to the KV allocator and await its grant, send the
plan to the executor and await the result. Tokens go to the per-request streams with ``send_nowait``
(coalescing when a consumer lags) so no client can stall the loop, and step N's tokens are delivered only
*after* the plan of step N+1 has gone to the executor: the HTTP writers they wake then run while the device
computes, instead of the device waiting for them. The scheduler/executor cycle holds at most one step in
flight (both channels have capacity 0: a rendezvous per step).

Shutdown is by closing: when the inbox closes, the loop finishes the work it has, then returns and closes
its outgoing channels, which ends the KV allocator and the executor.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from inference_server.actors.request_streams import RequestStreams
from inference_server.core.kv_grants import StepDemand, StepGrant
from inference_server.core.request import Request, RequestUpdate
from inference_server.core.scheduler import Scheduler
from inference_server.messages import Abort, Rejected, StepPlan, StepResult
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

ABANDON_POLL_SECONDS = 0.05  # while requests wait (no steps run), how often to look for departed clients


class SchedulerActor:
    def __init__(
        self,
        core: Scheduler,
        inbox: trio.MemoryReceiveChannel[Request | Abort],
        demands: trio.MemorySendChannel[StepDemand],
        grants: trio.MemoryReceiveChannel[StepGrant],
        plans: trio.MemorySendChannel[StepPlan],
        results: trio.MemoryReceiveChannel[StepResult],
        streams: RequestStreams,
        emit: Callable[[TelemetryEvent], None],
        *,
        max_queued_tokens: int,
    ) -> None:
        self.core = core
        self.inbox = inbox
        self.demands = demands
        self.grants = grants
        self.plans = plans
        self.results = results
        self.streams = streams
        self.emit = emit
        self.max_queued_tokens = max_queued_tokens
        self.inbox_closed = False
        self.last_step_end: float | None = None
        self._undelivered: list[RequestUpdate] = []  # the last step's updates, sent once the next step runs

    # -- the loop ------------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox, self.demands, self.grants, self.plans, self.results:
            while True:
                self._take_messages()
                self._deliver_all(self.core.expire(trio.current_time()))
                # Decoding requests learn that their client left when a delivery fails; requests that get no
                # deliveries yet (waiting, or prefilling a long prompt) have their streams checked here.
                silent = [r.request_id for r in self.core.waiting]
                silent += [r.request_id for r in self.core.running if not r.output_ids]
                for request_id in self.streams.flush_pending() + self.streams.abandoned(silent):
                    self._abort_gone(request_id)
                busy = self.core.has_work or self.core.has_pending_releases
                if busy and await self._step():
                    continue
                self.flush_deliveries()
                if self.inbox_closed and not busy:
                    return
                await self._wait_for_message()

    def _take_messages(self) -> None:
        while not self.inbox_closed:
            try:
                message = self.inbox.receive_nowait()
            except trio.WouldBlock:
                return
            except trio.EndOfChannel:
                self.inbox_closed = True
                return
            self._handle(message)

    async def _wait_for_message(self) -> None:
        """Sleep until a message arrives, the next admission deadline passes, or (while requests wait)
        the next poll for consumers that went away."""
        if self.inbox_closed:
            await trio.sleep(ABANDON_POLL_SECONDS)
            return
        wake = self._next_deadline()
        if self.core.requests:
            wake = min(wake, trio.current_time() + ABANDON_POLL_SECONDS)
        with trio.move_on_at(wake):
            try:
                message = await self.inbox.receive()
            except trio.EndOfChannel:
                self.inbox_closed = True
                return
            self._handle(message)

    def _next_deadline(self) -> float:
        deadlines = [r.deadline for r in self.core.waiting if r.deadline is not None and not r.started]
        return min(deadlines, default=math.inf)

    def _abort_gone(self, request_id: int) -> None:
        """The consumer is gone: end the request and free its KV (nothing left to deliver to)."""
        update = self.core.abort(request_id)
        if update is not None:
            self._report_update(update, trio.current_time())
            self.streams.deliver(update)  # closes the stream's send side

    def _handle(self, message: Request | Abort) -> None:
        if isinstance(message, Abort):
            update = self.core.abort(message.request_id, message.reason)
            if update is not None:
                self._deliver_all([update])
            return
        request = message
        queued = sum(len(r.prompt_ids) for r in self.core.waiting)
        if queued + len(request.prompt_ids) > self.max_queued_tokens:
            self.streams.reject(request.request_id, Rejected(
                "overloaded", f"the server has {queued} prompt tokens queued; retry later"))
            self.emit(RequestRejected(trio.current_time(), "overloaded", "queued prompt tokens", request.trace_id))
            return
        if not self.streams.admitted(request.request_id, len(request.prompt_ids)):
            return  # the client left before its request was queued
        self.core.add(request)
        self.emit(RequestQueued(trio.current_time(), request.request_id, len(request.prompt_ids),
                                request.session_id, request.trace_id, request.priority))

    async def _step(self) -> bool:
        """Run one step; False when nothing could be granted (the caller then waits for a message)."""
        waiting_before = {r.request_id for r in self.core.waiting}
        scheduling_began = trio.current_time()
        with profiler_ranges.phase("schedule", self.core.next_step_id):
            await self.demands.send(self.core.demand())
            grant = await self.grants.receive()
            plan = self.core.apply_grant(grant)
        if plan is None:
            return False
        now = trio.current_time()
        schedule_seconds = now - scheduling_began
        for sequence in plan.sequences:
            if sequence.request_id in waiting_before and sequence.reset:
                request = self.core.requests[sequence.request_id]
                self.emit(RequestStarted(now, request.request_id, request.num_cached_prompt_tokens))
        await self.plans.send(plan)
        delivering_began = trio.current_time()
        with profiler_ranges.phase("deliver", plan.step_id - 1):
            self.flush_deliveries()  # the previous step's tokens reach clients while this step runs
        deliver_seconds = trio.current_time() - delivering_began
        result = await self.results.receive()
        self.last_step_end = trio.current_time()
        updates = self.core.on_step_result(result)
        now = trio.current_time()
        for update in updates:
            self._report_update(update, now)
        self._undelivered.extend(updates)
        self._report_step(plan, result, grant, schedule_seconds, deliver_seconds)
        return bool(plan.sequences)

    def flush_deliveries(self) -> None:
        """Send the updates held back from the last step (see the module docstring)."""
        updates, self._undelivered = self._undelivered, []
        for update in updates:
            if not self.streams.deliver(update) and not update.finished:
                self._abort_gone(update.request_id)

    # -- delivery ------------------------------------------------------------------------------------
    def _deliver_all(self, updates: list[RequestUpdate]) -> None:
        now = trio.current_time()
        for update in updates:
            self._report_update(update, now)
            if not self.streams.deliver(update) and not update.finished:
                self._abort_gone(update.request_id)

    def _report_update(self, update: RequestUpdate, now: float) -> None:
        request = self.core.requests.get(update.request_id) or self._finished_request(update)
        if request is None:
            return
        if update.tokens and request.first_token_time is None:
            request.first_token_time = now
            self.emit(FirstToken(now, request.request_id, now - request.arrival_time))
        if update.finished:
            self.emit(RequestFinished(
                now, update.request_id, update.finish_reason, update.prompt_tokens, update.completion_tokens,
                update.cached_prompt_tokens, now - request.arrival_time,
                (request.first_token_time or now) - request.arrival_time, request.session_id, request.trace_id,
                update.error))

    def _finished_request(self, update: RequestUpdate) -> Request | None:
        return self.core.last_finished.get(update.request_id)

    def _report_step(self, plan: StepPlan, result: StepResult, grant: StepGrant, schedule_seconds: float,
                     deliver_seconds: float) -> None:
        decode = sum(1 for s in plan.sequences if len(s.token_ids) == 1 and s.cached_len >= s.prompt_len)
        sliding_free = grant.sliding_free_fraction
        self.emit(StepCompleted(
            time=trio.current_time(), step_id=plan.step_id, num_sequences=len(plan.sequences),
            num_prefill_tokens=plan.num_tokens - decode, num_decode_tokens=decode, seconds=result.seconds,
            num_waiting=len(self.core.waiting), num_running=len(self.core.running),
            kv_usage=1.0 - grant.free_fraction, num_preempted=len(grant.preempted), plan=plan,
            preempted=grant.preempted, kv_usage_sliding=None if sliding_free is None else 1.0 - sliding_free,
            schedule_seconds=schedule_seconds, deliver_seconds=deliver_seconds))


