"""``backends.transfer.padded_rows``: ragged integer rows as one zero-padded int32 array (the decode step's block
tables)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from inference_server.backends.transfer import padded_rows

ROWS = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=40).map(tuple), min_size=1, max_size=12)


@given(ROWS)
def test_padded_rows_equals_padding_each_row(rows: list[tuple[int, ...]]) -> None:
    width = max(1, max(len(r) for r in rows))
    expected = np.array([list(r) + [0] * (width - len(r)) for r in rows], dtype=np.int32)
    got = padded_rows(rows)
    assert got.dtype == np.int32 and got.shape == expected.shape
    assert np.array_equal(got, expected)


def test_padded_rows_of_empty_rows_has_one_column() -> None:
    assert padded_rows([(), ()]).tolist() == [[0], [0]]
