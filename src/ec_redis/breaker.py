"""Circuit breakers: stop calling a failing Redis node, probe after a cool-down that doubles.

closed -> (``failures`` in a row) -> open -> (cool-down elapsed) -> half-open: one probe;
success closes it, failure re-opens it with twice the cool-down (up to a ceiling).
``Breakers`` keeps one per node address, so a dead Cluster master stops calls to itself only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection

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

    def fresh(self) -> CircuitBreaker:
        """A closed breaker with the same settings (and clock)."""
        return CircuitBreaker(
            self._threshold, self._base_cooldown_s, self._max_cooldown_s, self._clock
        )

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


# breaker_state of a set: open beats half-open beats closed (what an operator must look at)
_SEVERITY = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class Breakers:
    """One breaker per node address (``host:port``), made on first use by ``make``.

    Keyed by node, not by slot: when a slot moves (a failover, a migration), its entries go
    to another node's breaker, and the dead node's stays open for whatever still maps to it.
    At most ``max_nodes`` are kept; past that, closed ones (which hold no state worth keeping)
    are forgotten first.
    """

    def __init__(self, make: Callable[[], CircuitBreaker], max_nodes: int = 256) -> None:
        self._make = make
        self._max_nodes = max_nodes
        self._lock = threading.Lock()
        self._by_address: dict[str, CircuitBreaker] = {}
        self._forgotten_trips = 0

    def get(self, address: str) -> CircuitBreaker:
        with self._lock:
            breaker = self._by_address.get(address)
            if breaker is None:
                self._bound()
                breaker = self._by_address[address] = self._make()
            return breaker

    def set(self, address: str, breaker: CircuitBreaker) -> None:
        with self._lock:
            self._by_address[address] = breaker

    def _bound(self) -> None:
        while len(self._by_address) >= self._max_nodes:
            closed = (a for a, b in self._by_address.items() if b.state == CLOSED)
            victim = next(closed, next(iter(self._by_address)))
            self._forgotten_trips += self._by_address.pop(victim).trips

    def retain(self, addresses: Collection[str]) -> None:
        """Forget the breakers of nodes not in ``addresses`` (nodes that serve nothing any
        more, e.g. a master whose replica took over): nothing will call them again."""
        with self._lock:
            for address in [a for a in self._by_address if a not in addresses]:
                self._forgotten_trips += self._by_address.pop(address).trips

    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._by_address)

    def stats(self) -> dict[str, float]:
        """``breaker_state`` of the worst node (open, else half-open, else closed), trips of
        all nodes, the longest cool-down, and how many nodes are not closed."""
        with self._lock:
            each = [b.stats() for b in self._by_address.values()]
            forgotten = self._forgotten_trips
        states = [int(s["breaker_state"]) for s in each] or [CLOSED]
        return {
            "breaker_state": float(max(states, key=_SEVERITY.__getitem__)),
            "breaker_trips": float(forgotten + sum(s["breaker_trips"] for s in each)),
            "breaker_cooldown_s": max((s["breaker_cooldown_s"] for s in each), default=0.0),
            "breaker_nodes_not_closed": float(sum(state != CLOSED for state in states)),
        }
