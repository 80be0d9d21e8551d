"""What the scheduler half reports to vLLM each step: its own increments (lookups, staging,
the read side of its cache) plus the worker halves' (saves, loads, the write side of their
cache), read from the stats channel at every step (vLLM asks while processing a step's
output, after the workers published what the step did). Each increment is reported once."""

from __future__ import annotations

from typing import Any

from ec_redis.cache import TieredCache
from ec_redis.connector.channel import Reader
from ec_redis.connector.scheduler import SchedulerSide
from ec_redis.connector.stats import COUNTERS, MAX_OBSERVATIONS, Deltas, read_counters


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
        scheduler.pending_work.worker_gauges = self._worker_gauges  # pending.py reads them

    def take(self) -> dict[str, Any]:
        """Increments since the last call: counters, changed gauges, new observations."""
        self._scheduler.begin_report()  # before reading anything a lookup may still change
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
        increments, gauges, observed = self._reader.take()
        self._worker_gauges.update(gauges)
        for name, change in increments.items():
            self._worker_totals[name] = self._worker_totals.get(name, 0) + change
        return increments, observed

    def acks(self) -> dict[str, int]:
        """What the workers may forget (sent to them in the step metadata)."""
        return self._reader.acks()

    def snapshot(self) -> dict[str, Any]:
        """Cumulative: this half's counters plus the worker halves' as last read; every
        exported counter is there, at 0 until it first counts (a missing one is a bug)."""
        zeros = dict.fromkeys(COUNTERS, 0)
        return {**zeros, **self._own(), **self._worker_totals, **self._worker_gauges}

    def close(self) -> None:
        self._reader.remove_all()
