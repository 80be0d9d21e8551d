"""ByteLRU accounting and eviction order; CircuitBreaker state machine under a fake clock."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_redis.breaker import CLOSED, HALF_OPEN, OPEN, Breakers, CircuitBreaker
from ec_redis.tiers.lru import ByteLRU

# -- ByteLRU -------------------------------------------------------------------------------


def lru(maxsize: int = 100) -> ByteLRU[bytes]:
    return ByteLRU(maxsize, len)


def test_put_within_budget_keeps_everything_and_counts_bytes() -> None:
    cache = lru(100)
    assert cache.put("a", b"x" * 30) == []
    assert cache.put("b", b"y" * 30) == []
    assert cache.put("c", b"z" * 40) == []  # exactly at capacity still fits
    assert cache.currsize == 100
    assert len(cache) == 3
    assert cache.keys() == ["a", "b", "c"]


def test_eviction_is_least_recently_used_first_and_reports_what_left() -> None:
    cache = lru(100)
    cache.put("a", b"a" * 30)
    cache.put("b", b"b" * 30)
    cache.put("c", b"c" * 30)
    assert cache.get("a") == b"a" * 30  # a is now the most recently used
    evicted = cache.put("d", b"d" * 50)  # needs 40 more bytes: b then c go, oldest first
    assert evicted == [("b", b"b" * 30), ("c", b"c" * 30)]
    assert cache.keys() == ["a", "d"]
    assert cache.currsize == 80
    assert "b" not in cache and cache.get("b") is None


def test_get_of_a_missing_key_does_not_change_order() -> None:
    cache = lru(60)
    cache.put("a", b"a" * 30)
    cache.put("b", b"b" * 30)
    assert cache.get("zzz") is None
    assert cache.put("c", b"c" * 30) == [("a", b"a" * 30)]


def test_replacing_a_value_is_not_an_eviction() -> None:
    cache = lru(100)
    cache.put("a", b"1" * 40)
    cache.put("b", b"2" * 40)
    assert cache.put("a", b"3" * 50) == []  # 40 + 50 fits once the old "a" is gone
    assert cache.get("a") == b"3" * 50
    assert cache.currsize == 90
    assert len(cache) == 2
    # A replacement that needs room evicts *other* keys, never reports the old value.
    evicted = cache.put("a", b"4" * 70)
    assert evicted == [("b", b"2" * 40)]
    assert cache.currsize == 70 and cache.keys() == ["a"]


def test_a_value_larger_than_the_budget_is_refused_without_touching_others() -> None:
    cache = lru(100)
    cache.put("a", b"a" * 60)
    assert cache.put("big", b"x" * 101) is None
    assert "big" not in cache
    assert cache.get("a") == b"a" * 60
    assert cache.currsize == 60


def test_a_refused_replacement_never_leaves_the_stale_value_behind() -> None:
    """Overwriting a key with a value that can never fit must not keep serving the old one."""
    cache = lru(100)
    cache.put("k", b"old" * 10)
    cache.put("other", b"o" * 10)
    assert cache.put("k", b"n" * 200) is None
    assert cache.get("k") is None
    assert cache.get("other") == b"o" * 10
    assert cache.currsize == 10


def test_pop_and_clear_keep_the_byte_count_exact() -> None:
    cache = lru(100)
    cache.put("a", b"a" * 10)
    cache.put("b", b"b" * 20)
    cache.put("c", b"c" * 30)
    assert cache.pop("b") == b"b" * 20
    assert cache.currsize == 40
    assert cache.pop("b") is None  # popping twice changes nothing
    assert cache.pop("missing") is None
    assert cache.currsize == 40
    assert cache.clear() == [("a", b"a" * 10), ("c", b"c" * 30)]
    assert cache.currsize == 0 and len(cache) == 0
    assert cache.put("d", b"d" * 100) == []  # the whole budget is usable again


def test_zero_budget_holds_nothing_but_empty_values() -> None:
    cache = lru(0)
    assert cache.put("a", b"x") is None
    assert cache.currsize == 0 and len(cache) == 0


_ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "pop"]),
        st.sampled_from("abcde"),
        # small values, and values around the budget (fits exactly / can never fit)
        st.one_of(st.integers(0, 60), st.integers(95, 110)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops)
def test_byte_lru_matches_a_reference_model(ops: list[tuple[str, str, int]]) -> None:
    """Random operations against a straightforward reference LRU; bytes never exceed max."""
    maxsize = 100
    cache = lru(maxsize)
    model: OrderedDict[str, bytes] = OrderedDict()
    for op, key, size in ops:
        value = key.encode() * size
        if op == "put":
            got = cache.put(key, value)
            if size > maxsize:
                assert got is None
                model.pop(key, None)  # never serve the value this put replaced
            else:
                model.pop(key, None)
                expected = []
                while sum(map(len, model.values())) + size > maxsize:
                    expected.append(model.popitem(last=False))
                model[key] = value
                assert got == expected
        elif op == "get":
            assert cache.get(key) == model.get(key)
            if key in model:
                model.move_to_end(key)
        else:
            assert cache.pop(key) == model.pop(key, None)
        assert cache.currsize == sum(map(len, model.values())) <= maxsize
        assert cache.keys() == list(model)


# -- CircuitBreaker --------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def breaker(clock: FakeClock, failures: int = 3, cooldown: float = 1.0, ceiling: float = 4.0):
    return CircuitBreaker(failures, cooldown, ceiling, clock=clock)


def trip(b: CircuitBreaker, failures: int = 3) -> None:
    for _ in range(failures):
        assert b.allow()
        b.failure()


def test_closed_breaker_allows_calls(clock: FakeClock) -> None:
    b = breaker(clock)
    assert b.state == CLOSED
    assert all(b.allow() for _ in range(10))
    assert b.stats() == {"breaker_state": 0.0, "breaker_trips": 0.0, "breaker_cooldown_s": 1.0}


def test_trips_after_exactly_n_consecutive_failures(clock: FakeClock) -> None:
    b = breaker(clock, failures=3)
    b.failure()
    b.failure()
    assert b.state == CLOSED and b.allow()
    b.failure()
    assert b.state == OPEN
    assert not b.allow()
    assert b.trips == 1
    assert b.stats()["breaker_state"] == float(OPEN)


def test_a_success_resets_the_failure_count(clock: FakeClock) -> None:
    b = breaker(clock, failures=3)
    b.failure()
    b.failure()
    b.success()
    b.failure()
    b.failure()
    assert b.state == CLOSED
    b.failure()
    assert b.state == OPEN


def test_open_until_the_cooldown_then_exactly_one_probe(clock: FakeClock) -> None:
    b = breaker(clock, cooldown=1.0)
    trip(b)
    clock.advance(0.999)
    assert not b.allow()
    clock.advance(0.001)
    assert b.allow()  # the probe
    assert b.state == HALF_OPEN
    assert not b.allow()
    clock.advance(100)
    assert not b.allow()  # still waiting for the probe's verdict, however long it takes


def test_half_open_lets_one_probe_through_across_threads(clock: FakeClock) -> None:
    b = breaker(clock)
    trip(b)
    clock.advance(1.0)
    start = threading.Barrier(8)
    results: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        start.wait()
        allowed = b.allow()
        with lock:
            results.append(allowed)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [False] * 7 + [True]


def test_failed_probe_reopens_for_twice_as_long_up_to_the_ceiling(clock: FakeClock) -> None:
    b = breaker(clock, cooldown=1.0, ceiling=4.0)
    trip(b)
    cooldown = 1.0
    for expected in (2.0, 4.0, 4.0):
        clock.advance(cooldown)
        assert b.allow()  # half-open probe
        b.failure()
        assert b.state == OPEN
        assert b.stats()["breaker_cooldown_s"] == expected
        opened_at, cooldown = clock.now, expected
        clock.now = opened_at + cooldown - 0.01  # shut for the whole new cooldown
        assert not b.allow()
        clock.now = opened_at
    assert b.trips == 4


def test_cooldown_sequence_is_exactly_doubling_then_capped(clock: FakeClock) -> None:
    b = breaker(clock, cooldown=0.5, ceiling=3.0)
    trip(b)
    seen = [b.stats()["breaker_cooldown_s"]]
    for _ in range(5):
        clock.advance(seen[-1])
        assert b.allow()
        b.failure()
        seen.append(b.stats()["breaker_cooldown_s"])
    assert seen == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert b.trips == 6


def test_successful_probe_closes_and_resets(clock: FakeClock) -> None:
    b = breaker(clock, failures=3, cooldown=1.0, ceiling=8.0)
    trip(b)
    clock.advance(1.0)
    assert b.allow()
    b.failure()  # cooldown now 2
    clock.advance(2.0)
    assert b.allow()
    b.success()
    assert b.state == CLOSED
    assert b.stats()["breaker_cooldown_s"] == 1.0
    assert all(b.allow() for _ in range(5))
    # the failure count restarted: it takes the full threshold again to trip
    b.failure()
    b.failure()
    assert b.state == CLOSED
    b.failure()
    assert b.state == OPEN
    clock.advance(0.99)
    assert not b.allow()
    clock.advance(0.01)
    assert b.allow()  # reopened with the base cooldown, not the doubled one


# -- one breaker per node ------------------------------------------------------------------


def test_each_node_has_its_own_breaker_made_fresh_with_the_same_settings(
    clock: FakeClock,
) -> None:
    template = CircuitBreaker(failures=2, cooldown_s=5.0, max_cooldown_s=10.0, clock=clock)
    breakers = Breakers(template.fresh)
    breakers.set("cluster", template)
    dead, healthy = breakers.get("10.0.0.1:7000"), breakers.get("10.0.0.2:7000")
    assert breakers.get("10.0.0.1:7000") is dead and dead is not template
    dead.failure()
    dead.failure()
    assert dead.state == OPEN and healthy.state == CLOSED and template.state == CLOSED
    assert healthy.allow() and not dead.allow()
    clock.now += 5.0  # the fresh breaker kept the template's cool-down and clock
    assert dead.allow() and dead.state == HALF_OPEN
    stats = breakers.stats()
    assert stats["breaker_state"] == HALF_OPEN and stats["breaker_nodes_not_closed"] == 1
    dead.failure()  # the probe failed: open again, for twice as long
    assert breakers.stats() == {
        "breaker_state": OPEN,
        "breaker_trips": 2,
        "breaker_cooldown_s": 10.0,
        "breaker_nodes_not_closed": 1,
    }


def test_the_node_table_is_bounded_and_forgets_closed_breakers_first(clock: FakeClock) -> None:
    breakers = Breakers(lambda: CircuitBreaker(failures=1, clock=clock), max_nodes=3)
    breakers.get("open").failure()
    for i in range(10):  # nodes come and go (replaced hosts, new ports)
        breakers.get(f"node-{i}")
    assert len(breakers.addresses()) == 3 and "open" in breakers.addresses()
    assert breakers.get("open").state == OPEN
    assert breakers.stats()["breaker_trips"] == 1


def test_breakers_of_nodes_that_serve_nothing_any_more_are_forgotten(clock: FakeClock) -> None:
    """A master whose replica took over is called no more: its open breaker must not keep
    ``breaker_state`` at "open" for ever."""
    breakers = Breakers(lambda: CircuitBreaker(failures=1, clock=clock))
    breakers.get("dead:7000").failure()
    breakers.get("alive:7001")
    assert breakers.stats()["breaker_state"] == OPEN
    breakers.retain({"alive:7001", "promoted:7002"})
    assert breakers.addresses() == ["alive:7001"]
    assert breakers.stats()["breaker_state"] == CLOSED
    assert breakers.stats()["breaker_trips"] == 1  # trips are history: they stay counted
