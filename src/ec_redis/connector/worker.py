"""Worker half: puts promised items into vLLM's encoder cache; saves new encoder outputs.

Call order driven by vLLM's model runner each step::

    bind_connector_metadata(meta)
    start_save_caches(encoder_cache)   # producers: publish items not yet published
    start_load_caches(encoder_cache)   # consumers: copy staged items onto this rank's device
    ... encoder runs ... save_caches(encoder_cache, mm_hash)   # producers, per new item
    get_finished() / build_connector_worker_meta()
    clear_connector_metadata()

Nothing here touches the network: loads arrive as host tensors in the step metadata, and
saves go to the cache, whose Redis writes run on a background thread. Saves come from TP
rank 0 only; loads happen on every rank.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from ec_redis.cache import TieredCache
from ec_redis.connector.ids import is_request_scoped
from ec_redis.connector.metadata import ECRedisMetadata, ECRedisWorkerMetadata
from ec_redis.connector.stats import Deltas
from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters
from ec_redis.tiers.base import tensor_nbytes

_REMEMBERED = 65536


class _RecentSet:
    """A bounded set of recently seen ids (oldest forgotten first)."""

    def __init__(self, maxsize: int = _REMEMBERED) -> None:
        self._items: OrderedDict[str, None] = OrderedDict()
        self._maxsize = maxsize

    def add(self, item: str) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        while len(self._items) > self._maxsize:
            self._items.popitem(last=False)

    def __contains__(self, item: object) -> bool:
        return item in self._items


class WorkerSide:
    def __init__(
        self,
        cache: TieredCache,
        device: torch.device,
        *,
        is_producer: bool,
        saves: bool,
    ) -> None:
        self._cache = cache
        self._device = device
        self._is_producer = is_producer
        self._saves = saves  # producer on the rank that publishes (TP rank 0)
        self._published = _RecentSet()
        self.counters = Counters()
        self._observations: dict[str, list[float]] = {"load_seconds": [], "save_seconds": []}
        self._stats_lock = threading.Lock()
        self._deltas = Deltas()
        self._log = RateLimitedLog()

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], meta: Any) -> None:
        if not isinstance(meta, ECRedisMetadata) or not meta.loads:
            return
        started = time.perf_counter()
        for load in meta.loads:
            if load.mm_hash in encoder_cache:
                continue
            # One copy that owns its memory (never aliasing the cache's read-only bytes): a
            # clone on CPU; on a GPU, through a pinned block, ordered before later work on the
            # current stream, and the staged tensor may be dropped as soon as it returns.
            tensor = self._cache.transfer.upload(load.tensor, self._device)
            encoder_cache[load.mm_hash] = tensor
            self._published.add(load.mm_hash)  # it came from the cache: nothing to publish
            nbytes = tensor_nbytes(tensor)
            self.counters.inc("loaded_items")
            self.counters.inc("loaded_bytes", nbytes)
            self._observe("item_mb", nbytes / 1e6)
        self._observe("load_seconds", time.perf_counter() - started)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if not self._saves:
            return
        tensor = encoder_cache.get(mm_hash)
        if tensor is None or is_request_scoped(mm_hash):
            return  # a request-scoped id names no content: never published (see ids.py)
        started = time.perf_counter()
        try:
            # The cache keeps a reference (and copies device tensors to host on a side
            # stream ordered after the encoder), so vLLM freeing the entry is safe. It
            # returns False on an internal failure (counted and logged there).
            stored = self._cache.put(mm_hash, tensor)
        except Exception as exc:  # a failed save costs sharing, never the step
            self._log.warning("save", "ec_redis: cannot save %r: %r", mm_hash, exc)
            stored = False
        if not stored:
            self.counters.inc("save_errors")
            return
        self._published.add(mm_hash)
        nbytes = tensor_nbytes(tensor)
        self.counters.inc("saved_items")
        self.counters.inc("saved_bytes", nbytes)
        self._observe("item_mb", nbytes / 1e6)
        self._observe("save_seconds", time.perf_counter() - started)

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        """Publish items cached in earlier steps that never went through ``save_caches``."""
        if not self._saves:
            return
        for mm_hash in list(encoder_cache):
            if mm_hash not in self._published:
                self.save_caches(encoder_cache, mm_hash)

    def worker_meta(self) -> ECRedisWorkerMetadata:
        writer = self._cache.writer
        return ECRedisWorkerMetadata(writer.depth()[0] if writer is not None and self._saves else 0)

    def _observe(self, name: str, value: float) -> None:
        series = self._observations.setdefault(name, [])
        if len(series) < 1024:
            series.append(value)

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counters (for tests and tools)."""
        return dict(self.counters.snapshot())

    def take_stats(self) -> dict[str, Any]:
        """Counter increments and observations since the last call (whoever calls: vLLM's V2
        runner on the worker, or the co-located scheduler half under V1)."""
        with self._stats_lock:
            out = self._deltas(self.counters.snapshot())
            for name, series in self._observations.items():
                if series:
                    out[name] = list(series)
                    series.clear()
        return out
