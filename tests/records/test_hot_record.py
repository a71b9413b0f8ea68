"""``hot_record``: the frozen record contract (value equality, hash, ``evolve``, slots) on a cheaper class."""

import attrs

from inference_server.core.kv_grants import Grant
from inference_server.core.stop_checker import StopUpdate
from inference_server.records.requests import RequestUpdate, TokenOutput
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import SampledToken, ScheduledSequence

HOT = (ScheduledSequence, SampledToken, TokenOutput, RequestUpdate, StopUpdate, Grant)


def test_hot_records_compare_and_hash_by_value() -> None:
    token = TokenOutput(5, "a", -0.5)
    first, second = RequestUpdate(1, (token,)), RequestUpdate(1, (TokenOutput(5, "a", -0.5),))
    assert first == second and hash(first) == hash(second) and first is not second
    assert RequestUpdate(1, (token,), finish_reason="stop") != first
    assert len({first, second, RequestUpdate(2)}) == 2


def test_evolve_builds_a_changed_copy_and_leaves_the_original() -> None:
    sequence = ScheduledSequence(3, (1, 2), 0, ((0,),), True, SamplingParams(), True, 2)
    changed = attrs.evolve(sequence, cached_len=2, token_ids=(9,))
    assert (changed.cached_len, changed.token_ids, changed.request_id) == (2, (9,), 3)
    assert (sequence.cached_len, sequence.token_ids) == (0, (1, 2))


def test_hot_records_are_slotted_attrs_classes() -> None:
    for cls in HOT:
        assert attrs.has(cls) and "__slots__" in cls.__dict__, cls
        assert cls.__hash__ is not None, cls
