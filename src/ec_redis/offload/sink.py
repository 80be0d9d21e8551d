"""The parent's side of the writer processes: a ``writer.Sink`` that hands each write to a
child (``process.py``, ``child.py``) and sleeps until it answers.

Children are kept in a pool, one per writer thread at most, started on the first write (or by
``warm``). Per write: copy the item into the child's arena, send one message, wait for the
reply, add the counters it carries to the parent tier's. A child is given another item only
after a valid reply to its last request; one that died, answered out of turn, stayed silent
past ``reply_timeout_s`` or was left with a request out by any error here is killed and
reaped, and only then is its arena dropped. Its write is retried once in a fresh child.

An engine's main thread may also hand a write over itself (``dispatch``, at the end of its
step): to a child that reads the item's bytes out of this process's memory (``peek.py``),
with one message and no copy, so no thread of the engine is needed for the write to land.
A child may hold several handed writes at once (up to ``MAX_HANDED``: a step that saved
several items hands them to an idle child each while there are any, then to one holding
some, which writes them in order); they form its
*pipe*, and the child takes no arena write until every reply in it was taken. Replies are
collected later, without blocking, by the engine's thread (``settle``) or, when that needs a
write made here or takes too long, by a writer thread (``finish``; ``writer.py``), in the
order sent, whoever collects. A child lost with a pipe is killed and reaped once, counted
once, and each write of its pipe gets its one retry. A dispatch that finds no such child, or
no room in its socket (it never waits), does nothing and the write takes the normal way.

Writes run on the calling thread through ``fallback`` (counted) whenever no child can take
them: none up yet, starts backed off, a request too large for the socket (a very long item
id), or a retry that finds no child. Starts back off (``backoff.py``) after a start fails, and
after children keep dying (a second death with no write served between): a machine whose
children cannot write pays no child start per write. Idle children that die are reaped at
once (``watch.py``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ec_redis.breaker import CLOSED
from ec_redis.logutil import RateLimitedLog
from ec_redis.offload import wire
from ec_redis.offload.backoff import Backoff, Strikes
from ec_redis.offload.process import ChildGone, WriterProcess
from ec_redis.offload.watch import DeathWatch
from ec_redis.stats import Counters
from ec_redis.tiers.transfer import HostCopy

Fallback = Callable[[str, HostCopy], bool]
Settled = Literal["written", "failed", "waiting", "writer"]
MAX_HANDED = 64  # handed writes one child holds at most (the writer bounds their bytes)
DEFAULT_BACKOFF = Backoff(base_s=10.0, max_s=600.0)
_COUNTERS = (
    "starts", "start_failures", "deaths", "retried_writes", "fallback_writes", "dispatched",
    "peek_failures",
)  # fmt: skip


class Dispatched:
    """A write handed to a child by ``dispatch``, in its ``pipe``. Holds the host copy: its
    bytes stay alive and where the child reads them until its reply is collected (``reply``,
    once: by whichever thread reads the pipe's replies up to it)."""

    def __init__(self, pipe: Pipe, host: HostCopy) -> None:
        self.pipe = pipe
        self.host = host
        self.collected = False
        self.reply: dict[str, Any] | None = None  # None once collected: the child was lost

    @property
    def child(self) -> WriterProcess:
        return self.pipe.child


class Pipe:
    """The handed writes of one child whose replies are not taken yet, in the order sent,
    which is the order of the replies. Busy while it has any; ended (the child idle again,
    or lost) when the last is taken."""

    def __init__(self, child: WriterProcess) -> None:
        self.child = child
        self.lock = threading.Lock()  # held by the thread reading its replies
        self.waiting: deque[Dispatched] = deque()  # sent, reply not taken (the sink's lock)
        self.broken: ChildGone | None = None  # seen by ``settle``: a writer thread ends it
        self.strike = True  # whether breaking it counts against the child (``_died``)


class ProcessSink:
    """Writes items through writer processes (see the module docstring)."""

    def __init__(
        self,
        spec: Mapping[str, Any],
        counters: Counters,
        fallback: Fallback,
        *,
        arena_limit: int,
        reply_timeout_s: float,
        max_children: int = 1,
        start_timeout_s: float = 120.0,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self._spec = dict(spec)
        self._tier_counters = counters  # the parent tier's: the children's deltas go there
        self._fallback = fallback
        self._arena_limit = arena_limit
        self._reply_timeout_s = reply_timeout_s
        self._start_timeout_s = start_timeout_s
        self._idle: list[WriterProcess] = []
        self._busy: set[WriterProcess] = set()
        self._exited_busy: set[WriterProcess] = set()  # seen dead mid-request: left to it
        self._handed: dict[WriterProcess, Pipe] = {}  # busy with handed writes out
        self._cond = threading.Condition()
        self._starting = 0
        self._starters: list[threading.Thread] = []
        self._max_children = max_children
        self._strikes = Strikes(backoff)  # when a child may be started again
        self._closed = False
        self.counters = Counters()
        for name in _COUNTERS:
            self.counters.inc(name, 0)  # reported from the start, never missing
        self._log = RateLimitedLog()
        self._watch = DeathWatch(self._watched, self._exited)

    def __call__(self, key: str, host: HostCopy, *, lost_once: bool = False) -> bool:
        """Write ``key`` through a child (``lost_once``: a child was already lost with this
        write, so this is its one retry)."""
        for attempt in range(1 if lost_once else 0, 2):
            child = self._take(wait_for_start=attempt > 0)  # a retry waits for a start
            if child is None:  # none up (starting, backed off) or closed: write here
                break
            if attempt:
                self.counters.inc("retried_writes")
            try:
                reply = self._ask(
                    child, f"while writing {_shown(key)}",
                    lambda c: c.put(key, host.tensor, self._reply_timeout_s),
                )  # fmt: skip
            except wire.TooLarge as exc:  # never sent: the child serves on
                self._log.warning(
                    "large", "ec_redis: the request to write %s does not fit the writer "
                    "process's socket (%s); written on the engine's thread", _shown(key), exc,
                )  # fmt: skip
                break
            if reply is None:  # lost: retried once in a fresh child, if one can start
                continue
            with self._cond:
                self._strikes.served()
            return bool(reply.get("ok"))
        self.counters.inc("fallback_writes")
        return self._fallback(key, host)

    def dispatch(self, key: str, host: HostCopy) -> Dispatched | None:
        """(The engine's main thread, never blocking.) Hand the write of ``key`` to a child
        that reads the bytes where they are: an idle one, else one whose pipe has room;
        ``None`` (nothing done) when none can, its socket has no room now, or the bytes are
        not ready on the host yet."""
        tensor = host.tensor
        ready = host.ready is None or host.ready.query()  # type: ignore[no-untyped-call]
        if not ready or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        with self._cond:
            child = self._take(start=False, peeking=True)  # an idle one first: in parallel
            fresh = child is not None
            pipe = Pipe(child) if child is not None else self._pipe_with_room()
            if pipe is None:
                return None
            try:  # never blocks, so under the lock: a reader meanwhile sees it whole
                pipe.child.send_peek(key, tensor)
            except wire.TooLarge:  # Full included: nothing went out
                if not fresh:
                    return None
                failed: BaseException | None = None
            except BaseException as exc:  # ChildGone, or a bug here
                if not fresh:  # requests are out: a writer thread ends the pipe
                    if isinstance(exc, ChildGone):
                        pipe.broken = exc
                        return None
                    pipe.broken = ChildGone(f"to an error here ({exc!r})")
                    pipe.strike = False  # not the child's failure
                    raise  # (maybe sent, not noted: its reply would be out of turn)
                failed = exc
            else:
                dispatched = Dispatched(pipe, host)
                pipe.waiting.append(dispatched)
                self._handed[pipe.child] = pipe
                self.counters.inc("dispatched")
                self._cond.notify_all()  # a writer thread waiting in _take collects it
                return dispatched
        self._release(pipe.child)  # a fresh child with a request out is killed
        if isinstance(failed, ChildGone):
            self._died(pipe.child, f"while handing over {_shown(key)} ({failed})")
        elif failed is not None:
            raise failed
        return None

    def _pipe_with_room(self) -> Pipe | None:
        """(Under the lock.) A pipe a handed write may join: its child reads items where
        they are, is sound, and holds fewer than ``MAX_HANDED``."""
        for pipe in self._handed.values():
            child = pipe.child
            if (
                pipe.broken is None and child.peeks and not child.gone
                and len(pipe.waiting) < MAX_HANDED and child not in self._exited_busy
            ):  # fmt: skip
                return pipe
        return None

    def finish(self, key: str, dispatched: Dispatched) -> bool:
        """(A writer thread.) The dispatched write's outcome: the child's reply; if the
        child was lost or could not read the bytes, the write made the normal way."""

        reply = self._collect(dispatched)
        if reply is None:  # lost with the write: its one retry
            return self(key, dispatched.host, lost_once=True)
        if reply.get("peek_failed"):  # nothing written: the normal way, from the arena
            self.counters.inc("peek_failures")
            return self(key, dispatched.host)
        with self._cond:
            self._strikes.served()
        return bool(reply.get("ok"))

    def settle(self, key: str, dispatched: Dispatched) -> Settled:
        """(The engine's thread, never blocking.) The outcome of a handed write if its reply
        is in: ``"written"`` or ``"failed"`` (Redis refused it); ``"waiting"``: not in yet,
        or another thread is reading the pipe; ``"writer"``: it needs more than this thread
        does, which ``finish`` on a writer thread does: a write made here (the child could
        not read the bytes; the reply taken here is kept for it), or a child to kill and
        reap first (it died, or broke the protocol: nothing waits for a process here).
        Replies of earlier writes in the pipe are taken on the way, for their writes."""
        pipe = dispatched.pipe
        if not pipe.lock.acquire(blocking=False):
            return "waiting"  # another thread is reading the pipe
        try:
            while not dispatched.collected:
                if pipe.broken is not None or self._closed:
                    return "writer"
                if not pipe.child.answered():
                    return "waiting"
                try:
                    answer = pipe.child.await_reply(self._reply_timeout_s)  # in: at once
                except ChildGone as exc:
                    pipe.broken = exc
                    return "writer"
                self._took(pipe, answer)
            reply = dispatched.reply
        finally:
            pipe.lock.release()
        if reply is None or reply.get("peek_failed"):
            return "writer"
        with self._cond:
            self._strikes.served()
        return "written" if reply.get("ok") else "failed"

    def _collect(self, dispatched: Dispatched) -> dict[str, Any] | None:
        """The reply to a handed write, waited for (replies of earlier ones in its pipe are
        taken on the way); ``None``: the child was lost with it (killed, reaped, counted
        once for the pipe; every write still in it is lost too)."""
        pipe = dispatched.pipe
        with pipe.lock:
            while not dispatched.collected:
                if pipe.broken is None:
                    try:
                        answer = pipe.child.await_reply(self._reply_timeout_s)
                    except ChildGone as exc:
                        pipe.broken = exc
                    except BaseException as exc:  # left with requests out: killed below
                        pipe.broken = ChildGone(f"to an error here ({exc!r})")
                        self._end(pipe, strike=False)
                        raise
                    else:
                        self._took(pipe, answer)
                        continue
                self._end(pipe, strike=pipe.strike)
        return dispatched.reply

    def _took(self, pipe: Pipe, reply: dict[str, Any]) -> None:
        """(Holding ``pipe.lock``.) ``reply``, valid, answers the oldest write in ``pipe``:
        counted; the child idle again once the pipe is empty."""
        _note_peek(pipe.child, reply)
        self._add(reply["counters"])
        self._breakers(reply.get("breakers"))
        with self._cond:
            dispatched = pipe.waiting.popleft()
            dispatched.reply, dispatched.collected = reply, True
            if pipe.waiting:
                return
            del self._handed[pipe.child]
        self._release(pipe.child)

    def _end(self, pipe: Pipe, *, strike: bool = True) -> None:
        """(Holding ``pipe.lock``.) The child of a broken pipe: every write still in it is
        lost (collected, no reply); the child killed, reaped and counted once."""
        with self._cond:
            lost = list(pipe.waiting)
            pipe.waiting.clear()
            for dispatched in lost:
                dispatched.collected = True
            if self._handed.get(pipe.child) is pipe:
                del self._handed[pipe.child]
        if not lost:
            return  # ended already
        self._release(pipe.child)  # killed: requests are out
        what = f"with {len(lost)} handed write(s) out ({pipe.broken})"
        self._died(pipe.child, what, strike=strike)

    def end_lease(self, key: str) -> bool | None:
        """End the single-flight lease of ``key`` (its write was dropped) through an idle
        child, behind the breaker that saw this cache's writes (the parent's saw none), as the
        in-process writer does behind its own. Without an idle child: False while the
        children last reported an open breaker, else ``None`` (the caller ends it itself)."""
        child = self._take(start=False)
        if child is None:
            return False if self.counters.get("breaker_state") != CLOSED else None
        try:
            reply = self._ask(
                child, f"while ending the lease of {_shown(key)}",
                lambda c: c.call({"op": "end_lease", "key": key}, self._reply_timeout_s),
            )  # fmt: skip
        except wire.TooLarge:
            return None
        return False if reply is None else bool(reply.get("ok"))

    def _ask(
        self,
        child: WriterProcess,
        what: str,
        request: Callable[[WriterProcess], dict[str, Any]],
    ) -> dict[str, Any] | None:
        """``request(child)``'s reply, its counters added; ``child`` is released whatever
        happens (``_release``). ``None``: the child was lost (killed, reaped, counted).
        Exceptions propagate: ``wire.TooLarge`` (nothing sent, the child serves on) or any
        other, which kills the child if its request was out."""
        try:
            reply = request(child)
        except ChildGone as exc:
            self._release(child)
            self._died(child, f"{what} ({exc})")
            return None
        except BaseException as exc:
            self._release(child)
            if child.in_flight:
                self._died(child, f"to an error here ({exc!r})", strike=False)
            raise
        self._accept(child, reply)
        return reply

    def _accept(self, child: WriterProcess, reply: dict[str, Any]) -> None:
        """A valid reply from ``child``: it goes back to the pool, its counters are added."""
        self._release(child)
        self._add(reply["counters"])
        self._breakers(reply.get("breakers"))

    def warm(self) -> None:
        """Start a child now, on a thread of its own, so that the first write finds it."""
        with self._cond:
            if not self._idle and not self._busy and not self._starting:
                self._start_async()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until a child is up (tests, benchmarks); False if none is after ``timeout_s``
        or starting failed."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._idle and not self._busy:
                remaining = deadline - time.monotonic()
                if self._closed or not self._starting or remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def _take(
        self, *, wait_for_start: bool = False, start: bool = True, peeking: bool = False
    ) -> WriterProcess | None:
        """An idle child (``peeking``: one that reads items where they are, else ``None``).
        Else, while fewer than ``max_children`` exist, one is started on another thread
        (``start``), and ``None`` is returned at once (a write never waits for a start)
        unless ``wait_for_start``; with every child busy, the next one given back. ``None``
        while starting is backed off, or once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                child = self._idle_child(peeking)
                if child is not None or peeking:
                    return child
                if not start:
                    return None
                backed_off = self._strikes.backed_off()
                if not backed_off and len(self._busy) + self._starting < self._max_children:
                    self._start_async()
                if backed_off or (self._starting and not wait_for_start):
                    return None
                pipe = next(iter(self._handed.values()), None)
                if pipe is not None and pipe.waiting:
                    # Every child busy, one with handed writes whose replies only a writer
                    # thread collects, and this may be the only one: collect them here, so
                    # a child comes back (never wait on a child nobody else gives back).
                    last = pipe.waiting[-1]
                    self._cond.release()
                    try:
                        self._collect(last)
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait()

    def _idle_child(self, peeking: bool) -> WriterProcess | None:
        """(Under the lock.) The idle child given back last that is alive (``peeking``: and
        reads items where they are), now busy; dead ones met on the way are reaped."""
        for child in [c for c in reversed(self._idle) if c.peeks or not peeking]:
            self._idle.remove(child)
            if child.quiet():
                self._busy.add(child)
                return child
            self._reap(child)  # died idle, the watch has not seen it yet
        return None

    def _start_async(self) -> None:
        """(Under the lock.) Start one child on a thread of its own."""
        self._starting += 1
        thread = threading.Thread(target=self._start, name="ec_redis-writer-start", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread
            self._start_failed(exc)
            return
        self._starters = [t for t in self._starters if t.is_alive()] + [thread]

    def _start(self) -> None:
        try:
            child = WriterProcess(self._spec, self._arena_limit, self._start_timeout_s)
        except Exception as exc:  # EMFILE, ENOMEM, no memfd, a broken interpreter, refused
            with self._cond:
                self._start_failed(exc)
            return
        self.counters.inc("starts")
        with self._cond:
            self._starting -= 1
            self._cond.notify_all()
            if not self._closed:
                self._idle.append(child)
                self._watch.changed()
                return
        child.stop(1.0)

    def _start_failed(self, exc: BaseException) -> None:
        """(Under the lock.)"""
        self._starting -= 1
        self._cond.notify_all()
        self.counters.inc("start_failures")
        delay_s = self._strikes.start_failed()
        self._log.warning(
            "start", "ec_redis: cannot start a writer process (%r); writing on the engine's "
            "thread for %.0f s", exc, delay_s,
        )  # fmt: skip

    def _release(self, child: WriterProcess) -> None:
        """Back to the pool if it answered its last request; else (a request may be out,
        so it may still read its arena) killed and reaped before anything else happens."""
        with self._cond:
            self._busy.discard(child)
            self._exited_busy.discard(child)
            self._cond.notify_all()
            if not child.in_flight and not child.gone and not self._closed:
                self._idle.append(child)
                return
        self._watch.changed()  # one child less to watch
        child.stop(1.0)  # a child with a request out is killed at once

    def _died(self, child: WriterProcess, what: str, *, strike: bool = True) -> None:
        """``child`` (already killed and reaped) was lost ``what``: counted; ``strike``: it
        failed (not this process), which backs starts off if it follows another failure."""
        with self._cond:
            delay_s = self._strikes.died() if strike else 0.0
        self._lost(child, what, delay_s)

    def _lost(self, child: WriterProcess, what: str, delay_s: float) -> None:
        self.counters.inc("deaths")
        self._log.warning(
            "gone", "ec_redis: writer process %d lost %s; %s", child.pid, what,
            f"no new one for {delay_s:.0f} s" if delay_s else "replaced",
        )  # fmt: skip

    def _watched(self) -> list[WriterProcess] | None:
        """(The watch's thread.) The children to watch; ``None`` once closed."""
        with self._cond:
            if self._closed:
                return None
            return [c for c in (*self._idle, *self._busy) if c not in self._exited_busy]

    def _exited(self, child: WriterProcess) -> None:
        """(The watch's thread.) ``child`` exited: reaped now if idle; if busy, its write
        finds it gone (end of stream) and handles it."""
        with self._cond:
            if child in self._idle:
                self._idle.remove(child)
                self._reap(child)
            elif child in self._busy:
                self._exited_busy.add(child)

    def _reap(self, child: WriterProcess) -> None:
        """(Under the lock.) An idle child died: reap it (it is dead: no wait)."""
        child.kill()
        self._watch.changed()
        status = child.proc.returncode if child.proc is not None else None
        self._lost(child, f"while idle (exit status {status})", self._strikes.died())

    def _add(self, counters: Mapping[str, Any]) -> None:
        for name, value in counters.items():
            if isinstance(name, str) and isinstance(value, int) and value > 0:
                self._tier_counters.inc(name, value)

    def _breakers(self, stats: object) -> None:
        """The writer processes' breakers as gauges (``process_breaker_state`` ...): the
        parent's own breaker sees none of their writes."""
        if isinstance(stats, dict):
            for name, value in stats.items():
                if isinstance(name, str) and isinstance(value, int | float):
                    self.counters.set(f"breaker_{name.removeprefix('breaker_')}", float(value))

    def pids(self) -> list[int]:
        """The writer processes' pids (tests and tools)."""
        with self._cond:
            return [c.pid for c in (*self._idle, *self._busy)]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the idle children and those being started (within ``timeout_s``); a busy one
        stops when its write returns."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            starters, self._starters = self._starters, []
            self._cond.notify_all()
        self._watch.close(timeout_s)
        for child in idle:
            child.stop(timeout_s)
        for thread in starters:  # a child being started is stopped as soon as it is up
            thread.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict[str, float]:
        out = {f"process_{name}": value for name, value in self.counters.snapshot().items()}
        with self._cond:
            for child in [c for c in self._idle if not c.quiet()]:  # without a pidfd
                self._idle.remove(child)
                self._reap(child)
            out["process_alive"] = float(len(self._idle) + len(self._busy))
        return out


def _note_peek(child: WriterProcess, reply: dict[str, Any]) -> None:
    """A child whose read failed is handed nothing more (e.g. a newer child took the Yama
    permission): set before it is idle again, so it takes writes through its arena only."""
    if reply.get("peek_failed"):
        child.peeks = False


def _shown(key: str) -> str:
    """An item id as a log line shows it: at most 80 characters of it."""
    return repr(key) if len(key) <= 80 else f"{key[:80]!r}... ({len(key)} characters)"
