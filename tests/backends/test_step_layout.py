"""``step_layout`` (the vectorised staging behind ``ModelRunner._step_tensors``) against a per-token loop."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_server.backends.model_runner import ModelRunner
from inference_server.backends.step_layout import step_layout
from inference_server.records.sampling_params import SamplingParams
from inference_server.records.steps import ScheduledSequence, StepPlan

BLOCK_SIZE = 4
NUM_GROUPS = 2


def per_token_layout(sequences: list[ScheduledSequence], num_groups: int, block_size: int) -> dict[str, list]:
    """The definition, one token at a time (the loop ``_step_tensors`` ran before it was vectorised)."""
    positions: list[int] = []
    cu, context_lens = [0], []
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    for seq in sequences:
        n = len(seq.token_ids)
        positions.extend(range(seq.cached_len, seq.cached_len + n))
        cu.append(cu[-1] + n)
        context_lens.append(seq.cached_len + n)
        for g in range(num_groups):
            table = seq.block_tables[g]
            for p in range(seq.cached_len, seq.cached_len + n):
                index = p // block_size
                slots[g].append(table[index] * block_size + p % block_size if index < len(table) else -1)
    tables = []
    for g in range(num_groups):
        width = max([1] + [len(s.block_tables[g]) for s in sequences])
        tables.append([list(s.block_tables[g]) + [0] * (width - len(s.block_tables[g])) for s in sequences])
    return {"positions": positions, "cu": cu, "context_lens": context_lens, "slots": slots, "tables": tables}


@st.composite
def sequences(draw: st.DrawFn) -> list[ScheduledSequence]:
    result = []
    for request_id in range(draw(st.integers(1, 6))):
        cached = draw(st.integers(0, 40))
        n = draw(st.integers(1, 20))
        needed = -(-(cached + n) // BLOCK_SIZE)
        tables = tuple(  # usually covering every position; sometimes short (slots -1) or with 0 entries
            tuple(draw(st.lists(st.integers(0, 500), min_size=max(0, needed - draw(st.integers(0, 2))),
                                max_size=needed + 1)))
            for _ in range(NUM_GROUPS))
        result.append(ScheduledSequence(request_id=request_id, token_ids=(7,) * n, cached_len=cached,
                                        block_tables=tables, sample=True, sampling=SamplingParams()))
    return result


@settings(max_examples=200, deadline=None)
@given(sequences())
def test_step_layout_matches_the_per_token_definition(seqs: list[ScheduledSequence]) -> None:
    layout = step_layout(seqs, NUM_GROUPS, BLOCK_SIZE)
    expected = per_token_layout(seqs, NUM_GROUPS, BLOCK_SIZE)
    assert layout.positions.tolist() == expected["positions"]
    assert layout.cu_seqlens_q.tolist() == expected["cu"]
    assert layout.context_lens.tolist() == expected["context_lens"]
    for g in range(NUM_GROUPS):
        assert layout.slot_mappings[g].tolist() == expected["slots"][g]
        assert layout.block_tables[g].tolist() == expected["tables"][g]


def test_step_tensors_dtypes_and_shapes() -> None:
    runner = ModelRunner.__new__(ModelRunner)  # _step_tensors reads only these three attributes
    runner.block_size, runner.num_groups, runner.device = BLOCK_SIZE, NUM_GROUPS, torch.device("cpu")
    seqs = (ScheduledSequence(1, (5, 6, 7), 2, ((3, 4), (8,)), True, SamplingParams()),
            ScheduledSequence(2, (9,), 9, ((1, 2, 0), (0, 0, 6)), True, SamplingParams()))
    step = ModelRunner._step_tensors(runner, StepPlan(step_id=0, sequences=seqs))
    assert step.positions.dtype == torch.int64 and step.positions.tolist() == [2, 3, 4, 9]
    assert step.cu_seqlens_q.dtype == torch.int32 and step.cu_seqlens_q.tolist() == [0, 3, 4]
    assert step.context_lens.dtype == torch.int32 and step.context_lens.tolist() == [5, 10]
    assert step.block_tables[0].dtype == torch.int32 and step.block_tables[0].tolist() == [[3, 4, 0], [1, 2, 0]]
    assert step.block_tables[1].tolist() == [[8, 0, 0], [0, 0, 6]]
    assert step.slot_mappings[0].dtype == torch.int64
    assert step.slot_mappings[0].tolist() == [14, 15, 16, 1]
    assert step.slot_mappings[1].tolist() == [34, 35, -1, 25]
    assert not step.is_decode_only
