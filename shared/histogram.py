"""A Prometheus histogram kept by a service and sent as `Sample`s over the bus (rf.metrics):
cumulative `<name>_bucket{le=...}`, `<name>_sum`, `<name>_count`, each with the histogram's own
labels. The gateway turns them back into histogram families for prometheus-client to write
(gateway/ops.py). Observed from any one thread; a reader may see a count one step ahead of the
buckets, which a scrape tolerates."""
from __future__ import annotations

import bisect
import math

from radixflow.shared.messages import Sample

# latencies from a millisecond (a decode step of a tiny model) to minutes (a long queue)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                   20.48, 40.96, 81.92, 163.84)


class Histogram:
    def __init__(self, name: str, buckets: tuple[float, ...] = LATENCY_BUCKETS, labels: dict[str, str] | None = None):
        self.name = name
        self.labels = dict(labels or {})
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)   # last slot: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1   # le: value <= bound
        self.sum += value
        self.count += 1

    def samples(self) -> list[Sample]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), list(self.counts)):
            running += n
            out.append(Sample(name=f"{self.name}_bucket", value=running, labels=self.labels | {"le": _le(bound)}))
        out.append(Sample(name=f"{self.name}_sum", value=self.sum, labels=dict(self.labels)))
        out.append(Sample(name=f"{self.name}_count", value=self.count, labels=dict(self.labels)))
        return out


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else f"{bound:g}"
