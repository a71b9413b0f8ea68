"""Streaming percentiles against exact ones: the sketch's relative-error guarantee, and the sliding windows
keep exactly the epochs they claim to."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_server.telemetry.stats import MIN_VALUE, LogSketch, SlidingSketch, SlidingSum

ACCURACY = 0.01
QS = (0.0, 0.01, 0.25, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)
latencies = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)


def exact_lower(values: list[float], q: float) -> float:
    """The exact "lower" percentile: the order statistic of rank floor(q (n - 1))."""
    ordered = sorted(values)
    return ordered[math.floor(q * (len(ordered) - 1))]


def assert_close(estimate: float | None, exact: float, accuracy: float = ACCURACY) -> None:
    assert estimate is not None
    if exact < MIN_VALUE:
        assert estimate == 0.0
    else:
        assert abs(estimate - exact) <= accuracy * exact * (1 + 1e-9), (estimate, exact)


@settings(max_examples=200, deadline=None)
@given(st.lists(latencies, min_size=1, max_size=500), st.sampled_from(QS))
def test_sketch_quantile_is_within_relative_accuracy_of_the_exact_percentile(values: list[float], q: float) -> None:
    sketch = LogSketch(ACCURACY)
    for value in values:
        sketch.add(value)
    assert sketch.count == len(values)
    assert math.isclose(sketch.sum, sum(values), rel_tol=1e-9, abs_tol=1e-9)
    assert_close(sketch.quantile(q), exact_lower(values, q))


def test_sketch_on_large_random_samples_of_several_shapes() -> None:
    rng = np.random.default_rng(7)
    samples = {"lognormal": rng.lognormal(-3.0, 1.5, 100_000), "uniform": rng.uniform(0.0, 2.0, 100_000),
               "bimodal": np.concatenate([rng.normal(0.02, 0.002, 50_000).clip(1e-6), rng.exponential(3.0, 50_000)])}
    for values in samples.values():
        sketch = LogSketch(ACCURACY)
        for value in values.tolist():
            sketch.add(value)
        for q in QS:
            assert_close(sketch.quantile(q), exact_lower(values.tolist(), q))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), latencies, st.integers(1, 3)), min_size=1, max_size=200),
       st.integers(1, 8), st.sampled_from(QS))
def test_sliding_window_answers_for_exactly_the_last_epochs(observations: list[tuple[int, float, int]],
                                                           slots: int, q: float) -> None:
    """Epochs arrive in non-decreasing order (time, or finished-request counts); weighted adds count
    ``count`` copies. The window at the latest epoch covers epochs latest - slots + 1 .. latest."""
    observations.sort(key=lambda o: o[0])
    sliding = SlidingSketch(slots, ACCURACY)
    sums = SlidingSum(slots)
    for epoch, value, count in observations:
        sliding.add(epoch, value, count)
        sums.add(epoch, value * count)
    latest = observations[-1][0]
    kept = [v for e, v, c in observations for _ in range(c) if latest - slots < e <= latest]
    window = sliding.window(latest)
    assert window.count == len(kept)
    assert_close(window.quantile(q), exact_lower(kept, q))
    assert math.isclose(sums.window(latest), sum(kept), rel_tol=1e-9, abs_tol=1e-9)
    assert sliding.window(latest + slots).count == 0  # everything has aged out


def test_empty_sketch_has_no_quantile() -> None:
    assert LogSketch().quantile(0.5) is None
    assert SlidingSketch(3).window(10).quantile(0.99) is None
