"""Single flight, transition by transition: two scheduler halves (two instances) share one
cache whose lookups the test releases by hand and whose leases behave as ``tiers/lease.py``'s
scripts do (``test_scheduler_states.GatedCache``), on a clock the test sets. What holds: one
claimant encodes, the other waits and loads; a wait ends at the lease's deadline, never later;
a lease never becomes a "yes"; a lease of other rows is never waited on; a claimant whose
request ends before its encode gives the lease back."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.conftest import embedding, wait_for
from tests.connector import test_scheduler_states as states
from tests.connector.conftest import request
from tests.connector.test_promises import Clock, counter
from tests.connector.test_scheduler_states import WIDTH, GatedCache

pytestmark = pytest.mark.vllm


def instance(cache: GatedCache, clock: Clock, role: str = "ec_both", **options: Any) -> Any:
    side, _ = states.make_side(role, None, clock, cache, **{"recheck_s": 0.01, **options})
    return side


def fleet(role: str = "ec_both", **options: Any) -> tuple[Any, Any, GatedCache, Clock]:
    clock = Clock()
    cache = GatedCache()
    cache.now = clock
    return (
        instance(cache, clock, role, **options),
        instance(cache, clock, role, **options),
        cache,
        clock,
    )


def look(side: Any, cache: GatedCache, req: Any) -> bool:
    """ensure (a lookup starts) -> it returns -> ensure again: the answer after the look."""
    generation = side._stager.generation
    assert side.ensure_cache_available(req, 0) is False  # its look is in flight
    cache.open()
    wait_for(lambda: side._stager.generation > generation, 10, "the look to return")
    wait_for(lambda: side._stager.in_flight == 0, 10, "lookups to return")
    return bool(side.ensure_cache_available(req, 0))


def encode_here(side: Any, req: Any, item: str) -> None:
    """vLLM encodes ``item`` for ``req`` (no yes): allocated, the step ends."""
    assert side.has_cache_item(item) is False
    side.update_state_after_alloc(req, 0)
    side.build_connector_meta(None)


def test_one_claimant_encodes_the_other_waits_and_loads_its_entry() -> None:
    a, b, cache, clock = fleet(lease_ttl_s=2.0)
    ra, rb = request("ra", ("new", 16)), request("rb", ("new", 16))
    assert look(a, cache, ra) is True  # claimed: let through to encode
    assert counter(a, "lease_claims") == 1
    assert look(b, cache, rb) is False  # a's lease: held, not encoded
    assert b.has_cache_item("new") is False  # a lease is never a yes
    assert counter(b, "lease_waits") == 1 and counter(b, "lease_claims") == 0
    encode_here(a, ra, "new")
    a.request_finished(ra)
    assert cache.released == []  # encoded: the write that follows ends the lease
    clock.now += 0.5  # still within a's deadline
    assert b.ensure_cache_available(rb, 0) is False  # due for another look: it starts
    cache.stored["new"] = embedding(16, WIDTH, seed=3)  # a's write landed
    generation = b._stager.generation
    cache.open()
    wait_for(lambda: b._stager.generation > generation, 10, "the look to return")
    assert b.ensure_cache_available(rb, 0) is True
    assert b.has_cache_item("new") is True
    b.update_state_after_alloc(rb, 0)
    loads = b.build_connector_meta(None).loads
    assert [load.mm_hash for load in loads] == ["new"]
    assert counter(b, "lease_loads") == 1 and counter(b, "lease_encodes_saved") == 1
    assert counter(b, "lease_takeovers") == 0


def test_a_wait_ends_at_the_deadline_and_the_waiter_encodes() -> None:
    a, b, cache, clock = fleet(lease_ttl_s=2.0)
    ra, rb = request("ra", ("stall", 16)), request("rb", ("stall", 16))
    assert look(a, cache, ra) is True  # a claims, then stalls (never encodes)
    assert look(b, cache, rb) is False
    clock.now += 1.99
    # Not yet: a look is due (recheck) but the lease is still a's.
    assert b.ensure_cache_available(rb, 0) is False
    cache.open()
    wait_for(lambda: b._stager.in_flight == 0, 10, "the look to return")
    clock.now += 0.02  # past the deadline seen first (a later look never extends it)
    assert b.ensure_cache_available(rb, 0) is True
    assert b.has_cache_item("stall") is False  # encoded here
    assert counter(b, "lease_takeovers") == 1


def test_a_wait_never_outlasts_lease_ttl_s_even_for_a_longer_lease() -> None:
    """A hostile or misconfigured holder with an hour-long lease: ours bounds the wait."""
    a, _, cache, clock = fleet(lease_ttl_s=3600.0)
    b = instance(cache, clock, lease_ttl_s=0.5)
    ra, rb = request("ra", ("long", 16)), request("rb", ("long", 16))
    assert look(a, cache, ra) is True
    assert look(b, cache, rb) is False
    clock.now += 0.51
    assert b.ensure_cache_available(rb, 0) is True and b.has_cache_item("long") is False


def test_a_reused_id_of_other_rows_never_waits_on_the_lease() -> None:
    a, b, cache, _ = fleet(lease_ttl_s=30.0)
    assert look(a, cache, request("ra", ("img", 16))) is True
    rb = request("rb", ("img", 24))  # the same id, another size: other content
    assert look(b, cache, rb) is True  # encoded at once
    assert b.has_cache_item("img") is False
    assert counter(b, "lease_waits") == 0


def test_a_garbage_lease_value_is_never_waited_on() -> None:
    _, b, cache, clock = fleet(lease_ttl_s=30.0)
    cache.leases["junk"] = (b"not a lease", clock.now + 3600)
    rb = request("rb", ("junk", 16))
    assert look(b, cache, rb) is True and b.has_cache_item("junk") is False
    assert counter(b, "lease_waits") == 0


def test_a_claimant_whose_request_ends_before_its_encode_gives_the_lease_back() -> None:
    a, b, cache, clock = fleet(lease_ttl_s=30.0)
    ra, rb = request("ra", ("gone", 16)), request("rb", ("gone", 16))
    assert look(a, cache, ra) is True
    assert look(b, cache, rb) is False
    a.request_finished(ra)  # aborted before vLLM scheduled its encode
    wait_for(lambda: "gone" not in cache.leases, 10, "the lease to be released")
    assert counter(a, "lease_releases") == 1
    clock.now += 0.02  # b's next look claims it
    assert b.ensure_cache_available(rb, 0) is False
    cache.open()
    wait_for(lambda: b._stager.in_flight == 0, 10, "the look to return")
    assert b.ensure_cache_available(rb, 0) is True and b.has_cache_item("gone") is False
    assert counter(b, "lease_claims") == 1


def test_a_pure_producer_waits_on_the_lease_then_skips_the_published_item() -> None:
    a, b, cache, clock = fleet("ec_producer", lease_ttl_s=2.0, producer_check_wait_s=0.01)
    ra, rb = request("ra", ("enc", 16)), request("rb", ("enc", 16))
    assert look(a, cache, ra) is True and a.has_cache_item("enc") is False
    assert look(b, cache, rb) is False  # past producer_check_wait_s, still held: a's lease
    clock.now += 0.5
    assert b.ensure_cache_available(rb, 0) is False  # looks again
    cache.stored["enc"] = embedding(16, WIDTH)
    cache.open()
    wait_for(lambda: b._stager.in_flight == 0, 10, "the look to return")
    assert b.ensure_cache_available(rb, 0) is True
    assert b.has_cache_item("enc") is True  # published: b skips the encode
    b.update_state_after_alloc(rb, 0)
    assert counter(b, "lease_skips") == 1 and counter(b, "lease_encodes_saved") == 1


def test_without_single_flight_nobody_claims_or_waits() -> None:
    a, b, cache, _ = fleet(single_flight=False)
    assert look(a, cache, request("ra", ("x", 16))) is True
    assert look(b, cache, request("rb", ("x", 16))) is True
    assert cache.leases == {}
    assert counter(a, "lease_claims") == 0 == counter(b, "lease_waits")


def test_a_pure_consumer_never_claims() -> None:
    a, _, cache, _ = fleet("ec_consumer")
    look(a, cache, request("ra", ("c", 16)))
    assert cache.leases == {}


# -- findings of the adversarial review (each failed before its fix) -----------------------


def test_cross_claims_never_stall_either_instance() -> None:
    """A holds X and finds Y held by B; B holds Y and finds X held by A (Cluster asks each
    node in turn, so two instances' claims interleave). Neither may wait: a request that
    holds a lease it must fulfil encodes everything it lacks."""
    from ec_redis.tiers.lease import claim_value

    a, b, cache, clock = fleet(lease_ttl_s=2.0)
    ra = request("ra", ("X", 16), ("Y", 16))
    rb = request("rb", ("Y", 16), ("X", 16))
    cache.leases["Y"] = (claim_value(16, b._token), clock.now + 2.0)  # B's claim of Y won
    assert look(a, cache, ra) is True  # holds X: encodes X and Y, waits on nothing
    cache.leases.pop("Y")
    cache.leases["Y"] = (claim_value(16, b._token), clock.now + 2.0)
    assert look(b, cache, rb) is True  # holds Y, finds X held by A: encodes both
    assert a.has_cache_item("X") is False and a.has_cache_item("Y") is False
    assert counter(a, "lease_waits") == 0 == counter(b, "lease_waits")


def test_a_pure_producers_takeover_is_counted_and_the_item_noted_unpublished() -> None:
    a, b, cache, clock = fleet("ec_producer", lease_ttl_s=0.2, producer_check_wait_s=0.01)
    ra, rb = request("ra", ("slow", 16)), request("rb", ("slow", 16))
    assert look(a, cache, ra) is True
    assert look(b, cache, rb) is False
    clock.now += 0.3  # past the deadline, and due for another look
    assert b.ensure_cache_available(rb, 0) is True
    assert b.has_cache_item("slow") is False
    assert counter(b, "lease_takeovers") == 1
    assert "slow" in b._gate.unpublished.get("rb", {})


def test_a_media_less_request_never_claims() -> None:
    """It cannot encode: a claim would make every other instance wait for nothing."""
    a, _, cache, _ = fleet(lease_ttl_s=30.0)
    req = request("ra", ("meta", 16), media=False)
    generation = a._stager.generation
    assert a.ensure_cache_available(req, 0) is False
    cache.open()
    wait_for(lambda: a._stager.generation > generation, 10, "the look to return")
    assert cache.leases == {}


def test_a_lease_is_released_with_the_value_it_was_claimed_with() -> None:
    """Another request's look at the same id with other rows rewrites the entry's rows; the
    release must still name this claim's own value, or the lease would stay."""
    a, _, cache, _ = fleet(lease_ttl_s=30.0)
    first = request("r1", ("same", 16))
    assert look(a, cache, first) is True
    entry = a._stager.get("same")
    entry.rows = 24  # what a later look for a 24-row request would leave there
    a.request_finished(first)
    wait_for(lambda: "same" not in cache.leases, 10, "the lease to be released")


def test_an_encode_saved_is_counted_once_however_many_requests_load_it() -> None:
    a, b, cache, clock = fleet(lease_ttl_s=2.0)
    assert look(a, cache, request("ra", ("pop", 16))) is True
    r1, r2 = request("r1", ("pop", 16)), request("r2", ("pop", 16))
    assert look(b, cache, r1) is False
    assert b.ensure_cache_available(r2, 0) is False
    cache.stored["pop"] = embedding(16, WIDTH)
    clock.now += 0.05
    assert b.ensure_cache_available(r1, 0) is False
    cache.open()
    wait_for(lambda: b._stager.in_flight == 0, 10, "the look to return")
    for req in (r1, r2):
        assert b.ensure_cache_available(req, 0) is True and b.has_cache_item("pop")
        b.update_state_after_alloc(req, 0)
        b.build_connector_meta(None)
    assert counter(b, "lease_encodes_saved") == 1


def test_a_claimant_still_waits_for_an_item_it_cannot_encode() -> None:
    """Holding X's lease, the request waits on no lease (no cycles), except for an item it
    has no media for: failing the request would be worse than a bounded wait."""
    from ec_redis.tiers.lease import claim_value

    a, b, cache, clock = fleet(lease_ttl_s=2.0)
    ra = request("ra", ("X", 16), ("Y", 16))
    ra.mm_features[1].data = None  # Y: metadata only, must be loaded
    cache.leases["Y"] = (claim_value(16, b._token), clock.now + 2.0)  # B encodes Y
    assert look(a, cache, ra) is False  # held for Y, not failed
    assert a.take_unavailable_requests() == set() and counter(a, "lease_waits") == 1


def test_a_pure_producer_checks_again_after_an_expired_lease() -> None:
    """A new request for an item whose lease ran out (a takeover here) still gets its
    "already published?" look: the late write may have landed."""
    a, b, cache, clock = fleet("ec_producer", lease_ttl_s=0.2, producer_check_wait_s=0.5)
    ra, rb = request("ra", ("slow", 16)), request("rb", ("slow", 16))
    assert look(a, cache, ra) is True
    assert look(b, cache, rb) is False
    clock.now += 0.6  # past the lease and rb's check deadline: rb takes over
    assert b.ensure_cache_available(rb, 0) is True
    cache.stored["slow"] = embedding(16, WIDTH)  # a's late write landed; no announcement
    clock.now += 0.05
    rc = request("rc", ("slow", 16))
    assert b.ensure_cache_available(rc, 0) is False  # its check is on its way
    cache.open()
    wait_for(lambda: b._stager.in_flight == 0, 10, "the check to return")
    assert b.ensure_cache_available(rc, 0) is True and b.has_cache_item("slow") is True


@pytest.mark.parametrize("role", ["ec_producer", "ec_both"])
def test_an_announcement_is_looked_up_only_by_an_instance_waiting_on_its_lease(role: str) -> None:
    """The encoder's own write announced while its request still wants the entry: no look
    (one head check per request, as without single flight); a waiter looks at once."""
    a, b, cache, _ = fleet(role, lease_ttl_s=2.0, recheck_s=60)
    ra, rb = request("ra", ("mine", 16)), request("rb", ("mine", 16))
    assert look(a, cache, ra) is True  # a claimed it and encodes it
    assert look(b, cache, rb) is False  # b waits on a's lease
    cache.stored["mine"] = embedding(16, WIDTH)
    looks = len(cache.lookups)
    assert a._on_stored("mine") is False  # a's own write: nothing to look for
    assert b._on_stored("mine") is True  # b waits for it: looks now, not at its recheck
    cache.open()
    wait_for(lambda: b._stager.in_flight == 0, 10, "b's look")
    assert len(cache.lookups) == looks + 1
    assert b.ensure_cache_available(rb, 0) is True and b.has_cache_item("mine") is True


def test_an_announcement_during_a_producers_first_look_costs_no_second_look() -> None:
    """On a busy machine the encoder's first look can outlast its encode and write: the
    announcement of its own write then arrives with the look still in flight. One head
    check per request, as without single flight (tests/e2e/test_epd_load.py counts them)."""
    a, _, cache, _ = fleet("ec_producer", lease_ttl_s=2.0, recheck_s=60)
    req = request("ra", ("own", 16))
    assert a.ensure_cache_available(req, 0) is False  # the look is in flight
    wait_for(lambda: len(cache.lookups) == 1, 5, "the look to start")
    assert a._on_stored("own") is False
    cache.open()
    wait_for(lambda: a._stager.in_flight == 0, 10, "the look to return")
    cache.open()  # a second look, if one were started, would not block
    time.sleep(0.1)
    assert len(cache.lookups) == 1
