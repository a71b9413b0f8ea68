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
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from inference_server.records.stop_patterns import compile_stop_regex


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

    def __init__(self, patterns: Sequence[str]) -> None:
        self._patterns = tuple((pattern, compile_stop_regex(pattern)) for pattern in patterns)
        self._text = ""
        self._dead = [0] * len(self._patterns)  # per pattern: no match can start before this index

    @property
    def length(self) -> int:
        """Characters of output text seen so far."""
        return len(self._text)

    def push(self, text: str) -> RegexMatch | None:
        """Add ``text`` to the output; the first match it completes (at the earliest end position of the text at
        which a pattern matches; ties: the earliest start, then the pattern listed first), or None."""
        old = len(self._text)
        self._text += text
        for end in range(old + 1, len(self._text) + 1):
            found: RegexMatch | None = None
            for (pattern, compiled), dead in zip(self._patterns, self._dead, strict=True):
                match = compiled.search(self._text, dead, end)
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
        for index, (_, compiled) in enumerate(self._patterns):
            match = compiled.search(self._text, self._dead[index], partial=True)
            self._dead[index] = match.start() if match is not None else len(self._text)
