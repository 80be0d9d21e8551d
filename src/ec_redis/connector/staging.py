"""Scheduler-side staging: one entry per item, looked up off the scheduling path and held
until a step loads it or no live request wants it any more.

An entry's life::

    FETCHING (bytes reserved) ──► STAGED (found: a tensor, or a producer's description)
                               ├─► ABSENT (not found, or no room once its real size was
                               │           known: a later look may refetch it, reserving
                               │           that size)
                               └─► REFUSED (wrong dtype or width: never for this model)

It dies when the last request that wants it lets go (loaded, freed, finished, aborted), or
after ``idle_ttl_s`` untouched (a safety net, never the mechanism). A lookup in flight keeps
its reservation until it returns, even if nobody wants the result any more: the bytes are
being allocated by then. Staged plus reserved bytes, plus the bytes of dead entries that
promises and loads in transit still hold (``outside``: ``transport.py``), never exceed
``stage_bytes`` (an item larger than the whole budget is never staged), and the table never
holds more than ``max_items`` entries.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters
from ec_redis.tiers.lease import Lease

FETCHING, STAGED, ABSENT, REFUSED = "fetching", "staged", "absent", "refused"


@dataclass(frozen=True)
class Found:
    """What a lookup found: the tensor itself (loads) or only its description (a pure
    producer's "already published?" check reads the blob header, never the tensor)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    tensor: torch.Tensor | None = None
    path: str | None = None  # the bytes moved to a host-local file (transport.py)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 0

    @property
    def loadable(self) -> bool:
        return self.tensor is not None or self.path is not None

    @property
    def nbytes(self) -> int:
        """Bytes this process holds for it (in memory or in its staged file)."""
        if not self.loadable:
            return 0
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


# A lookup's answer per item: what it found, or, for an item it did not find and claimed
# (single flight, ``tiers/lease.py``), the claim's outcome, or None.
Lookup = Callable[[list[str]], Mapping[str, Found | Lease | None]]
# Entry-level validation (dtype, width) of what a lookup found: a problem, or None.
Check = Callable[[str, Found], str | None]
# Where staged bytes live (transport.py): keep moves a found tensor there, discard frees it.
Keep = Callable[[Found], Found]
Discard = Callable[[Found], None]


@dataclass(eq=False)
class Entry:
    item: str
    modality: str
    state: str
    since: float  # when the current state began
    touched: float  # last time a request asked for it
    reserved: int = 0  # bytes reserved while FETCHING
    estimate: int = 0  # what a fetch of it reserves
    announced: bool = False  # a writer announced it while a (possibly stale) look ran
    last_miss: str = "absent"  # why it is ABSENT: "absent", or "stage_full" (no room)
    found: Found | None = None
    wanted_by: set[str] = field(default_factory=set)
    rows: int = -1  # embedding rows of the request that started its look (-1: not one size)
    look_only: bool = False  # that request cannot encode it: its look never claims
    # Single flight: the last claim's outcome while ABSENT, and, for another instance's
    # lease, the earliest deadline seen (a later holder never extends a wait).
    lease: Lease | None = None
    lease_until: float = 0.0
    waited: bool = False  # a request waited on another instance's lease for it
    took_over: bool = False  # ... and this instance encodes it: that lease's deadline passed
    encoding: bool = False  # this instance holds its lease and vLLM is encoding it


class Stager:
    """Thread-safe table of item id -> Entry, filled by batched background lookups."""

    def __init__(
        self,
        lookup: Lookup,
        *,
        threads: int,
        stage_bytes: int,
        max_items: int = 16384,
        idle_ttl_s: float = 300.0,
        check: Check | None = None,
        keep: Keep | None = None,
        discard: Discard | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_fetch: Callable[[float], None] | None = None,
        outside: Callable[[], int] | None = None,
        release: Callable[[str, int], None] | None = None,
    ) -> None:
        """``release(item, rows)``: give up a lease this process won for an entry that died
        before vLLM encoded it; called under the table's lock, so it must only hand the work
        on (never touch Redis itself)."""
        self._lookup = lookup
        self._release = release
        self._outside = outside or (lambda: 0)
        self._check = check
        self._keep = keep
        self._discard = discard
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ec_redis-stage")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, Entry] = {}
        self.stage_bytes = stage_bytes
        self.max_items = max_items
        self._idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._on_fetch = on_fetch
        self.staged_bytes = 0
        self.reserved_bytes = 0
        self.in_flight = 0  # lookups submitted and not yet returned
        # Bumped whenever a lookup returns: a held request whose answer cannot have changed
        # since it last looked is answered without walking its items again.
        self.generation = 0
        self.counters = Counters()
        self._closed = False
        self._log = RateLimitedLog()

    # -- reads (lock-free: a dict read and attribute reads are atomic in CPython) -----------

    def get(self, item: str) -> Entry | None:
        return self._entries.get(item)

    # -- requests take and drop interest --------------------------------------------------

    def want(self, entry: Entry, request_id: str) -> None:
        with self._lock:
            entry.wanted_by.add(request_id)
            entry.touched = self._clock()

    def fetch(
        self,
        wanted: Iterable[tuple[str, str, int]],
        request_id: str,
        rows: Mapping[str, int] | None = None,
        look_only: Iterable[str] = (),
    ) -> tuple[list[str], list[str]]:
        """Start one batched lookup for ``(item, modality, reserve_bytes)`` triples: new items
        and ABSENT ones due for another look. Returns ``(started, refused)``: what is now in
        flight for ``request_id``, and what found no room (the caller encodes those).
        ``rows``: the embedding rows the request has for an item, for its claim;
        ``look_only``: items it cannot encode, whose looks only ask for a lease's holder."""
        look_only = set(look_only)
        now = self._clock()
        started: list[str] = []
        refused: list[str] = []
        with self._lock:
            if self._closed:
                return [], [item for item, _, _ in wanted]
            for item, modality, reserve in wanted:
                entry = self._entries.get(item)
                if entry is not None:
                    reserve = max(reserve, entry.estimate)  # its real size, once seen
                if entry is not None and entry.state != ABSENT:
                    # on its way, or settled since the caller looked (a push's lookup)
                    entry.wanted_by.add(request_id)
                    entry.touched = now
                    continue
                if not self._has_room_locked(entry is None, reserve):
                    refused.append(item)
                    self.counters.inc("stage_full")
                    continue
                if entry is None:
                    entry = Entry(item, modality, FETCHING, now, now)
                    self._entries[item] = entry
                else:  # ABSENT (it holds no bytes): look once more
                    entry.state, entry.since = FETCHING, now
                entry.touched = now
                entry.reserved = entry.estimate = reserve
                entry.wanted_by.add(request_id)
                if rows is not None and item in rows:
                    entry.rows = rows[item]
                    entry.look_only = item in look_only
                self.reserved_bytes += reserve
                started.append(item)
            if started:
                self.in_flight += 1
        if started:
            self._submit(started)
        return started, refused

    def _has_room_locked(self, new_entry: bool, reserve: int) -> bool:
        if new_entry and len(self._entries) >= self.max_items:
            return False
        return self._used_locked() + reserve <= self.stage_bytes

    def _used_locked(self) -> int:
        """Every staged byte that exists or is reserved: entries, lookups in flight, and
        dead entries' bytes that promises and loads in transit still hold."""
        return self.staged_bytes + self.reserved_bytes + self._outside()

    def _submit(self, batch: list[str]) -> None:
        with contextlib.suppress(RuntimeError):  # closed meanwhile: close() dropped them all
            self._pool.submit(self._run, batch)

    def nudge(self, item: str) -> bool:
        """A writer announced ``item``: if a request waits for it (ABSENT), look again now
        instead of at the next recheck. True if a lookup started."""
        now = self._clock()
        with self._lock:
            entry = self._entries.get(item)
            if self._closed or entry is None or not entry.wanted_by:
                return False
            if entry.state == FETCHING:  # that look may have started before the write landed
                entry.announced = True
                return False
            if entry.state != ABSENT:
                return False
            if not self._has_room_locked(False, entry.estimate):
                return False  # the next recheck tries again
            entry.state, entry.since, entry.reserved = FETCHING, now, entry.estimate
            self.reserved_bytes += entry.estimate
            self.in_flight += 1
        self.counters.inc("nudged")
        self._submit([item])
        return True

    def claims(self, items: Iterable[str]) -> dict[str, Entry]:
        """The entries among ``items`` whose look carries a claim (a request of one size
        started it): their ``rows``, ``modality`` and ``look_only`` say what to claim."""
        return {
            item: entry
            for item in items
            if (entry := self._entries.get(item)) is not None and entry.rows >= 0
        }

    def encoding(self, item: str) -> None:
        """vLLM encodes ``item`` here this step: a lease won for it is kept (the write that
        follows ends it) when the entry dies."""
        with self._lock:
            entry = self._entries.get(item)
            if entry is not None and entry.lease is not None and entry.lease.won:
                entry.encoding = True

    def release(self, item: str, request_id: str) -> None:
        """``request_id`` no longer wants ``item``; the entry dies with its last wanter."""
        with self._lock:
            entry = self._entries.get(item)
            if entry is not None:
                entry.wanted_by.discard(request_id)
                if not entry.wanted_by:
                    self._drop_locked(entry)

    # -- lookups --------------------------------------------------------------------------

    def _run(self, batch: list[str]) -> None:
        started = time.perf_counter()
        try:
            found: Mapping[str, Found | Lease | None] = self._lookup(batch)
            if self._on_fetch is not None:
                self._on_fetch(time.perf_counter() - started)
            problems = {
                item: self._problem(item, r) for item, r in found.items() if isinstance(r, Found)
            }
        except Exception as exc:  # every entry of the batch must settle, whatever failed
            self.counters.inc("lookup_errors")
            self._log.warning("stage", "ec_redis: lookup failed: %r", exc)
            found, problems = {}, {}
        usable = {
            item: result
            for item, result in found.items()
            if isinstance(result, Found) and problems.get(item) is None
        }
        overflow = self._reserve_real_sizes(usable)
        kept = {item: self._kept(result) for item, result in usable.items() if item not in overflow}
        now = self._clock()
        unused: list[Found] = []
        again: list[str] = []
        with self._lock:
            self.in_flight -= 1
            for item in batch:
                entry = self._entries.get(item)
                if (
                    entry is not None
                    and entry.state == FETCHING
                    and entry.announced
                    and not isinstance(found.get(item), Found)
                    and entry.wanted_by
                    and not self._closed
                ):
                    entry.announced = False  # a stale "absent": look once more right away
                    again.append(item)
                    continue
                result = kept.get(item, found.get(item))
                if entry is not None and entry.state == FETCHING and item in overflow:
                    self._overflow_locked(entry, overflow[item], now)
                    continue
                settled = (
                    entry is not None
                    and entry.state == FETCHING
                    and self._settle_locked(entry, result, problems.get(item), now)
                )
                if not settled and item in kept:
                    unused.append(kept[item])
            if again:
                self.in_flight += 1
            self.generation += 1
            self._changed.notify_all()
        for result in unused:
            self._free(result)
        if again:
            self.counters.inc("nudged", len(again))
            self._submit(again)

    def _reserve_real_sizes(self, usable: Mapping[str, Found]) -> dict[str, int]:
        """Before any found item is staged (written to ``stage_dir``), swap its estimated
        reservation for its real size where that fits; the rest overflow (item -> size), so a
        batch whose estimates were low never stages more than ``stage_bytes``."""
        overflow: dict[str, int] = {}
        with self._lock:
            for item, result in usable.items():
                entry = self._entries.get(item)
                if entry is None or entry.state != FETCHING:
                    continue
                size = result.nbytes
                if self._used_locked() - entry.reserved + size > self.stage_bytes:
                    overflow[item] = size
                    continue
                self.reserved_bytes += size - entry.reserved
                entry.reserved = size
        return overflow

    def _overflow_locked(self, entry: Entry, size: int, now: float) -> None:
        """The item is larger than its reservation and the room left: no bytes are kept;
        it counts as missing for now (looked for again, reserving its real size)."""
        entry.announced = False
        self.reserved_bytes -= entry.reserved
        entry.reserved, entry.since = 0, now
        self.counters.inc("stage_overflow")
        if not entry.wanted_by:
            del self._entries[entry.item]
            return
        entry.state, entry.estimate, entry.last_miss = ABSENT, size, "stage_full"

    def _kept(self, result: Found) -> Found:
        if self._keep is None:
            return result
        try:
            return self._keep(result)
        except Exception as exc:  # where the bytes live is an optimisation: keep them here
            self.counters.inc("lookup_errors")
            self._log.warning("keep", "ec_redis: cannot move a staged item: %r", exc)
            return result

    def _free(self, result: Found) -> None:
        if self._discard is not None:
            self._discard(result)

    def _problem(self, item: str, result: Found) -> str | None:
        entry = self._entries.get(item)
        if self._check is None or entry is None:
            return None
        return self._check(entry.modality, result)

    def _settle_locked(
        self, entry: Entry, result: Found | Lease | None, problem: str | None, now: float
    ) -> bool:
        """Move a FETCHING entry to its next state; True if it now holds ``result``."""
        entry.announced = False
        self.reserved_bytes -= entry.reserved
        entry.reserved, entry.since = 0, now
        if isinstance(result, Lease) or result is None:
            self._note_lease_locked(entry, result, now)
        if not entry.wanted_by:  # every request that wanted it ended meanwhile
            del self._entries[entry.item]
            self._give_up_lease_locked(entry)
            return False
        if not isinstance(result, Found):
            entry.state, entry.last_miss = ABSENT, "absent"
            return False
        if problem is not None:
            entry.state = REFUSED
            self.counters.inc("rejected_items")
            self._log.warning(
                "reject", "ec_redis: cached item %r refused (%s); encoding it", entry.item, problem
            )
            return False
        size = result.nbytes
        if self._used_locked() + size > self.stage_bytes:  # its real size was reserved
            entry.state, entry.estimate, entry.last_miss = ABSENT, size, "stage_full"
            self.counters.inc("stage_overflow")
            return False
        entry.state, entry.found = STAGED, result
        self.staged_bytes += size
        return True

    @staticmethod
    def _note_lease_locked(entry: Entry, lease: Lease | None, now: float) -> None:
        """Record a claim's outcome (None: no lease, so nothing to wait for: Redis down, or
        an entry there but unusable). Another instance's lease keeps the earliest deadline
        seen: a request waits for one holder at most, never for a chain of them."""
        if lease is not None and not lease.won:
            until = now + lease.ttl_s
            had = entry.lease is not None and not entry.lease.won
            entry.lease_until = min(entry.lease_until, until) if had else until
        entry.lease = lease

    def _give_up_lease_locked(self, entry: Entry) -> None:
        """The entry died: a lease this process won for it and vLLM never started encoding
        is released, so a waiter elsewhere claims it at its next look."""
        lease = entry.lease
        if lease is None or not lease.won or entry.encoding or self._release is None:
            return
        entry.lease = None
        self._release(entry.item, lease.rows)  # the rows it claimed with: its own value

    def wait(self, generation: int, deadline: float) -> None:
        """Sleep until a lookup returns after ``generation`` or ``deadline`` (a ``clock()``
        time) passes; the GIL is released, so lookup threads run at full speed meanwhile."""
        with self._changed:
            while self.generation == generation and not self._closed:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return
                self._changed.wait(remaining)

    # -- housekeeping ---------------------------------------------------------------------

    def expire(self) -> None:
        """Drop entries nobody touched for ``idle_ttl_s`` (a request vLLM never finished)."""
        cutoff = self._clock() - self._idle_ttl_s
        with self._lock:
            for entry in list(self._entries.values()):
                if entry.state != FETCHING and entry.touched < cutoff:
                    self.counters.inc("expired_entries")
                    self._drop_locked(entry)

    def _drop_locked(self, entry: Entry) -> None:
        if entry.state == FETCHING:
            entry.wanted_by.clear()  # settles (and disappears) when its lookup returns
            return
        if self._entries.get(entry.item) is entry:
            del self._entries[entry.item]
        self._give_up_lease_locked(entry)
        if entry.found is not None:
            self.staged_bytes -= entry.found.nbytes
            self._free(entry.found)  # a file unlink at most; loads in transit hold their own
            entry.found = None

    # -- introspection and lifecycle ------------------------------------------------------

    def live_state(self) -> dict[str, int]:
        with self._lock:
            return {
                "items": len(self._entries),
                "staged_bytes": self.staged_bytes,
                "reserved_bytes": self.reserved_bytes,
                "transit_bytes": self._outside(),
                "stage_bytes": self.stage_bytes,
                "lookups_in_flight": self.in_flight,
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for entry in self._entries.values():
                if entry.found is not None:
                    self._free(entry.found)
            self._entries.clear()
            self.staged_bytes = self.reserved_bytes = 0
            self.generation += 1
            self._changed.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
