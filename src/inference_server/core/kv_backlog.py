"""KV backpressure: will a new request start before its admission deadline, judging by the KV cache?

A request can only start when the KV cache has room for its prompt. ``KVTurnover`` measures how fast the
cache turns over — KV tokens given back by finished requests per second, over a sliding window of recent
finishes — and ``estimated_wait`` turns the backlog (prompt tokens queued ahead, plus the new prompt,
beyond what is free now) into seconds at that rate. When that exceeds the admission deadline, the
scheduler answers 429 at once instead of letting the request time out (504) after holding a queue slot.

It is an estimate, and errs towards admitting: it ignores the KV the running requests still grow into,
and with no finishes observed yet (no rate) it never refuses; the admission deadline stays the backstop.
"""

from __future__ import annotations

import collections

TURNOVER_WINDOW_SECONDS = 30.0
"""How far back finished requests count towards the turnover rate."""
MIN_RATE_SPAN_SECONDS = 1.0
"""The rate is taken over at least this long, so one burst of finishes does not look like a huge rate."""


class KVTurnover:
    """KV tokens released by finished requests, over a sliding window of ``window`` seconds."""

    def __init__(self, window: float = TURNOVER_WINDOW_SECONDS) -> None:
        self.window = window
        self._releases: collections.deque[tuple[float, int]] = collections.deque()
        self._total = 0
        self._first_time: float | None = None

    def record(self, now: float, tokens: int) -> None:
        """A finished request gave back ``tokens`` KV tokens at time ``now``."""
        if self._first_time is None:
            self._first_time = now
        self._releases.append((now, tokens))
        self._total += tokens
        self._forget(now)

    def rate(self, now: float) -> float | None:
        """Tokens released per second over the window, or None before any release."""
        self._forget(now)
        if self._first_time is None:
            return None
        span = max(MIN_RATE_SPAN_SECONDS, min(self.window, now - self._first_time))
        return self._total / span

    def _forget(self, now: float) -> None:
        while self._releases and self._releases[0][0] < now - self.window:
            _, tokens = self._releases.popleft()
            self._total -= tokens


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
