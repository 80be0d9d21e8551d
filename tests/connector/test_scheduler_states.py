"""The scheduler half's state machine, transition by transition, with a cache whose lookups
the test releases by hand (no Redis, no timing luck) and real vLLM requests."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ec_redis.config import ConnectorOptions
from ec_redis.tiers.lease import Claim
from tests.conftest import embedding, wait_for
from tests.connector.conftest import request
from tests.counters import count

pytestmark = pytest.mark.vllm
WIDTH = 128


class GatedCache:
    """Stands in for TieredCache: holds ``stored`` tensors; every lookup blocks until the
    test opens the gate, so each state is observed before the next one."""

    writer = None
    config = SimpleNamespace(producer_id="gated", max_blob_bytes=512 * 1024 * 1024)

    def __init__(self) -> None:
        self.stored: dict[str, torch.Tensor] = {}
        # Single-flight leases as Redis would hold them: item -> (value, expiry on ``now``).
        self.leases: dict[str, tuple[bytes, float]] = {}
        self.now: Any = time.monotonic
        self.released: list[tuple[str, bytes]] = []
        self.gate = threading.Semaphore(0)
        self.lookups: list[list[str]] = []
        self.fail_next = False

    def open(self, lookups: int = 1) -> None:
        for _ in range(lookups):
            self.gate.release()

    def _wait(self, items: list[str]) -> None:
        self.lookups.append(items)
        assert self.gate.acquire(timeout=10), "lookup never released"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected lookup failure")

    def get_many(
        self, items: list[str], *, on_host: bool = False, claim: Claim | None = None
    ) -> dict[str, Any]:
        self._wait(items)
        self._claim(items, claim)
        return {item: self.stored.get(item) for item in items}

    def _claim(self, items: list[str], claim: Claim | None) -> None:
        """What ``tiers/lease.py``'s CLAIM script answers, for each item ``claim`` names."""
        for item in items if claim is not None else []:
            assert claim is not None
            if item not in claim.rows:
                continue
            if item in self.stored:
                claim.settle(item, [0])
                continue
            now, ttl_ms = self.now(), claim.ttl_ms
            held = self.leases.get(item)
            if (held is None or held[1] <= now) and item in claim.look_only:
                claim.settle(item, [0])
            elif held is None or held[1] <= now:
                self.leases[item] = (claim.value(item), now + ttl_ms / 1000)
                claim.settle(item, [1, ttl_ms, 1])
            elif held[0] == claim.value(item):
                claim.settle(item, [1, int((held[1] - now) * 1000), 0])
            else:
                claim.settle(item, [2, held[0][:96], int((held[1] - now) * 1000)])

    def release_lease(self, item: str, value: bytes) -> None:
        self.released.append((item, value))
        if self.leases.get(item, (b"",))[0] == value:
            del self.leases[item]

    def subscribe(self, on_item: Any) -> None:
        return None  # announcements are driven by hand (Stager.nudge) in these tests

    def describe_many(self, items: list[str], claim: Claim | None = None) -> dict[str, Any]:
        self._wait(items)
        self._claim(items, claim)
        return {
            item: (t.dtype, tuple(t.shape)) if (t := self.stored.get(item)) is not None else None
            for item in items
        }


def make_side(
    role: str = "ec_consumer",
    transport: Any = None,
    clock: Any = None,
    cache: GatedCache | None = None,
    **options: Any,
) -> tuple[Any, GatedCache]:
    """A scheduler half over ``cache`` (a new one by default; single-flight tests give
    several halves one cache, as instances share one Redis)."""
    from ec_redis.connector.checks import TensorCheck
    from ec_redis.connector.scheduler import SchedulerSide

    cache = cache or GatedCache()
    defaults: dict[str, Any] = {"consumer_wait_s": 0.0, "recheck_s": 0.001, "lookup_wait_s": 0}
    side = SchedulerSide(
        cache,  # type: ignore[arg-type]
        ConnectorOptions(**{**defaults, **options}),
        TensorCheck(torch.bfloat16, lambda modality: WIDTH, WIDTH),
        is_producer=role in ("ec_producer", "ec_both"),
        is_consumer=role in ("ec_consumer", "ec_both"),
        transport=transport,
        **({} if clock is None else {"clock": clock}),
    )
    return side, cache


def settle(side: Any, generation: int) -> None:
    wait_for(lambda: side._stager.generation > generation, 10, "a lookup to return")


def stage(side: Any, cache: GatedCache, req: Any, computed: int = 0) -> None:
    """ensure -> (lookup released) -> ensure again: the request's items are settled."""
    generation = side._stager.generation
    assert side.ensure_cache_available(req, computed) is False
    cache.open()
    settle(side, generation)


def drained(side: Any) -> bool:
    state = side.live_state()
    return all(
        state[k] == 0
        for k in ("requests", "items", "staged_bytes", "reserved_bytes", "answers", "loads")
    )


def test_fetch_stage_load_and_every_trace_goes() -> None:
    side, cache = make_side()
    cache.stored["a"] = embedding(16, WIDTH, seed=1)
    req = request("r1", ("a", 16))
    stage(side, cache, req)
    assert side.live_state()["staged_bytes"] == 16 * WIDTH * 2
    assert side.ensure_cache_available(req, 0) is True
    assert side.has_cache_item("a") is True
    side.update_state_after_alloc(req, 0)
    meta = side.build_connector_meta(None)
    assert [load.mm_hash for load in meta.loads] == ["a"]
    assert torch.equal(meta.loads[0].tensor, cache.stored["a"])
    assert side.live_state()["items"] == 0  # taken by the load: the entry died with it
    side.request_finished(req)
    assert drained(side), side.live_state()


def test_an_abort_while_staged_then_a_miss_never_crashes_the_scheduler() -> None:
    """The issue's crash: abort while staged, item gone everywhere, another request asks."""
    side, cache = make_side()
    cache.stored["x"] = embedding(16, WIDTH)
    first = request("r1", ("x", 16))
    stage(side, cache, first)
    assert side.ensure_cache_available(first, 0) is True
    side.request_finished(first)  # aborted while staged and validated
    assert drained(side), side.live_state()
    del cache.stored["x"]  # evicted from Redis and the CPU tier
    second = request("r2", ("x", 16))
    stage(side, cache, second)
    assert side.ensure_cache_available(second, 0) is True  # absent: encode locally
    assert side.has_cache_item("x") is False
    side.update_state_after_alloc(second, 0)  # vLLM reports the local encode: no raise
    assert side.build_connector_meta(None).loads == []
    side.request_finished(second)
    assert drained(side) and count(side.snapshot(), "internal_errors") == 0


def test_a_yes_without_an_allocation_is_forgotten_at_the_end_of_the_step() -> None:
    side, cache = make_side()
    cache.stored["a"] = embedding(16, WIDTH)
    req = request("r1", ("a", 16))
    stage(side, cache, req)
    assert side.ensure_cache_available(req, 0) and side.has_cache_item("a")
    assert side.build_connector_meta(None).loads == []  # KV allocation failed: no alloc
    # A later allocation without a fresh "yes" in its own step is a local encode.
    side.update_state_after_alloc(req, 0)
    assert side.build_connector_meta(None).loads == []
    assert side.live_state()["items"] == 1  # still staged for the request
    assert side.ensure_cache_available(req, 0) and side.has_cache_item("a")
    side.update_state_after_alloc(req, 0)
    assert len(side.build_connector_meta(None).loads) == 1


def test_preemption_restages_what_the_request_already_loaded() -> None:
    from vllm.v1.request import RequestStatus

    side, cache = make_side()
    cache.stored["a"] = embedding(16, WIDTH, seed=3)
    req = request("r1", ("a", 16))
    stage(side, cache, req)
    assert side.ensure_cache_available(req, 0) and side.has_cache_item("a")
    side.update_state_after_alloc(req, 0)
    assert len(side.build_connector_meta(None).loads) == 1
    req.status = RequestStatus.RUNNING  # scheduled: 10 of its tokens computed
    assert side.ensure_cache_available(req, 10) is True  # mid-item: in vLLM's cache
    # vLLM preempts it: encoder inputs freed without update_state_after_free, tokens to 0.
    req.status, req.num_preemptions = RequestStatus.PREEMPTED, 1
    stage(side, cache, req, computed=0)  # needed again: fetched again, not re-encoded
    assert side.ensure_cache_available(req, 0) and side.has_cache_item("a")
    side.update_state_after_alloc(req, 0)
    loads = side.build_connector_meta(None).loads
    assert [load.mm_hash for load in loads] == ["a"]
    assert torch.equal(loads[0].tensor, cache.stored["a"])
    side.request_finished(req)
    assert drained(side), side.live_state()


def test_update_state_after_free_lets_go_of_the_item() -> None:
    side, cache = make_side()
    cache.stored.update(a=embedding(16, WIDTH), b=embedding(8, WIDTH))
    owner, other = request("r1", ("a", 16)), request("r2", ("a", 16))
    stage(side, cache, owner)
    assert side.ensure_cache_available(other, 0) is True  # joins the staged entry
    assert side._stager.get("a").wanted_by == {"r1", "r2"}
    side.update_state_after_free(owner, 0)
    assert side._stager.get("a").wanted_by == {"r2"}
    side.update_state_after_free(other, 0)
    assert side.live_state()["items"] == 0 and side.live_state()["staged_bytes"] == 0


def test_rows_are_checked_for_the_request_that_asks() -> None:
    side, cache = make_side()
    cache.stored["u"] = embedding(16, WIDTH)  # a client uuid, reused for other content
    wrong, right = request("r1", ("u", 20)), request("r2", ("u", 16))
    stage(side, cache, wrong)
    assert side.ensure_cache_available(wrong, 0) is True
    assert side.has_cache_item("u") is False  # 16 rows stored, 20 expected
    assert side.ensure_cache_available(right, 0) is True
    assert side.has_cache_item("u") is True
    assert side.snapshot()["rejected_items"] == 1


def test_a_wrong_dtype_or_width_is_refused_once_and_encoded() -> None:
    side, cache = make_side()
    cache.stored.update(f=embedding(16, WIDTH).float(), w=embedding(16, 64))
    req = request("r1", ("f", 16), ("w", 16))
    stage(side, cache, req)
    assert side.ensure_cache_available(req, 0) is True
    assert not side.has_cache_item("f") and not side.has_cache_item("w")
    assert side.snapshot()["rejected_items"] == 2
    assert side.live_state()["staged_bytes"] == 0


def test_a_pure_consumer_waits_for_absent_items_then_fails_or_encodes() -> None:
    side, cache = make_side(consumer_wait_s=0.2, recheck_s=0.01, on_missing="fail")
    req = request("r1", ("late", 16))
    stage(side, cache, req)
    assert side.ensure_cache_available(req, 0) is False  # absent, still within the wait
    cache.open(1000)  # let every recheck through from now on
    failed: set[str] = set()

    def failed_by_now() -> bool:
        assert side.ensure_cache_available(req, 0) is False  # held: never promised
        failed.update(side.take_unavailable_requests())
        return failed == {"r1"}

    wait_for(failed_by_now, 5, "the request to be failed as unavailable")
    side.request_finished(req)
    assert drained(side) and side.live_state()["unavailable"] == 0


def test_a_held_request_is_answered_without_walking_its_items_again() -> None:
    side, cache = make_side(consumer_wait_s=60, recheck_s=60)
    reqs = [request(f"r{i}", (f"img-{i}", 16)) for i in range(4)]
    for req in reqs:
        assert side.ensure_cache_available(req, 0) is False
    assert len(cache.lookups) <= 4
    calls = {"n": 0}
    real_get = side._stager.get

    def counting_get(item: str) -> Any:
        calls["n"] += 1
        return real_get(item)

    side._stager.get = counting_get
    for req in reqs:
        assert side.ensure_cache_available(req, 0) is False
    assert calls["n"] == 0  # nothing returned since: held on the fast path
    cache.open(4)
    wait_for(lambda: side._stager.in_flight == 0, 10, "lookups to return")
    assert side.ensure_cache_available(reqs[0], 0) is False  # absent: re-walked now
    assert calls["n"] == 1


def test_one_bounded_wait_per_idle_step_and_none_when_work_is_scheduled() -> None:
    side, cache = make_side(lookup_wait_s=0.2, consumer_wait_s=60)

    class Output:
        def __init__(self, tokens: int) -> None:
            self.total_num_scheduled_tokens = tokens

    waits: list[float] = []  # the deadline of each wait, as the step asks for it
    real_wait = side._stager.wait

    def wait(generation: int, deadline: float) -> None:
        waits.append(deadline)
        real_wait(generation, deadline)

    side._stager.wait = wait  # type: ignore[method-assign]
    reqs = [request(f"r{i}", (f"img-{i}", 16)) for i in range(50)]
    started = time.monotonic()
    for req in reqs:
        assert side.ensure_cache_available(req, 0) is False  # never blocks
    side.build_connector_meta(Output(tokens=8))  # other work ran: no wait at all
    busy_s = time.monotonic() - started
    assert waits == []
    started = time.monotonic()
    for req in reqs:
        side.ensure_cache_available(req, 0)
    side.build_connector_meta(Output(tokens=0))  # idle: one wait, bounded by 0.2 s
    idle_s = time.monotonic() - started
    assert len(waits) == 1  # the single shared wait, not 50 of them
    # Generous bounds (a loaded host): the wrong behaviours cost 50 waits, 10 s.
    assert busy_s < 2.0
    assert 0.15 <= idle_s < 5.0
    cache.open(100)


def test_an_idle_step_waits_for_an_absent_item_too_and_a_pushed_lookup_ends_the_wait() -> None:
    """A request held for an item not yet written has no lookup in flight: the idle step
    still waits (at most lookup_wait_s) instead of letting the engine spin, which starved
    the subscriber and lookup threads of the GIL; a lookup started by a push ends it."""

    class Idle:
        total_num_scheduled_tokens = 0

    side, cache = make_side(lookup_wait_s=0.3, consumer_wait_s=60, recheck_s=30)
    req = request("r1", ("late", 16))
    stage(side, cache, req)  # looked once: absent, nothing in flight
    assert side._stager.in_flight == 0
    started = time.monotonic()
    assert side.ensure_cache_available(req, 0) is False
    side.build_connector_meta(Idle())
    assert time.monotonic() - started >= 0.25  # waited, though no lookup was in flight

    # The push half on a side whose bound is far above the push's ~0.05 s, so that a
    # loaded host's thread hand-offs cannot reach it: only the push can end this wait early.
    side, cache = make_side(lookup_wait_s=5.0, consumer_wait_s=60, recheck_s=30)
    req = request("r1", ("late", 16))
    stage(side, cache, req)
    assert side._stager.in_flight == 0
    cache.stored["late"] = embedding(16, WIDTH)
    cache.open()  # the lookup the push below starts returns at once
    pushed = threading.Timer(0.05, side._stager.nudge, args=("late",))
    started = time.monotonic()
    assert side.ensure_cache_available(req, 0) is False
    pushed.start()
    side.build_connector_meta(Idle())
    waited = time.monotonic() - started
    pushed.join()
    assert waited < 2.5, waited  # ended by the pushed lookup (~0.05 s), not the 5 s bound
    assert side.ensure_cache_available(req, 0) is True and side.has_cache_item("late")


def test_the_engine_steps_on_until_a_lookup_that_outlived_its_request_is_reported() -> None:
    """vLLM reports stats only while it steps: an encoder's head check that returns after
    its request was encoded and finished must still reach /metrics."""
    side, cache = make_side("ec_producer", producer_check_wait_s=0.01)
    req = request("r1", ("a", 16))
    side.begin_report()
    assert side.has_pending_push_work() is False
    generation = side._stager.generation
    assert side.ensure_cache_available(req, 0) is False  # the check runs (gate closed)
    time.sleep(0.05)
    assert side.ensure_cache_available(req, 0) is True  # too late to spare the encoder
    side.request_finished(req)
    side.begin_report()
    assert side.take_observations() == {}
    assert side.has_pending_push_work() is True  # the check is still in flight
    cache.open()
    settle(side, generation)
    assert side.has_pending_push_work() is True  # returned, not yet reported
    side.begin_report()
    assert len(side.take_observations()["fetch_seconds"]) == 1
    assert side.has_pending_push_work() is False  # reported: the engine may go idle


def test_hooks_never_raise_on_broken_input() -> None:
    side, _ = make_side()

    class Broken:
        request_id = "broken"

        @property
        def mm_features(self) -> Any:
            raise RuntimeError("boom")

        status = None

    assert side.ensure_cache_available(Broken(), 0) is True
    side.update_state_after_alloc(Broken(), 0)
    side.update_state_after_free(Broken(), 0)
    assert side.request_finished(Broken()) == (False, None)
    assert side.build_connector_meta(None).loads == []
    assert side.snapshot()["internal_errors"] == 3  # request_finished needs only the id


def test_a_failed_lookup_is_a_miss_and_the_table_drains() -> None:
    side, cache = make_side()
    cache.stored["a"] = embedding(16, WIDTH)
    cache.fail_next = True
    req = request("r1", ("a", 16))
    stage(side, cache, req)
    assert side.ensure_cache_available(req, 0) is True
    assert side.has_cache_item("a") is False
    side.request_finished(req)
    assert drained(side), side.live_state()


def test_request_scoped_ids_are_never_looked_up() -> None:
    side, cache = make_side()
    req = request("r1", ("renderer0-mm-7-image-0", 16))
    assert side.ensure_cache_available(req, 0) is True
    assert side.has_cache_item("renderer0-mm-7-image-0") is False
    assert cache.lookups == [] and drained(side)


def test_request_records_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import ec_redis.connector.gate as module

    monkeypatch.setattr(module, "MAX_REQUESTS", 3)
    side, cache = make_side(consumer_wait_s=60)
    for i in range(10):
        side.ensure_cache_available(request(f"r{i}", (f"img-{i}", 16)), 0)
    assert side.live_state()["requests"] == 3
    cache.open(10)


def test_staged_and_reserved_bytes_never_exceed_the_budget() -> None:
    item_bytes = 16 * WIDTH * 2
    side, cache = make_side(stage_bytes=3 * item_bytes + 1)
    reqs = [request(f"r{i}", (f"img-{i}", 16)) for i in range(12)]
    for i, req in enumerate(reqs):
        cache.stored[f"img-{i}"] = embedding(16, WIDTH, seed=i)
        side.ensure_cache_available(req, 0)
        state = side.live_state()
        assert state["staged_bytes"] + state["reserved_bytes"] <= 3 * item_bytes + 1
    assert side.snapshot()["stage_full"] == 9  # the rest were told to encode locally
    cache.open(12)
    wait_for(lambda: side._stager.in_flight == 0, 10, "lookups to return")
    state = side.live_state()
    assert state["reserved_bytes"] == 0 and state["staged_bytes"] == 3 * item_bytes
    for req in reqs:
        side.request_finished(req)
    assert drained(side), side.live_state()


def test_an_item_bigger_than_its_reservation_is_refused_when_it_would_overflow() -> None:
    item_bytes = 16 * WIDTH * 2
    side, cache = make_side(stage_bytes=item_bytes + item_bytes // 2)
    cache.stored["big"] = embedding(32, WIDTH)  # twice the rows the request expects
    req = request("r1", ("big", 16))
    stage(side, cache, req)
    assert side.live_state()["staged_bytes"] == 0
    assert side.snapshot()["stage_overflow"] == 1
    assert side.ensure_cache_available(req, 0) is True and side.has_cache_item("big") is False
    side.request_finished(req)
    assert drained(side), side.live_state()


def test_a_lookup_racing_a_push_never_stages_an_item_twice() -> None:
    """The gate saw ABSENT and asks again; a push's lookup staged the item meanwhile: the
    second fetch joins the staged entry instead of restarting it over its bytes."""
    side, cache = make_side(consumer_wait_s=60, recheck_s=0.0)
    first = request("r1", ("late", 16))
    stage(side, cache, first)  # absent
    cache.stored["late"] = embedding(16, WIDTH)
    generation = side._stager.generation
    assert side._stager.nudge("late") is True
    cache.open()
    settle(side, generation)  # staged by the push
    started, refused = side._stager.fetch([("late", "image", 16 * WIDTH * 2)], "r2")
    assert (started, refused) == ([], [])  # joined, nothing started
    assert side.live_state()["staged_bytes"] == 16 * WIDTH * 2
    side.request_finished(first)
    side._stager.release("late", "r2")  # what the gate's record of r2 would do at its end
    assert drained(side), side.live_state()


def test_a_failing_check_settles_the_whole_batch() -> None:
    side, cache = make_side()
    cache.stored["a"] = embedding(16, WIDTH)
    req = request("r1", ("a", 16))

    def broken(modality: str, found: Any) -> str | None:
        raise ValueError("injected check failure")

    side._stager._check = broken
    stage(side, cache, req)
    state = side.live_state()
    assert state["lookups_in_flight"] == 0 and state["reserved_bytes"] == 0
    assert side.snapshot()["lookup_errors"] == 1
    assert side.ensure_cache_available(req, 0) is True  # absent, no wait: encode locally
    side.request_finished(req)
    assert drained(side), side.live_state()


def test_a_yes_to_a_request_vllm_did_not_schedule_never_becomes_another_ones_load() -> None:
    """Same id, different sizes (a reused client uuid): B's "no" is B's, whatever A got."""
    side, cache = make_side()
    cache.stored["u"] = embedding(16, WIDTH)
    a, b = request("ra", ("u", 16)), request("rb", ("u", 24))
    stage(side, cache, a)
    assert side.ensure_cache_available(a, 0) is True
    assert side.has_cache_item("u") is True  # ... but vLLM does not schedule A this step
    assert side.ensure_cache_available(b, 0) is True
    assert side.has_cache_item("u") is False  # 16 rows staged, B expects 24: encode
    side.update_state_after_alloc(b, 0)  # vLLM allocates B's local encode
    assert side.build_connector_meta(None).loads == []
    for req in (a, b):
        side.request_finished(req)
    assert drained(side), side.live_state()


def test_a_producer_answers_from_the_head_and_never_holds_past_its_deadline() -> None:
    side, cache = make_side("ec_producer", producer_check_wait_s=0.05)
    cache.stored["pub"] = embedding(16, WIDTH)
    req = request("r1", ("pub", 16), ("new", 16))
    assert side.ensure_cache_available(req, 0) is False  # checks in flight
    time.sleep(0.06)
    assert side.ensure_cache_available(req, 0) is True  # deadline passed: encode
    assert side.has_cache_item("pub") is False  # not known yet: encode it
    cache.open()
    wait_for(lambda: side._stager.in_flight == 0, 10, "the check to return")
    assert side.ensure_cache_available(req, 0) is True
    assert side.has_cache_item("pub") is True and side.has_cache_item("new") is False
    side.update_state_after_alloc(req, 0)
    assert side.build_connector_meta(None).loads == []  # nothing to load on a producer
    side.request_finished(req)
    assert drained(side), side.live_state()


def test_an_announcement_refetches_an_awaited_item_at_once() -> None:
    side, cache = make_side(consumer_wait_s=60, recheck_s=60)  # polling would take a minute
    req = request("r1", ("late", 16))
    stage(side, cache, req)  # absent
    assert side.ensure_cache_available(req, 0) is False
    cache.stored["late"] = embedding(16, WIDTH)
    generation = side._stager.generation
    assert side._stager.nudge("late") is True  # what the subscriber thread does
    cache.open()
    settle(side, generation)
    assert side.ensure_cache_available(req, 0) is True and side.has_cache_item("late")


def test_an_announcement_during_a_stale_look_is_not_lost() -> None:
    """The look started before the write landed and will say "absent": the announcement that
    arrives meanwhile makes it look once more instead of waiting for the next recheck."""
    side, cache = make_side(consumer_wait_s=60, recheck_s=60)
    req = request("r1", ("racing", 16))
    generation = side._stager.generation
    assert side.ensure_cache_available(req, 0) is False  # look in flight, item not stored yet
    wait_for(lambda: len(cache.lookups) == 1, 5, "the first look to start")
    assert side._stager.nudge("racing") is False  # in flight: remembered, not started twice
    cache.open()  # the first look returns "absent" ...
    wait_for(lambda: len(cache.lookups) == 2, 5, "the second look")  # ... and looks again
    cache.stored["racing"] = embedding(16, WIDTH)
    cache.open()
    settle(side, generation + 1)
    assert side.ensure_cache_available(req, 0) is True and side.has_cache_item("racing")
