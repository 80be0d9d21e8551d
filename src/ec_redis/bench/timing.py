"""Timing helpers: repeated runs, medians, throughput."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """Seconds per operation over several runs."""

    samples: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)

    @property
    def p90_s(self) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    def gbps(self, nbytes: int) -> float:
        """Throughput in GB/s (10^9 bytes) at the median."""
        return nbytes / self.median_s / 1e9


def measure(
    fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None
) -> Timing:
    """Run ``fn`` ``repeat`` times (after ``setup`` each time, untimed) and time each run."""
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timing(tuple(samples))


def percentile(values: list[float], pct: int) -> float:
    """The ``pct``-th percentile of ``values`` (inclusive method; one value is itself)."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]
