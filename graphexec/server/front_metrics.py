"""The data-parallel front's metrics: every replica's, relabelled, plus their totals.

`/metrics` merges the replicas' Prometheus text: each sample gains a label `replica="i"`, and one
more sample per series, `replica="total"`, holds the sum over the replicas that answered
(counters, gauges, and histogram buckets, sums and counts alike).  Two kinds of gauge do not
add up: `*_created` timestamps (the total is the earliest) and `*_ratio` gauges (the total is the
mean; replicas share one config, so equal pools make it the pooled ratio).  `/metrics/json`
merges the replicas' JSON the same way (numbers summed key by key) beside the router's counters.

No I/O here: the front fetches the texts and hands them in.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
TOTAL = "total"


def merge_prometheus(texts: Sequence[str | None]) -> bytes:
    """One exposition from each replica's (None: the replica did not answer; left out)."""
    families: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, list[float]]] = {}
    for replica, text in enumerate(texts):
        if text is None:
            continue
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            series = totals.setdefault(family.name, {})
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": str(replica)}, sample.value)
                series.setdefault((sample.name, tuple(sorted(sample.labels.items()))), []).append(sample.value)
    for name, family in families.items():
        for (sample_name, labels), values in totals[name].items():
            family.add_sample(sample_name, {**dict(labels), "replica": TOTAL}, _total(sample_name, values))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


def _total(sample_name: str, values: list[float]) -> float:
    if sample_name.endswith("_created"):
        return min(values)
    if sample_name.endswith("_ratio"):
        return sum(values) / len(values)
    return sum(values)


class _Families(Collector):
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_json(replicas: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """Numbers summed key by key over the replicas that answered; a string kept when all agree."""
    answered = [r for r in replicas if r is not None]
    return _merge(answered) if answered else {}


def _merge(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, Mapping):
        keys = dict.fromkeys(k for v in values if isinstance(v, Mapping) for k in v)
        return {k: _merge([v[k] for v in values if isinstance(v, Mapping) and k in v]) for k in keys}
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sum(values)
    if all(v == first for v in values):
        return first
    return None  # differs between replicas and does not add up (a list, a flag)
