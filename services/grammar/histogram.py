"""A Prometheus histogram as `Sample`s: cumulative `<name>_bucket{le=...}`, `<name>_sum`, `<name>_count`.
(Generic; belongs in shared/ once a second service needs one.)"""
from __future__ import annotations

import bisect
import math

from radixflow.shared.messages import Sample


class Histogram:
    def __init__(self, name: str, buckets: tuple[float, ...]):
        self.name = name
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
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            running += n
            out.append(Sample(name=f"{self.name}_bucket", value=running, labels={"le": _le(bound)}))
        out.append(Sample(name=f"{self.name}_sum", value=self.sum))
        out.append(Sample(name=f"{self.name}_count", value=self.count))
        return out


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else f"{bound:g}"
