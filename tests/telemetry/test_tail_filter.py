"""What the tail shows under each filter."""

from __future__ import annotations

from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan
from inference_server.telemetry.events import (
    FirstToken,
    RequestFinished,
    RequestQueued,
    RequestRejected,
    StepCompleted,
)
from inference_server.telemetry.tail_filter import TailFilter


def step(step_id: int, *request_ids: int) -> StepCompleted:
    plan = StepPlan(step_id, tuple(ScheduledSequence(r, (5,), 3, ((0,),), True, SamplingParams(), False, 3)
                                   for r in request_ids))
    return StepCompleted(1.0, step_id, len(request_ids), 0, len(request_ids), 0.01, 0, len(request_ids), 0.1, 0, plan)


EVENTS = [
    RequestQueued(0.0, 1, 4, "alice", "t1", 0),
    RequestQueued(0.0, 2, 4, "bob", "t2", 0),
    RequestRejected(0.1, "overloaded", "full", "t3"),
    step(0, 1, 2),
    step(1, 2),
    FirstToken(0.2, 1, 0.2),
    FirstToken(0.2, 2, 0.2),
    RequestFinished(0.5, 1, "stop", 4, 2, 0, 0.5, 0.2, "alice", "t1"),
]


def shown(tail: TailFilter) -> list[tuple]:
    lines = [tail.line(e) for e in EVENTS]
    return [(line["event"], line.get("request_id", line.get("step_id", line.get("trace_id"))))
            for line in lines if line is not None]


def test_unfiltered_shows_everything() -> None:
    assert len(shown(TailFilter())) == len(EVENTS)


def test_session_filter_keeps_its_requests_and_their_steps_and_hides_rejections() -> None:
    assert shown(TailFilter(session_id="alice")) == [("queued", 1), ("step", 0), ("first_token", 1),
                                                     ("finished", 1)]


def test_trace_filter_and_no_steps() -> None:
    assert shown(TailFilter(trace_id="t2", steps=False)) == [("queued", 2), ("first_token", 2)]
    assert shown(TailFilter(trace_id="t3")) == [("rejected", "t3")]


def test_a_filtered_tail_shows_the_step_that_made_a_requests_last_token() -> None:
    """The scheduler reports a step's finished requests before the step itself (``RequestFinished``, then
    ``StepCompleted``), so the step that sampled a request's last token comes after its ``finished`` line:
    a filtered tail must still show that step, and only that one."""
    tail = TailFilter(session_id="alice")
    events = [RequestQueued(0.0, 1, 4, "alice", "t1", 0), step(0, 1),
              RequestFinished(0.5, 1, "length", 4, 2, 0, 0.5, 0.2, "alice", "t1"), step(1, 1), step(2, 1)]
    lines = [line for line in map(tail.line, events) if line is not None]
    assert [(line["event"], line.get("step_id")) for line in lines] == [
        ("queued", None), ("step", 0), ("finished", None), ("step", 1)]
