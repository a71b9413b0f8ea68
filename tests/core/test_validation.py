"""Prompt token-id validation in ``core.validation.prepare`` (the fast path must refuse what the scan refuses)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from inference_server.core.validation import prepare
from inference_server.records.errors import RequestError
from inference_server.records.requests import GenerationRequest
from inference_server.records.sampling_params import SamplingParams

VOCAB = 100


def _prepare(ids: tuple) -> tuple[int, ...]:  # type: ignore[type-arg]
    request = GenerationRequest(params=SamplingParams(max_tokens=1), prompt_ids=ids)
    return prepare(request, None, max_model_len=1000, vocab_size=VOCAB)[0]


@given(st.lists(st.one_of(st.integers(-3, VOCAB + 3), st.booleans(), st.floats(0, 5), st.text(max_size=1)),
                min_size=1, max_size=30))
def test_ids_are_accepted_exactly_when_each_is_an_int_in_the_vocabulary(ids: list) -> None:  # type: ignore[type-arg]
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < VOCAB)]
    if not bad:
        assert _prepare(tuple(ids)) == tuple(ids)
        return
    with pytest.raises(RequestError) as raised:
        _prepare(tuple(ids))
    assert f"prompt token id {bad[0]} is out of vocabulary" in raised.value.message


def test_an_engine_request_for_several_samples_is_refused() -> None:
    """``n`` > 1 is expanded by the caller (``SamplingParams.samples``); the engine runs one sequence a request."""
    request = GenerationRequest(params=SamplingParams(max_tokens=1, n=2), prompt_ids=(1, 2))
    with pytest.raises(RequestError, match="n=2: an engine request is one sequence") as raised:
        prepare(request, None, max_model_len=1000, vocab_size=VOCAB)
    assert raised.value.param == "n"
