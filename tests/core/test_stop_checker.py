"""StopChecker: finish reasons, stop strings across tokens, held-back text."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_server.core.stop_checker import StopChecker, StopUpdate
from inference_server.records.sampling_params import SamplingParams

EOS = 1


def feed(checker: StopChecker, pieces: list[str | tuple[int, str]]) -> list[StopUpdate]:
    """Feed text pieces (token id 100 + index) or explicit (token id, text) pairs until finished."""
    updates = []
    for i, piece in enumerate(pieces):
        token_id, text = piece if isinstance(piece, tuple) else (100 + i, piece)
        updates.append(checker.update(token_id, text))
        if updates[-1].finished:
            break
    return updates


def emitted(updates: list[StopUpdate]) -> str:
    return "".join(u.text for u in updates)


def make(**kwargs: object) -> StopChecker:
    kwargs.setdefault("max_tokens", 100)
    kwargs.setdefault("eos_token_ids", (EOS,))
    return StopChecker(**kwargs)  # type: ignore[arg-type]


def test_eos_stops_without_its_text() -> None:
    updates = feed(make(), ["Hello", " world", (EOS, "</s>"), "never"])
    assert [u.text for u in updates] == ["Hello", " world", ""]
    assert updates[-1] == StopUpdate("", "stop", None)
    assert all(not u.finished for u in updates[:-1])


def test_ignore_eos_keeps_going_until_length() -> None:
    checker = make(ignore_eos=True, max_tokens=3)
    updates = feed(checker, ["a", (EOS, "<eos>"), "b", "c"])
    assert emitted(updates) == "a<eos>b"
    assert (checker.finish_reason, checker.stop_reason, checker.num_tokens) == ("length", None, 3)


def test_stop_token_id_reports_the_id_and_beats_ignore_eos() -> None:
    checker = make(stop_token_ids=(7, EOS), ignore_eos=True)
    updates = feed(checker, ["x", (7, "<end>")])
    assert emitted(updates) == "x"
    assert updates[-1].finish_reason == "stop" and updates[-1].stop_reason == 7
    assert feed(make(stop_token_ids=(EOS,), ignore_eos=True), [(EOS, "")])[-1].stop_reason == EOS


def test_stop_token_text_kept_with_include_stop_str() -> None:
    updates = feed(make(stop_token_ids=(7,), include_stop_str_in_output=True), ["x", (7, "<end>")])
    assert emitted(updates) == "x<end>"


def test_max_tokens_gives_length_on_the_last_token() -> None:
    checker = make(max_tokens=2)
    updates = feed(checker, ["a", "b", "c"])
    assert [u.finish_reason for u in updates] == [None, "length"]
    assert emitted(updates) == "ab" and checker.finished


def test_stop_beats_length_on_the_same_token() -> None:
    updates = feed(make(max_tokens=2, stop=("b",)), ["a", "b"])
    assert updates[-1] == StopUpdate("", "stop", "b")


def test_stop_string_spanning_tokens_truncates_before_it() -> None:
    checker = make(stop=("o Wor",))
    updates = feed(checker, ["Hel", "lo W", "or", "ld"])
    assert [u.text for u in updates] == ["Hel", "l", ""]
    assert (checker.finish_reason, checker.stop_reason) == ("stop", "o Wor")


def test_stop_string_inside_one_token_drops_the_rest() -> None:
    updates = feed(make(stop=("STOP",)), ["abc", "dSTOPef"])
    assert emitted(updates) == "abcd" and updates[-1].stop_reason == "STOP"


def test_partial_match_is_held_then_released_when_it_fails() -> None:
    updates = feed(make(stop=("###",)), ["a#", "#", "b", "c"])
    assert [u.text for u in updates] == ["a", "", "##b", "c"]
    assert not updates[-1].finished


def test_held_text_is_flushed_on_eos_and_length() -> None:
    assert emitted(feed(make(stop=("###",)), ["a#", (EOS, "")])) == "a#"
    assert emitted(feed(make(stop=("###",), max_tokens=2), ["a", "##"])) == "a##"


def test_flush_releases_held_text() -> None:
    checker = make(stop=("xyz",))
    assert checker.update(5, "abxy").text == "ab"
    assert checker.flush() == "xy" and checker.flush() == ""


def test_earliest_completed_stop_string_wins() -> None:
    checker = make(stop=("abcd", "bc"))
    assert emitted(feed(checker, ["abcd"])) == "a" and checker.stop_reason == "bc"


def test_longest_wins_when_two_stop_strings_end_together() -> None:
    checker = make(stop=("cd", "bcd"))
    assert emitted(feed(checker, ["ab", "cde"])) == "a" and checker.stop_reason == "bcd"


def test_multiple_stop_strings_any_can_stop() -> None:
    for text, reason in [("one\n\nx", "\n\n"), ("one END x", "END")]:
        checker = make(stop=("\n\n", "END"))
        assert emitted(feed(checker, list(text))) == "one" + ("" if reason == "\n\n" else " ")
        assert checker.stop_reason == reason


def test_include_stop_str_in_output_keeps_the_match_and_holds_nothing() -> None:
    checker = make(stop=("o Wor",), include_stop_str_in_output=True)
    updates = feed(checker, ["Hel", "lo W", "orld"])
    assert [u.text for u in updates] == ["Hel", "lo W", "or"]
    assert checker.stop_reason == "o Wor"


def test_empty_text_deltas_are_fine() -> None:
    updates = feed(make(stop=("ab",)), ["", "a", "", "b"])
    assert emitted(updates) == "" and updates[-1].stop_reason == "ab"


def test_update_after_finish_is_a_bug() -> None:
    checker = make(max_tokens=1)
    checker.update(5, "a")
    with pytest.raises(RuntimeError, match="finished"):
        checker.update(6, "b")


def test_from_params() -> None:
    params = SamplingParams(max_tokens=5, stop=("\n",), stop_token_ids=(9,), include_stop_str_in_output=True)
    checker = StopChecker.from_params(params, eos_token_ids=(EOS,))
    assert emitted(feed(checker, ["a", "b\nc"])) == "ab\n" and checker.stop_reason == "\n"
    checker = StopChecker.from_params(SamplingParams(ignore_eos=True, max_tokens=2), eos_token_ids=(EOS,))
    assert feed(checker, [(EOS, ""), (EOS, "")])[-1].finish_reason == "length"


def reference_output(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Output text and stop reason by scanning the whole text char by char."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end if include else end - len(s)], s
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
)
def test_output_does_not_depend_on_token_boundaries(
    text: str, cuts: list[int], stops: list[str], include: bool
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces: list[str | tuple[int, str]] = [text[a:b] for a, b in pairwise(bounds)]
    checker = make(stop=tuple(stops), include_stop_str_in_output=include)
    updates = feed(checker, pieces)
    expected_text, expected_reason = reference_output(text, stops, include)
    assert emitted(updates) + checker.flush() == expected_text
    assert checker.stop_reason == expected_reason
    assert checker.finished == (expected_reason is not None)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="ab<\n", max_size=4), max_size=12),
    stops=st.lists(st.text(alphabet="ab<\n", min_size=1, max_size=5), min_size=1, max_size=4),
)
def test_only_a_possible_stop_string_start_is_held_back(pieces: list[str], stops: list[str]) -> None:
    """Until a match, everything is released at once except the longest suffix of the text so far that is a proper
    prefix of some stop string (brute force here): nothing is held that could not become a stop string."""
    checker = make(stop=tuple(stops))
    text, released = "", ""
    for piece in pieces:
        update = checker.update(5, piece)
        released += update.text
        text += piece
        if update.finished:
            return
        held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        assert released == text[: len(text) - held]


def test_min_tokens_defers_eos_stop_ids_and_stop_strings() -> None:
    checker = StopChecker(max_tokens=10, eos_token_ids={1}, stop=["ab"], stop_token_ids={7}, min_tokens=3)
    assert checker.update(1, "x") == StopUpdate("x")  # EOS before min_tokens: just a token
    assert checker.update(5, "ab") == StopUpdate("ab")  # a stop string completed early is released as text
    update = checker.update(7, "c")  # the 3rd token may stop
    assert (update.text, update.finish_reason, update.stop_reason) == ("", "stop", 7)


def test_min_tokens_then_stop_string() -> None:
    checker = StopChecker(max_tokens=10, stop=["z"], min_tokens=2)
    assert checker.update(4, "z").text == "z"
    update = checker.update(4, "yz")
    assert (update.text, update.finish_reason, update.stop_reason) == ("y", "stop", "z")


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 5), st.text(max_size=4)), min_size=1, max_size=12),
    max_tokens=st.integers(1, 14), min_tokens=st.integers(0, 4), include_stop=st.booleans(),
)
def test_no_stop_strings_fast_path_equals_scanning(steps: list[tuple[int, str]], max_tokens: int, min_tokens: int,
                                                   include_stop: bool) -> None:
    """Without stop strings, text skips the scan; a stop string that never occurs (NUL is never drawn) makes
    the checker scan every token, and must give the same updates."""
    def checker(stop: tuple[str, ...]) -> StopChecker:
        return StopChecker(max_tokens=max_tokens, eos_token_ids={0}, stop_token_ids={1}, stop=stop,
                           include_stop_str_in_output=include_stop, min_tokens=min_tokens)

    fast, scanning = checker(()), checker(("\x00",))
    for token_id, text in steps:
        text = text.replace("\x00", "")
        assert fast.update(token_id, text) == scanning.update(token_id, text)
        if fast.finished:
            break
    assert fast.flush() == scanning.flush()
