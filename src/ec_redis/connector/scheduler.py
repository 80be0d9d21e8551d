"""Scheduler half: decides, without blocking a step, which items the worker will load.

Call order driven by vLLM each step (per request with multimodal items)::

    ensure_cache_available(request)   # start batched lookups; hold the request until staged
    has_cache_item(identifier)        # True only for items staged *and* validated
    update_state_after_alloc(request, index)   # record the promised loads
    build_connector_meta()            # hand the staged tensors to the worker; reset
    update_connector_output(output)   # worker -> scheduler: queued writes
    take_unavailable_requests()       # requests to fail as retryable (on_missing="fail")
    request_finished(request)         # forget its staging

A "yes" is a promise the worker must keep (vLLM crashes the step otherwise), so it is only
given for bytes already in this process, checked for dtype, width and row count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ec_redis.cache import TieredCache
from ec_redis.config import ConnectorOptions
from ec_redis.connector.metadata import ECRedisMetadata, ECRedisWorkerMetadata, LoadItem
from ec_redis.connector.staging import ABSENT, FETCHING, STAGED, Stager
from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters

PUSH_REPORT_FRESH_S = 10.0


class TensorCheck:
    """What a fetched tensor must look like to be handed to vLLM."""

    def __init__(self, dtype: torch.dtype, width_for: Callable[[str], int | None]) -> None:
        self.dtype = dtype
        self._width_for = width_for

    def problem(self, tensor: torch.Tensor, modality: str, num_embeds: int) -> str | None:
        if tensor.dim() != 2:
            return f"rank {tensor.dim()}, expected 2"
        if tensor.dtype != self.dtype:
            return f"dtype {tensor.dtype}, expected {self.dtype}"
        if tensor.shape[0] != num_embeds:
            return f"{tensor.shape[0]} rows, the request expects {num_embeds}"
        width = self._width_for(modality)
        if width is not None and tensor.shape[1] != width:
            return f"width {tensor.shape[1]}, expected {width}"
        return None


class SchedulerSide:
    def __init__(
        self,
        cache: TieredCache,
        options: ConnectorOptions,
        check: TensorCheck,
        *,
        is_producer: bool,
        is_consumer: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache = cache
        self._options = options
        self._check = check
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        # A pure consumer waits for items its encoder instance is still writing.
        self._wait_s = options.consumer_wait_s if is_consumer and not is_producer else 0.0
        self._clock = clock
        self._lookup_wait_s = options.lookup_wait_s
        self.counters = Counters()
        self._fetch_seconds: list[float] = []
        self._stager = Stager(
            cache,
            threads=options.lookup_threads,
            stage_bytes=options.stage_bytes,
            clock=clock,
            on_fetch=self._fetch_seconds.append,
        )
        self._first_seen: dict[str, float] = {}
        # Items vLLM already allocated per request (loaded or computed): a chunked prefill
        # calls ensure_cache_available again while they sit in vLLM's encoder cache.
        self._allocated: dict[str, set[str]] = {}
        self._validated: set[str] = set()
        self._loads: dict[str, LoadItem] = {}
        self._unavailable: set[str] = set()
        self._pending_writes = 0
        self._pending_reported_at = 0.0
        self.reported_queue_depth = 0.0  # the write-queue gauge as last reported to vLLM
        self._log = RateLimitedLog()

    # -- the scheduling hot path -----------------------------------------------------------

    def ensure_cache_available(
        self, request: Any, num_computed_tokens: int, _waited: bool = False
    ) -> bool:
        if not self._is_consumer:
            return True  # producers never load; has_cache_item answers from staging alone
        now = self._clock()
        first = self._first_seen.setdefault(request.request_id, now)
        ready = True
        to_fetch: list[str] = []
        allocated = self._allocated.get(request.request_id, ())
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # already consumed by the model
            item = feature.identifier
            if item in allocated:
                continue  # in vLLM's encoder cache already
            entry = self._stager.entry(item)
            if entry is None:
                if self._stager.has_room():
                    to_fetch.append(item)
                    ready = False
                continue  # no room to stage: encode locally
            if entry.state == FETCHING:
                ready = False
            elif entry.state == STAGED:
                self._validate(request, index, item, entry.tensor)
            elif entry.state == ABSENT and not self._give_up(request, now, first):
                ready = False
                if now - entry.since >= self._options.recheck_s:
                    to_fetch.append(item)
        if to_fetch:
            self._stager.fetch(to_fetch, request.request_id)
        if not ready:
            self.counters.inc("waits")
            if not _waited and self._lookup_wait_s > 0 and (to_fetch or self._fetching(request)):
                # A short, bounded wait: small items become ready in this very call, and a
                # spinning engine loop no longer starves the lookup threads of the GIL.
                self._stager.wait(self._lookup_wait_s)
                return self.ensure_cache_available(request, num_computed_tokens, _waited=True)
        return ready

    def _fetching(self, request: Any) -> bool:
        for feature in request.mm_features:
            entry = self._stager.entry(feature.identifier)
            if entry is not None and entry.state == FETCHING:
                return True
        return False

    def _give_up(self, request: Any, now: float, first: float) -> bool:
        """An item is still absent: stop waiting (encode locally) or fail the request."""
        if now - first < self._wait_s:
            return False
        if self._options.on_missing == "fail":
            if request.request_id not in self._unavailable:
                self._unavailable.add(request.request_id)
                self.counters.inc("unavailable_requests")
            return False  # keep holding it until vLLM fails it
        return True

    def _validate(self, request: Any, index: int, item: str, tensor: Any) -> None:
        if item in self._validated:
            return
        feature = request.mm_features[index]
        problem = self._check.problem(
            tensor, feature.modality, request.get_num_encoder_embeds(index)
        )
        if problem is None:
            self._validated.add(item)
            return
        self._stager.drop(item)  # not deleted: another request may legitimately match it
        self.counters.inc("rejected_items")
        self._log.warning(
            "reject", "ec_redis: cached item %r refused (%s); encoding it", item, problem
        )

    def has_cache_item(self, identifier: str) -> bool:
        entry = self._stager.entry(identifier)
        found = entry is not None and entry.state == STAGED and identifier in self._validated
        if not found and self._is_consumer:
            self.counters.inc("local_fallbacks")
        return found

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        item = request.mm_features[index].identifier
        self._allocated.setdefault(request.request_id, set()).add(item)
        if not self._is_consumer or item not in self._validated:
            return  # computed locally
        tensor = self._stager.take(item)
        self._validated.discard(item)
        if tensor is None:  # cannot happen: has_cache_item said yes from the same entry
            raise RuntimeError(f"ec_redis: promised item {item!r} is no longer staged")
        self._loads[item] = LoadItem(item, request.get_num_encoder_embeds(index), tensor)

    def build_connector_meta(self, scheduler_output: Any) -> ECRedisMetadata:
        meta = ECRedisMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        self._stager.expire()
        return meta

    # -- after the step ----------------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(meta, ECRedisWorkerMetadata):
            self._pending_writes = meta.pending_writes
            self._pending_reported_at = self._clock()

    def has_pending_push_work(self) -> bool:
        """Keep a producer-only engine stepping while its Redis writes drain.

        With the worker in this process the shared cache's write queue says so directly
        (vLLM's V1 encoder-only path drops worker metadata); otherwise the last report from
        the workers counts, for a bounded time.
        """
        if not self._is_producer or self._is_consumer:
            return False
        writer = self._cache.writer
        if writer is not None and (writer.depth()[0] > 0 or self.reported_queue_depth > 0):
            return True  # one more step after draining reports the queue as empty
        fresh = self._clock() - self._pending_reported_at < PUSH_REPORT_FRESH_S
        return self._pending_writes > 0 and fresh

    def take_unavailable_requests(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._first_seen.pop(request.request_id, None)
        self._allocated.pop(request.request_id, None)
        self._stager.release_request(request.request_id)
        return False, None

    def update_state_after_free(self, request: Any, index: int) -> None:
        item = request.mm_features[index].identifier
        self._validated.discard(item)
        self._allocated.get(request.request_id, set()).discard(item)

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counters plus the staged-bytes gauge."""
        out: dict[str, Any] = dict(self.counters.snapshot())
        out["staged_bytes"] = self._stager.staged_bytes
        return out

    def take_observations(self) -> dict[str, list[float]]:
        if not self._fetch_seconds:
            return {}
        taken, self._fetch_seconds[:] = list(self._fetch_seconds), []
        return {"fetch_seconds": taken}

    def shutdown(self) -> None:
        self._stager.close()
