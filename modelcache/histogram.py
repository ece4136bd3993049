"""Latency histograms with fixed buckets, kept by the daemon (opens) and the executor (requests) alike,
written out as Prometheus histogram lines by daemon/metrics.py."""

from __future__ import annotations

import bisect

OPEN_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Counts per bucket (upper bounds in seconds, then +Inf), their sum and count: a Prometheus histogram."""

    def __init__(self, buckets=OPEN_BUCKETS_S):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def merge(self, counts: list, total: float) -> None:
        """Add another histogram's counts (the same buckets) and sum: one kept elsewhere, reported here."""
        if len(counts) != len(self.counts):
            raise ValueError(f"{len(counts)} bucket counts for a histogram of {len(self.counts)}")
        self.counts = [a + int(b) for a, b in zip(self.counts, counts)]
        self.total += float(total)
        self.n += sum(int(b) for b in counts)

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out, cum = [], 0
        for bound, count in zip((*self.buckets, "+Inf"), self.counts):
            cum += count
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {cum}')
        lab = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{lab} {self.total:.6f}", f"{name}_count{lab} {self.n}"]
        return out
