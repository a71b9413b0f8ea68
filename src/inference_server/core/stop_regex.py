"""Regex stops (SGLang's ``stop_regex``) for ``StopChecker``: where in the output text a pattern first matches,
and from where a match may still begin (the text the checker must hold back).

Semantics (SGLang's, at character rather than token granularity): after each new piece of output, a pattern is
searched in the text generated so far *as if the output ended there*: ``$``, ``\\b`` and lookaheads see the end
of that text (``foo(?!bar)`` matches as soon as ``foo`` is written). The output stops at the first end position
at which some pattern matches; the result never depends on how the text was split into tokens, because every
end position inside a new piece is tried in turn. ``^`` and lookbehinds see the whole output (searches start
past the dead prefix with ``pos``, they do not cut the text).

Holding back: the third-party ``regex`` module's partial matching (``partial=True``) finds the leftmost
position at which a pattern matches or could still match once more text comes; every position before it is
dead for good (an attempt there failed without reaching the end of the text, so no continuation changes it).
Text from the earliest live position of any pattern on is held back until it is decided.

Cost bound: the patterns are the client's and run on a host thread shared by every request (the engine's event loop
in-process, the front's with a separate engine), and a backtracking engine can take exponential time on some
(``(a+)+b`` over a run of ``a``). Every search runs with the ``regex`` module's ``timeout`` set to what is left of
the request's search time; a request whose searches spend it raises ``StopRegexTooSlow`` (its caller ends the request
with an error naming ``stop_regex``). The time is a bucket: ``STOP_REGEX_SECONDS`` at the start, refilled by
``STOP_REGEX_SECONDS_PER_CHARACTER`` for each pattern and character of output and by
``STOP_REGEX_SECONDS_PER_SCANNED_CHARACTER`` for each character a search scans, never past ``STOP_REGEX_SECONDS``. So
one bad pattern stalls the others for at most that long at once, while a simple pattern, which costs a few
microseconds a character (a search at every end position), keeps up with an output of any length.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import regex

from inference_server.records.stop_patterns import compile_stop_regex

STOP_REGEX_SECONDS = 0.25
"""Time one request's stop patterns may spend searching at a stretch (see the module docstring)."""
STOP_REGEX_SECONDS_PER_CHARACTER = 20e-6
"""Search time each pattern gets back for each character of output: a simple pattern spends 2-3 us a character on an
idle 2-core machine (its searches at every end position, and the partial one), a few times that on a busy one. A fixed
total ran out on long outputs: 0.25 s is 40,000 characters of one such pattern idle, fewer busy or with several."""
STOP_REGEX_SECONDS_PER_SCANNED_CHARACTER = 50e-9
"""Search time each search gets back for each character of the span it searches: scanning costs about 4 ns a character
idle (``<a>.*</a>`` over the text after its ``<a>``), so a pattern whose searches scan a growing span (its cost per
character of output grows with the output) keeps up too, while one that backtracks (exponential in the span) does
not."""


class StopRegexTooSlow(Exception):
    """A request's stop patterns spent ``STOP_REGEX_SECONDS``: the request cannot go on with them."""

    def __init__(self, pattern: str) -> None:
        super().__init__(f"stop_regex {pattern[:40]!r} took more than {STOP_REGEX_SECONDS:g} s to search this "
                         "output (the pattern backtracks too much: simplify it)")
        self.pattern = pattern


@attrs.frozen
class RegexMatch:
    """A pattern's first match, in output-text indices: ``decided`` is the end of the text it was found in (past
    ``end`` when a lookahead read on)."""

    start: int
    end: int
    decided: int
    pattern: str


class RegexStops:
    """The output text of one request and its stop patterns' search state (see the module docstring)."""

    def __init__(self, patterns: Sequence[str], budget_seconds: float = STOP_REGEX_SECONDS) -> None:
        self._patterns = tuple((pattern, compile_stop_regex(pattern)) for pattern in patterns)
        self._text = ""
        self._dead = [0] * len(self._patterns)  # per pattern: no match can start before this index
        self._budget = budget_seconds
        self._left = budget_seconds  # search time this request may still spend

    @property
    def length(self) -> int:
        """Characters of output text seen so far."""
        return len(self._text)

    def push(self, text: str) -> RegexMatch | None:
        """Add ``text`` to the output; the first match it completes (at the earliest end position of the text at
        which a pattern matches; ties: the earliest start, then the pattern listed first), or None.
        ``StopRegexTooSlow`` once the searches spent the request's time."""
        old = len(self._text)
        self._text += text
        refill = STOP_REGEX_SECONDS_PER_CHARACTER * len(text) * len(self._patterns)
        self._left = min(self._budget, self._left + refill)
        for end in range(old + 1, len(self._text) + 1):
            found: RegexMatch | None = None
            for (pattern, compiled), dead in zip(self._patterns, self._dead, strict=True):
                match = self._search(pattern, compiled, dead, end, partial=False)
                if match is not None and (found is None or match.start() < found.start):
                    found = RegexMatch(match.start(), match.end(), end, pattern)
            if found is not None:
                return found
        self._advance()
        return None

    def live_from(self) -> int:
        """The earliest output-text index at which some pattern could still begin a match (``length``: none)."""
        return min(self._dead, default=len(self._text))

    def _advance(self) -> None:
        """Move each pattern's dead prefix up to its leftmost possible (partial) match."""
        for index, (pattern, compiled) in enumerate(self._patterns):
            match = self._search(pattern, compiled, self._dead[index], len(self._text), partial=True)
            self._dead[index] = match.start() if match is not None else len(self._text)

    def _search(self, pattern: str, compiled: regex.Pattern[str], start: int, end: int,
                partial: bool) -> regex.Match[str] | None:
        """``compiled.search`` of the text in ``[start, end)``, within the time left (module docstring). The span
        refills the bucket too: a pattern that can match across the output (``<a>.*</a>`` once ``<a>`` was written)
        keeps its dead prefix where the match could start, so each search scans the whole span after it."""
        refill = STOP_REGEX_SECONDS_PER_SCANNED_CHARACTER * (end - start)
        self._left = min(self._budget, self._left + refill)
        began = time.perf_counter()
        try:
            match = compiled.search(self._text, start, end, partial=partial, timeout=max(self._left, 1e-6))
        except TimeoutError:
            self._left = 0.0
            raise StopRegexTooSlow(pattern) from None
        self._left -= time.perf_counter() - began
        if self._left <= 0.0:
            raise StopRegexTooSlow(pattern)
        return match
