"""What the scheduler half reports to vLLM each step: its own increments (lookups, staging,
the read side of its cache) plus the worker halves' (saves, loads, the write side of their
cache), read from the stats channel. Each increment is reported once."""

from __future__ import annotations

from typing import Any

from ec_redis.cache import TieredCache
from ec_redis.connector.channel import Reader
from ec_redis.connector.scheduler import SchedulerSide
from ec_redis.connector.stats import MAX_OBSERVATIONS, Deltas, read_counters


class Reporter:
    def __init__(
        self,
        scheduler: SchedulerSide,
        cache: TieredCache,
        reader: Reader,
    ) -> None:
        self._scheduler = scheduler
        self._cache = cache
        self._reader = reader
        self._deltas = Deltas()
        self._worker_totals: dict[str, float] = {}  # cumulative, for stats_snapshot
        self._worker_gauges: dict[str, float] = {}
        scheduler.worker_gauges = self._worker_gauges  # has_pending_push_work reads them

    def take(self) -> dict[str, Any]:
        """Increments since the last call: counters, changed gauges, new observations."""
        increments, observed = self._read_channel()
        data = self._deltas({**self._own(), **self._worker_gauges})
        for name, change in increments.items():
            data[name] = data.get(name, 0) + change
        for name, values in {**self._scheduler.take_observations(), **observed}.items():
            data[name] = (data.get(name, []) + values)[-MAX_OBSERVATIONS:]
        return data

    def _own(self) -> dict[str, Any]:
        out: dict[str, Any] = read_counters(self._cache.stats())
        out.update(self._scheduler.snapshot())
        return out

    def _read_channel(self) -> tuple[dict[str, float], dict[str, list[float]]]:
        increments, gauges, observed, step = self._reader.take()  # cheap when unchanged
        self._worker_gauges.update(gauges)
        # has_pending_push_work keeps the engine stepping until this catches up.
        self._scheduler.worker_reported_step = max(self._scheduler.worker_reported_step, step)
        for name, change in increments.items():
            self._worker_totals[name] = self._worker_totals.get(name, 0) + change
        return increments, observed

    def snapshot(self) -> dict[str, Any]:
        """Cumulative: this half's counters plus the worker halves' as last read."""
        return {**self._own(), **self._worker_totals, **self._worker_gauges}

    def close(self) -> None:
        self._reader.remove_all()
