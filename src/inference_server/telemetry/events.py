"""Telemetry event records: what actors report about requests and steps.

Actors emit these with ``send_nowait`` into the telemetry inbox; a full inbox drops the event and counts the
drop, so reporting can never block the step loop. Times are trio clock readings (seconds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from inference_server.records.steps import PlanView


@attrs.frozen
class RequestQueued:
    time: float
    request_id: int
    prompt_tokens: int
    session_id: str | None
    trace_id: str | None
    priority: int


@attrs.frozen
class RequestRejected:
    time: float
    code: str
    message: str
    trace_id: str | None


@attrs.frozen
class RequestStarted:
    time: float
    request_id: int
    cached_prompt_tokens: int


@attrs.frozen
class FirstToken:
    time: float
    request_id: int
    ttft: float  # seconds from queueing to the first generated token


@attrs.frozen
class RequestFinished:
    time: float
    request_id: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    e2e_latency: float
    ttft: float  # seconds from arrival to the first generated token (the whole latency when there was none)
    session_id: str | None
    trace_id: str | None
    error: str | None = None
    preemptions: int = 0  # the scheduler's count for this request (a preemption may not be reported yet)


@attrs.frozen
class StepCompleted:
    time: float
    step_id: int
    num_sequences: int
    num_prefill_tokens: int
    num_decode_tokens: int
    seconds: float
    num_waiting: int  # the queue now (the gauges are resynchronised from these)
    num_running: int
    kv_usage: float  # fraction of full-group KV blocks in use
    num_preempted: int
    # What the step did, by reference (free for the scheduler; sinks read the composition off the plan).
    plan: PlanView | None = None
    preempted: tuple[int, ...] = ()  # request ids preempted by this step's grant
    kv_usage_sliding: float | None = None  # fraction of sliding-window KV blocks in use (None: no such group)
    schedule_seconds: float = 0.0  # demand, grant and plan (the scheduler's side of the step)
    deliver_seconds: float = 0.0  # delivering the previous step's tokens to the request streams
    num_generated: int | None = None
    """Output tokens this step added to requests (None: count the plan's sampled sequences). Differs from the
    plan with overlap: a token sampled for a request that stopped or was preempted meanwhile is discarded."""
    discarded: tuple[int, ...] = ()
    """Request ids the plan sampled for whose token was discarded (so: no token reached a client, and no
    inter-token latency)."""
    step_waiting: int | None = None
    step_running: int | None = None
    """The queue right after this step's grant, what the step's record shows (None: ``num_waiting`` /
    ``num_running``). With overlap a step is reported after the next step's grant, so the queue *now* can
    already hold the next step's admissions and lack the requests that ended with this one."""

    @property
    def queue_at_step(self) -> tuple[int, int]:
        """(waiting, running) as this step's record shows them: ``step_waiting`` / ``step_running``, else the
        queue now."""
        return (self.num_waiting if self.step_waiting is None else self.step_waiting,
                self.num_running if self.step_running is None else self.step_running)


@attrs.frozen
class KVBlocksChanged:
    """The prefix cache's changes over one step, by chained block hash (``core/kv_events.py``): numbered
    ``seq`` = 1, 2, 3, ... so a consumer (``GET /kv/events``, a multi-replica router) notices a lost batch."""

    time: float
    seq: int
    stored: tuple[int, ...]
    removed: tuple[int, ...]


TelemetryEvent = (RequestQueued | RequestRejected | RequestStarted | FirstToken | RequestFinished
                  | StepCompleted | KVBlocksChanged)
