"""Scheduler half: decides, without blocking a step, which items vLLM loads instead of encoding.

Call order driven by vLLM's scheduler (``vllm/v1/core/sched/scheduler.py``) each step::

    ensure_cache_available(request, n)    # per request with items: start lookups; hold the
                                          # request while one of its items is on its way
    has_cache_item(identifier)            # that request's items vLLM would otherwise encode
    update_state_after_alloc(request, i)  # every allocation: a load iff we said yes above
    build_connector_meta(output)          # this step's loads; per-step state resets here
    update_connector_output(output)       # worker -> scheduler: writes still queued
    take_unavailable_requests()           # requests to fail as retryable (on_missing="fail")
    update_state_after_free(request, i)   # the item is consumed: the request lets go of it
    request_finished(request)             # finish or abort: every trace of the request goes

State, and what it dies with:

- **per step**: the answers ``has_cache_item`` gave (each holding what it promised) and the
  loads they became; reset by ``build_connector_meta``. A "yes" is a promise the worker must
  keep (vLLM crashes the step otherwise), so it is given only for bytes already in this
  process, checked for dtype, width and the asking request's rows.
- **per request** (``gate.py``): when it was first seen and which staging entries it wants; gone in
  ``request_finished``. Nothing here mirrors vLLM's own encoder cache: which items a request
  still needs is derived from its status and token count at each call, so a preemption
  (tokens back to 0) simply makes its items needed again.
- **per item**: the staging entry (``staging.py``), alive while a live request wants it.

No hook raises for a cache, Redis or timing condition: problems are counted, logged at a
limited rate, and become local encodes. Per step there is at most one bounded wait, shared
by all requests, and only on a step that scheduled nothing (an engine that would otherwise
spin while lookups run).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ec_redis.cache import TieredCache
from ec_redis.codec import destination
from ec_redis.config import ConnectorOptions
from ec_redis.connector.checks import TensorCheck
from ec_redis.connector.gate import RequestGate
from ec_redis.connector.ids import cache_id, request_salt
from ec_redis.connector.metadata import ECRedisMetadata, ECRedisWorkerMetadata, LoadItem
from ec_redis.connector.pending import PendingWork
from ec_redis.connector.staging import Found, Stager
from ec_redis.connector.transport import InlineTransport
from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters
from ec_redis.tiers.lease import LEASE_COUNTERS, Claim, Lease, claim_value, new_token

MAX_OBSERVATIONS = 1024
HOUSEKEEPING_S = 1.0
# Single flight, auto deadline (lease_ttl_s 0): 3x the p90 of the last measured claim-to-stored
# times, within these bounds; the default until something was measured.
LEASE_AUTO_S = (1.0, 2.0, 5.0)  # (floor, default, ceiling); the claim-to-stored time includes
# the claimant's queueing in vLLM, which a burst multiplies: a short deadline there is a
# duplicate encode (a deadline costs waiters only when the holder never delivers)
LEASE_SAMPLES = 64
MAX_CLAIMS = 4096  # claims remembered for measuring (the oldest go first) ...
CLAIM_MEMORY_S = 2 * LEASE_AUTO_S[2]  # ... and for no longer than two longest deadlines


class LeaseClock:
    """The single-flight lease deadline: ``lease_ttl_s``, or derived from this instance's own
    claim-to-stored times (a claim won, then the writer's announcement of that item: encode
    plus write, as waiters elsewhere meet it). Fed from lookup and subscriber threads."""

    def __init__(self, fixed_s: float, clock: Callable[[], float]) -> None:
        self._fixed_s = fixed_s
        self._clock = clock
        self._lock = threading.Lock()
        self._claimed: OrderedDict[str, float] = OrderedDict()
        self._samples: list[float] = []

    def ttl_ms(self) -> int:
        if self._fixed_s > 0:
            return max(1, int(self._fixed_s * 1000))
        floor, default, ceiling = LEASE_AUTO_S
        with self._lock:
            samples = sorted(self._samples)
        if not samples:
            return int(default * 1000)
        p90 = samples[min(len(samples) - 1, int(len(samples) * 0.9))]
        return int(min(max(3 * p90, floor), ceiling) * 1000)

    def claimed(self, item: str) -> None:
        """Note a lease just set for ``item``; claims never stored (their lease expired)
        are forgotten after ``CLAIM_MEMORY_S`` or beyond ``MAX_CLAIMS``."""
        now = self._clock()
        with self._lock:
            while self._claimed and (
                len(self._claimed) >= MAX_CLAIMS
                or next(iter(self._claimed.values())) < now - CLAIM_MEMORY_S
            ):
                self._claimed.popitem(last=False)
            # A claim it still remembers keeps its time (its lease expired, and this claim
            # takes over from itself): a slow encode is not measured short.
            self._claimed.setdefault(item, now)

    def stored(self, item: str) -> None:
        """A writer announced ``item``: if this instance claimed it, that is one sample."""
        with self._lock:
            since = self._claimed.pop(item, None)
            if since is not None:
                self._samples.append(self._clock() - since)
                del self._samples[:-LEASE_SAMPLES]

    def forget(self, item: str) -> None:
        with self._lock:
            self._claimed.pop(item, None)


class SchedulerSide:
    def __init__(
        self,
        cache: TieredCache,
        options: ConnectorOptions,
        check: TensorCheck,
        *,
        is_producer: bool,
        is_consumer: bool,
        transport: InlineTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache = cache
        self._transport = transport or InlineTransport()
        self._options = options
        self._check = check
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        self._clock = clock
        self.counters = Counters()
        self._fetch_seconds: list[float] = []
        # Single flight (``tiers/lease.py``): instances that may encode claim the items they
        # miss; this process's token names its leases.
        self._single_flight = is_producer and options.single_flight
        self._token = new_token(cache.config.producer_id)
        # An item Redis would refuse (its encode could never end the lease) is never claimed.
        self._claim_limit = cache.config.max_blob_bytes
        self._lease_clock = LeaseClock(options.lease_ttl_s, clock)
        self._releases = ThreadPoolExecutor(1, thread_name_prefix="ec_redis-lease")
        for name in LEASE_COUNTERS:  # present from the start: a zero is a zero, not a gap
            self.counters.inc(name, 0)
        self._stager = Stager(
            self._fetch_tensors if is_consumer else self._check_published,
            threads=options.lookup_threads,
            stage_bytes=options.stage_bytes,
            check=check.problem,
            keep=self._transport.stage,
            discard=self._transport.discard,
            clock=clock,
            on_fetch=self._observe_fetch,
            outside=self._transport.outside_bytes,
            release=self._release_lease,
        )
        self._gate = RequestGate(
            self._stager,
            check,
            options,
            is_producer=is_producer,
            is_consumer=is_consumer,
            counters=self.counters,
            clock=clock,
        )
        # Per step (reset by build_connector_meta).
        self._current: Any = None  # the request ensure_cache_available saw last
        self._answers: dict[tuple[str, str], Found] = {}  # (request id, item): promised
        self._save_as: dict[str, set[str]] = {}  # item -> cache ids of salted local encodes
        self._allocated: set[tuple[str, str]] = set()  # (request id, item) allocated
        self._loads: dict[str, LoadItem] = {}
        self._step_start: float | None = None
        self._step = 0  # numbers the metadata; workers acknowledge the steps they ran
        self.pending_work = PendingWork(
            self._stager, cache, pure_producer=is_producer and not is_consumer, clock=clock
        )
        self._next_housekeeping = 0.0
        self._log = RateLimitedLog()
        # A pure consumer hears the moment a producer stores an item it may wait for; so
        # does a single-flight instance (items other instances hold the lease of).
        waits = is_consumer and not is_producer and options.consumer_wait_s > 0
        listen = (waits or self._single_flight) and options.push_notifications
        self._subscription = cache.subscribe(self._on_stored) if listen else None

    def _on_stored(self, item: str) -> object:
        """A writer announced ``item`` (subscriber thread). An instance that may encode
        waits only on another instance's lease: an item missing here for any other reason
        (its own lease: it encodes, or just wrote, it; or its first look still in flight,
        which a busy machine can make outlast the encode and write) is not looked up
        again."""
        self._lease_clock.stored(item)
        if self._is_producer:
            entry = self._stager.get(item)
            lease = None if entry is None else entry.lease
            if entry is not None and (lease is None or lease.won):
                return False
        return self._stager.nudge(item)

    # -- lookups (run on the stager's threads) ----------------------------------------------

    def _claim(self, items: list[str]) -> Claim | None:
        if not self._single_flight:
            return None
        entries = {
            item: entry
            for item, entry in self._stager.claims(items).items()
            if self._check.reserve(entry.modality, entry.rows) < self._claim_limit
        }
        if not entries:
            return None
        rows = {item: entry.rows for item, entry in entries.items()}
        looks = frozenset(item for item, entry in entries.items() if entry.look_only)
        return Claim(self._token, self._lease_clock.ttl_ms(), rows, look_only=looks)

    def _fetch_tensors(self, items: list[str]) -> dict[str, Found | Lease | None]:
        # Host tensors that own their memory: staged bytes may cross to worker processes.
        # A read may land straight in a file staged for the workers (``spares.py``).
        claim = self._claim(items)
        with destination.lending(self._transport.lend):
            found = self._cache.get_many(items, on_host=True, claim=claim)
        out: dict[str, Found | Lease | None] = {
            item: None if t is None else Found(t.dtype, tuple(t.shape), t)
            for item, t in found.items()
        }
        return self._with_leases(out, claim)

    def _check_published(self, items: list[str]) -> dict[str, Found | Lease | None]:
        # A pure producer loads nothing: the blob heads say whether, and what, is published.
        claim = self._claim(items)
        described = self._cache.describe_many(items, claim)
        out: dict[str, Found | Lease | None] = {
            item: None if d is None else Found(d[0], d[1]) for item, d in described.items()
        }
        return self._with_leases(out, claim)

    def _with_leases(
        self, out: dict[str, Found | Lease | None], claim: Claim | None
    ) -> dict[str, Found | Lease | None]:
        """What each claim came to, for the items not found; a lease won for an item found
        after all (a head that came between the read and the claim) is given back."""
        if claim is None:
            return out
        for item, lease in claim.results.items():
            if out.get(item) is not None:
                if lease.won:
                    self._cache.release_lease(item, claim.value(item))
                continue
            out[item] = lease
            if lease.won and lease.fresh:  # not one it held already (a look again)
                self._lease_clock.claimed(item)
                self.counters.inc("lease_claims")
        return out

    def _release_lease(self, item: str, rows: int) -> None:
        """A lease won for an entry that died before vLLM encoded it (the request finished,
        was aborted, or found the item elsewhere): another instance may claim it now. Called
        under the stager's lock, on the step or a lookup thread: the Redis call goes to a
        thread of its own."""
        self._lease_clock.forget(item)
        self.counters.inc("lease_releases")
        value = claim_value(rows, self._token)
        with contextlib.suppress(RuntimeError):  # shut down: the lease expires by itself
            self._releases.submit(self._cache.release_lease, item, value)

    def _observe_fetch(self, seconds: float) -> None:
        if len(self._fetch_seconds) < MAX_OBSERVATIONS:
            self._fetch_seconds.append(seconds)

    # -- the scheduling hot path -----------------------------------------------------------

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        self._current = request
        if self._step_start is None:
            self._step_start = self._clock()
        try:
            return self._gate.ready(request, num_computed_tokens)
        except Exception as exc:
            self.internal_error("ensure_cache_available", exc)
            request_id = getattr(request, "request_id", None)
            if isinstance(request_id, str):
                self._gate.verdicts.pop(request_id, None)  # no promise for it this step
                if self._gate.must_fail_on_error(request):
                    self._gate.fail(request_id, "error")
                    return False  # a local encode is impossible or not allowed
            return True  # let vLLM encode whatever we cannot vouch for

    def has_cache_item(self, identifier: str) -> bool:
        """Yes only for a verdict ``ensure_cache_available`` gave the request vLLM is
        scheduling: an item staged here whose rows fit every feature of that request naming
        it. The yes holds its bytes until the end of the step, so the load it becomes
        always has them."""
        found: Found | None = None
        request_id = ""
        try:
            request = self._current
            if request is not None:
                request_id = request.request_id
                verdicts = self._gate.verdicts.get(request_id)
                found = None if verdicts is None else verdicts.get(identifier)
                if found is not None and (request_id, identifier) not in self._answers:
                    if self._is_consumer:
                        self._transport.hold(found)
                    self._answers[(request_id, identifier)] = found
        except Exception as exc:
            self.internal_error("has_cache_item", exc)
            found = None
        if found is None:
            if self._is_consumer:
                self.counters.inc("local_fallbacks")
            return False
        if not self._is_consumer:
            self.counters.inc("skipped_encodes")  # published already: the encoder skips it
        return True

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        try:
            item = request.mm_features[index].identifier
            self._allocated.add((request.request_id, item))
            found = self._answers.get((request.request_id, item))
            salt = request_salt(request)
            if found is None:  # encoded locally: a salted request's encode is saved as such
                key = cache_id(item, salt) if salt and self._is_producer else None
                if key is not None:
                    self._save_as.setdefault(item, set()).add(key)
                if self._single_flight:  # a lease won for it stays: the write ends it
                    self._stager.encoding(cache_id(item, salt) or "")
                return
            if self._is_consumer:
                if request.get_num_encoder_embeds(index) != found.rows:
                    # The verdict covered every feature of this request naming ``item``.
                    self.counters.inc("promise_mismatches")
                    return
                if item not in self._loads:
                    self._loads[item] = self._transport.load(item, found, self._step)
                    self._after_lease_wait(item, salt, "lease_loads")
            else:
                self._after_lease_wait(item, salt, "lease_skips")
            self._gate.let_go(request, index)
        except Exception as exc:
            self.internal_error("update_state_after_alloc", exc)

    def _after_lease_wait(self, item: str, salt: str | None, counter: str) -> None:
        """An item loaded (or, on a pure producer, skipped) here: if a request waited on
        another instance's lease for it, that is an encode single flight saved."""
        key = cache_id(item, salt) if self._single_flight else None
        entry = None if key is None else self._stager.get(key)
        if entry is not None and entry.waited:
            entry.waited = False  # one encode saved per wait, however many requests load it
            entry.lease = None  # its holder's entry is here: no later request waited on it
            self.counters.inc(counter)
            self.counters.inc("lease_encodes_saved")

    def build_connector_meta(self, scheduler_output: Any) -> ECRedisMetadata:
        save_as = {item: sorted(keys) for item, keys in self._save_as.items()}
        meta = ECRedisMetadata(
            loads=list(self._loads.values()),
            step=self._step,
            save_as=save_as,
            republish=self._republish(scheduler_output),
        )
        answers, self._loads, self._answers, self._current = self._answers, {}, {}, None
        self._save_as, self._allocated = {}, set()
        self._step += 1
        try:
            if self._is_consumer:
                for found in answers.values():
                    self._transport.unhold(found)  # its load (if any) holds its own
            if self._idle(scheduler_output):
                self._wait_for_lookups()
            self._housekeeping()
        except Exception as exc:
            self.internal_error("build_connector_meta", exc)
        self._step_start = None
        self._gate.new_step()
        return meta

    def _republish(self, scheduler_output: Any) -> list[tuple[str, str, int]]:
        """Producers: items Redis lacks that a scheduled request needs and vLLM neither
        loaded nor encoded this step (its own encoder cache holds them: another salt's
        encode, or an entry Redis evicted): the worker writes them from there."""
        if not self._is_producer:
            return []
        try:
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            out: list[tuple[str, str, int]] = []
            for request_id, items in self._gate.unpublished.items():
                if request_id not in scheduled:
                    continue
                for item, (key, rows) in items.items():
                    done = (request_id, item) in self._allocated
                    if not done and (request_id, item) not in self._answers:
                        out.append((item, key, rows))
            return out
        except Exception as exc:
            self.internal_error("build_connector_meta", exc)
            return []

    @staticmethod
    def _idle(scheduler_output: Any) -> bool:
        return getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0

    def _wait_for_lookups(self) -> None:
        """One wait (at most ``lookup_wait_s``, ended by any lookup returning) on a step that
        scheduled nothing while requests wait for us or lookups run: the engine would
        otherwise spin and starve the lookup and subscriber threads of the GIL.

        A request held for an item not yet in Redis has no lookup in flight: it waits for a
        push or its next recheck. Spinning there made a push slower than polling (16 MiB
        items found 107 ms after ``save_caches`` instead of 57 ms; ``ec-redis
        bench-connector --visibility``)."""
        wait_s = self._options.lookup_wait_s
        if wait_s <= 0 or not (self._gate.held_this_step or self._stager.in_flight > 0):
            return
        start = self._step_start if self._step_start is not None else self._clock()
        self._stager.wait(self._stager.generation, start + wait_s)

    def _housekeeping(self) -> None:
        now = self._clock()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + HOUSEKEEPING_S
        self._stager.expire()
        self._transport.sweep()

    # -- after the step ----------------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "ec_connector_worker_meta", None)
        if not isinstance(meta, ECRedisWorkerMetadata):
            return
        try:
            self.pending_work.worker_reported(meta.pending_writes)
            if meta.loaded_step >= 0:
                self._transport.step_done(meta.loaded_step)  # every rank ran those loads
        except Exception as exc:
            self.internal_error("update_connector_output", exc)

    def begin_report(self) -> None:
        self.pending_work.begin_report()

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while something it did is still to be reported
        (``pending.py``)."""
        try:
            return self.pending_work.any()
        except Exception as exc:
            self.internal_error("has_pending_push_work", exc)
            return False

    def take_unavailable_requests(self) -> set[str]:
        try:
            return self._gate.take_unavailable()
        except Exception as exc:
            self.internal_error("take_unavailable_requests", exc)
            return set()

    def update_state_after_free(self, request: Any, index: int) -> None:
        try:
            self._gate.let_go(request, index)
        except Exception as exc:
            self.internal_error("update_state_after_free", exc)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        try:
            self._gate.forget(request.request_id)
            if self._current is request:
                self._current = None
        except Exception as exc:
            self.internal_error("request_finished", exc)
        return False, None

    # -- introspection -------------------------------------------------------------------------

    def internal_error(self, hook: str, exc: Exception) -> None:
        """A hook failed inside ec_redis: count it, log it (rate-limited), never raise."""
        self.counters.inc("internal_errors")
        self._log.warning(
            "internal-" + hook, "ec_redis: %s failed (%r); falling back to local encoding",
            hook, exc,
        )  # fmt: skip

    def live_state(self) -> dict[str, int]:
        """Sizes of every table this half keeps (tests assert they drain)."""
        out = self._stager.live_state()
        out.update(self._gate.sizes(), answers=len(self._answers), loads=len(self._loads))
        out["files"] = self._transport.live_files()
        out["buffers"] = self._transport.live_buffers()
        return out

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counters plus the staging gauges."""
        out: dict[str, Any] = dict(self.counters.snapshot())
        for counters in (self._stager.counters, self._transport.counters):
            for name, value in counters.snapshot().items():
                out[name] = out.get(name, 0) + value
        out["staged_bytes"] = self._stager.staged_bytes
        out["reserved_bytes"] = self._stager.reserved_bytes
        out["transit_bytes"] = self._transport.outside_bytes()
        out["spare_bytes"] = self._transport.spare_bytes()
        return out

    def take_observations(self) -> dict[str, list[float]]:
        if not self._fetch_seconds:
            return {}
        taken, self._fetch_seconds[:] = list(self._fetch_seconds), []
        return {"fetch_seconds": taken}

    def shutdown(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
        self._releases.shutdown(wait=False, cancel_futures=True)
        self._stager.close()
        self._gate.clear()
        self._transport.close()
