"""KV backpressure estimate: the turnover rate over stepping time, and the wait it implies."""

from __future__ import annotations

import math

import pytest

from inference_server.core.kv_backlog import MIN_RATE_SPAN_SECONDS, KVTurnover, estimated_wait


def test_no_release_in_the_window_means_no_rate() -> None:
    turnover = KVTurnover(window=30.0)
    assert turnover.rate(0.0) is None
    turnover.step(1.0, 1.0)
    assert turnover.rate(1.0) is None
    turnover.record(2.0, 100)
    turnover.step(2.0, 1.0)
    assert turnover.rate(2.0) == pytest.approx(100 / 2.0)
    assert turnover.rate(40.0) is None  # the release left the window


def test_only_stepping_time_counts_and_old_steps_leave_the_window() -> None:
    turnover = KVTurnover(window=10.0)
    for t in range(1, 5):  # 4 s of steps
        turnover.step(float(t), 1.0)
    turnover.record(4.0, 40)
    assert turnover.rate(100.0 - 95.0) == pytest.approx(40 / 4.0)  # an idle second later: still 4 s of work
    turnover.step(13.0, 1.0)  # the steps before t=3 leave the window
    assert turnover.rate(13.0) == pytest.approx(40 / 3.0)


def test_a_quick_first_finish_is_measured_over_at_least_the_minimum_span() -> None:
    turnover = KVTurnover()
    turnover.step(0.01, 0.01)
    turnover.record(0.01, 50)
    assert turnover.rate(0.01) == pytest.approx(50 / MIN_RATE_SPAN_SECONDS)


@pytest.mark.parametrize(
    ("free", "queued", "new", "rate", "expected"),
    [
        (100, 0, 50, 10.0, 0.0),  # fits now
        (100, 80, 50, 10.0, 3.0),  # 30 tokens short at 10 tokens/s
        (0, 0, 50, None, 0.0),  # no rate: never refuse on a guess
        (0, 0, 50, 0.0, math.inf),  # nothing is being freed
    ],
)
def test_estimated_wait(free: int, queued: int, new: int, rate: float | None, expected: float) -> None:
    assert estimated_wait(free_tokens=free, queued_tokens=queued, new_tokens=new, rate=rate) == expected
