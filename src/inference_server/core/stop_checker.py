"""Per-request stop detection and stop-string-safe text release (pure Python, no torch).

The caller feeds each new token with the text its detokenizer produced for it (possibly ``""``). The
checker answers with the text that is safe to show now and, once, why the request finished:

* ``"stop"``: an EOS token (unless ``ignore_eos``; ``stop_reason`` None), a stop token id
  (``stop_reason`` = the id) or a stop string (``stop_reason`` = the string);
* ``"length"``: ``max_tokens`` tokens were generated.

A stop condition beats ``"length"`` on the same token. With ``min_tokens``, neither EOS, stop token ids
nor stop strings end the output before that many tokens (vLLM's rule: a stop string that completes
earlier is released as text and never matched). Stop strings are matched in the concatenated
output text, across token boundaries; the first match to *complete* wins (ties: the longest), so the
result never depends on how the text was split into tokens. Output ends before the matched string, or
after it with ``include_stop_str_in_output``; a stop token's own text is dropped unless that flag is set
(vLLM's behaviour). Text that could still be the start of a stop string is held back until resolved;
with ``include_stop_str_in_output`` nothing needs holding back.

Regex stops (SGLang's ``stop_regex``, ``stop_regex.RegexStops``): the output ends before the first match of a
pattern in the text so far (after it with ``include_stop_str_in_output``; ``stop_reason`` = the pattern), a
stop string or a pattern, whichever is decided at the earlier end position. Text from where a pattern could
still begin a match is held back, also with ``include_stop_str_in_output`` (a lookahead decides on text after
the match). ``min_tokens`` is not combined with them (``SamplingParams.validate``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Literal

from inference_server.core.stop_regex import RegexStops, StopRegexTooSlow
from inference_server.records.hot_record import hot_record
from inference_server.records.stop_patterns import STOP_REGEX_TOO_SLOW

if TYPE_CHECKING:
    from inference_server.records.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "error"]
"""``error``: only for regex stops that spent their time (``stop_regex.StopRegexTooSlow``)."""


@hot_record
class StopUpdate:
    """What one token changed: text to emit now and, on the last token, why the request ended."""

    text: str
    """Newly released output text (may be empty while a possible stop string is pending)."""
    finish_reason: FinishReason | None = None
    """None while the request keeps going."""
    stop_reason: str | int | None = None
    """The matched stop string or stop token id (None for EOS, length, or while running; ``STOP_REGEX_TOO_SLOW``
    with ``error``)."""
    error: str | None = None
    """With ``finish_reason`` ``error``: why."""

    @property
    def finished(self) -> bool:
        """Whether this was the request's last token."""
        return self.finish_reason is not None


_NOTHING_YET = StopUpdate("")
"""A token that released no text and ended nothing: one shared record (records are never changed), so a checker
fed no text (the engine process's, which sees only token ids) builds none per token."""


def ends_after_last_token(update: StopUpdate) -> bool:
    """Whether ``update`` ends the output after its token (``length``, EOS, a stop token id): then the output
    is every token's text, and a character the detokenizer still holds back (its bytes incomplete) belongs to
    it, released as ``decode`` writes it (U+FFFD). A stop string ends the output at the match instead, and
    whatever follows the match is dropped anyway."""
    return update.finish_reason is not None and not isinstance(update.stop_reason, str)


class StopChecker:
    """Decides, token by token, when one request is done and how much of its text may be shown."""

    def __init__(
        self,
        *,
        max_tokens: int,
        eos_token_ids: Collection[int] = (),
        stop: Sequence[str] = (),
        stop_token_ids: Collection[int] = (),
        ignore_eos: bool = False,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        stop_regex: Sequence[str] = (),
    ) -> None:
        self._max_tokens = max_tokens
        self._min_tokens = min_tokens
        self._eos = frozenset(() if ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(stop_token_ids)
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._keep = max((len(s) for s in self._stop), default=1) - 1  # tail chars a match may start in
        # Every proper prefix of a stop string, by its last char, longest first: a suffix of the text that is such
        # a prefix ends with the text's last char, so one dict lookup leaves a few C-level ``endswith`` calls.
        by_last: dict[str, set[str]] = {}
        for stop_str in self._stop:
            for n in range(1, len(stop_str)):
                by_last.setdefault(stop_str[n - 1], set()).add(stop_str[:n])
        self._prefixes_by_last = {c: tuple(sorted(ps, key=len, reverse=True)) for c, ps in by_last.items()}
        self._regex = RegexStops(stop_regex) if stop_regex else None
        self._tail = ""  # the last `_keep` chars of output text seen so far (at least the held ones)
        self._held = 0  # how many chars at the end of `_tail` are not yet released
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None

    @classmethod
    def from_params(cls, params: SamplingParams, eos_token_ids: Collection[int], *, stop_strings: bool = True,
                    max_tokens: int | None = None) -> StopChecker:
        """A checker for one request (``eos_token_ids``: the model's EOS ids, from its generation config).

        With a separate engine process (docs/ipc.md, decision 1) each request has two: the engine's, with
        ``stop_strings=False`` (token-level finishes only: it sees no text), and the front's, with the strings
        and ``max_tokens`` unbounded (the engine's ``length`` finish tells it when the budget ran out)."""
        return cls(
            max_tokens=params.resolved_max_tokens() if max_tokens is None else max_tokens,
            eos_token_ids=eos_token_ids,
            stop=params.stop if stop_strings else (),
            stop_regex=params.stop_regex if stop_strings else (),
            stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos and params.constraint is None,  # a complete constraint allows only EOS
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    @property
    def finished(self) -> bool:
        """Whether a finishing token has been seen (then `update` must not be called again)."""
        return self.finish_reason is not None

    def update(self, token_id: int, text: str) -> StopUpdate:
        """Account for one generated token and the text its detokenization added."""
        if self.finish_reason is not None:
            raise RuntimeError("StopChecker.update called after the request finished")
        self.num_tokens += 1
        may_stop = self.num_tokens >= self._min_tokens
        if may_stop and (token_id in self._eos or token_id in self._stop_ids):
            reason = token_id if token_id in self._stop_ids else None
            return self._finish("stop", reason, self.flush() + (text if self._include_stop else ""))
        if self._stop or self._regex is not None:
            try:
                released, match = self._scan(text, match=may_stop)
            except StopRegexTooSlow as slow:  # nothing held is released: the output ends where it was sent
                self._held = 0
                self.finish_reason, self.stop_reason = "error", STOP_REGEX_TOO_SLOW
                return StopUpdate("", "error", STOP_REGEX_TOO_SLOW, str(slow))
            if match is not None:
                return self._finish("stop", match, released)
        else:  # no stop strings: nothing is ever held back, and ``_scan`` would release ``text`` as it is
            released = text
        if self.num_tokens >= self._max_tokens:
            return self._finish("length", None, released + self.flush())
        return StopUpdate(released) if released else _NOTHING_YET

    def flush(self) -> str:
        """Release held-back text, e.g. when the caller ends the request for its own reasons."""
        held, self._held = (self._tail[len(self._tail) - self._held :] if self._held else ""), 0
        return held

    def _finish(self, reason: FinishReason, stop_reason: str | int | None, text: str) -> StopUpdate:
        self.finish_reason, self.stop_reason = reason, stop_reason
        return StopUpdate(text, reason, stop_reason)

    def _scan(self, text: str, *, match: bool = True) -> tuple[str, str | None]:
        """Release what is safe of ``tail + text``; return (released text, matched stop string or None).
        ``match=False`` (before ``min_tokens``): stop strings completing now are not matched."""
        buf = self._tail + text
        unreleased = len(self._tail) - self._held  # index in buf of the first unreleased char
        found = self._first_match(buf, new_from=len(self._tail)) if match else None
        if self._regex is not None:
            origin = self._regex.length - len(self._tail)  # output-text index of buf[0]
            hit = self._regex.push(text)
            # the earlier decided wins: a string at its end, a pattern where it first matched; ties: the string
            if hit is not None and match and (found is None or hit.decided - origin < found[0] + len(found[1])):
                self._held = 0
                return buf[unreleased:(hit.end if self._include_stop else hit.start) - origin], hit.pattern
        if found is not None:
            start, stop_str = found
            end = start + len(stop_str) if self._include_stop else start
            self._held = 0
            return buf[unreleased:end], stop_str
        hold = 0 if self._include_stop else self._partial_match_len(buf)
        if self._regex is not None:  # held from where a pattern may still begin (a lookahead: also when included)
            hold = max(hold, self._regex.length - self._regex.live_from())
        self._held = hold
        keep = max(self._keep, hold)
        self._tail = buf[max(0, len(buf) - keep) :] if keep else ""
        return buf[unreleased : len(buf) - hold], None

    def _first_match(self, buf: str, new_from: int) -> tuple[int, str] | None:
        """The match ending earliest (ties: longest) among those ending after ``buf[:new_from]``."""
        best: tuple[int, int, str] | None = None  # (end, -len, string)
        for s in self._stop:
            start = buf.find(s, max(0, new_from - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), -len(s)) < best[:2]):
                best = (start + len(s), -len(s), s)
        return None if best is None else (best[0] + best[1], best[2])

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        if not buf:
            return 0
        for prefix in self._prefixes_by_last.get(buf[-1], ()):
            if buf.endswith(prefix):  # a prefix longer than buf never matches
                return len(prefix)
        return 0
