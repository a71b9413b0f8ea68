"""A step's packed batch as host arrays (``StepLayout``), built with numpy (``step_layout``): what
``ModelRunner._step_tensors`` copies to the device as ``paged_kv.StepTensors``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs
import numpy as np

from inference_server.records.steps import ScheduledSequence


@attrs.frozen
class StepLayout:
    """Host arrays of one step's packed batch (what ``StepTensors`` holds on the device).

    ``positions`` int64 [T]; ``cu_seqlens_q`` int32 [B + 1]; ``context_lens`` int32 [B]; per group g,
    ``block_tables[g]`` int32 [B, max(1, longest table)] padded with 0, and ``slot_mappings[g]`` int64 [T]:
    ``table[p // block_size] * block_size + p % block_size`` for the token at position p, -1 where the table
    has no entry for p.
    """

    positions: np.ndarray
    cu_seqlens_q: np.ndarray
    context_lens: np.ndarray
    block_tables: tuple[np.ndarray, ...]
    slot_mappings: tuple[np.ndarray, ...]


def step_layout(sequences: Sequence[ScheduledSequence], num_groups: int, block_size: int) -> StepLayout:
    """``StepLayout`` of ``sequences`` with numpy: per-sequence work is a length and a table copy, per-token
    work is array arithmetic (no Python loop over tokens)."""
    lens = np.fromiter((len(s.token_ids) for s in sequences), dtype=np.int64, count=len(sequences))
    starts = np.fromiter((s.cached_len for s in sequences), dtype=np.int64, count=len(sequences))
    cu = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    row = np.repeat(np.arange(len(sequences)), lens)  # sequence of each token
    positions = np.arange(total, dtype=np.int64) - cu[:-1][row] + starts[row]
    block_index, offset = np.divmod(positions, block_size)
    tables, slot_mappings = [], []
    for g in range(num_groups):
        group_tables = [s.block_tables[g] for s in sequences]
        table_lens = np.fromiter((len(t) for t in group_tables), dtype=np.int64, count=len(sequences))
        width = max(1, int(table_lens.max(initial=0)))
        table = np.zeros((len(sequences), width), dtype=np.int32)
        flat = np.fromiter(itertools.chain.from_iterable(group_tables), dtype=np.int32,
                           count=int(table_lens.sum()))
        table[np.arange(width) < table_lens[:, None]] = flat  # row-major: each row's entries in order
        present = block_index < table_lens[row]
        blocks = table[row, np.minimum(block_index, width - 1)].astype(np.int64)
        slot_mappings.append(np.where(present, blocks * block_size + offset, -1))
        tables.append(table)
    return StepLayout(positions=positions, cu_seqlens_q=cu.astype(np.int32),
                      context_lens=(starts + lens).astype(np.int32), block_tables=tuple(tables),
                      slot_mappings=tuple(slot_mappings))
