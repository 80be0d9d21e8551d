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
from ec_redis.connector.ids import cache_id
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

    def discard(self, item: str) -> None:
        self._items.pop(item, None)

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
        save_wait_s: float = 0.0,
    ) -> None:
        self._cache = cache
        self._device = device
        self._is_producer = is_producer
        self._saves = saves  # producer on the rank that publishes (TP rank 0)
        self._save_wait_s = save_wait_s
        self._step_saves: list[str] = []  # saved this step, awaited at its end
        self._published = _RecentSet()
        self._salted = _RecentSet()  # items last encoded for requests with a cache_salt
        self.counters = Counters()
        self._observations = Observations()
        self._log = RateLimitedLog()
        if saves:
            cache.warm_writes()  # the writer process starts now, not at the first save

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], meta: Any) -> None:
        if not isinstance(meta, ECRedisMetadata) or not meta.loads:
            return
        started = time.perf_counter()
        for load in meta.loads:
            # Always replace: the scheduler promised only what vLLM's encoder cache does not
            # hold, so a tensor already under the id is one vLLM evicted this very pass (it
            # keeps the worker's copy when it allocates the id again: the new value
            # overwrites it), possibly another item's or another salt's.
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

    def save_caches(
        self,
        encoder_cache: dict[str, torch.Tensor],
        mm_hash: str,
        meta: Any = None,
        *,
        fresh: bool = True,
    ) -> None:
        """Save one encoder output: under the cache ids the step's metadata names for it
        (it was encoded for requests with a ``cache_salt``), else under its identifier.
        ``fresh``: encoded this step (else cached earlier: ``start_save_caches``)."""
        if not self._saves:
            return
        tensor = encoder_cache.get(mm_hash)
        if tensor is None or cache_id(mm_hash, None) is None:
            return  # a request-scoped id names no content: never published (see ids.py)
        save_as = meta.save_as.get(mm_hash) if isinstance(meta, ECRedisMetadata) else None
        if save_as:
            self._salted.add(mm_hash)  # encoded for salted requests: theirs alone
        elif not fresh and mm_hash in self._salted:
            return  # a salted encode of an earlier step is never published unsalted
        else:
            self._salted.discard(mm_hash)
        started = time.perf_counter()
        stored = False
        for key in save_as or (mm_hash,):
            stored |= self._put(key, tensor)
        self._published.add(mm_hash)  # tried once: a failure is not retried every step
        if not stored:
            self.counters.inc("save_errors")
            return
        nbytes = tensor_nbytes(tensor)
        self.counters.inc("saved_items")
        self.counters.inc("saved_bytes", nbytes)
        self._observe("item_mb", nbytes / 1e6)
        self._observe("save_seconds", time.perf_counter() - started)

    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor], meta: Any = None) -> None:
        """Publish items cached in earlier steps that never went through ``save_caches``,
        and those the scheduler half found missing from Redis while vLLM's encoder cache
        serves them (``republish``: evicted from Redis, or needed under another salt)."""
        if not self._saves:
            return
        for mm_hash in list(encoder_cache):
            if mm_hash not in self._published:
                self.save_caches(encoder_cache, mm_hash, meta, fresh=False)
        for item, key, rows in meta.republish if isinstance(meta, ECRedisMetadata) else ():
            tensor = encoder_cache.get(item)
            if tensor is None or tensor.dim() != 2 or tensor.shape[0] != rows:
                continue  # not (or no longer) the item the request names
            if self._put(key, tensor):
                self.counters.inc("republished_items")

    def _put(self, key: str, tensor: torch.Tensor) -> bool:
        """Hand one entry to the cache; a pure producer's step then awaits its write."""
        try:
            # The cache keeps a reference (and copies device tensors to host on a side
            # stream ordered after the encoder), so vLLM freeing the entry is safe. It
            # returns False on an internal failure (counted and logged there).
            stored = self._cache.put(key, tensor)
        except Exception as exc:  # a failed save costs sharing, never the step
            self._log.warning("save", "ec_redis: cannot save %r: %r", key, exc)
            return False
        if stored:
            self._step_saves.append(key)
        return stored

    def worker_meta(self, meta: Any) -> ECRedisWorkerMetadata:
        """Queued writes, and the step whose metadata this rank just ran (its loads are done,
        so the scheduler half may drop their staged files). Called at the end of every step
        (V1 and V2), after its saves: a pure producer first waits for them to land. Writes
        handed over earlier whose outcomes are in are collected here (never waiting)."""
        self._await_step_saves()
        if self._saves:
            self._collect_writes()
        writer = self._cache.writer
        pending = writer.depth()[0] if writer is not None and self._saves else 0
        step = meta.step if isinstance(meta, ECRedisMetadata) else -1
        return ECRedisWorkerMetadata(pending, step)

    def _await_step_saves(self) -> None:
        """Hand the step's saves over; a pure producer's step ends once those not handed to a
        writer process are in Redis (at most ``save_wait_s``).

        vLLM answers a request right after the step that encoded it, and an EPD proxy then
        sends it to PD at once, so PD looks for the items at about the time this step ends.
        Left to the writer thread alone, a write trailed the answer by up to 10 s in a busy
        worker process (40 requests of 2 images at concurrency 8, two servers on two cores):
        between steps vLLM's worker spins on its input queue and the writer thread gets the
        GIL and a core only now and then, so PD gave up after ``consumer_wait_s`` and
        encoded the items itself. Waiting here releases the GIL and blocks the main thread,
        so the writer runs at full speed; the step takes one Redis write longer.

        Writer processes that read an item where it is take the step's writes first, from
        this thread, with one message each (``cache.dispatch_writes``): those land with no
        thread of this process needed, so the step does not wait for them."""
        if not self._step_saves:
            return
        keys, self._step_saves = self._step_saves, []
        try:
            handed = set(self._cache.dispatch_writes(keys))
        except Exception as exc:  # a shortcut only: the writes stay queued, and are waited for
            self._log.warning("dispatch", "ec_redis: cannot hand writes over: %r", exc)
            handed = set()
        keys = [key for key in keys if key not in handed]
        if not keys or self._save_wait_s <= 0:
            return
        if self._cache.wait_written(keys, self._save_wait_s):
            return
        writer = self._cache.writer
        late = sum(writer.pending(key) is not None for key in keys) if writer else 0
        self.counters.inc("save_wait_timeouts", late)
        self._log.warning(
            "save-wait", "ec_redis: %d saved item(s) not in Redis after save_wait_s=%s; "
            "the encoder answers before PD can find them", late, self._save_wait_s,
        )  # fmt: skip

    def _collect_writes(self) -> None:
        try:
            self._cache.collect_writes()
        except Exception as exc:  # a shortcut only: a writer thread collects them later
            self._log.warning("collect", "ec_redis: cannot collect handed writes: %r", exc)

    def _observe(self, name: str, value: float) -> None:
        self._observations.add(name, value)

    def forget_observations(self, upto: int) -> None:
        """The scheduler half has reported observations up to number ``upto``."""
        self._observations.trim(upto)

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counters (for tests and tools)."""
        return dict(self.counters.snapshot())

    def channel_snapshot(self) -> dict[str, Any]:
        """What this half publishes for the scheduler half to report (``channel.py``): its
        cumulative counters, its cache's write side when it saves, recent observations."""
        # The queue depth before the counters: a write that lands in between is then counted
        # and still shown queued (the next publish says 0), never done but not yet counted.
        writer = self._cache.writer
        depth = writer.depth()[0] if writer is not None and self._saves else None
        counters: dict[str, float] = dict(self.counters.snapshot())
        gauges: dict[str, float] = {}
        if self._saves:
            written, gauges = write_counters(self._cache.stats())
            counters.update(written)
            if depth is not None:
                gauges["write_queue_depth"] = depth
        return {
            "counters": counters,
            "gauges": gauges,
            "observations": self._observations.snapshot(),
        }
