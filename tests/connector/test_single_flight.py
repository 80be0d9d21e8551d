"""Issue 16: single-flight leases between instances of vLLM's real v1 ``Scheduler``.

Two or three instances share one real redis-server. Each is its own ``Scheduler`` (whose
scheduler half vLLM's factory builds) and its own worker half (``EngineDriver(own_worker=
True)``: built as vLLM builds its per-process singleton, and made that singleton only while
its own worker step runs), with its own ``producer_id`` and so its own in-process cache
(``connector/shared.py`` shares one per configuration): what one instance encodes reaches
another only through Redis. Items are bf16 x 4096 (the connector's ``embed_width``; the tiny
model's scheduler never looks at the width): 230 rows = 1.8 MiB, 2048 rows = 16 MiB (stored
chunked). Every tensor vLLM reads is checked bit-exactly against the truth for its id and
rows (``simulated_worker``), so a wrong load is a failure, as is an encoder-cache miss.

The instances get the same burst of new requests and are stepped round-robin. The first
round's looks (and so their claims) all return before any instance steps again: every
instance has seen the lease state before anyone encodes, so the counts are exact whoever won
which claim (which the lookup threads decide). With ``serial`` each instance's look returns
before the next instance steps: the first in the seeded order wins every claim, so a seed
says who encodes what.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from ec_redis.embedded import EmbeddedRedis
from ec_redis.tiers.lease import LEASE_COUNTERS
from tests.conftest import paused, wait_for
from tests.connector.scheduler_driver import EngineDriver, EngineShape, Item, build_vllm_config
from tests.counters import count

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

WIDTH = 4096
MiB = 1024 * 1024
SMALL_ROWS = 230  # 230 x 4096 bf16: 1.8 MiB
BIG_ROWS = 2048  # 16 MiB: four 4 MiB chunks
SHAPE = EngineShape(
    max_num_seqs=8,
    max_num_batched_tokens=4096,  # a whole burst's prompts in one step
    block_size=16,
    num_kv_blocks=2048,
    max_model_len=4608,
    max_images_per_prompt=2,
    encoder_cache_tokens=8192,  # every item of a burst at once (2048 + 3 x 230 rows)
    encoder_compute_tokens=8192,
)
ROLES = ["ec_both", "ec_producer"]


# -- instances ------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_worker_singleton_left() -> Iterator[None]:
    """An instance's own worker half is never left installed as vLLM's singleton (the next
    test's ``EngineDriver`` would find it)."""
    from vllm.distributed.ec_transfer import has_ec_transfer

    yield
    assert not has_ec_transfer()


def build(tiny_model: Path, url: str, role: str, name: str, **options: Any) -> EngineDriver:
    """One instance: its scheduler and its own worker half, its own ``producer_id``."""
    extra: dict[str, Any] = {
        "redis_url": url,
        "producer_id": name,
        "embed_width": WIDTH,
        "cpu_cache_bytes": "64MiB",
        "recheck_s": 0.02,
        "lease_ttl_s": 20.0,  # far longer than any burst: a takeover here is a bug
        **options,
    }
    config = build_vllm_config(tiny_model, role, extra, SHAPE)
    return EngineDriver(
        config, SHAPE, own_worker=True, width=WIDTH, encoder_only=role == "ec_producer"
    )


@contextmanager
def fleet(
    tiny_model: Path, url: str, role: str, n: int = 3, per: list[dict[str, Any]] | None = None,
    **options: Any,
) -> Iterator[list[EngineDriver]]:  # fmt: skip
    """``n`` instances (``per``: options of each one); all shut down afterwards."""
    drivers: list[EngineDriver] = []
    try:
        for i in range(n):
            own = {**options, **(per[i] if per else {})}
            drivers.append(build(tiny_model, url, role, f"inst{i}", **own))
        yield drivers
    finally:
        for driver in drivers:
            driver.close()


def side(driver: EngineDriver) -> Any:
    """The instance's ``SchedulerSide`` (its stager says when its looks returned)."""
    return driver.connector._scheduler


def counters(driver: EngineDriver) -> dict[str, Any]:
    return dict(driver.connector.stats_snapshot())


def c(snapshot: dict[str, Any], name: str) -> int:
    return int(count(snapshot, name))


def lease_key(driver: EngineDriver, item: str) -> str:
    return str(driver.connector._cache.redis.keys.lease(item))


def lease_keys(raw: redis.Redis) -> list[bytes]:
    return sorted(k if isinstance(k, bytes) else k.encode() for k in raw.keys("*:lease"))


def looks_returned(drivers: list[EngineDriver]) -> None:
    live = [d for d in drivers if not d.closed]
    wait_for(lambda: all(side(d)._stager.in_flight == 0 for d in live), 20, "looks to return")


# -- requests ------------------------------------------------------------------------------


Burst = list[tuple[str, list[Item]]]


def burst(seed: int) -> Burst:
    """New items of 1.8 MiB and one of 16 MiB, in three requests (one carries two items);
    seeded ids and rows."""
    rng = random.Random(seed)
    tag = f"{seed}-{rng.randrange(1 << 32):08x}"
    small = [Item(f"s{i}-{tag}", SMALL_ROWS - rng.randrange(3)) for i in range(3)]
    big = Item(f"b-{tag}", BIG_ROWS)
    return [("r0", [small[0], big]), ("r1", [small[1]]), ("r2", [small[2]])]


def distinct(requests: Burst) -> set[tuple[str, int]]:
    return {(item.identifier, item.rows) for _, items in requests for item in items}


def add(driver: EngineDriver, requests: Burst, rng: random.Random, salt: str | None = None) -> None:
    from tests.connector.scheduler_driver import image_request

    for request_id, items in rng.sample(requests, len(requests)):
        request = image_request(request_id, items, [2] * (len(items) + 1), max_tokens=2)
        request.cache_salt = salt
        driver.add_request(request)


# -- running -------------------------------------------------------------------------------


@dataclass
class Run:
    drivers: list[EngineDriver]
    order: list[int]
    seconds: float = 0.0
    longest_step_s: float = 0.0
    done_at: dict[int, float] = field(default_factory=dict)  # instance -> seconds from start
    lease_keys_seen: set[bytes] = field(default_factory=set)


def first_round(drivers: list[EngineDriver], order: list[int], serial: bool = False) -> None:
    """Every instance steps once (its looks, and so its claims, start); all return."""
    for i in order:
        drivers[i].step()
        if serial:
            looks_returned([drivers[i]])
    looks_returned(drivers)


def run_to_end(
    drivers: list[EngineDriver],
    order: list[int],
    timeout_s: float = 30.0,
    raw: redis.Redis | None = None,
    start: float | None = None,
) -> Run:
    """Step the live instances round-robin until none has requests; with ``raw``, note
    every lease key in Redis after every round."""
    run = Run(drivers, order)
    t0 = time.monotonic() if start is None else start
    while True:
        live = [i for i in order if not drivers[i].closed and drivers[i].alive]
        for i in live:
            if i not in run.done_at and not drivers[i].has_requests():
                run.done_at[i] = time.monotonic() - t0
        busy = [i for i in live if drivers[i].has_requests()]
        if not busy:
            break
        elapsed = time.monotonic() - t0
        assert elapsed < timeout_s, f"instances {busy} still busy after {elapsed:.1f} s"
        scheduled = 0
        for i in busy:
            began = time.perf_counter()
            scheduled += drivers[i].step()
            run.longest_step_s = max(run.longest_step_s, time.perf_counter() - began)
        if raw is not None:
            run.lease_keys_seen.update(lease_keys(raw))
        if scheduled == 0:
            time.sleep(0.002)
    run.seconds = time.monotonic() - t0
    return run


def flushed(drivers: list[EngineDriver]) -> None:
    for driver in drivers:
        if not driver.closed:
            assert driver.worker_connector._cache.flush(10), "writes still queued after 10 s"


def healthy(driver: EngineDriver, requests: int) -> dict[str, Any]:
    """No engine failure (escaped exception, encoder-cache miss, wrong bytes), no promise
    broken, every request finished normally; the instance's counters."""
    assert driver.failures == [], driver.failures
    assert not driver.has_requests()
    reasons = driver.finish_reasons
    assert len(reasons) == requests and all(r in ("LENGTH", "STOP") for r in reasons.values()), (
        reasons
    )
    snapshot = counters(driver)
    assert c(snapshot, "internal_errors") == 0, snapshot
    assert c(snapshot, "promise_mismatches") == 0, snapshot
    assert c(snapshot, "unavailable_requests") == 0, snapshot
    return snapshot


def leases(snapshot: dict[str, Any]) -> dict[str, int]:
    return {name: c(snapshot, name) for name in LEASE_COUNTERS}


def execs(driver: EngineDriver) -> list[tuple[int, tuple[str, ...]]]:
    """(step, ids encoded) of each worker step (the trace's ``exec`` events)."""
    out: list[tuple[int, tuple[str, ...]]] = []
    for event in driver.trace:
        if event[0] == "exec":
            step, encoded_ids = event[1], event[3]
            assert isinstance(step, int) and isinstance(encoded_ids, tuple)
            out.append((step, tuple(str(i) for i in encoded_ids)))
    return out


def encoded(driver: EngineDriver) -> list[str]:
    """The ids this instance's worker encoded, in order."""
    return [item for _, ids in execs(driver) for item in ids]


def encoded_at_step(driver: EngineDriver, item: str) -> int:
    for step, ids in execs(driver):
        if item in ids:
            return step
    raise AssertionError(f"{item} never encoded: {driver.trace}")


# -- 1. one encode per item across the fleet -------------------------------------------------


@pytest.mark.parametrize("serial", [False, True], ids=["racing", "serial"])
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("seed", [1601, 1602])
def test_a_burst_on_three_instances_is_encoded_once_per_item(
    tiny_model: Path, redis_url: str, raw: redis.Redis, role: str, seed: int, serial: bool
) -> None:
    rng = random.Random(seed)
    requests = burst(seed)
    items = distinct(requests)
    with fleet(tiny_model, redis_url, role) as drivers:
        order = rng.sample(range(3), 3)
        for driver in drivers:
            add(driver, requests, rng)
        first_round(drivers, order, serial)
        claimed = lease_keys(raw)
        assert len(claimed) == len(items), claimed  # one lease per new item, nobody's entry yet
        run = run_to_end(drivers, order, raw=raw)
        flushed(drivers)
        snapshots = [healthy(d, len(requests)) for d in drivers]
    encodes = [d.stats.local_encodes for d in drivers]
    loads = [d.stats.loads for d in drivers]
    assert sum(encodes) == len(items), (encodes, [encoded(d) for d in drivers])
    assert sorted(i for d in drivers for i in encoded(d)) == sorted(i for i, _ in items)
    per = [leases(s) for s in snapshots]
    assert sum(p["lease_claims"] for p in per) == len(items), per
    for driver, snapshot, lease in zip(drivers, snapshots, per, strict=True):
        enc = driver.stats.local_encodes
        assert lease["lease_claims"] == enc, per  # it encoded exactly what it claimed
        assert lease["lease_waits"] == len(items) - enc, per  # it waited for all the rest
        assert lease["lease_takeovers"] == 0 and lease["lease_releases"] == 0, per
        if role == "ec_both":
            assert driver.stats.loads == len(items) - enc, (loads, per)
            assert lease["lease_loads"] == driver.stats.loads == lease["lease_encodes_saved"]
            assert lease["lease_skips"] == 0
        else:  # a pure producer loads nothing: it skips what another instance published
            assert driver.stats.loads == 0
            assert lease["lease_skips"] == len(items) - enc == lease["lease_encodes_saved"]
            assert c(snapshot, "skipped_encodes") == len(items) - enc
    if role == "ec_both":  # the 16 MiB item really came from Redis to both waiters
        assert sum(d.stats.big_loads for d in drivers) == 2
    if serial:  # the first instance to look won every claim
        assert encodes[order[0]] == len(items), (order, encodes)
    assert lease_keys(raw) == []  # each entry's write ended its lease
    assert len(run.lease_keys_seen) <= len(items)


def burst_outcome(tiny_model: Path, url: str, raw: redis.Redis, seed: int) -> list[Any]:
    """A serial burst of ``seed``: what each instance encoded, loaded and counted."""
    raw.flushall()
    rng = random.Random(seed)
    requests = burst(seed)
    with fleet(tiny_model, url, "ec_both") as drivers:
        order = rng.sample(range(3), 3)
        for driver in drivers:
            add(driver, requests, rng)
        first_round(drivers, order, serial=True)
        run_to_end(drivers, order)
        flushed(drivers)
        snapshots = [healthy(d, len(requests)) for d in drivers]
    return [
        (sorted(encoded(d)), d.stats.loads, d.stats.loaded_bytes, leases(s))
        for d, s in zip(drivers, snapshots, strict=True)
    ]


def test_a_seed_replays(tiny_model: Path, redis_url: str, raw: redis.Redis) -> None:
    """Who encodes what, who loads what and every lease counter: the same for one seed
    (serial claims), whatever the lookup and writer threads' timing."""
    first = burst_outcome(tiny_model, redis_url, raw, 1603)
    assert first == burst_outcome(tiny_model, redis_url, raw, 1603)
    assert sum(len(encodes) for encodes, *_ in first) == len(distinct(burst(1603)))


# -- 2. the holder dies --------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_the_others_encode_a_dead_holders_items_at_their_deadline(
    tiny_model: Path, redis_url: str, raw: redis.Redis, role: str
) -> None:
    """The holder claims every item of the burst, then is shut down before it encodes
    (its leases, 30 s, stay: nobody gives them back). The waiters wait no longer than their
    own ``lease_ttl_s`` (3 s), then encode the items themselves. A wait is counted when the
    next step meets a lease still inside the waiter's deadline, and the holder's shutdown
    (up to 0.5 s of it the notification thread's join) comes between the first step and
    that one: 3 s leaves a loaded host room for both."""
    ttl_s = 3.0
    requests = burst(1610)
    items = distinct(requests)
    per = [{"lease_ttl_s": 30.0}, {"lease_ttl_s": ttl_s}, {"lease_ttl_s": ttl_s}]
    rng = random.Random(1610)
    with fleet(tiny_model, redis_url, role, per=per) as drivers:
        for driver in drivers:
            add(driver, requests, rng)
        start = time.monotonic()
        first_round(drivers, [0, 1, 2], serial=True)  # instance 0 claims everything
        holder = counters(drivers[0])
        assert c(holder, "lease_claims") == len(items), leases(holder)
        held = lease_keys(raw)
        assert len(held) == len(items) and all(raw.pttl(k) > 25_000 for k in held)
        drivers[0].close()  # mid-burst: claimed, never encoded, never saved
        assert drivers[0].stats.local_encodes == 0
        run = run_to_end(drivers, [1, 2], timeout_s=10 * ttl_s + 5, start=start)
        flushed(drivers)
        waiters = [(d, healthy(d, len(requests))) for d in drivers[1:]]
    assert raw.dbsize() > 0
    # Each waiter finished after its deadline, well within 5x it (generous for 2 cores).
    for i in (1, 2):
        assert ttl_s * 0.9 <= run.done_at[i] <= 5 * ttl_s + 2.0, run.done_at
    takeovers = 0
    for driver, snapshot in waiters:
        lease = leases(snapshot)
        assert lease["lease_waits"] == len(items), str(lease)  # it waited on the holder
        # Each item encoded here (taken over; or claimed, had the lease ended meanwhile)
        # or found published by the other waiter.
        here = lease["lease_takeovers"] + lease["lease_claims"]
        assert driver.stats.local_encodes == here, str(lease)
        assert here + lease["lease_loads"] + lease["lease_skips"] == len(items), str(lease)
        takeovers += lease["lease_takeovers"]
    assert takeovers > 0
    assert lease_keys(raw) == []  # the waiters' writes ended the dead holder's leases


def test_a_lease_nobody_fulfils_expires_by_itself(
    tiny_model: Path, redis_url: str, raw: redis.Redis
) -> None:
    """An instance claims and is shut down before encoding; its leases (3 s) expire. (The
    shutdown, up to 0.5 s of it the notification thread's join, comes between the claim and
    the check that the leases are still there: 3 s leaves a loaded host room.)"""
    requests = burst(1611)
    with fleet(tiny_model, redis_url, "ec_both", n=1, lease_ttl_s=3.0) as (driver,):
        add(driver, requests, random.Random(1611))
        first_round([driver], [0])
        assert c(counters(driver), "lease_claims") == len(distinct(requests))
        driver.close()
    held = lease_keys(raw)
    assert len(held) == len(distinct(requests))
    assert all(0 < raw.pttl(k) <= 3000 for k in held), [raw.pttl(k) for k in held]
    wait_for(lambda: lease_keys(raw) == [], 15, "the leases to expire")
    assert raw.exists(*held) == 0
    assert raw.keys("*") == []  # nothing else was ever written


# -- 3. Redis down: everyone encodes, nobody waits -------------------------------------------


@pytest.mark.parametrize("fault", ["killed", "paused"])
def test_with_redis_down_everyone_encodes_and_nobody_waits(
    tiny_model: Path, private_redis: EmbeddedRedis, fault: str
) -> None:
    requests = burst(1620)
    items = distinct(requests)
    timeouts: dict[str, Any] = {"redis_socket_timeout_s": 0.3, "redis_connect_timeout_s": 0.3}
    url = private_redis.url
    probe = redis.Redis.from_url(url, socket_timeout=0.2, socket_connect_timeout=0.2)
    with fleet(tiny_model, url, "ec_both", lease_ttl_s=30.0, **timeouts) as drivers:
        for driver in drivers:
            add(driver, requests, random.Random(1620))
        if fault == "killed":
            private_redis.kill()
            assert not private_redis.alive
            with pytest.raises(redis.ConnectionError):
                probe.ping()
            run = run_to_end(drivers, [0, 1, 2], timeout_s=60)
        else:
            with paused(private_redis):
                with pytest.raises(redis.TimeoutError):
                    probe.ping()
                run = run_to_end(drivers, [0, 1, 2], timeout_s=60)
                with pytest.raises(redis.TimeoutError):  # paused all along
                    redis.Redis.from_url(url, socket_timeout=0.2).ping()
        snapshots = [healthy(d, len(requests)) for d in drivers]
    probe.close()
    # Each instance encodes every item, loads nothing; no lease was claimed, waited on...
    assert [d.stats.local_encodes for d in drivers] == [len(items)] * 3
    assert [d.stats.loads for d in drivers] == [0] * 3
    for snapshot in snapshots:
        assert leases(snapshot) == dict.fromkeys(LEASE_COUNTERS, 0), leases(snapshot)
    # ... and no request waited anywhere near the 30 s lease deadline (a look costs at
    # most a connect or socket timeout, 0.3 s, and a retry).
    assert run.seconds < 10.0, run
    assert run.longest_step_s < 2.0, run


# -- 4. adversarial ------------------------------------------------------------------------


def two_looked(
    drivers: list[EngineDriver], first: list[tuple[str, list[Item]]],
    second: list[tuple[str, list[Item]]], salts: tuple[str | None, str | None] = (None, None),
) -> None:  # fmt: skip
    """Instance 0 gets ``first``, instance 1 ``second``; 0 looks (and claims) first."""
    rng = random.Random(0)
    add(drivers[0], first, rng, salts[0])
    add(drivers[1], second, rng, salts[1])
    first_round(drivers, [0, 1], serial=True)


def test_an_id_reused_for_other_rows_never_waits_on_the_first_instances_lease(
    tiny_model: Path, redis_url: str, raw: redis.Redis
) -> None:
    with fleet(tiny_model, redis_url, "ec_both", n=2) as drivers:
        two_looked(drivers, [("a", [Item("uuid", 230)])], [("b", [Item("uuid", 300)])])
        assert raw.get(lease_key(drivers[0], "uuid")) is not None  # 0 holds it (230 rows)
        assert c(counters(drivers[1]), "lease_waits") == 0
        run = run_to_end(drivers, [0, 1])
        flushed(drivers)
        snapshots = [healthy(d, 1) for d in drivers]
    assert [d.stats.local_encodes for d in drivers] == [1, 1]
    assert [d.stats.loads for d in drivers] == [0, 0]
    other = leases(snapshots[1])
    assert other["lease_waits"] == 0 and other["lease_takeovers"] == 0, other
    assert encoded_at_step(drivers[1], "uuid") == 2  # at its first step after its look
    assert run.done_at[1] < 5.0  # nowhere near the first instance's 20 s lease


GARBAGE = {
    "no-separator": (b"\x00\xff garbage", 60_000, False),
    "rows-too-long": (b"9999999999999|tok", 60_000, False),
    "no-token": (b"230|", 60_000, False),
    "forged-holder": (b"230|forged.token", 60_000, True),  # looks like a holder of 230 rows
    "forged-no-ttl": (b"230|forged.token", None, True),  # ... whose lease never expires
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_a_garbage_lease_never_holds_a_request_past_lease_ttl_nor_loads(
    tiny_model: Path, redis_url: str, raw: redis.Redis, name: str
) -> None:
    value, px, looks_held = GARBAGE[name]
    # The wait is counted when the look's answer meets a lease still inside the request's
    # deadline; a loaded CI host once took > 0.5 s from the first step to that answer (and
    # so counted a takeover with no wait). 3 s leaves room, and a wrong wait on a garbage
    # lease (the other cases) still shows as a run far over their 2 s bound.
    ttl_s = 3.0
    with fleet(tiny_model, redis_url, "ec_both", n=1, lease_ttl_s=ttl_s) as (driver,):
        key = lease_key(driver, "g")
        raw.set(key, value, px=px)
        add(driver, [("r", [Item("g", 230)])], random.Random(0))
        start = time.monotonic()
        first_round([driver], [0])
        assert raw.get(key) == value  # nobody's claim replaced it
        run = run_to_end([driver], [0], start=start)
        flushed([driver])
        snapshot = healthy(driver, 1)
    lease = leases(snapshot)
    assert driver.stats.local_encodes == 1 and driver.stats.loads == 0
    assert lease["lease_claims"] == 0 and lease["lease_loads"] == 0, lease
    if looks_held:  # waited at most its own deadline, then encoded
        assert lease == {**dict.fromkeys(LEASE_COUNTERS, 0), "lease_waits": 1,
                         "lease_takeovers": 1}, lease  # fmt: skip
        assert ttl_s * 0.9 <= run.seconds <= ttl_s + 2.0, run
    else:  # not a lease of its rows: encoded at once
        assert lease == dict.fromkeys(LEASE_COUNTERS, 0), lease
        assert encoded_at_step(driver, "g") == 2
        assert run.seconds < 0.9 * ttl_s, run  # a wait on it would take the whole ttl_s
    assert raw.exists(key) == 0  # the entry's write ended it


def test_a_lease_key_of_the_wrong_type_is_an_encode_not_a_crash(
    tiny_model: Path, redis_url: str, raw: redis.Redis
) -> None:
    with fleet(tiny_model, redis_url, "ec_both", n=1) as (driver,):
        key = lease_key(driver, "w")
        raw.rpush(key, "not", "a", "string")
        add(driver, [("r", [Item("w", 230)])], random.Random(0))
        start = time.monotonic()
        first_round([driver], [0])
        assert raw.type(key) == b"list"  # the claim's script met it (and failed on it)
        run = run_to_end([driver], [0], start=start)
        flushed([driver])
        snapshot = healthy(driver, 1)
    assert driver.stats.local_encodes == 1 and driver.stats.loads == 0
    assert leases(snapshot) == dict.fromkeys(LEASE_COUNTERS, 0), leases(snapshot)
    assert encoded_at_step(driver, "w") == 2  # no wait
    assert run.seconds < 5.0
    assert raw.type(key) == b"none"  # the entry's write ended it, whatever its type


def test_an_aborted_holder_gives_its_lease_back_and_the_waiter_claims_it(
    tiny_model: Path, redis_url: str, raw: redis.Redis
) -> None:
    with fleet(tiny_model, redis_url, "ec_both", n=2) as drivers:  # 20 s leases
        two_looked(drivers, [("a", [Item("x", 230)])], [("b", [Item("x", 230)])])
        key = lease_key(drivers[0], "x")
        holder_value = raw.get(key)
        assert holder_value is not None
        drivers[1].step()  # it sees the holder's lease: held
        assert c(counters(drivers[1]), "lease_waits") == 1
        assert drivers[1].stats.local_encodes == 0
        start = time.monotonic()
        assert drivers[0].abort(["a"]) == 1  # before its encode
        wait_for(lambda: c(counters(drivers[0]), "lease_releases") == 1, 5, "the release")
        # Gone, or already the waiter's (its next look claimed it).
        wait_for(lambda: raw.get(key) != holder_value, 5, "the holder's lease to go")
        run = run_to_end(drivers, [0, 1], start=start)
        flushed(drivers)
        waiter = healthy(drivers[1], 1)
    assert drivers[0].stats.local_encodes == 0
    assert drivers[1].stats.local_encodes == 1 and drivers[1].stats.loads == 0
    lease = leases(waiter)
    assert lease["lease_claims"] == 1 and lease["lease_takeovers"] == 0, lease
    assert run.done_at[1] < 5.0  # released, not waited out (the lease was 20 s)
    assert raw.exists(key) == 0


@pytest.mark.parametrize("differs", ["tenant_salt", "model_name", "cache_salt", "nothing"])
def test_tenants_models_and_salts_never_share_a_lease(
    tiny_model: Path, redis_url: str, raw: redis.Redis, differs: str
) -> None:
    per: list[dict[str, Any]] = [{}, {}]
    salts: tuple[str | None, str | None] = (None, None)
    if differs == "tenant_salt":
        per = [{"tenant_salt": "tenant-a"}, {"tenant_salt": "tenant-b"}]
    elif differs == "model_name":
        per = [{"model_name": "model-a"}, {"model_name": "model-b"}]
    elif differs == "cache_salt":
        salts = ("salt-a", "salt-b")
    with fleet(tiny_model, redis_url, "ec_both", n=2, per=per) as drivers:
        two_looked(drivers, [("a", [Item("m", 230)])], [("b", [Item("m", 230)])], salts)
        claimed = lease_keys(raw)
        run_to_end(drivers, [0, 1])
        flushed(drivers)
        snapshots = [leases(healthy(d, 1)) for d in drivers]
    if differs == "nothing":  # the control: one lease, the second instance waits and loads
        assert len(claimed) == 1
        assert [s["lease_claims"] for s in snapshots] == [1, 0]
        assert snapshots[1]["lease_waits"] == 1 and snapshots[1]["lease_loads"] == 1
        assert [d.stats.local_encodes for d in drivers] == [1, 0]
    else:
        assert len(claimed) == 2, claimed
        assert [s["lease_claims"] for s in snapshots] == [1, 1]
        assert [s["lease_waits"] for s in snapshots] == [0, 0]
        assert [d.stats.local_encodes for d in drivers] == [1, 1]
        assert [d.stats.loads for d in drivers] == [0, 0]


# -- 5. single_flight off ------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_single_flight_off_every_instance_encodes_and_no_lease_is_written(
    tiny_model: Path, redis_url: str, raw: redis.Redis, role: str
) -> None:
    requests = burst(1650)
    items = distinct(requests)
    with fleet(
        tiny_model, redis_url, role, single_flight=False, producer_check_wait_s=0.02
    ) as drivers:
        for driver in drivers:
            add(driver, requests, random.Random(1650))
        first_round(drivers, [0, 1, 2])
        assert lease_keys(raw) == []
        run = run_to_end(drivers, [0, 1, 2], raw=raw)
        flushed(drivers)
        snapshots = [healthy(d, len(requests)) for d in drivers]
    assert run.lease_keys_seen == set()
    assert [d.stats.local_encodes for d in drivers] == [len(items)] * 3
    for snapshot in snapshots:
        assert leases(snapshot) == dict.fromkeys(LEASE_COUNTERS, 0), leases(snapshot)
    assert raw.dbsize() > 0  # they did write their entries
