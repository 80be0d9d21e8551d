"""When the pool may start a writer process again after they failed: a doubling back-off."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """No start for ``base_s`` after the first failure, doubling, at most ``max_s``."""

    base_s: float = 10.0
    max_s: float = 600.0

    def delay_s(self, failures: int) -> float:
        return min(self.max_s, self.base_s * 2.0 ** max(0, failures - 1))


class Strikes:
    """Failures in a row since a child last served a write: a failed start backs starts
    off at once; a child that died (mid-write or idle) does from the second death on, so one
    OOM kill costs one fresh start while children that cannot write stop costing a start per
    write. Not thread-safe: the pool's lock guards it."""

    def __init__(self, backoff: Backoff, clock: Callable[[], float] = time.monotonic) -> None:
        self._backoff = backoff
        self._clock = clock
        self._strikes = 0
        self._no_start_until = 0.0

    def start_failed(self) -> float:
        """Counted; the back-off it started (seconds)."""
        self._strikes += 1
        return self._back_off(self._strikes)

    def died(self) -> float:
        """Counted; the back-off it started (seconds), 0 after a first failure."""
        self._strikes += 1
        return self._back_off(self._strikes - 1)

    def served(self) -> None:
        self._strikes = 0

    def backed_off(self) -> bool:
        return self._clock() < self._no_start_until

    def _back_off(self, failures: int) -> float:
        if failures < 1:
            return 0.0
        delay_s = self._backoff.delay_s(failures)
        self._no_start_until = self._clock() + delay_s
        return delay_s
