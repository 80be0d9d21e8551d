"""Deterministic stand-ins for the connector's thread-timed parts, so a chaos seed replays
exactly: lookups run when the harness says, and time moves when the harness says.

- ``SteppedExecutor`` replaces the ``ThreadPoolExecutor`` the scheduler half's stager runs its
  lookups on (``ec_redis.connector.staging``): ``submit`` only queues; the harness runs queued
  lookups, in the calling thread, at seeded points between engine calls.
- ``FakeClock`` replaces ``time.monotonic`` where the connector takes a clock: the scheduler
  half (``SchedulerSide(clock=...)``: its gate's ``consumer_wait_s``/``recheck_s``, the
  stager, housekeeping, pending work) and the circuit breakers of every ``TieredCache``.
  The harness advances it by a fixed amount per engine step.

``deterministic_connector`` installs both (``monkeypatch``), and says what it could not patch:
the product offers no public hook for either, so this reaches the module attributes the
connector resolves at call time (``ec_redis.connector.connector.SchedulerSide``,
``ec_redis.cache.CircuitBreaker``, ``ec_redis.connector.staging.ThreadPoolExecutor``).
What stays on real time: the Redis socket timeouts (the pause fault is sized around them),
the file transport's ``in_transit_ttl_s`` backstop (120 s: longer than any seed) and redis-py's
30 s connection health check.
"""

from __future__ import annotations

import functools
import inspect
import random
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


@dataclass
class _Job:
    future: Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def describe(self) -> str:
        """What the job is, for traces: the callable's name and its arguments (a stager's
        lookup takes the batch of item ids)."""
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"{name}{self.args!r}"


class SteppedExecutor:
    """``concurrent.futures.ThreadPoolExecutor``'s interface (``submit``, ``shutdown``) with no
    threads: a submitted callable waits in a queue until ``run`` executes it in the caller's
    thread. Exceptions escaping a job are kept in ``errors`` (a real pool would hide them
    in a future nobody reads; the harness reports them)."""

    def __init__(
        self, max_workers: int | None = None, thread_name_prefix: str = "", *_: Any, **__: Any
    ) -> None:
        self.name = thread_name_prefix
        self.max_workers = max_workers
        self._queue: list[_Job] = []
        self._shutdown = False
        self.submitted = 0
        self.ran = 0
        self.cancelled = 0
        self.errors: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        future: Future[Any] = Future()
        self._queue.append(_Job(future, fn, args, dict(kwargs)))
        self.submitted += 1
        return future

    @property
    def pending(self) -> int:
        return len(self._queue)

    def describe(self) -> list[str]:
        return [job.describe() for job in self._queue]

    def run(self, index: int = 0) -> str:
        """Run the queued job at ``index`` now (in this thread); what it was."""
        job = self._queue.pop(index)
        if not job.future.set_running_or_notify_cancel():
            return f"cancelled {job.describe()}"
        self.ran += 1
        try:
            result = job.fn(*job.args, **job.kwargs)
        except BaseException as exc:
            self.errors.append(f"{job.describe()} raised {type(exc).__name__}: {exc}")
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)
        return job.describe()

    def run_some(self, rng: random.Random, p_none: float = 0.25) -> list[str]:
        """A seeded share of the queue, in a seeded order (two real threads finish lookups in
        any order): none with probability ``p_none``, else 1..all."""
        if not self._queue or rng.random() < p_none:
            return []
        count = rng.randint(1, len(self._queue))
        return [self.run(rng.randrange(len(self._queue))) for _ in range(count)]

    def run_all(self, limit: int = 10_000) -> list[str]:
        """Everything queued, also what the jobs queue while running (oldest first)."""
        ran: list[str] = []
        while self._queue and len(ran) < limit:
            ran.append(self.run(0))
        return ran

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        if cancel_futures:
            for job in self._queue:
                job.future.cancel()
            self.cancelled += len(self._queue)
            self._queue.clear()


@dataclass
class Determinism:
    """What ``deterministic_connector`` installed: the clock and every executor made since."""

    clock: FakeClock = field(default_factory=FakeClock)
    executors: list[SteppedExecutor] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # hooks that could not be installed

    def executor(self, *args: Any, **kwargs: Any) -> SteppedExecutor:
        made = SteppedExecutor(*args, **kwargs)
        self.executors.append(made)
        return made


def deterministic_connector(monkeypatch: pytest.MonkeyPatch) -> Determinism:
    """Install the stepped executor and the fake clock for connectors built from now on."""
    import ec_redis.cache as cache_module
    import ec_redis.connector.connector as facade
    import ec_redis.connector.staging as staging
    from ec_redis.breaker import CircuitBreaker

    det = Determinism()
    if hasattr(staging, "ThreadPoolExecutor"):
        monkeypatch.setattr(staging, "ThreadPoolExecutor", det.executor)
    else:
        det.problems.append("ec_redis.connector.staging no longer uses ThreadPoolExecutor")
    scheduler_side = getattr(facade, "SchedulerSide", None)
    if scheduler_side is not None and "clock" in inspect.signature(scheduler_side).parameters:
        with_clock = functools.partial(scheduler_side, clock=det.clock)
        monkeypatch.setattr(facade, "SchedulerSide", with_clock)
    else:
        det.problems.append("SchedulerSide takes no clock: the gate's waits run on real time")
    if "clock" in inspect.signature(CircuitBreaker).parameters and hasattr(
        cache_module, "CircuitBreaker"
    ):
        monkeypatch.setattr(
            cache_module, "CircuitBreaker", functools.partial(CircuitBreaker, clock=det.clock)
        )
    else:
        det.problems.append("the cache's circuit breaker takes no clock: cool-downs are real")
    return det
