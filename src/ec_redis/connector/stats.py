"""Connector metrics: an ``ECConnectorStats`` that vLLM logs, and Prometheus metrics named
``vllm:ec_redis_*`` that vLLM's frontend exports.

The data dict holds plain counters (summed across ranks and intervals) and short lists of
observations for histograms (capped, so a slow logger never grows memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

MAX_OBSERVATIONS = 1024
# Counters, with the Prometheus name each one is exported as (vllm:ec_redis_<name>_total).
COUNTERS: dict[str, str] = {
    "hits_gpu": "Items served from the GPU tier",
    "hits_cpu": "Items served from the CPU tier",
    "hits_redis": "Items served from Redis",
    "misses": "Items looked up and not found in any tier",
    "loaded_items": "Items put into vLLM's encoder cache by the connector",
    "loaded_bytes": "Bytes put into vLLM's encoder cache by the connector",
    "saved_items": "Encoder outputs handed to the cache by producers",
    "saved_bytes": "Bytes of encoder outputs handed to the cache by producers",
    "save_errors": "Encoder outputs the cache refused (too large, or an internal error)",
    "republished_items": "Items written again from vLLM's encoder cache because Redis lacked them",
    "redis_written_bytes": "Bytes written to Redis",
    "redis_errors": "Failed Redis reads (counted as misses)",
    "redis_write_errors": "Failed Redis writes (the entry stays local; sharing is lost)",
    "bad_blobs": "Corrupt, truncated or foreign blobs rejected and deleted",
    "oversized_blobs": "Entries larger than max_blob_bytes, refused from their header alone",
    "foreign_keys": "Keys of another Redis type where an entry belongs (each one miss)",
    "incomplete_entries": "Published heads whose chunks are gone (the producer republishes)",
    "write_drops": "Pending Redis writes dropped because the write queue was full",
    "writer_process_starts": "Writer processes started (Redis writes run outside the engine)",
    "writer_process_deaths": "Writer processes that died (mid-write or idle) or hung mid-write",
    "writer_fallback_writes": "Redis writes made on the engine's thread: no writer process was up",
    "writer_handed_over_writes": "Redis writes handed to a writer process that read them in place",
    "rejected_items": "Fetched items refused because dtype/width/rows disagreed with the request",
    "local_fallbacks": "Items encoded locally because the cache could not provide them",
    "unavailable_requests": "Requests failed as retryable because an item was unavailable",
    "unavailable_absent": "Requests failed: an item was still missing after consumer_wait_s",
    "unavailable_timeout": "Requests failed: a lookup was in flight longer than fetch_wait_s",
    "unavailable_stage_full": "Requests failed: staging had no room for an item in time",
    "unavailable_refused": "Requests failed: a fetched item had the wrong dtype, width or size",
    "unavailable_rows": "Requests failed: one id named items of different sizes",
    "unavailable_error": "Requests failed: an internal error where no local encode is possible",
    "unavailable_uncacheable": "Requests failed: a media-less item's id can never be cached",
    "waits": "Scheduler steps a request was held back waiting for an item",
    "skipped_encodes": "Items a producer did not encode because they were already published",
    "stage_full": "Items encoded locally because staging had no room (stage_bytes)",
    "stage_overflow": "Fetched items dropped because they outgrew their staging reservation",
    "staged_files": "Fetched items staged as host-local files the worker processes read",
    "stage_inline_fallbacks": "Items staged inline (in the step metadata) because a file failed",
    "stage_spare_hits": "Staged files that were spares made ahead of time (no new tmpfs pages)",
    "internal_errors": "Unexpected errors inside connector hooks (each fell back to encoding)",
    "save_wait_timeouts": "Saved items not yet in Redis when their step's save_wait_s ran out",
    "lease_claims": "New items this instance claimed in Redis and so encodes (single flight)",
    "lease_waits": "Items a request here waited for because another instance held their lease",
    "lease_loads": "Items loaded after waiting on another instance's lease",
    "lease_skips": "Items a pure producer skipped after waiting on another instance's lease",
    "lease_takeovers": "Items encoded here because another instance's lease deadline passed",
    "lease_encodes_saved": "Encodes single flight saved here (lease_loads plus lease_skips)",
    "lease_releases": "Leases given back unfulfilled (the request ended before its encode)",
}
GAUGES: dict[str, str] = {
    "breaker_state": "Redis circuit breaker: 0 closed, 1 open, 2 half-open",
    "write_queue_depth": "Redis writes queued or in flight",
    "staged_bytes": "Bytes fetched and held for promised loads",
    "reserved_bytes": "Bytes reserved for lookups in flight (counted against stage_bytes)",
    "transit_bytes": "Staged bytes kept only by loads in transit (counted against stage_bytes)",
    "spare_bytes": "Bytes held in spare staging buffers made ahead of time",
}
HISTOGRAMS: dict[str, tuple[str, list[float]]] = {
    "item_mb": (
        "Size of loaded or saved items in MB",
        [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 250],
    ),
    "fetch_seconds": (
        "Latency of a scheduler-side batch fetch (local tiers, then Redis)",
        [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5],
    ),
    "load_seconds": (
        "Time start_load_caches spends per step",
        [0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25],
    ),
    "save_seconds": (
        "Time save_caches spends per item (the Redis write happens off the step)",
        [0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01],
    ),
}


@dataclass
class ECRedisStats(ECConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                merged = self.data.get(key, []) + value
                self.data[key] = merged[-MAX_OBSERVATIONS:]
            elif key in GAUGES:
                self.data[key] = value
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, list):
                if value:
                    ordered = sorted(value)
                    out[f"{key}_p50"] = round(ordered[len(ordered) // 2], 6)
                    out[f"{key}_max"] = round(ordered[-1], 6)
            else:
                out[key] = value
        out.update(hit_rate(self.data))
        return out

    def is_empty(self) -> bool:
        # Deltas carry only what changed, so a gauge that fell to 0 is still news.
        return not self.data


class ECRedisPromMetrics(ECConnectorPromMetrics):
    """Creates the ``vllm:ec_redis_*`` metrics per engine and records stats data into them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._per_engine(self._counter_cls, name, doc) for name, doc in COUNTERS.items()
        }
        self._gauges = {
            name: self._per_engine(self._gauge_cls, name, doc, multiprocess_mode="mostrecent")
            for name, doc in GAUGES.items()
        }
        self._histograms = {
            name: self._per_engine(self._histogram_cls, name, doc, buckets=buckets)
            for name, (doc, buckets) in HISTOGRAMS.items()
        }

    def _per_engine(self, cls: Any, name: str, doc: str, **kwargs: Any) -> dict[int, Any]:
        metric = cls(
            name=f"vllm:ec_redis_{name}", documentation=doc, labelnames=self._labelnames, **kwargs
        )
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self._counters and value:
                self._counters[key][engine_idx].inc(value)
            elif key in self._gauges:
                self._gauges[key][engine_idx].set(value)
            elif key in self._histograms and isinstance(value, list):
                for observation in value:
                    self._histograms[key][engine_idx].observe(observation)


def hit_rate(data: dict[str, Any]) -> dict[str, float]:
    """``{"hit_rate": items served / items needed}``, or ``{}`` when nothing was needed.

    Items needed = served (a hit in any tier) + encoded locally because the cache could not
    provide them (``local_fallbacks``). Not ``misses``: a consumer waiting for an item looks
    again every ``recheck_s``, and each look that finds nothing is a miss, so one item that
    arrives after ten looks would count as one hit and ten misses. The dashboard's hit-rate
    panels use the same ratio."""
    hits = sum(float(data.get(f"hits_{tier}", 0)) for tier in ("gpu", "cpu", "redis"))
    needed = hits + float(data.get("local_fallbacks", 0))
    return {"hit_rate": round(hits / needed, 4)} if needed else {}


def metric_names() -> list[str]:
    """Every Prometheus series name the connector exports (for dashboards and tests)."""
    return (
        [f"vllm:ec_redis_{n}_total" for n in COUNTERS]
        + [f"vllm:ec_redis_{n}" for n in GAUGES]
        + [f"vllm:ec_redis_{n}_bucket" for n in HISTOGRAMS]
    )


class Deltas:
    """Turns cumulative counters into per-interval increments (vLLM sums intervals)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def __call__(self, current: dict[str, Any]) -> dict[str, Any]:
        """Counters as increments, gauges when they changed, observation lists as they are."""
        out: dict[str, Any] = {}
        for key, value in current.items():
            if isinstance(value, list):
                if value:
                    out[key] = value
            elif key in GAUGES:
                if self._last.get(key) != value:
                    out[key] = value
                    self._last[key] = value
            else:
                change = value - self._last.get(key, 0)
                self._last[key] = value
                if change:
                    out[key] = change
        return out


def read_counters(stats: dict[str, Any]) -> dict[str, float]:
    """The read side of ``TieredCache.stats()`` under the connector's metric names (what the
    scheduler half's lookups did). With one cache shared by both halves of a process, each
    half reports only its own side, so nothing is counted twice."""
    redis = stats.get("redis", {})
    out = {
        "hits_gpu": stats.get("gpu", {}).get("hits", 0),
        "hits_cpu": stats.get("cpu", {}).get("hits", 0) + stats.get("pending_write_hits", 0),
        "hits_redis": redis.get("hits", 0),
        "misses": stats.get("misses", 0),
        "redis_errors": redis.get("errors", 0) - redis.get("write_errors", 0),
        "bad_blobs": redis.get("bad_blobs", 0),
        "oversized_blobs": redis.get("oversized", 0),
        "foreign_keys": redis.get("foreign_keys", 0),
        "incomplete_entries": redis.get("describe_incomplete", 0),
    }
    if redis:
        out["breaker_state"] = redis.get("breaker_state", 0)
    return out


def write_counters(stats: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """The write side of ``TieredCache.stats()`` (what the saving worker half's Redis writes
    did): ``(counters, gauges)``."""
    redis = stats.get("redis", {})
    writer = stats.get("writer", {})
    counters = {
        "redis_written_bytes": redis.get("bytes_written", 0),
        "redis_write_errors": redis.get("write_errors", 0),
        "write_drops": writer.get("dropped", 0),
        "writer_process_starts": writer.get("process_starts", 0),
        "writer_process_deaths": writer.get("process_deaths", 0),
        "writer_fallback_writes": writer.get("process_fallback_writes", 0),
        "writer_handed_over_writes": writer.get("process_dispatched", 0),
    }
    gauges = {"write_queue_depth": writer.get("queue_depth", 0)} if writer else {}
    return counters, gauges
