"""vLLM's ``bad_words``: how admission spells them in tokens, and which tokens the sampler bans after an output."""

from __future__ import annotations

import pytest

from inference_server.core.bad_words import bad_words_token_ids
from inference_server.records.errors import RequestError
from inference_server.records.sampling_params import SamplingParams


class ScriptedEncoder:
    """A tokenizer double: fixed encodings by text (anything else encodes to no token)."""

    def __init__(self, encodings: dict[str, list[int]]) -> None:
        self.encodings = encodings
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return self.encodings.get(text, [])


def test_each_word_is_banned_as_written_and_after_a_space() -> None:
    encoder = ScriptedEncoder({"paris": [5], " paris": [6], "new york": [7, 8], " new york": [9, 8],
                               "big": [3], " big": [4, 4]})
    ids = bad_words_token_ids(["paris", "  new york", "big"], encoder)
    # " big" is two tokens where "big" is one: vLLM keeps the spaced spelling only when it is as long
    assert ids == ((5,), (6,), (7, 8), (9, 8), (3,))
    assert all(not special for _, special in encoder.calls)  # no BOS in a word
    assert ("new york", False) in encoder.calls  # leading whitespace stripped, as vLLM


def test_a_spaced_spelling_that_adds_nothing_is_not_repeated() -> None:
    encoder = ScriptedEncoder({"w5": [40], " w5": [40]})  # a whitespace-splitting tokenizer
    assert bad_words_token_ids(["w5", "w5"], encoder) == ((40,),)


def test_words_that_encode_to_nothing_or_no_tokenizer_are_refused() -> None:
    with pytest.raises(RequestError) as error:
        bad_words_token_ids(["ghost"], ScriptedEncoder({}))
    assert error.value.param == "bad_words" and "encodes to no token" in error.value.message
    with pytest.raises(RequestError) as error:
        bad_words_token_ids(["paris"], None)
    assert error.value.param == "bad_words"
    assert bad_words_token_ids([], None) == ()


def test_bans_follow_the_output_so_far() -> None:
    params = SamplingParams(bad_words_token_ids=[[5], [7, 8], [9, 7, 8]])
    assert params.bad_words_token_ids == ((5,), (7, 8), (9, 7, 8))
    assert params.bad_word_bans([]) == (5,)
    assert params.bad_word_bans([1, 7]) == (5, 8)
    assert params.bad_word_bans([9, 7]) == (5, 8)
    assert params.bad_word_bans([7, 1]) == (5,)
    assert params.bans_after_prefixes and params.needs_token_history and params.uses_logit_mask
    single = SamplingParams(bad_words_token_ids=((5,),))
    assert not single.bans_after_prefixes and not single.needs_token_history and single.uses_logit_mask


def test_bad_words_are_validated_and_their_ids_checked_against_the_vocabulary() -> None:
    with pytest.raises(RequestError) as error:
        SamplingParams(bad_words=("ok", "  ")).validate()
    assert error.value.param == "bad_words"
    with pytest.raises(RequestError) as error:
        SamplingParams(bad_words=("x",), bad_words_token_ids=((3, 600),)).validate_vocabulary(512)
    assert error.value.param == "bad_words" and "600" in error.value.message


@pytest.mark.parametrize("spelled", [((),), ((5, ()),), ((5, "x"),), ((-1,),), (5,)])
def test_token_sequences_given_directly_are_checked(spelled: object) -> None:
    """``bad_words_token_ids`` may be given directly (offline); one the sampler cannot use, an empty sequence above
    all (it bans each one's last id), is a request error, not a failed step of every request in the batch."""
    with pytest.raises(RequestError) as error:
        SamplingParams(bad_words_token_ids=spelled).validate()  # type: ignore[arg-type]
    assert error.value.param == "bad_words_token_ids"
    SamplingParams(bad_words_token_ids=((5,), (6, 7))).validate()
