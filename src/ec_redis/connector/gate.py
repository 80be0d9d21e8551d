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
from ec_redis.connector.ids import is_request_scoped
from ec_redis.connector.staging import ABSENT, FETCHING, Stager
from ec_redis.stats import Counters

MAX_REQUESTS = 65536  # request records; vLLM finishes every request, this is a backstop
Needed = list[tuple[int, str, str]]  # (index into mm_features, identifier, modality)


@dataclass(eq=False)
class RequestRecord:
    first_seen: float
    wanted: set[str] = field(default_factory=set)  # staging entries it registered in
    held_at: int = -1  # stager generation when it was last held back
    next_look: float = math.inf  # when a held request must be looked at again anyway


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
        self.counters = counters
        self._clock = clock
        self._records: dict[str, RequestRecord] = {}
        self._unavailable: set[str] = set()
        self.held_this_step = False  # reset by the scheduler half at the end of each step

    def ready(self, request: Any, num_computed_tokens: int) -> bool:
        """Whether vLLM may schedule the request's items now; False holds it this step."""
        needed = self._needed(request, num_computed_tokens)
        if not needed:
            return True
        request_id = request.request_id
        now = self._clock()
        record = self._records.get(request_id)
        if record is None:
            record = self._new_record(request_id, now)
        elif record.held_at == self._stager.generation and now < record.next_look:
            return self._hold()  # nothing it waits for can have changed since
        generation = self._stager.generation  # read before looking at any entry
        if self._is_consumer:
            ready, next_look = self._evaluate_loads(request, record, needed, now)
        else:
            ready, next_look = self._evaluate_published(request_id, record, needed, now)
        if ready:
            record.held_at = -1
            return True
        record.held_at, record.next_look = generation, next_look
        return self._hold()

    def _hold(self) -> bool:
        self.counters.inc("waits")
        self.held_this_step = True
        return False

    def _needed(self, request: Any, num_computed_tokens: int) -> Needed:
        """Items the request still needs and vLLM's encoder cache does not hold for it:
        not consumed yet, and, for a running request, not started (an item a running
        request is part-way through sits in vLLM's encoder cache until it is consumed)."""
        # vllm.v1.request.RequestStatus.RUNNING, by name: importing that module costs the
        # API server (which imports this class) most of a second.
        running = getattr(request.status, "name", None) == "RUNNING"
        out: Needed = []
        for index, feature in enumerate(request.mm_features):
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue
            if running and position.offset < num_computed_tokens:
                continue
            if is_request_scoped(feature.identifier):
                continue  # names a request, not content: never cached (see ids.py)
            out.append((index, feature.identifier, feature.modality))
        return out

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
        """Consumers: ready once every needed item is staged, refused, or given up on."""
        request_id = request.request_id
        ready, next_look = True, math.inf
        look: list[tuple[str, str, int]] = []
        for index, item, modality in needed:
            entry = self._stager.get(item)
            if entry is None:
                rows = request.get_num_encoder_embeds(index)
                look.append((item, modality, self._check.reserve(modality, rows)))
                continue
            if request_id not in entry.wanted_by:
                self._stager.want(entry, request_id)
                record.wanted.add(item)
            if entry.state == FETCHING:
                ready = False
            elif entry.state == ABSENT:
                deadline = record.first_seen + self._wait_s
                if now >= deadline:
                    if self._fail_missing(request_id):
                        ready = False  # held until vLLM fails it
                    continue  # encode it locally
                ready = False
                due = entry.since + self._options.recheck_s
                if now >= due:
                    rows = request.get_num_encoder_embeds(index)
                    look.append((item, modality, self._check.reserve(modality, rows)))
                next_look = min(next_look, due, deadline)
            # STAGED and REFUSED decide nothing more here (has_cache_item checks rows)
        if look and self._start(look, request_id, record):
            ready = False
        return ready, next_look

    def _evaluate_published(
        self, request_id: str, record: RequestRecord, needed: Needed, now: float
    ) -> tuple[bool, float]:
        """Pure producers: hold a request at most ``producer_check_wait_s`` while its
        "already published?" checks run; after that, whatever is not known is encoded."""
        deadline = record.first_seen + self._options.producer_check_wait_s
        if now >= deadline:
            return True, math.inf  # too late for a check to spare this request's encoder
        look: list[tuple[str, str, int]] = []
        in_flight = False
        for _, item, modality in needed:
            entry = self._stager.get(item)
            if entry is None or (
                entry.state == ABSENT and now >= entry.since + self._options.recheck_s
            ):
                look.append((item, modality, 0))
                continue
            if request_id not in entry.wanted_by:
                self._stager.want(entry, request_id)
                record.wanted.add(item)
            in_flight |= entry.state == FETCHING
        if look and self._start(look, request_id, record):
            in_flight = True
        return (False, deadline) if in_flight else (True, math.inf)

    def _start(
        self, look: list[tuple[str, str, int]], request_id: str, record: RequestRecord
    ) -> bool:
        _, refused = self._stager.fetch(look, request_id)
        record.wanted.update(item for item, _, _ in look if item not in refused)
        return len(refused) < len(look)  # something is on its way (started or joined)

    def _fail_missing(self, request_id: str) -> bool:
        """on_missing="fail" (pure consumers): fail the request instead of encoding."""
        if self._options.on_missing != "fail" or self._is_producer:
            return False
        if request_id not in self._unavailable:
            self._unavailable.add(request_id)
            self.counters.inc("unavailable_requests")
        return True

    def let_go(self, request_id: str, item: str) -> None:
        """The request no longer needs ``item`` (loaded, or consumed)."""
        record = self._records.get(request_id)
        if record is not None:
            record.wanted.discard(item)
        self._stager.release(item, request_id)

    def forget(self, request_id: str) -> None:
        """The request ended (finished or aborted): every trace of it goes."""
        record = self._records.pop(request_id, None)
        self._unavailable.discard(request_id)
        if record is not None:
            for item in record.wanted:
                self._stager.release(item, request_id)

    def take_unavailable(self) -> set[str]:
        failed, self._unavailable = self._unavailable, set()
        return failed

    def sizes(self) -> dict[str, int]:
        return {"requests": len(self._records), "unavailable": len(self._unavailable)}

    def clear(self) -> None:
        self._records.clear()
        self._unavailable.clear()
