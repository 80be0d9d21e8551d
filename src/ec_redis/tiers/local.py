"""Shared machinery of the in-process tiers: a locked byte LRU with counters."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from ec_redis.stats import Counters
from ec_redis.tiers.base import Tier
from ec_redis.tiers.lru import ByteLRU

V = TypeVar("V")


class LocalTier(Tier, Generic[V]):
    """A tier whose entries live in this process, bounded by ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, getsizeof: Callable[[V], int]) -> None:
        self._lru: ByteLRU[V] = ByteLRU(capacity_bytes, getsizeof)
        self._lock = threading.Lock()
        self.counters = Counters()

    @property
    def enabled(self) -> bool:
        return self._lru.maxsize > 0

    def _lookup(self, key: str) -> V | None:
        with self._lock:
            value = self._lru.get(key)
        self.counters.inc("hits" if value is not None else "misses")
        return value

    def _insert(self, key: str, value: V) -> list[tuple[str, V]] | None:
        """Insert; return the evicted entries, or ``None`` when the value can never fit."""
        with self._lock:
            evicted = self._lru.put(key, value)
        if evicted is None:
            self.counters.inc("rejected_too_large")
        else:
            self.counters.inc("evictions", len(evicted))
        return evicted

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._lru

    def delete(self, key: str) -> None:
        with self._lock:
            self._lru.pop(key)

    def close(self) -> None:
        with self._lock:
            self._lru.clear()

    def stats(self) -> dict[str, float]:
        with self._lock:
            out = {"bytes": float(self._lru.currsize), "entries": float(len(self._lru))}
        out["capacity_bytes"] = float(self._lru.maxsize)
        out.update(self.counters.snapshot())
        return out
