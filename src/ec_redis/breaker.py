"""Circuit breaker: stop calling a failing Redis, probe after a cool-down that doubles.

closed -> (``failures`` in a row) -> open -> (cool-down elapsed) -> half-open: one probe;
success closes it, failure re-opens it with twice the cool-down (up to a ceiling).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half_open"}


class CircuitBreaker:
    def __init__(
        self,
        failures: int = 3,
        cooldown_s: float = 1.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._threshold = failures
        self._base_cooldown_s = cooldown_s
        self._max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._cooldown_s = cooldown_s
        self._open_until = 0.0
        self.trips = 0

    @property
    def state(self) -> int:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May a call go to Redis now? In half-open state only one probe is let through."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN and self._clock() >= self._open_until:
                self._state = HALF_OPEN
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._state = CLOSED
            self._failures = 0
            self._cooldown_s = self._base_cooldown_s

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._state == HALF_OPEN:
                self._cooldown_s = min(self._cooldown_s * 2, self._max_cooldown_s)
                self._open()
            elif self._state == CLOSED and self._failures >= self._threshold:
                self._open()

    def _open(self) -> None:
        self._state = OPEN
        self._open_until = self._clock() + self._cooldown_s
        self.trips += 1

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "breaker_state": float(self._state),
                "breaker_trips": float(self.trips),
                "breaker_cooldown_s": self._cooldown_s,
            }
