"""Overlap at the core scheduler: step N+1 is planned before step N's tokens arrive.

The harness plays the executor with one step launched ahead: it plans step k, "launches" it (the fake
runner computes it at once, replacing each ``PENDING_TOKEN`` with the token the previous step sampled for
that request, as the device does), and only then hands step k-1's result to the scheduler. Outputs must be
exactly those of the sequential loop, whatever ends the requests (length, stop tokens, aborts, preemption),
with KV released exactly once.
"""

from __future__ import annotations

import attrs
import pytest
from tests.core.test_scheduler import (
    BLOCK,
    Harness,
    Outcomes,
    fake_token,
    make_scheduler,
    run_to_completion,
)
from tests.fake_engine import FakeEngine

from inference_server.core.request import Request
from inference_server.core.stop_checker import StopChecker
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import PENDING_TOKEN, StepPlan, StepResult


class PipelinedRunner(FakeEngine):
    """``FakeEngine`` that resolves pending tokens from the previous launched step, and checks that they
    only ever stand for the last token of a sequence sampled by that step."""

    def __init__(self) -> None:
        super().__init__()
        self.previous: dict[int, int] = {}
        self.pending_seen = 0

    def execute(self, plan: StepPlan) -> StepResult:
        sequences = []
        for seq in plan.sequences:
            assert PENDING_TOKEN not in seq.token_ids[:-1]
            if seq.pending:
                self.pending_seen += 1
                seq = attrs.evolve(seq, token_ids=(*seq.token_ids[:-1], self.previous[seq.request_id]))
            sequences.append(seq)
        resolved = StepPlan(plan.step_id, tuple(sequences), plan.finished_request_ids)
        result = super().execute(resolved)
        self.previous = {t.request_id: t.token_id for t in result.tokens}
        return result


def run_overlapped(scheduler: Harness, runner: PipelinedRunner, *, abort_at: dict[int, int] | None = None,
                   max_steps: int = 1000) -> dict[int, tuple[list[int], str]]:
    """Run to completion with one step in flight; ``abort_at`` maps a step index to a request aborted right
    after that step was launched (while its token is in flight)."""
    outcomes = Outcomes()
    in_flight: StepResult | None = None

    def receive(result: StepResult) -> None:
        outcomes.record(scheduler.on_step_result(result))

    for step in range(max_steps):
        plan = scheduler.schedule()
        if plan is None:
            if in_flight is None:
                break
            receive(in_flight)  # a drain: nothing more to plan until the step in flight is back
            in_flight = None
            continue
        launched = runner.execute(plan)
        if abort_at and step in abort_at:
            update = scheduler.abort(abort_at[step])
            if update is not None:
                outcomes.finished[update.request_id] = update.finish_reason
        if in_flight is not None:
            receive(in_flight)
        in_flight = launched
        scheduler.check_integrity()
    return outcomes.settle(scheduler)


def stop_request(rid: int, prompt_len: int, max_tokens: int, stop_ids: tuple[int, ...] = ()) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=tuple(stop_ids))
    return Request(request_id=rid, prompt_ids=tuple(range(rid * 7, rid * 7 + prompt_len)), params=params,
                   arrival_time=0.0, arrival_index=rid, stop_checker=StopChecker.from_params(params, eos_token_ids=()))


def mixed_requests() -> list[Request]:
    """Lengths that end by max_tokens, and stop ids that end some requests early."""
    return [stop_request(rid, 5 + rid, 4 + 3 * rid, stop_ids=(fake_token(20, 9), 50, 77)) for rid in range(1, 8)]


@pytest.mark.parametrize("num_blocks,mode", [(256, "chunked"), (14, "chunked"), (256, "monolithic")])
def test_overlapped_outputs_equal_sequential_outputs(num_blocks: int, mode: str) -> None:
    sequential, overlapped = (make_scheduler(num_blocks=num_blocks, prefill_mode=mode, max_num_batched_tokens=12)
                              for _ in range(2))
    for scheduler in (sequential, overlapped):
        for r in mixed_requests():
            scheduler.add(r)
    expected = run_to_completion(sequential, FakeEngine())
    runner = PipelinedRunner()
    assert run_overlapped(overlapped, runner) == expected
    assert runner.pending_seen > 0
    if num_blocks == 14:
        assert overlapped.num_preemptions > 0


def test_a_decode_is_planned_before_its_token_arrives() -> None:
    scheduler = make_scheduler()
    scheduler.add(stop_request(1, prompt_len=5, max_tokens=10))
    first = scheduler.schedule()
    assert first.sequences[0].sample and not first.sequences[0].pending
    second = scheduler.schedule()  # the first step's token is still in flight
    (seq,) = second.sequences
    assert seq.token_ids == (PENDING_TOKEN,) and seq.cached_len == 5 and seq.sample
    assert scheduler.requests[1].num_in_flight == 2


def test_a_request_ending_by_length_costs_no_extra_step() -> None:
    sequential, overlapped = make_scheduler(), make_scheduler()
    for scheduler in (sequential, overlapped):
        scheduler.add(stop_request(1, prompt_len=6, max_tokens=5))
        scheduler.add(stop_request(2, prompt_len=9, max_tokens=3))
    sequential_runner, overlapped_runner = FakeEngine(), PipelinedRunner()
    assert run_overlapped(overlapped, overlapped_runner) == run_to_completion(sequential, sequential_runner)
    assert overlapped_runner.tokens_computed == sequential_runner.tokens_computed


def test_a_request_ending_on_a_stop_token_wastes_at_most_one_token() -> None:
    stop = fake_token(8, fake_token(7, 13))  # the second token request 1 generates
    sequential, overlapped = make_scheduler(), make_scheduler()
    for scheduler in (sequential, overlapped):
        scheduler.add(stop_request(1, prompt_len=7, max_tokens=50, stop_ids=(stop,)))
    sequential_runner, overlapped_runner = FakeEngine(), PipelinedRunner()
    expected = run_to_completion(sequential, sequential_runner)
    assert expected[1] == ([fake_token(7, 13), stop], "stop")
    assert run_overlapped(overlapped, overlapped_runner) == expected
    assert overlapped_runner.tokens_computed == sequential_runner.tokens_computed + 1


def test_an_abort_while_a_token_is_in_flight_releases_kv_once() -> None:
    scheduler = make_scheduler(num_blocks=64)
    for r in mixed_requests():
        scheduler.add(r)
    results = run_overlapped(scheduler, PipelinedRunner(), abort_at={2: 3, 3: 5, 6: 1})
    assert {rid for rid, (_, reason) in results.items() if reason == "abort"} <= {1, 3, 5}
    assert len(results) == 7


def test_a_preempted_request_forgets_its_token_in_flight() -> None:
    scheduler = make_scheduler(num_blocks=(8 + 20) // BLOCK + 2, max_num_batched_tokens=64)  # room for one
    scheduler.add(stop_request(1, prompt_len=8, max_tokens=20))
    scheduler.add(stop_request(2, prompt_len=8, max_tokens=20))
    results = run_overlapped(scheduler, PipelinedRunner())
    assert scheduler.num_preemptions > 0
    sequential = make_scheduler(num_blocks=256)
    sequential.add(stop_request(1, prompt_len=8, max_tokens=20))
    sequential.add(stop_request(2, prompt_len=8, max_tokens=20))
    assert results == run_to_completion(sequential, FakeEngine())


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_planned_token_ids_slice_prompt_outputs_and_pending(in_flight: int) -> None:
    request = stop_request(1, prompt_len=5, max_tokens=20)
    request.output_ids.extend([100, 101, 102])
    request.num_in_flight = in_flight
    padded = request.all_token_ids + (PENDING_TOKEN,) * in_flight
    for start in range(len(padded)):
        for count in range(len(padded) - start + 1):
            assert request.planned_token_ids(start, count) == padded[start:start + count]
