"""SGLang's ``stop_regex`` patterns, checked once: what ``SamplingParams.validate`` refuses and what
``core/stop_regex.RegexStops`` searches with (the third-party ``regex`` module, for its partial matching)."""

from __future__ import annotations

import regex

STOP_REGEX_TOO_SLOW = "stop_regex"
"""The ``stop_reason`` of a request ended with ``error`` because its ``stop_regex`` patterns took too long to search
(``core.stop_regex.StopRegexTooSlow``): what the HTTP layer turns into a 400 naming ``stop_regex``
(``http.errors.from_unsuccessful_finish``)."""


def compile_stop_regex(pattern: str) -> regex.Pattern[str]:
    """``pattern`` compiled, or ``ValueError`` saying why it cannot be a stop: it does not compile, or it matches
    the empty string (it would end every output before its first character)."""
    try:
        compiled = regex.compile(pattern)
    except regex.error as error:
        raise ValueError(f"{pattern[:40]!r} is not a valid regular expression: {error}") from None
    if compiled.search("") is not None:
        raise ValueError(f"{pattern[:40]!r} matches the empty string, so it would stop every output at once")
    return compiled
