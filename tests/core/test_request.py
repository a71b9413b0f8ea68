"""``Request.token_slice``: a slice of prompt plus output without building the whole sequence."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from inference_server.core.request import Request
from inference_server.records.sampling_params import SamplingParams


@given(prompt=st.lists(st.integers(0, 9), min_size=1, max_size=12), output=st.lists(st.integers(0, 9), max_size=12),
       data=st.data())
def test_token_slice_is_a_slice_of_all_token_ids(prompt: list[int], output: list[int], data: st.DataObject) -> None:
    request = Request(request_id=1, prompt_ids=tuple(prompt), params=SamplingParams(), arrival_time=0.0,
                      arrival_index=1, output_ids=list(output))
    total = len(prompt) + len(output)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    assert request.token_slice(start, stop) == request.all_token_ids[start:stop]
    assert isinstance(request.token_slice(start, stop), tuple)
