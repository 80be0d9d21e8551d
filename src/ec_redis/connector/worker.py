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

import time
from collections import OrderedDict
from typing import Any

import torch

from ec_redis.cache import TieredCache
from ec_redis.connector.channel import Observations
from ec_redis.connector.ids import is_request_scoped
from ec_redis.connector.metadata import ECRedisMetadata, ECRedisWorkerMetadata, LoadItem
from ec_redis.connector.stats import write_counters
from ec_redis.connector.transport import read_staged
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
        self._ran_step = -1  # the last step this half finished (its counters include it)
        self.counters = Counters()
        self._observations = Observations()
        self.changed = False  # since the last publish on the stats channel
        self._log = RateLimitedLog()

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], meta: Any) -> None:
        if not isinstance(meta, ECRedisMetadata) or not meta.loads:
            return
        started = time.perf_counter()
        for load in meta.loads:
            if load.mm_hash in encoder_cache:
                continue
            tensor = self._to_rank(load)
            encoder_cache[load.mm_hash] = tensor
            self._published.add(load.mm_hash)  # it came from the cache: nothing to publish
            nbytes = tensor_nbytes(tensor)
            self.counters.inc("loaded_items")
            self.counters.inc("loaded_bytes", nbytes)
            self._observe("item_mb", nbytes / 1e6)
        self._observe("load_seconds", time.perf_counter() - started)

    def _to_rank(self, load: LoadItem) -> torch.Tensor:
        """The load's bytes as vLLM's own tensor on this rank's device, never memory shared
        with the cache: on CPU a staged file is mapped privately (no copy) and an inline
        tensor cloned; on a GPU one copy through a pinned block, ordered before later work on
        the current stream (the staged bytes may go as soon as this returns)."""
        staged = read_staged(load)
        if self._device.type == "cpu" and load.tensor is None:
            return staged
        return self._cache.transfer.upload(staged, self._device)

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
            self.changed = True
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

    def worker_meta(self, meta: Any) -> ECRedisWorkerMetadata:
        """Queued writes, and the step whose metadata this rank just ran (its loads are done,
        so the scheduler half may drop their staged files)."""
        writer = self._cache.writer
        pending = writer.depth()[0] if writer is not None and self._saves else 0
        step = meta.step if isinstance(meta, ECRedisMetadata) else -1
        self._ran_step = max(self._ran_step, step)  # vLLM calls this last in every step
        return ECRedisWorkerMetadata(pending, step)

    def _observe(self, name: str, value: float) -> None:
        self._observations.add(name, value)
        self.changed = True

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counters (for tests and tools)."""
        return dict(self.counters.snapshot())

    def channel_snapshot(self) -> dict[str, Any]:
        """What this half publishes for the scheduler half to report (``channel.py``): the
        last step it finished, its cumulative counters (read after the step, so they include
        that step's), its cache's write side when it saves, recent observations."""
        step = self._ran_step
        counters: dict[str, float] = dict(self.counters.snapshot())
        gauges: dict[str, float] = {}
        if self._saves:
            written, gauges = write_counters(self._cache.stats())
            counters.update(written)
        return {
            "step": step,
            "counters": counters,
            "gauges": gauges,
            "observations": self._observations.snapshot(),
        }
