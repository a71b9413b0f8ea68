"""KV backpressure: will a new request start before its admission deadline, judging by the KV cache?

A request can only start when the KV cache has room for its prompt. ``KVTurnover`` measures how fast the
cache turns over — KV tokens given back by finished requests over the last ``window`` seconds, per second
spent stepping in that window — and ``estimated_wait`` turns the backlog (prompt tokens queued ahead, plus
the new prompt, beyond what is free now) into seconds at that rate. When that exceeds the admission deadline, the
scheduler answers 429 at once instead of letting the request time out (504) after holding a queue slot.

It is an estimate, and errs towards admitting: it ignores the KV the running requests still grow into,
and with no finish in the window (no rate: a burst reaching an idle engine, say) it never refuses; the
admission deadline stays the backstop.
"""

from __future__ import annotations

import collections

TURNOVER_WINDOW_SECONDS = 30.0
"""How far back finished requests count towards the turnover rate."""
MIN_RATE_SPAN_SECONDS = 1.0
"""The rate is taken over at least this much stepping, so a few quick finishes do not look like a huge rate."""


class KVTurnover:
    """KV tokens released by finished requests, per second of stepping, over the last ``window`` seconds.

    Only time spent in steps counts (idle spells do not dilute the rate), so the figure is what the cache
    frees while the engine works: the rate a queue behind a full cache will see.
    """

    def __init__(self, window: float = TURNOVER_WINDOW_SECONDS) -> None:
        self.window = window
        self._releases: collections.deque[tuple[float, int]] = collections.deque()
        self._steps: collections.deque[tuple[float, float]] = collections.deque()
        self._released = 0
        self._busy = 0.0

    def step(self, now: float, seconds: float) -> None:
        """A step that took ``seconds`` ended at ``now``."""
        self._steps.append((now, seconds))
        self._busy += seconds
        self._forget(now)

    def record(self, now: float, tokens: int) -> None:
        """A finished request gave back ``tokens`` KV tokens at time ``now``."""
        self._releases.append((now, tokens))
        self._released += tokens
        self._forget(now)

    def rate(self, now: float) -> float | None:
        """Tokens released per second of stepping over the window, or None without a release in it."""
        self._forget(now)
        if not self._releases:
            return None
        return self._released / max(MIN_RATE_SPAN_SECONDS, self._busy)

    def _forget(self, now: float) -> None:
        while self._releases and self._releases[0][0] < now - self.window:
            self._released -= self._releases.popleft()[1]
        while self._steps and self._steps[0][0] < now - self.window:
            self._busy -= self._steps.popleft()[1]


def estimated_wait(*, free_tokens: int, queued_tokens: int, new_tokens: int, rate: float | None) -> float:
    """Seconds until ``new_tokens`` more prompt tokens find room behind ``queued_tokens`` already waiting,
    with ``free_tokens`` free now and the cache turning over at ``rate`` tokens/s (0 when it fits now or
    the rate is unknown; infinite when nothing is being freed)."""
    shortfall = queued_tokens + new_tokens - free_tokens
    if shortfall <= 0 or rate is None:
        return 0.0
    if rate <= 0:
        return float("inf")
    return shortfall / rate
