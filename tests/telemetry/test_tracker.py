"""``RequestTracker`` on the event orders the scheduler actor really emits: with overlap the next step is
planned (its ``RequestStarted`` events sent) before the previous step's ``StepCompleted`` reports the
preemptions of its grant, so a request preempted by one grant and restarted by the next is started again
before the tracker hears that it was preempted."""

from __future__ import annotations

from typing import Any

import attrs

from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan
from inference_server.telemetry.events import RequestFinished, RequestQueued, RequestStarted, StepCompleted
from inference_server.telemetry.records import RequestRecord, StepRecord
from inference_server.telemetry.tracker import RecordConsumer, RequestTracker


class Records(RecordConsumer):
    def __init__(self) -> None:
        self.ended: list[RequestRecord] = []

    def finished(self, record: RequestRecord) -> None:
        self.ended.append(record)


def step(step_id: int, *, preempted: tuple[int, ...] = (), waiting: int = 0, running: int = 1) -> StepCompleted:
    return StepCompleted(float(step_id), step_id, running, 0, running, 0.01, waiting, running, 0.5,
                         len(preempted), preempted=preempted)


def recorded_preemptions(events: list[Any]) -> list[int]:
    """The preemption counts of the request records a fresh tracker writes from ``events``."""
    records = Records()
    tracker = RequestTracker([records])
    for event in events:
        tracker(event)
    return [record.preemptions for record in records.ended]


def test_a_restart_reported_before_its_preemption_still_counts_every_preemption() -> None:
    """Request 1 is started by grant 0, preempted by grant 1, restarted by grant 2, preempted by grant 3 and
    restarted by grant 5; each ``StepCompleted(n)`` arrives after grant n + 1 was applied (overlap). The early
    restart used to be ignored (the tracker still thought it was running), so once told of the first
    preemption the tracker held the running request for a preempted waiting one, and did not count the second
    preemption (a "waiting" request cannot be preempted): 1 preemption in its record instead of 2."""
    records = Records()
    tracker = RequestTracker([records])
    for event in [RequestQueued(0.0, 1, 8, None, None, 0),
                  RequestStarted(0.0, 1, 0),  # grant 0
                  step(0),  # (grant 1 preempts it)
                  RequestStarted(2.0, 1, 0),  # grant 2 restarts it
                  step(1, preempted=(1,))]:
        tracker(event)
    assert tracker.live[1].running and tracker.num_preempted_waiting == 0
    for event in [step(2),  # (grant 3 preempts it; grant 4 does not restart it)
                  step(3, preempted=(1,), waiting=1, running=0),
                  RequestStarted(5.0, 1, 0),  # grant 5 restarts it
                  step(4, waiting=1, running=0),
                  RequestFinished(6.0, 1, "length", 8, 4, 0, 6.0, 1.0, None, None)]:
        tracker(event)
    assert [record.preemptions for record in records.ended] == [2]


def test_an_abort_between_an_early_restart_and_its_preemption_report_counts_the_preemption() -> None:
    assert recorded_preemptions([
        RequestQueued(0.0, 1, 8, None, None, 0), RequestStarted(0.0, 1, 0), step(0),
        RequestStarted(2.0, 1, 0), RequestFinished(2.5, 1, "abort", 8, 1, 0, 2.5, 1.0, None, None),
        step(1, preempted=(1,), running=0)]) == [1]


def test_a_restart_after_its_preemption_is_reported_counts_once() -> None:
    """The ordinary order (no overlap, or a restart some steps later) counts each preemption once."""
    assert recorded_preemptions([
        RequestQueued(0.0, 1, 8, None, None, 0), RequestStarted(0.0, 1, 0), step(0),
        step(1, preempted=(1,), waiting=1, running=0), RequestStarted(3.0, 1, 0), step(2),
        RequestFinished(4.0, 1, "length", 8, 4, 0, 4.0, 1.0, None, None)]) == [1]


def test_an_abort_before_its_preemption_is_reported_counts_the_preemption() -> None:
    """Request 1 is preempted by grant 1 and aborted before ``StepCompleted(1)`` reports it: its record
    takes the scheduler's count from ``RequestFinished`` (it used to say 0)."""
    assert recorded_preemptions([
        RequestQueued(0.0, 1, 8, None, None, 0), RequestStarted(0.0, 1, 0), step(0),
        RequestFinished(1.5, 1, "abort", 8, 1, 0, 1.5, 1.0, None, None, preemptions=1),
        step(1, preempted=(1,), running=0)]) == [1]


class Latencies(RecordConsumer):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def step(self, record: StepRecord) -> None:
        self.counts.append(sum(count for _, count in record.inter_token_latencies))


def sampling_step(step_id: int, *request_ids: int, discarded: tuple[int, ...] = ()) -> StepCompleted:
    plan = StepPlan(step_id, tuple(ScheduledSequence(r, (5,), 3, ((0,),), True, SamplingParams(), False, 3)
                                   for r in request_ids))
    return StepCompleted(float(step_id), step_id, len(request_ids), 0, len(request_ids), 0.01, 0,
                         len(request_ids), 0.1, 0, plan, discarded=discarded)


def test_a_discarded_sample_is_no_inter_token_latency() -> None:
    """With overlap a step samples for a request that was aborted or preempted while it ran; its token is
    dropped (no client sees it), so it is no inter-token latency either. Such samples used to be counted:
    ``vllm:inter_token_latency_seconds_count`` exceeded the tokens generated after the first ones (791 against
    817 - 47 = 770 in a run with preemptions and clients leaving), and the next real token's latency was
    measured from the dropped one."""
    latencies = Latencies()
    tracker = RequestTracker([latencies])
    for request_id in (1, 2):
        tracker(RequestQueued(0.0, request_id, 3, None, None, 0))
        tracker(RequestStarted(0.0, request_id, 0))
    tracker(sampling_step(0, 1, 2))  # first tokens: no latency yet
    tracker(sampling_step(1, 1, 2, discarded=(2,)))  # request 2 was preempted meanwhile: its token dropped
    tracker(sampling_step(2, 1))
    assert latencies.counts == [0, 1, 1]


def test_a_step_record_shows_its_own_queue_and_the_gauges_the_queue_now() -> None:
    """Step 0 reported after grant 1 admitted two more requests: its record (run file, timeline) keeps the
    queue of its own grant, while the running / waiting gauges follow the queue now."""
    rows: list[StepRecord] = []

    class Steps(RecordConsumer):
        def step(self, record: StepRecord) -> None:
            rows.append(record)

    tracker = RequestTracker([Steps()])
    tracker(attrs.evolve(step(0, waiting=0, running=3), step_waiting=1, step_running=1))
    assert (rows[0].num_waiting, rows[0].num_running) == (1, 1)
    assert (tracker.num_waiting, tracker.num_running) == (0, 3)
