"""Holding requests until their items are staged: what each request still needs, what to
look up, when to look again, and when to stop waiting.

Per request it keeps one record (when it was first seen, which staging entries it wants, and
when its answer can next change); the record dies in ``forget`` (vLLM's ``request_finished``).
Which items a request still needs is derived from its status and token count at each call,
never remembered: an item a *running* request is part-way through sits in vLLM's encoder
cache, anything else not yet consumed is needed. So a preemption (tokens back to 0) simply
makes the request's items needed again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ec_redis.config import ConnectorOptions
from ec_redis.connector.checks import TensorCheck
from ec_redis.connector.ids import cache_id, request_salt
from ec_redis.connector.staging import ABSENT, FETCHING, STAGED, Entry, Found, Stager
from ec_redis.stats import Counters

MAX_REQUESTS = 65536  # request records; vLLM finishes every request, this is a backstop
LEASE_WAIT_MAX_S = 5.0  # longest wait on another instance's lease unless lease_ttl_s says
# (index into mm_features, vLLM's identifier, the cache id it is staged under, modality)
Needed = list[tuple[int, str, str, str]]


def _one_per_key(look: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """One look per cache id (a request naming one id at two sizes asks twice), reserving
    the larger size: with two, staging could start one and refuse the other, and the
    request would want an entry it never recorded (and so never released)."""
    out: dict[str, tuple[str, str, int]] = {}
    for key, modality, reserve in look:
        if key not in out or reserve > out[key][2]:
            out[key] = (key, modality, reserve)
    return list(out.values())


def rows_by_item(request: Any) -> dict[str, set[int]]:
    """The embedding rows of every feature of ``request``, by identifier (a client id reused
    for items of other sizes has several)."""
    out: dict[str, set[int]] = {}
    for index, feature in enumerate(request.mm_features):
        out.setdefault(feature.identifier, set()).add(request.get_num_encoder_embeds(index))
    return out


@dataclass(eq=False)
class RequestRecord:
    first_seen: float
    wanted: set[str] = field(default_factory=set)  # staging entries it registered in
    held_at: int = -1  # stager generation when it was last held back
    waiting_since: float | None = None  # first held in this episode (None: let through)
    next_look: float = math.inf  # when a held request must be looked at again anyway
    claimant: bool = False  # holds a lease of one of its items (single flight): never waits


class RequestGate:
    def __init__(
        self,
        stager: Stager,
        check: TensorCheck,
        options: ConnectorOptions,
        *,
        is_producer: bool,
        is_consumer: bool,
        counters: Counters,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stager = stager
        self._check = check
        self._options = options
        self._is_producer = is_producer
        self._is_consumer = is_consumer
        # A pure consumer waits for items its encoder instance is still writing.
        self._wait_s = options.consumer_wait_s if is_consumer and not is_producer else 0.0
        # Only a pure consumer may be told never to encode (ec_both encodes what it misses).
        self._fail_on_missing = options.on_missing == "fail" and is_consumer and not is_producer
        # Single flight: an instance that may encode waits on another's lease, this long at
        # most per episode (and never past the lease's own deadline).
        self._single_flight = is_producer and options.single_flight
        self._lease_wait_s = options.lease_ttl_s or LEASE_WAIT_MAX_S
        self.counters = counters
        self._clock = clock
        self._records: dict[str, RequestRecord] = {}
        self._unavailable: set[str] = set()
        # Per step (reset by ``new_step``): for each request ``ready`` let through, the
        # staged items a "yes" may promise (``has_cache_item`` answers from these alone).
        self.verdicts: dict[str, dict[str, Found]] = {}
        # Producers, per step: request -> identifier -> (cache id, rows) known to be missing
        # from Redis when the request was let through.
        self.unpublished: dict[str, dict[str, tuple[str, int]]] = {}
        self.held_this_step = False  # reset by the scheduler half at the end of each step

    def ready(self, request: Any, num_computed_tokens: int) -> bool:
        """Whether vLLM may schedule the request's items now; False holds it this step."""
        request_id = request.request_id
        self.verdicts.pop(request_id, None)
        if request_id in self._unavailable:
            return self._hold()  # failed: held until vLLM takes it from take_unavailable
        needed, uncacheable = self._needed(request, num_computed_tokens)
        if any(self._must_deliver(request, identifier) for identifier in uncacheable):
            self.fail(request_id, "uncacheable")  # no cache can serve it, no encoder here
            return self._hold()
        if not needed:
            return True

        now = self._clock()
        record = self._records.get(request_id)
        if record is None:
            record = self._new_record(request_id, now)
        elif record.held_at == self._stager.generation and now < record.next_look:
            return self._hold()  # nothing it waits for can have changed since
        generation = self._stager.generation  # read before looking at any entry
        if record.waiting_since is None:
            record.waiting_since = now
        if self._is_consumer:
            ready, next_look = self._evaluate_loads(request, record, needed, now)
        else:
            ready, next_look = self._evaluate_published(request, record, needed, now)
        if ready:
            record.held_at, record.waiting_since = -1, None
            return True
        record.held_at, record.next_look = generation, next_look
        return self._hold()

    def _hold(self) -> bool:
        self.counters.inc("waits")
        self.held_this_step = True
        return False

    def _needed(self, request: Any, num_computed_tokens: int) -> tuple[Needed, list[str]]:
        """Items the request still needs and vLLM's encoder cache does not hold for it:
        not consumed yet, and, for a running request, not started (an item a running
        request is part-way through sits in vLLM's encoder cache until it is consumed).
        Also the identifiers among them that can never be cached (``ids.cache_id``)."""
        # vllm.v1.request.RequestStatus.RUNNING, by name: importing that module costs the
        # API server (which imports this class) most of a second.
        running = getattr(request.status, "name", None) == "RUNNING"
        out: Needed = []
        uncacheable: list[str] = []
        salt = request_salt(request)
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue
            if running and position.offset < num_computed_tokens:
                continue
            key = cache_id(feature.identifier, salt)
            if key is None:  # names a request, not content: never cached (see ids.py)
                uncacheable.append(feature.identifier)
                continue
            out.append((index, feature.identifier, key, feature.modality))
        return out, uncacheable

    def _new_record(self, request_id: str, now: float) -> RequestRecord:
        if len(self._records) >= MAX_REQUESTS:  # vLLM lost track of one: drop the oldest
            oldest = next(iter(self._records))
            self.counters.inc("dropped_request_records")
            self.forget(oldest)
        record = self._records[request_id] = RequestRecord(first_seen=now)
        return record

    def _evaluate_loads(
        self, request: Any, record: RequestRecord, needed: Needed, now: float
    ) -> tuple[bool, float]:
        """Consumers: ready once every needed item is staged or cannot be delivered; the
        staged ones that fit every feature naming them become the request's verdicts. An
        item that cannot be delivered is encoded locally, or, under ``on_missing: fail`` or
        when a feature naming it carries no media, fails the request."""
        request_id = request.request_id
        next_look = math.inf
        # One wait per episode (from when the request was first held until it is let
        # through): absent items for consumer_wait_s, and nothing at all, lookups in flight
        # included, past fetch_wait_s more, however often announcements restart a lookup.
        start = now if record.waiting_since is None else record.waiting_since
        wait_deadline = start + self._wait_s
        give_up = wait_deadline + self._options.fetch_wait_s
        waiting: set[str] = set()
        blocked: dict[str, str] = {}  # identifier -> why it cannot be delivered
        verdicts: dict[str, Found] = {}
        rows = rows_by_item(request)
        look: list[tuple[str, str, int]] = []
        identifier_of: dict[str, str] = {}  # cache id -> identifier (one salt per request)
        record.claimant = self._single_flight and self._holds_a_lease(needed)
        for index, item, key, modality in needed:
            identifier_of[key] = item
            entry = self._stager.get(key)
            if entry is not None and request_id not in entry.wanted_by:
                self._stager.want(entry, request_id)
                record.wanted.add(key)
            state = None if entry is None else entry.state
            if entry is not None and state in (ABSENT, FETCHING):
                until = self._lease_deadline(entry, record, rows[item], now, request, item)
                if until and state == ABSENT and now < until:  # its holder encodes it
                    waiting.add(item)
                    due = entry.since + self._options.recheck_s
                    if now >= due:  # looked up (and claimed) again now
                        reserve = self._check.reserve(
                            modality, request.get_num_encoder_embeds(index)
                        )
                        look.append((key, modality, reserve))
                        next_look = min(next_look, now + self._options.fetch_wait_s, until)
                    else:
                        next_look = min(next_look, due, until)
                    continue
                if until and now >= until:
                    self._took_over(entry)
                    blocked[item] = "absent"  # the holder's deadline passed: encoded here
                    continue
                if until:  # a look in flight: whatever it brings, the deadline holds
                    next_look = min(next_look, until)
            if entry is None or state == ABSENT:
                why = "absent" if entry is None else entry.last_miss
                if entry is not None and (
                    now >= wait_deadline
                    or (why == "stage_full" and not self._must_deliver(request, item))
                ):
                    blocked[item] = why  # encoded here now, or failed below
                    continue
                if now >= give_up:
                    blocked[item] = "timeout"
                    continue
                waiting.add(item)
                due = now if entry is None else entry.since + self._options.recheck_s
                if now >= due:  # looked up now: its return bumps the generation
                    reserve = self._check.reserve(modality, request.get_num_encoder_embeds(index))
                    look.append((key, modality, reserve))
                    next_look = min(next_look, now + self._options.fetch_wait_s)
                else:
                    next_look = min(next_look, due, wait_deadline)
            elif state == FETCHING:
                assert entry is not None
                deadline = min(entry.since + self._options.fetch_wait_s, give_up)
                if now >= deadline:
                    blocked[item] = "timeout"  # a paused or stuck Redis: wait no longer
                    continue
                waiting.add(item)
                next_look = min(next_look, deadline)
            elif state == STAGED and entry is not None and entry.found is not None:
                # Found what another instance's lease stood for: held for it, as a pure
                # producer's check counts it (``lease_waits``; the load is then saved).
                self._lease_deadline(entry, record, rows[item], now, request, item)
                found = entry.found
                if not found.loadable:
                    blocked[item] = "refused"
                elif rows[item] != {found.rows}:
                    # A client id reused for items of other sizes: whichever feature vLLM
                    # asks about, a yes must be right for it, so none gets one.
                    blocked[item] = "rows"
                else:
                    verdicts[item] = found
            else:  # REFUSED: wrong dtype or width
                blocked[item] = "refused"
        if look:
            refused = self._start(look, request_id, record, rows, identifier_of, request)
            for item in {identifier_of[key] for key in refused}:  # staging is full now
                if self._must_deliver(request, item) and now < wait_deadline:
                    next_look = min(next_look, now + self._options.recheck_s)
                else:
                    waiting.discard(item)
                    blocked[item] = "stage_full"
        failing = [item for item in blocked if self._must_deliver(request, item)]
        if failing:
            self.fail(request_id, blocked[failing[0]])
            return False, math.inf  # held until vLLM fails it
        if waiting:
            return False, next_look
        reused = sum(why == "rows" for why in blocked.values())
        if reused:
            self.counters.inc("rejected_items", reused)
        self.verdicts[request_id] = verdicts
        if self._is_producer:  # ec_both: what vLLM may already hold and Redis lacks
            self._note_unpublished(request, needed, blocked, "absent")
        return True, math.inf

    def _note_unpublished(
        self, request: Any, needed: Needed, missing: Any, why: str | None = None
    ) -> None:
        """Producers: the needed items known to be missing from Redis (``missing``: their
        identifiers, or identifier -> why). If vLLM neither loads nor encodes one this step
        (its own encoder cache holds it), the worker republishes it from there."""
        out: dict[str, tuple[str, int]] = {}
        for index, item, key, _ in needed:
            if item in missing and (why is None or missing[item] == why):
                out[item] = (key, request.get_num_encoder_embeds(index))
        if out:
            self.unpublished[request.request_id] = out

    def _must_deliver(self, request: Any, item: str) -> bool:
        """Whether ``item`` may not be encoded here: ``on_missing: fail`` on a pure
        consumer, or a feature naming it carries no media (vLLM's runner would skip its
        encode, and the gather would crash the step)."""
        if self._fail_on_missing:
            return True
        return any(f.identifier == item and f.data is None for f in request.mm_features)

    def _evaluate_published(
        self, request: Any, record: RequestRecord, needed: Needed, now: float
    ) -> tuple[bool, float]:
        """Pure producers: hold a request at most ``producer_check_wait_s`` while its
        "already published?" checks run; after that, whatever is not known is encoded.
        Verdicts: the items published whole, with the rows every feature naming them has."""
        request_id = request.request_id
        deadline = record.first_seen + self._options.producer_check_wait_s
        checking = now < deadline  # else too late for a check to spare the encoder
        look: list[tuple[str, str, int]] = []
        in_flight = False
        leased = math.inf  # the earliest wake-up of an item another instance encodes
        verdicts: dict[str, Found] = {}
        absent: set[str] = set()
        rows = rows_by_item(request)
        identifier_of: dict[str, str] = {}
        record.claimant = self._single_flight and self._holds_a_lease(needed)
        for _, item, key, modality in needed:
            identifier_of[key] = item
            entry = self._stager.get(key)
            until = (
                0.0
                if entry is None
                else self._lease_deadline(entry, record, rows[item], now, request, item)
            )
            unsettled = entry is not None and entry.state in (ABSENT, FETCHING)
            waits = unsettled and until > now
            if entry is not None and unsettled and until and not waits and not checking:
                # The holder's deadline passed, and so did producer_check_wait_s: encoded here
                # (while checking, a look as without single flight may still find it).
                self._took_over(entry)
                absent.add(item)
                continue
            if entry is None or (
                entry.state == ABSENT and now >= entry.since + self._options.recheck_s
            ):
                if checking or waits:
                    look.append((key, modality, 0))
                    if waits:
                        leased = min(leased, until)
                continue
            if request_id not in entry.wanted_by:
                self._stager.want(entry, request_id)
                record.wanted.add(key)
            if waits:  # its holder is encoding it: published soon, or the deadline passes
                assert entry is not None
                leased = min(leased, until, entry.since + self._options.recheck_s)
                continue
            in_flight |= entry.state == FETCHING
            found = entry.found if entry.state == STAGED else None
            if found is not None and rows[item] == {found.rows}:
                verdicts[item] = found
            elif entry.state == ABSENT:
                if until:
                    self._took_over(entry)
                absent.add(item)
        if look:
            refused = set(self._start(look, request_id, record, rows, identifier_of, request))
            if {key for key, _, _ in look} - refused:
                in_flight = True  # something is on its way (started or joined)
        if checking and in_flight:
            return False, min(deadline, leased)
        if leased < math.inf:
            return False, leased
        self.verdicts[request_id] = verdicts
        self._note_unpublished(request, needed, absent)
        return True, math.inf

    def _lease_deadline(
        self,
        entry: Entry,
        record: RequestRecord,
        item_rows: set[int],
        now: float,
        request: Any,
        item: str,
    ) -> float:
        """Until when the request may wait for ``entry``'s item because another instance
        holds its lease (0: it may not): only for a lease of the request's own rows (a
        reused id of another size is encoded here at once), and at most ``lease_ttl_s``
        from when the request began to wait."""
        lease = entry.lease
        if not self._single_flight or lease is None or lease.won or item_rows != {lease.rows}:
            return 0.0
        if record.claimant and not self._must_deliver(request, item):
            # It holds a lease it must fulfil: waiting could be a cycle (an item it cannot
            # encode, it waits for all the same: failing it would be worse than a wait).
            return 0.0
        start = now if record.waiting_since is None else record.waiting_since
        until = min(entry.lease_until, start + self._lease_wait_s)
        if not entry.waited and now < until:
            entry.waited = True
            self.counters.inc("lease_waits")
        return until

    def _holds_a_lease(self, needed: Needed) -> bool:
        """Whether one of the request's needed items is leased to this instance and not
        found yet: the request then waits on no other instance's lease (A holding X waiting
        for B's Y while B holds Y waiting for A's X would stall both to the deadline)."""
        for _, _, key, _ in needed:
            entry = self._stager.get(key)
            lease = None if entry is None else entry.lease
            if lease is not None and lease.won and entry is not None and entry.state != STAGED:
                return True
        return False

    def _took_over(self, entry: Entry) -> None:
        if not entry.took_over:
            entry.took_over = True
            self.counters.inc("lease_takeovers")

    def _start(
        self,
        look: list[tuple[str, str, int]],
        request_id: str,
        record: RequestRecord,
        rows: dict[str, set[int]],
        identifier_of: dict[str, str],
        request: Any,
    ) -> list[str]:
        """Look up ``look`` (one look per cache id) for the request; the cache ids refused
        for lack of room. ``rows`` (by identifier) and ``identifier_of`` (cache id ->
        identifier) give the rows its claims carry: an id of one size in this request."""
        look = _one_per_key(look)
        claim_rows: dict[str, int] | None = None
        look_only: set[str] = set()
        if self._single_flight:
            claim_rows = {}
            for key, _, _ in look:
                item = identifier_of[key]
                if len(rows[item]) == 1:  # one size: claimed, or asked who holds it
                    claim_rows[key] = next(iter(rows[item]))
                    # What this instance cannot encode (no media) it never claims.
                    if self._must_deliver(request, item):
                        look_only.add(key)
        _, refused = self._stager.fetch(look, request_id, claim_rows, look_only)
        record.wanted.update(key for key, _, _ in look if key not in refused)
        return refused

    def fail(self, request_id: str, why: str) -> None:
        """Fail the request as retryable (vLLM takes it from ``take_unavailable``); ``why``
        names the counter: absent, timeout, stage_full, refused, rows, uncacheable or
        error."""
        if request_id not in self._unavailable:
            self._unavailable.add(request_id)
            self.counters.inc("unavailable_requests")
            self.counters.inc(f"unavailable_{why}")
        self.verdicts.pop(request_id, None)

    def must_fail_on_error(self, request: Any) -> bool:
        """A hook failed for ``request``: whether a local encode is impossible for it."""
        if self._fail_on_missing:
            return True
        try:
            return any(f.data is None for f in request.mm_features)
        except Exception:  # unreadable features: vLLM cannot encode them either way
            return False

    def let_go(self, request: Any, index: int) -> None:
        """The request no longer needs feature ``index`` (loaded, or consumed). Its item
        stays staged while a later feature of the request names it too: vLLM may evict its
        own copy before then and ask again."""
        features = request.mm_features
        identifier = features[index].identifier
        offset = features[index].mm_position.offset
        if any(f.identifier == identifier and f.mm_position.offset > offset for f in features):
            return
        key = cache_id(identifier, request_salt(request))
        if key is None:
            return
        request_id = request.request_id
        record = self._records.get(request_id)
        if record is not None:
            record.wanted.discard(key)
        self._stager.release(key, request_id)

    def forget(self, request_id: str) -> None:
        """The request ended (finished or aborted): every trace of it goes."""
        record = self._records.pop(request_id, None)
        self._unavailable.discard(request_id)
        self.verdicts.pop(request_id, None)
        self.unpublished.pop(request_id, None)
        if record is not None:
            for item in record.wanted:
                self._stager.release(item, request_id)

    def take_unavailable(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed

    def sizes(self) -> dict[str, int]:
        return {
            "requests": len(self._records),
            "unavailable": len(self._unavailable),
            "verdicts": len(self.verdicts),
        }

    def new_step(self) -> None:
        self.verdicts.clear()
        self.unpublished.clear()
        self.held_this_step = False

    def clear(self) -> None:
        self._records.clear()
        self._unavailable.clear()
        self.verdicts.clear()
        self.unpublished.clear()
