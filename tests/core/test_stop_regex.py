"""StopChecker's regex stops (SGLang's ``stop_regex``): where the output ends, what is held back while a match may
still begin, and that neither depends on how the text was split into tokens."""

from __future__ import annotations

from itertools import pairwise

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_server.core.stop_checker import StopChecker, StopUpdate
from inference_server.records.errors import RequestError
from inference_server.records.sampling_params import SamplingParams


def run(pieces: list[str], **kwargs: object) -> tuple[list[str], StopChecker]:
    """Each piece's released text (the last entry: what a flush releases when nothing stopped)."""
    checker = StopChecker(max_tokens=100, **kwargs)  # type: ignore[arg-type]
    released = []
    for index, piece in enumerate(pieces):
        update: StopUpdate = checker.update(100 + index, piece)
        released.append(update.text)
        if update.finished:
            return released, checker
    return [*released, checker.flush()], checker


def test_the_output_ends_before_the_first_match() -> None:
    released, checker = run(["The", " answer", " is", " 42", ".", " More"], stop_regex=[r"\d+"])
    assert released == ["The", " answer", " is", " "]
    assert (checker.finish_reason, checker.stop_reason) == ("stop", r"\d+")


def test_text_that_may_begin_a_match_is_held_then_released_when_it_cannot() -> None:
    released, checker = run(["Ans", "wer", ": ", "x", " and"], stop_regex=[r"Answer: \d"])
    assert released == ["", "", "", "Answer: x", " and", ""]  # held while "Answer: " could still take a digit
    assert checker.finish_reason is None
    released, _ = run(["xxA", "ns", "wer: 7"], stop_regex=[r"Answer: \d"])
    assert released == ["xx", "", ""]  # only from where a match may begin


def test_include_stop_str_in_output_keeps_the_match() -> None:
    released, checker = run(["Ans", "wer", ": ", "7", " and"], stop_regex=[r"Answer: \d"],
                            include_stop_str_in_output=True)
    assert "".join(released) == "Answer: 7" and checker.stop_reason == r"Answer: \d"


@pytest.mark.parametrize("include, output", [(False, "xx"), (True, "xxfoo")])
def test_a_lookahead_decides_on_text_it_does_not_match(include: bool, output: str) -> None:
    """``foo(?=bar)`` is decided once ``bar`` is written; ``bar`` is never released, even when the match is kept."""
    released, checker = run(["xx", "foo", "bar", "baz"], stop_regex=["foo(?=bar)"], include_stop_str_in_output=include)
    assert released[:2] == ["xx", ""] and "".join(released) == output and checker.finish_reason == "stop"


def test_a_pattern_is_matched_as_if_the_output_ended_there() -> None:
    """SGLang's rule (a search of the text so far): ``$`` and ``\\b`` see the end of the text written yet."""
    released, checker = run(["Hello", ".", " Next"], stop_regex=[r"[.!?]\s*$"])
    assert "".join(released) == "Hello" and checker.finished
    released, checker = run(["a cat", "s"], stop_regex=[r"\bcat\b"])
    assert "".join(released) == "a " and checker.finished


def test_anchors_and_lookbehinds_see_the_whole_output() -> None:
    released, checker = run(["a", "b", "ab"], stop_regex=["^ab"])
    assert "".join(released) == "" and checker.finished
    released, checker = run(["ba", "b"], stop_regex=["^ab"])
    assert "".join(released) == "bab" and not checker.finished  # "ab" later is not at the start
    released, checker = run(["xa", "b"], stop_regex=["(?<=xa)b"])
    assert "".join(released) == "xa" and checker.finished


def test_the_earlier_decided_of_a_string_and_a_pattern_wins_ties_to_the_string() -> None:
    released, checker = run(["ab", "cd"], stop_regex=["bc"], stop=["cd"])
    assert ("".join(released), checker.stop_reason) == ("a", "bc")
    released, checker = run(["abc", "d"], stop_regex=["b"], stop=["ab"])
    assert ("".join(released), checker.stop_reason) == ("", "ab")
    released, checker = run(["xyz"], stop_regex=["z", "y"])
    assert ("".join(released), checker.stop_reason) == ("x", "y")


PATTERNS = ["ab", "a+b", "b$", "(?<=a)b", "a(?=b)", "^b", r"\bab", "a\nb", "(ab|ba)a", "b{2}", r"a(?!a)"]


def reference(text: str, patterns: list[str], include: bool) -> tuple[str, str | None]:
    """Brute force: the shortest prefix of ``text`` in which some pattern matches (a slice, not ``endpos``)."""
    for end in range(1, len(text) + 1):
        hits = [(m.start(), i, m.end()) for i, p in enumerate(patterns) if (m := regex.search(p, text[:end]))]
        if hits:
            start, index, match_end = min(hits)
            return text[: match_end if include else start], patterns[index]
    return text, None


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab\n", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=10),
       patterns=st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=3, unique=True), include=st.booleans())
def test_output_does_not_depend_on_token_boundaries(text: str, cuts: list[int], patterns: list[str],
                                                    include: bool) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in pairwise(bounds)]
    released, checker = run(pieces, stop_regex=patterns, include_stop_str_in_output=include)
    assert ("".join(released), checker.stop_reason) == reference(text, patterns, include)


def test_from_params_leaves_patterns_to_the_front_with_a_separate_engine() -> None:
    params = SamplingParams(max_tokens=10, stop_regex=r"\d")
    assert params.stop_regex == (r"\d",)
    with_text = StopChecker.from_params(params, (1,))
    assert with_text.update(5, "a1").stop_reason == r"\d"
    engine_side = StopChecker.from_params(params, (1,), stop_strings=False)
    assert not engine_side.update(5, "a1").finished


@pytest.mark.parametrize("patterns, says", [
    (("(",), "is not a valid regular expression"),
    (("(?V0)(?V1)a",), "mutually incompatible"),  # regex raises ValueError, not regex.error, for these flags
    (("a*",), "matches the empty string"),
    (("",), "a tuple of non-empty strings"),
    (("(?r)ab",), "searches in reverse"),
])
def test_bad_patterns_are_refused_naming_stop_regex(patterns: tuple[str, ...], says: str) -> None:
    with pytest.raises(RequestError) as error:
        SamplingParams(stop_regex=patterns).validate()
    assert error.value.param == "stop_regex" and says in error.value.message


@pytest.mark.parametrize("patterns", [
    (r"(?:x{400}){400}",),  # the regex module writes x out 160,000 times ((?:x{20000}){20000}: all the memory)
    (r"(?:[ab]{300}?){300}?",),  # lazy repeats too
    (r"(?:ab|cd){3000}",),
    ("x" * 10_001,),  # long text: parsed at 10 us a character
    (r"x{3000}",) * 4,  # each small enough, not together
])
def test_patterns_too_large_to_compile_quickly_are_refused_before_compiling(patterns: tuple[str, ...]) -> None:
    """Compiling is on the thread every request shares, and the ``regex`` module's compiler writes each counted
    repetition's body out ``min`` times: a 17-character pattern took a gigabyte and seconds. Refused by size."""
    with pytest.raises(RequestError) as error:
        SamplingParams(stop_regex=patterns).validate()
    assert error.value.param == "stop_regex" and "too large" in error.value.message


def test_a_pattern_nested_too_deeply_to_parse_is_a_request_error() -> None:
    """The parser recurses: a ``RecursionError`` would have been an internal error (a 500) instead of a 400."""
    with pytest.raises(RequestError) as error:
        SamplingParams(stop_regex=("(" * 600 + "a" + ")" * 600,)).validate()
    assert error.value.param == "stop_regex" and "nests too deeply" in error.value.message


@pytest.mark.parametrize("pattern", [r"(?:x{0,2000}y){1,2000}", r"(?:ab|cd){1000}", r"\d{4}-\d{2}-\d{2}",
                                     "(" * 50 + "a" + ")" * 50, r"a(?x) b{10}", "x" * 5000])
def test_patterns_of_a_reasonable_size_are_accepted(pattern: str) -> None:
    SamplingParams(stop_regex=(pattern,)).validate()


def test_stop_regex_is_not_combined_with_min_tokens() -> None:
    """A match completed before ``min_tokens`` would have to be forgotten while later ones count: refused."""
    with pytest.raises(RequestError) as error:
        SamplingParams(stop_regex=("a",), min_tokens=2).validate()
    assert error.value.param == "stop_regex" and "min_tokens" in error.value.message
    SamplingParams(stop_regex=("a",)).validate()


def test_a_pattern_that_backtracks_without_end_ends_the_request_with_an_error_in_bounded_time() -> None:
    """``(a+)+b`` over a run of ``a`` takes exponential time in a backtracking engine: the request's searches stop
    at its time budget and it ends with ``error`` (``stop_reason`` ``stop_regex``), instead of stalling the host
    thread every request shares. The first pieces are released as usual."""
    checker = StopChecker(max_tokens=1000, stop_regex=[r"x|(a+)+b"])
    updates = [checker.update(100 + i, piece) for i, piece in enumerate(["Hi ", *["a"] * 200])
               if not checker.finished]
    last = updates[-1]
    assert updates[0].text == "Hi "
    assert (last.finish_reason, last.stop_reason) == ("error", "stop_regex") and checker.finish_reason == "error"
    assert last.error is not None and "stop_regex" in last.error and "simplify" in last.error
    assert len(updates) < 201  # it ended well before the run of a's did


class _SteadyClock:
    """``time`` for ``core/stop_regex.py`` whose every search takes ``step`` seconds (from the reading before it to
    the one after it)."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_a_simple_pattern_keeps_up_with_a_long_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pattern is searched at every character: a simple one costs a few microseconds a character, on a busy
    machine 5 us a search, so 60,000 characters (15,000 tokens) spend 0.4 s in all. The time budget bounds a
    pattern that backtracks, not the length of the output: the request runs to its end."""
    from inference_server.core import stop_regex

    monkeypatch.setattr(stop_regex, "time", _SteadyClock(5e-6))
    checker = StopChecker(max_tokens=15_000, stop_regex=[r"Answer: \d+"])
    updates = [checker.update(100 + i, " wor") for i in range(15_000)]
    assert (updates[-1].finish_reason, updates[-2].finish_reason) == ("length", None)


class _ScanClock:
    """``time`` for ``core/stop_regex.py`` whose searches take ``per_character`` seconds for each character of the
    span they search (a pattern such as ``<a>.*</a>`` scans everything after its ``<a>`` at every search)."""

    def __init__(self, per_character: float) -> None:
        self.now, self.per_character = 0.0, per_character

    def perf_counter(self) -> float:
        return self.now


class _ScanningPattern:
    def __init__(self, compiled: regex.Pattern[str], clock: _ScanClock) -> None:
        self.compiled, self.clock = compiled, clock

    def search(self, text: str, start: int, end: int, **kwargs: object) -> regex.Match[str] | None:
        self.clock.now += self.clock.per_character * (end - start)
        return self.compiled.search(text, start, end, **kwargs)


def test_a_pattern_that_spans_the_output_keeps_up_with_a_long_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once ``<a>`` is written, ``<a>.*</a>`` may still match from there, so every search scans the output after it:
    a search's cost grows with the output (20 ns a character here, a busy machine's). A refill per character of output
    alone ran out part way (8,000 characters); the span searched refills the time too, so the request runs on."""
    from inference_server.core import stop_regex

    clock = _ScanClock(20e-9)
    monkeypatch.setattr(stop_regex, "time", clock)
    stops = stop_regex.RegexStops([r"<a>.*</a>"])
    stops._patterns = tuple((p, _ScanningPattern(c, clock)) for p, c in stops._patterns)  # type: ignore[misc]
    assert stops.push("<a>") is None
    for _ in range(2_000):
        assert stops.push(" wor") is None
    assert stops.push("</a>") is not None


def test_an_error_finish_for_slow_stop_patterns_is_a_400_naming_stop_regex() -> None:
    from inference_server.http.errors import from_unsuccessful_finish
    from inference_server.records.requests import RequestUpdate

    error = from_unsuccessful_finish(RequestUpdate(1, (), "error", "stop_regex", "stop_regex 'x' took too long"),
                                     engine_failed=False)
    assert (error.status, error.param, error.code) == (400, "stop_regex", "stop_regex_too_slow")
    other = from_unsuccessful_finish(RequestUpdate(1, (), "error", None, "shutting down"), engine_failed=False)
    assert other.status == 503
