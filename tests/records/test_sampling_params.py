"""SamplingParams validation: each field's accepted range, named in the error."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from inference_server.records.sampling_params import MAX_LOGPROBS, SamplingParams

# -- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, "finite"),
        ("top_k", -2, "-1 or 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_p", math.nan, "(0, 1]"),
        ("min_p", -0.01, "[0, 1]"),
        ("min_p", 1.01, "[0, 1]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", math.inf, "> 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("presence_penalty", -math.inf, "[-2, 2]"),
        ("frequency_penalty", -2.01, "[-2, 2]"),
        ("seed", 2**64, "None or an integer"),
        ("seed", 1.5, "None or an integer"),
        ("n", 0, "an integer >= 1"),
        ("n", 2.0, "an integer >= 1"),
        ("max_tokens", 0, ">= 1"),
        ("logprobs", -1, f"[0, {MAX_LOGPROBS}]"),
        ("logprobs", MAX_LOGPROBS + 1, f"[0, {MAX_LOGPROBS}]"),
        ("prompt_logprobs", -1, f"[0, {MAX_LOGPROBS}]"),
        ("prompt_logprobs", True, f"[0, {MAX_LOGPROBS}]"),
        ("stop", ("ok", ""), "non-empty strings"),
        ("stop_token_ids", (1, -5), "integers >= 0"),
        ("logit_bias", ((3, 100.5),), "[-100, 100]"),
        ("logit_bias", ((3, math.nan),), "[-100, 100]"),
        ("logit_bias", (("3", 1.0),), "(token id, bias) pairs"),
        ("allowed_token_ids", (), "non-empty"),
        ("allowed_token_ids", (1, 2.5), "token ids"),
        ("min_tokens", -1, ">= 0"),
        ("min_tokens", 17, "<= max_tokens"),
    ],
)
def test_validation_names_field_and_range(field: str, value: object, accepted: str) -> None:
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError) as info:
        params.validate()
    message = str(info.value)
    assert message.startswith(f"{field} must be ") and accepted in message and repr(value) in message


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0, top_k=-1, top_p=1.0, min_p=0.0, max_tokens=1),
        SamplingParams(temperature=5.0, top_k=1, top_p=1e-9, min_p=1.0, repetition_penalty=1e-3),
        SamplingParams(presence_penalty=-2, frequency_penalty=2, seed=-(2**63), logprobs=MAX_LOGPROBS),
        SamplingParams(seed=2**64 - 1, logprobs=0, stop=("\n",), stop_token_ids=(0, 1)),
        SamplingParams(logit_bias=((0, -100.0), (5, 100)), allowed_token_ids=(0,), min_tokens=16, max_tokens=16),
    ],
)
def test_validation_accepts_boundaries(params: SamplingParams) -> None:
    params.validate()
    torch.Generator().manual_seed(params.seed or 0)  # every accepted seed is a valid torch seed


def test_max_tokens_zero_needs_prompt_logprobs() -> None:
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()
    with pytest.raises(ValueError, match=r"max_tokens must be an integer >= 1 \(0 only with prompt_logprobs"):
        SamplingParams(max_tokens=-1, prompt_logprobs=0).validate()


@pytest.mark.parametrize(("field", "params"), [
    ("stop_token_ids", SamplingParams(stop_token_ids=(3, 100))),
    ("logit_bias", SamplingParams(logit_bias=((100, 1.0),))),
    ("logit_bias", SamplingParams(logit_bias=((-1, 1.0),))),
    ("allowed_token_ids", SamplingParams(allowed_token_ids=(1, 100))),
])
def test_token_ids_are_checked_against_the_vocabulary(field: str, params: SamplingParams) -> None:
    params.validate()
    with pytest.raises(ValueError) as info:
        params.validate_vocabulary(100)
    assert info.value.param == field  # type: ignore[attr-defined]
    assert "vocabulary size 100" in str(info.value)


def test_ids_inside_the_vocabulary_pass() -> None:
    SamplingParams(stop_token_ids=(0, 99), logit_bias=((99, 1.0),), allowed_token_ids=(0, 99)).validate_vocabulary(100)


def test_min_tokens_stop_ids_follow_ignore_eos() -> None:
    params = SamplingParams(min_tokens=2, stop_token_ids=(9, 4), eos_token_ids=(1,))
    assert params.min_tokens_stop_ids() == (1, 4, 9)
    assert attrs.evolve(params, ignore_eos=True).min_tokens_stop_ids() == (4, 9)


def test_max_tokens_zero_error_names_echo_as_the_completions_field() -> None:
    """/generate and the offline API have no ``echo``: the message says where that field lives."""
    with pytest.raises(ValueError, match=r"\(0 only with prompt_logprobs, or echo on /v1/completions\)"):
        SamplingParams(max_tokens=0).validate()


def test_each_sample_is_one_sequence_seeded_seed_plus_its_index() -> None:
    """vLLM's ``n``: sample j of a seeded request uses ``seed + j`` (sample 0 the seed itself), so the samples
    differ and each is reproducible alone; unseeded samples stay unseeded."""
    seeded = SamplingParams(n=3, seed=7, temperature=0.8)
    assert seeded.samples() == tuple(attrs.evolve(seeded, n=1, seed=7 + j) for j in range(3))
    assert SamplingParams(n=2).samples() == (SamplingParams(), SamplingParams())
    assert SamplingParams(seed=5).samples() == (SamplingParams(seed=5),)
    assert SamplingParams(n=2, seed=2**63 - 1).samples()[1].seed == 0  # wrapped inside the seed range
    assert SamplingParams(n=0).samples() == (SamplingParams(n=0),)  # left for validation to refuse


def test_stops_are_taken_as_vllm_users_write_them() -> None:
    """vLLM's ``stop`` is a string or a list, its ``stop_token_ids`` a list: kept as the tuples the engine uses."""
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4]) == SamplingParams(stop=("a", "b"),
                                                                                     stop_token_ids=(3, 4))
    assert attrs.evolve(SamplingParams(), stop=["x"]).stop == ("x",)
    with pytest.raises(ValueError, match="stop must be a tuple of non-empty strings"):
        SamplingParams(stop={"x"}).validate()  # type: ignore[arg-type]


def test_logit_bias_and_allowed_ids_are_taken_as_vllm_users_write_them() -> None:
    """vLLM's ``logit_bias`` is a dict of token id to bias, its ``allowed_token_ids`` a list: kept as tuples."""
    params = SamplingParams(logit_bias={5: -100.0, 2: 3}, allowed_token_ids=[1, 2])  # type: ignore[arg-type]
    assert params == SamplingParams(logit_bias=((5, -100.0), (2, 3)), allowed_token_ids=(1, 2))
    assert SamplingParams(logit_bias=[[5, 1.0]]).logit_bias == ((5, 1.0),)  # type: ignore[arg-type]
    params.validate()
    with pytest.raises(ValueError, match="logit_bias must be"):
        SamplingParams(logit_bias={5: 101.0}).validate()  # type: ignore[arg-type]
