"""``/metrics`` over replicas: every replica's families merged, each sample labelled ``replica="i"``, plus the
front's own registry (routing decisions, healthy replicas).

Prometheus' text format wants all samples of a family together, so expositions are parsed
(``prometheus_client.parser``) and written again as one registry, rather than concatenated.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Merged:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_expositions(by_replica: Mapping[int, str], own: CollectorRegistry | None = None) -> bytes:
    """One exposition holding every family of every replica (labelled ``replica``), then ``own``'s."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(by_replica.items()):
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            target.samples += [s._replace(labels={**s.labels, "replica": str(replica)}) for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry) + (generate_latest(own) if own is not None else b"")
