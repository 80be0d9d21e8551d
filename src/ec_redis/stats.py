"""Thread-safe counters and gauges: what every tier and the writer report in ``stats()``."""

from __future__ import annotations

import threading
from collections import defaultdict


class Counters:
    """Named monotonically increasing counters plus settable gauges, safe across threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: defaultdict[str, int] = defaultdict(int)
        self._gauges: dict[str, float] = {}

    def inc(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value

    def get(self, name: str) -> float:
        with self._lock:
            return self._gauges.get(name, self._counts.get(name, 0))

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            out.update(self._gauges)
            return out
