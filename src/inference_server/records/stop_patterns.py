"""SGLang's ``stop_regex`` patterns, checked once: what ``SamplingParams.validate`` refuses and what
``core/stop_regex.RegexStops`` searches with (the third-party ``regex`` module, for its partial matching)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import regex
from regex import _regex_core

_CORE: Any = _regex_core
"""The ``regex`` module's parser, for ``pattern_size``: internal (its stubs do not describe it), its version pinned
by ``uv.lock``; tests/core/test_stop_regex.py fails if it changes shape."""

STOP_REGEX_TOO_SLOW = "stop_regex"
"""The ``stop_reason`` of a request ended with ``error`` because its ``stop_regex`` patterns took too long to search
(``core.stop_regex.StopRegexTooSlow``): what the HTTP layer turns into a 400 naming ``stop_regex``
(``http.errors.from_unsuccessful_finish``)."""


STOP_REGEX_MAX_SIZE = 10_000
"""The largest ``pattern_size`` of a request's stop patterns, together. The ``regex`` module's compiler writes a
counted repetition out ``min`` times (nested ones multiply): ``(?:x{2000}){2000}``, 17 characters, takes 1 GB and
2 s to compile, ``(?:x{20000}){20000}`` all the memory there is, on the thread that runs every request. Patterns
within the bound compile in milliseconds."""


def pattern_size(pattern: str) -> int:
    """How many elements the ``regex`` module's compiler writes out for ``pattern`` (each counted repetition's body
    ``min`` times; a literal's characters one each), from its parse tree (nothing is compiled; a pattern longer
    than ``STOP_REGEX_MAX_SIZE`` is not even parsed: parsing takes 10 us a character), capped just past
    ``STOP_REGEX_MAX_SIZE``; ``regex.error`` (or ``ValueError``, for conflicting flags) where it does not parse,
    ``RecursionError`` where it nests too deeply to."""
    if len(pattern) > STOP_REGEX_MAX_SIZE:
        return STOP_REGEX_MAX_SIZE + 1
    flags = 0
    while True:  # as regex.compile: a global flag found late (``a(?x)``) restarts the parse with it
        source = _CORE.Source(pattern)
        info = _CORE.Info(flags, source.char_type)
        source.ignore_space = bool(info.flags & regex.VERBOSE)
        try:
            root = _CORE._parse_pattern(source, info)
            break
        except _CORE._UnscopedFlagSet:
            flags = info.global_flags
    order, stack, seen = [], [root], set()
    while stack:  # depth first, without recursion (a parse tree can be as deep as Python's stack)
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            order.append(node)
            stack.extend(_children(node))
    sizes: dict[int, int] = {}
    for node in reversed(order):  # every child before its parent
        size = 1 + len(getattr(node, "characters", ())) + sum(sizes.get(id(c), 0) for c in _children(node))
        if isinstance(node, _CORE.GreedyRepeat):  # the lazy and possessive repeats too
            size *= max(node.min_count, 1)
        sizes[id(node)] = min(size, STOP_REGEX_MAX_SIZE + 1)
    return sizes[id(root)]


def total_size(patterns: Sequence[str]) -> int:
    """The ``pattern_size`` of ``patterns`` together (one that does not parse counts 0: compiling it names it),
    capped just past ``STOP_REGEX_MAX_SIZE``."""
    if sum(len(pattern) for pattern in patterns) > STOP_REGEX_MAX_SIZE:
        return STOP_REGEX_MAX_SIZE + 1
    total = 0
    for pattern in patterns:
        with contextlib.suppress(regex.error, RecursionError, ValueError):  # ValueError: flags that conflict
            total += pattern_size(pattern)
    return min(total, STOP_REGEX_MAX_SIZE + 1)


def _children(node: object) -> list[object]:
    children = []
    for value in vars(node).values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, _CORE.RegexBase):
                children.append(item)
    return children


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> regex.Pattern[str]:
    """``pattern`` compiled, or ``ValueError`` saying why it cannot be a stop: it does not compile, it is too
    large to compile (``STOP_REGEX_MAX_SIZE``), it searches in reverse (``(?r)``: ``core/stop_regex``'s dead prefix
    and hold-back assume a forward search), or it matches the empty string (it would end every output before its
    first character). Cached (a pattern, immutable once compiled): ``SamplingParams.validate`` and then the
    request's ``RegexStops`` both ask for it; a refused pattern raises again each time."""
    try:
        if pattern_size(pattern) > STOP_REGEX_MAX_SIZE:
            raise ValueError(f"{pattern[:40]!r} is too large: its counted repetitions and literals expand to more "
                             f"than {STOP_REGEX_MAX_SIZE} elements")
        compiled = regex.compile(pattern)
    except regex.error as error:
        raise ValueError(f"{pattern[:40]!r} is not a valid regular expression: {error}") from None
    except RecursionError:
        raise ValueError(f"{pattern[:40]!r} nests too deeply") from None
    if compiled.flags & regex.REVERSE:  # searched right to left, it has no first match for the hold-back to follow
        raise ValueError(f"{pattern[:40]!r} searches in reverse ((?r)): a stop needs a forward pattern")
    if compiled.search("") is not None:
        raise ValueError(f"{pattern[:40]!r} matches the empty string, so it would stop every output at once")
    return compiled
