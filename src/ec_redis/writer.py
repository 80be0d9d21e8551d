"""Background Redis writer: a bounded queue so ``put`` never waits on the network.

The queue is bounded in entries and in bytes — the bytes each host copy really holds (a
pinned pool block rounded up, or a tensor's whole storage), not its tensor's size. When
full, the **oldest** pending write is dropped and counted (its data is still in the local
tiers; only sharing is lost). A newer write of a pending key replaces the older one. Threads
are daemons and ``close`` has a deadline, so an engine can always exit. A write reads its
host copy only after the device->host copy's ``ready`` event (``HostCopy.wait``). A write
the queue drops (full, or larger than the whole queue) is handed to ``on_lost`` on a writer
thread: the cache ends the item's single-flight lease, so other instances waiting for this
write encode the item at their next look instead of at the lease's deadline. (A write the
sink fails is not: Redis is what failed, and the waiters' own lookups meet that.)

With a ``Dispatcher`` (writer processes that read an item where it is: ``offload/sink.py``)
the engine's thread hands writes over itself: in ``submit`` when the dispatcher takes the
write at once, later (``dispatch``, at the end of its step) for those queued meanwhile (a
GPU item whose host copy was not ready). A write handed over skips the queue; until its
outcome is collected it is pending (read-your-writes) like any other, and its host copy is
held: handed writes count towards the queue's bounds (``max_items``, ``max_bytes``: what the
host copies held for writes may take, e.g. the pinned pool's share), and one that would
pass them is queued instead, where the oldest queued writes make room as usual. A queued
write a writer thread took first is written the normal way.

Handing over wakes no thread here: a thread woken in the middle of the engine's step would
take the GIL from it, and on a machine whose cores are busy (the writer process and Redis
are then running too) it can be descheduled while holding it, which stalled steps by
milliseconds. The engine's thread collects the outcomes itself, without blocking, in its
next ``submit`` or ``collect`` (the connector calls it at the end of every step); a writer
thread collects those still out after ``collect_after_s`` (an engine gone idle, a reply that
needs a write made here: a child lost or unable to read), and at once for ``flush`` and
``wait_written``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ec_redis import sched
from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters
from ec_redis.tiers.transfer import HostCopy

Sink = Callable[[str, HostCopy], bool]
MAX_LOST = 4096  # lost writes awaiting on_lost (the oldest are forgotten: leases expire)
COLLECT_AFTER_S = 0.5  # a handed write's outcome left to a writer thread after this long


class Dispatcher(Protocol):
    def dispatch(self, key: str, host: HostCopy) -> Any:
        """Hand the write over now, without blocking; ``None`` if it cannot be."""

    def finish(self, key: str, dispatched: Any) -> bool:
        """The outcome of a write handed over (waits for it)."""

    def settle(self, key: str, dispatched: Any) -> str:
        """Never blocks: ``"written"`` or ``"failed"`` once the outcome of a write handed
        over is in and needs nothing more; ``"waiting"`` until then; ``"writer"`` when a
        writer thread's ``finish`` must complete it."""


@dataclass
class _Job:
    host: HostCopy
    nbytes: int


@dataclass(eq=False)
class _Handed:
    """A write handed over, its outcome not collected yet."""

    key: str
    host: HostCopy
    dispatched: Any  # the dispatcher's handle
    due: float  # monotonic time from which a writer thread collects it


class BackgroundWriter:
    def __init__(
        self,
        sink: Sink,
        max_items: int,
        max_bytes: int,
        threads: int = 1,
        on_lost: Callable[[str], object] | None = None,
        dispatcher: Dispatcher | None = None,
        collect_after_s: float = COLLECT_AFTER_S,
    ) -> None:
        self._sink = sink
        self._dispatcher = dispatcher
        self._collect_after_s = collect_after_s
        self._dispatched: deque[_Handed] = deque()  # outcomes to collect, oldest first
        self._urgent = 0  # threads waiting for writes: handed outcomes are collected at once
        # our threads under SCHED_BATCH (native ids), back under SCHED_OTHER while a thread
        # waits for writes (``_urgency``); each leaves this set, under the lock, before it ends
        self._background: set[int] = set()
        # in flight through the dispatcher, per key, oldest first (a key may be written
        # again before an earlier write of it is done)
        self._handed: dict[str, list[HostCopy]] = {}
        self._handed_sizes: dict[int, int] = {}  # id(host) -> its bytes, for ``_handed``
        self._handed_bytes = 0
        self._spent: list[HostCopy] = []  # collected by the engine's thread, dropped by ours
        self._spent_bytes = 0
        self._on_lost = on_lost
        self._lost: deque[str] = deque(maxlen=MAX_LOST)
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._queue: OrderedDict[str, _Job] = OrderedDict()
        self._queued_bytes = 0
        self._in_flight: dict[str, list[HostCopy]] = {}  # being written, as ``_handed``
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # writes done (flush, wait_written)
        self._work = threading.Condition(lock)  # work for the writer threads
        self._closed = False
        self.counters = Counters()
        self._log = RateLimitedLog()
        self._threads = [
            threading.Thread(target=self._run, name=f"ec_redis-writer-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, key: str, host: HostCopy) -> bool:
        """Queue a write; never blocks. Returns False if the writer is closed or it is too big."""
        nbytes = host.nbytes
        self.collect()  # a child whose last handed write is done can take this one
        if nbytes > self._max_bytes:
            self.counters.inc("dropped_too_large")
            self._lose([key])
            return False
        with self._cond:
            if self._closed:
                return False
            old = self._queue.pop(key, None)
            if old is not None:
                self._queued_bytes -= old.nbytes
                self.counters.inc("coalesced")
            self.counters.inc("submitted")
            if self._hand_over(key, host):  # in flight at once, never queued
                return True
            while self._queue and (
                len(self._queue) + len(self._handed_sizes) >= self._max_items
                or self._held_bytes() + nbytes > self._max_bytes
            ):
                lost, dropped = self._queue.popitem(last=False)
                self._queued_bytes -= dropped.nbytes
                if self._on_lost is not None:
                    self._lost.append(lost)
                self.counters.inc("dropped")
                self._log.warning("drop", "ec_redis: write queue full; dropped the oldest write")
            self._queue[key] = _Job(host, nbytes)
            self._queued_bytes += nbytes
            self._work.notify()
        return True

    def _hand_over(self, key: str, host: HostCopy, queued: _Job | None = None) -> bool:
        """(Under the lock.) Hand the write to the dispatcher now, if it takes it (``queued``:
        its job in the queue, which it leaves if handed over: not counted twice). A host copy
        already handed over is not handed again (its write is queued)."""
        if self._dispatcher is None:
            return False
        nbytes = host.nbytes
        credit_items, credit_bytes = (1, queued.nbytes) if queued is not None else (0, 0)
        if id(host) in self._handed_sizes or (
            len(self._queue) - credit_items + len(self._handed_sizes) >= self._max_items
            or self._held_bytes() - credit_bytes + nbytes > self._max_bytes
        ):
            return False  # held until written: within the queue's bounds
        try:
            dispatched = self._dispatcher.dispatch(key, host)
        except Exception as exc:  # handing over is a shortcut: the queue takes the write
            self._log.warning("dispatch", "ec_redis: cannot hand %r over: %r", key, exc)
            return False
        if dispatched is None:
            return False
        _add(self._in_flight, key, host)
        _add(self._handed, key, host)
        self._handed_sizes[id(host)] = nbytes
        self._handed_bytes += nbytes
        due = time.monotonic() + self._collect_after_s
        self._dispatched.append(_Handed(key, host, dispatched, due))  # no thread woken
        return True

    def collect(self) -> int:
        """(The engine's thread.) Take the outcomes of handed writes whose replies are in and
        need nothing more, without blocking; the number taken. The rest stay for later or
        for a writer thread (woken for a reply that needs a write made here)."""
        if self._dispatcher is None:
            return 0
        with self._cond:
            handed = list(self._dispatched)
        if not handed:
            return 0
        outcomes: list[str] = []
        for entry in handed:
            try:
                outcomes.append(self._dispatcher.settle(entry.key, entry.dispatched))
            except Exception as exc:  # a writer thread's ``finish`` deals with it
                self._log.warning("collect", "ec_redis: cannot collect a write: %r", exc)
                outcomes.append("writer")
        taken = 0
        with self._cond:
            for entry, outcome in zip(handed, outcomes, strict=True):
                if entry not in self._dispatched:  # a writer thread took it meanwhile (and
                    self._spend(entry.host)  # counts it): this may be the last reference
                elif outcome == "writer":  # due now: a writer thread completes it
                    entry.due = 0.0
                    self._work.notify()
                elif outcome != "waiting":
                    self._dispatched.remove(entry)
                    self.counters.inc("written" if outcome == "written" else "failed")
                    self._done(entry.key, entry.host)
                    self._spend(entry.host)
                    taken += 1
            if taken:
                self._cond.notify_all()
        return taken

    def _spend(self, host: HostCopy) -> None:
        """(Under the lock.) Keep a written host copy for a writer thread to drop: when it is
        the last reference to the item (the engine dropped its own), freeing it costs
        milliseconds (``munmap``, with the GIL held), which the engine's step must not pay.
        Dropped at the writer thread's next wake (within ``collect_after_s``), at once when
        half the queue's budget is held this way."""
        if self._closed:
            return  # no writer thread to drop it any more
        self._spent.append(host)
        self._spent_bytes += host.nbytes
        if self._spent_bytes > self._max_bytes // 2:
            self._work.notify()

    def _done(self, key: str, host: HostCopy) -> None:
        """(Under the lock.) The write of ``host`` under ``key`` is no longer in flight."""
        _remove(self._in_flight, key, host)
        if _remove(self._handed, key, host):
            self._handed_bytes -= self._handed_sizes.pop(id(host))

    def _held_bytes(self) -> int:
        """(Under the lock.) Bytes of host copies queued or handed over."""
        return self._queued_bytes + self._handed_bytes

    def _lose(self, keys: list[str]) -> None:
        with self._cond:
            if self._on_lost is not None and not self._closed:
                self._lost.extend(keys)
                self._work.notify()

    def dispatch(self, keys: Iterable[str]) -> list[str]:
        """Hand the queued writes of ``keys`` over now (see the module docstring); the keys
        whose writes are in flight through the dispatcher (handed now or before). Never
        blocks on the network."""
        if self._dispatcher is None:
            return []
        self.collect()  # a child whose last handed write is done can take one of these
        done: list[str] = []
        with self._cond:  # held while handing over: no thread takes the job meanwhile
            taken = not self._closed  # the dispatcher takes more
            for key in keys:
                job = self._queue.get(key)
                if job is not None and taken and self._hand_over(key, job.host, job):
                    del self._queue[key]
                    self._queued_bytes -= job.nbytes
                    done.append(key)
                elif job is not None:
                    taken = False  # none can take it now: the writer threads write these
                elif key in self._handed:
                    done.append(key)
        return done

    def discard(self, key: str) -> None:
        """Forget a queued write of ``key`` (one already in flight still completes)."""
        with self._cond:
            job = self._queue.pop(key, None)
            if job is not None:
                self._queued_bytes -= job.nbytes
                self._cond.notify_all()

    def pending(self, key: str) -> HostCopy | None:
        """The host copy of a write not yet in Redis (read-your-writes)."""
        with self._cond:
            job = self._queue.get(key)
            if job is not None:
                return job.host
            writing = self._in_flight.get(key)
            return writing[-1] if writing else None

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write is done; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._urgency():
            while self._queue or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    @contextmanager
    def _urgency(self) -> Iterator[None]:
        """The lock, held by a thread waiting for writes: handed outcomes are collected at
        once meanwhile (a writer thread is woken for them), and the writer threads run under
        ``SCHED_OTHER``: a waking one preempts as any thread would."""
        with self._cond:
            self._urgent += 1
            if self._urgent == 1:  # what it waits for must not wait for scheduler ticks
                self._set_background(False)
            self._work.notify_all()
            try:
                yield
            finally:
                self._urgent -= 1
                if not self._urgent:
                    self._set_background(True)

    def _set_background(self, background: bool) -> None:
        """(Under the lock.) Our threads under ``SCHED_BATCH``, or back under ``SCHED_OTHER``
        while a thread waits for writes (``sched.py``)."""
        for thread_id in self._background:
            sched.set_policy(thread_id, background=background)

    def wait_written(self, keys: Iterable[str], timeout_s: float) -> bool:
        """Wait until none of ``keys`` is queued or being written (stored, failed or dropped);
        False if ``timeout_s`` passed first. Waiting releases the GIL: the writer threads run
        at full speed meanwhile."""
        wanted = set(keys)
        deadline = time.monotonic() + timeout_s
        with self._urgency():
            while any(key in self._queue or key in self._in_flight for key in wanted):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop taking writes, drain for up to ``timeout_s``, stop the threads."""
        drained = self.flush(timeout_s)
        with self._cond:
            self._closed = True
            abandoned = len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._spent, self._spent_bytes = [], 0
            self._cond.notify_all()
            self._work.notify_all()
        self.counters.inc("abandoned_on_close", abandoned)
        deadline = time.monotonic() + max(timeout_s, 0.1)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return drained

    def depth(self) -> tuple[int, int]:
        with self._cond:
            writing = sum(len(hosts) for hosts in self._in_flight.values())
            return len(self._queue) + writing, self._queued_bytes

    def threads_alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def _due(self) -> _Handed | None:
        """(Under the lock.) The handed write a writer thread collects now, if any."""
        now = time.monotonic()
        for entry in self._dispatched:
            if self._closed or self._urgent or entry.due <= now:
                self._dispatched.remove(entry)
                return entry
        return None

    def _idle_wait_s(self) -> float | None:
        """(Under the lock.) How long a writer thread with nothing to do sleeps: until the
        oldest handed write is due, checked every ``collect_after_s`` (handing over wakes no
        thread), or until woken when nothing is handed."""
        if self._dispatcher is None:
            return None
        if self._dispatched:
            due = min(entry.due for entry in self._dispatched)
            return min(self._collect_after_s, max(0.001, due - time.monotonic()))
        return self._collect_after_s

    def _run(self) -> None:
        me = threading.get_native_id()
        with self._cond:  # woken by a write, it never preempts the engine's thread ...
            if sched.as_background():
                self._background.add(me)
                if self._urgent:  # ... except while the engine's thread waits for writes
                    sched.set_policy(me, background=False)
        try:
            while self._one():
                pass  # each write's locals (its host copy) go when ``_one`` returns
        finally:
            with self._cond:  # its id may be another thread's once it has ended
                self._background.discard(me)

    def _one(self) -> bool:
        """Wait for one piece of work and do it; False once closed."""
        with self._cond:
            while not (self._queue or self._lost or self._closed):
                self._drop_spent()
                dispatched = self._due()
                if dispatched is not None:
                    break
                self._work.wait(self._idle_wait_s())
            else:
                dispatched = self._due()
            self._drop_spent()
            if self._closed and dispatched is None:
                return False
            lost = list(self._lost)
            self._lost.clear()
            if dispatched is not None:
                key, host, handed = dispatched.key, dispatched.host, dispatched.dispatched
            elif not lost:
                key, job = self._queue.popitem(last=False)
                self._queued_bytes -= job.nbytes
                host = job.host
                _add(self._in_flight, key, host)
        if lost:
            self._report_lost(lost)
            if dispatched is None:
                return True
        try:
            if dispatched is not None:
                assert self._dispatcher is not None
                ok = self._dispatcher.finish(key, handed)
            else:
                host.wait()  # the device->host copy, if any
                ok = self._sink(key, host)
            self.counters.inc("written" if ok else "failed")
        except Exception as exc:  # the writer must survive any bug in a sink
            self.counters.inc("failed")
            self._log.warning("sink", "ec_redis: write of %r failed: %r", key, exc)
        finally:
            with self._cond:
                self._done(key, host)
                self._cond.notify_all()
        return True

    def _drop_spent(self) -> None:
        """(Under the lock, on a writer thread.) Drop the host copies ``collect`` kept."""
        if self._spent:
            self._spent = []  # freed here, on this thread
            self._spent_bytes = 0

    def _report_lost(self, keys: list[str]) -> None:
        """``on_lost`` for each key; after one that fails (Redis unwell), none: their leases
        expire by themselves, and the writer goes back to writing."""
        if self._on_lost is None:
            return
        for key in keys:
            try:
                if self._on_lost(key) is False:
                    return
            except Exception as exc:  # best effort: the lease expires by itself
                self._log.warning("lost", "ec_redis: on_lost(%r) failed: %r", key, exc)
                return

    def stats(self) -> dict[str, float]:
        depth, queued = self.depth()
        out = self.counters.snapshot()
        out.update({"queue_depth": float(depth), "queue_bytes": float(queued)})
        return out


def _add(writes: dict[str, list[HostCopy]], key: str, host: HostCopy) -> None:
    writes.setdefault(key, []).append(host)


def _remove(writes: dict[str, list[HostCopy]], key: str, host: HostCopy) -> bool:
    """Forget the write of ``host`` (by identity) under ``key``, and the key with its last;
    whether it was there."""
    hosts = writes.get(key, [])
    found = False
    for i, other in enumerate(hosts):
        if other is host:
            del hosts[i]
            found = True
            break
    if not hosts:
        writes.pop(key, None)
    return found
