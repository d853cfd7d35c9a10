"""/metrics: the `Sample`s every service instance answers on rf.metrics, as prometheus-client
metric families. Each sample gets its `service` and `instance` labels; `<name>_bucket` / `_sum` /
`_count` rows (shared/histogram.py) become one histogram series per label set, `*_total` rows
counters, the rest gauges. A family's label names are the union of its samples' (missing ones
empty), since prometheus-client fixes them per family."""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from radixflow.shared.messages import MetricsReply

PREFIX = "radixflow_"
HELP = {
    "time_to_first_token_seconds": "From the scheduler accepting a request to its first output token.",
    "inter_token_latency_seconds": "Between a request's outputs, per token.",
    "e2e_request_latency_seconds": "From the scheduler accepting a request to its end.",
    "queue_seconds": "From a request reaching the executor to its KV pages being granted.",
    "step_seconds": "One executor step (model, sampling, output handling), by phase.",
    "grammar_compile_seconds": "What a grammar compile miss cost the request.",
}
_PARTS = ("_bucket", "_sum", "_count")

Row = tuple[dict[str, str], str, float]      # labels, part ("_bucket", "_sum", "_count" or ""), value


class Gathered:
    """A prometheus-client collector over one scrape's replies."""

    def __init__(self, replies: Iterable[MetricsReply]):
        self.replies = sorted(replies, key=lambda r: (r.service, r.instance))

    def collect(self) -> Iterator[Metric]:
        rows: dict[str, list[Row]] = {}
        histograms = set()
        for r in self.replies:
            for s in r.samples:
                part = next((p for p in _PARTS if s.name.endswith(p)), "")
                base = s.name[: len(s.name) - len(part)] if part else s.name
                if part == "_bucket":
                    histograms.add(base)
                rows.setdefault(base, []).append(({"service": r.service, "instance": r.instance} | s.labels, part, s.value))
        for base in sorted(rows):
            if base in histograms:
                yield _histogram(base, rows[base])
                continue
            by_name: dict[str, list[Row]] = {}
            for row in rows[base]:
                by_name.setdefault(base + row[1], []).append(row)
            for name, group in by_name.items():
                keys = _keys(group)
                kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
                fam = kind(PREFIX + name, HELP.get(name, name.replace("_", " ")), labels=keys)
                for labels, _, value in group:
                    fam.add_metric([labels.get(k, "") for k in keys], value)
                yield fam


def _keys(rows: list[Row], skip: str = "") -> list[str]:
    keys = ["service", "instance"]
    for labels, _, _ in rows:
        keys += [k for k in labels if k not in keys and k != skip]
    return keys


def _histogram(base: str, rows: list[Row]) -> HistogramMetricFamily:
    keys = _keys(rows, skip="le")
    series: dict[tuple[str, ...], tuple[list[tuple[str, float]], list[float]]] = {}
    for labels, part, value in rows:
        buckets, total = series.setdefault(tuple(labels.get(k, "") for k in keys), ([], [0.0]))
        if part == "_bucket":
            buckets.append((labels["le"], value))
        elif part == "_sum":
            total[0] = value
    fam = HistogramMetricFamily(PREFIX + base, HELP.get(base, base.replace("_", " ")), labels=keys)
    for values, (buckets, total) in series.items():
        buckets.sort(key=lambda b: math.inf if b[0] == "+Inf" else float(b[0]))
        fam.add_metric(list(values), buckets, total[0])
    return fam
