"""``PlanDigest``: a step plan as telemetry reads it, forwarded from the engine process to the front. It must carry
every field the sinks read, survive pickling unchanged, and pickle as columns rather than an object per sequence
(what made forwarding a step of 256 sequences cost ~0.5 ms on each side)."""

import pickle

from hypothesis import given
from hypothesis import strategies as st

from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import PlanDigest, ScheduledSequence, SequenceDigest, StepPlan
from inference_server.telemetry.events import StepCompleted
from inference_server.telemetry.records import BatchEntry, StepRecord

sequences = st.lists(st.tuples(st.integers(0, 2**40), st.integers(1, 4096), st.integers(0, 2**20),
                               st.integers(0, 2**20), st.booleans(), st.booleans()), max_size=40)


def plan_of(rows: list[tuple[int, int, int, int, bool, bool]], step_id: int = 7) -> StepPlan:
    return StepPlan(step_id, tuple(
        ScheduledSequence(request_id, (3,) * tokens, cached, ((1, 2),), sample, SamplingParams(), reset, prompt)
        for request_id, tokens, cached, prompt, reset, sample in rows))


@given(sequences)
def test_the_digest_reads_as_the_plan_and_survives_pickling(rows: list[tuple[int, int, int, int, bool, bool]]) -> None:
    plan = plan_of(rows)
    digest = PlanDigest.of(plan)
    assert digest.step_id == plan.step_id
    assert [tuple(s) for s in digest.sequences] == [
        (s.request_id, s.num_tokens, s.cached_len, s.prompt_len, s.reset, s.sample) for s in plan.sequences]
    assert pickle.loads(pickle.dumps(digest, protocol=pickle.HIGHEST_PROTOCOL)) == digest
    assert pickle.loads(pickle.dumps(digest)) == digest
    assert PlanDigest.of(digest) == digest  # a digest of any plan view, not only of a StepPlan


def test_a_digest_gives_the_sinks_the_plans_batch() -> None:
    plan = plan_of([(1, 1, 40, 8, False, True), (2, 16, 0, 30, True, False), (3, 1, 3, 3, False, True)])
    batches = []
    for view in (plan, pickle.loads(pickle.dumps(PlanDigest.of(plan)))):
        event = StepCompleted(1.0, 7, 3, 16, 2, 0.01, 0, 3, 0.1, 0, plan=view)
        record = StepRecord(7, event.time, 0.01, 0.0, 0.0, 16, 2, 2, 0, 3, 0.1, None, (2,), (), (), event.plan, (), ())
        batches.append(record.batch())
    assert batches[0] == batches[1] == (BatchEntry(1, 1, "decode"), BatchEntry(2, 16, "prefill"),
                                        BatchEntry(3, 1, "decode"))


def test_the_digest_pickles_as_columns_not_as_an_object_per_sequence() -> None:
    plan = plan_of([(i, 1, 300 + i, 256, False, True) for i in range(256)])
    forwarded = pickle.dumps(PlanDigest.of(plan), protocol=pickle.HIGHEST_PROTOCOL)
    assert SequenceDigest.__name__.encode() not in forwarded  # no class reference, no object per sequence
    assert pickle.loads(forwarded) == PlanDigest.of(plan)
