"""The bulk-observed inter-token histogram exposes exactly what prometheus-client's own Histogram would."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inference_server.telemetry.metrics import ITL_BUCKETS, WeightedHistogram


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*ITL_BUCKETS, 0.0, 0.0031, 0.2, 99.0, 1e-7]), st.integers(1, 5)),
                max_size=30))
def test_weighted_histogram_matches_prometheus_client(observations: list[tuple[float, int]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    weighted = WeightedHistogram("h_seconds", "doc", ITL_BUCKETS, "m")
    ours.register(weighted)
    reference = Histogram("h_seconds", "doc", ["model_name"], buckets=ITL_BUCKETS, registry=theirs).labels("m")
    for value, count in observations:
        weighted.observe(value, count)
        for _ in range(count):
            reference.observe(value)
    ours_samples, their_samples = _samples(ours), _samples(theirs)
    assert ours_samples.keys() == their_samples.keys()
    for name, value in ours_samples.items():
        assert value == pytest.approx(their_samples[name], rel=1e-12, abs=1e-15), name


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    """Samples without the _created timestamp (which only prometheus-client's own histogram has)."""
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples if not s.name.endswith("_created")}
