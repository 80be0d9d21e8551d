"""Findings of the adversarial review of issue 14's change, one test each; every one failed
on the change as first written (and on ``e6f457e``) and passes with its fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import embedding, wait_for
from tests.connector.conftest import request
from tests.connector.test_promises import Clock, make_side
from tests.connector.test_scheduler_states import WIDTH, settle

pytestmark = pytest.mark.vllm


def _return(side: Any, cache: Any) -> None:
    generation = side._stager.generation
    cache.open()
    settle(side, generation)
    wait_for(lambda: side._stager.in_flight == 0, 10, "lookups to return")


# -- A. announcements (anyone who can PUBLISH on the channel) hold a request forever -------


def test_announcement_spam_never_lets_a_waiting_request_go() -> None:
    """A pure consumer waits ``consumer_wait_s`` for an absent item, then encodes (or fails).
    But the deadline is checked only while the entry is ABSENT; each announcement (a PUBLISH
    on the model's channel, which any client of the shared Redis may send, or a producer whose
    entry keeps being evicted) turns it FETCHING with a fresh ``since``, and a FETCHING entry
    only has ``fetch_wait_s`` from *that* ``since``. An announcement between every lookup and
    every step keeps the request held forever: it is neither encoded nor failed."""
    side, cache, clock = make_side(consumer_wait_s=0.5, fetch_wait_s=10.0, recheck_s=0.05)
    req = request("r1", ("x", 16))
    assert side.ensure_cache_available(req, 0) is False  # first look starts
    _return(side, cache)  # absent
    held_steps = 0
    for _ in range(200):  # 200 steps, 1 s apart: far past consumer_wait_s + fetch_wait_s
        clock.now += 1.0
        assert side._stager.nudge(side._stager.get("x").item)  # a (forged) announcement
        ready = side.ensure_cache_available(req, 0)
        side.build_connector_meta(None)
        if ready or side.take_unavailable_requests():
            break
        held_steps += 1
        _return(side, cache)  # the announced look finds nothing
    # 200 s of held steps for a request told to wait 0.5 s (+ at most 10 s per lookup)
    assert held_steps < 20, f"held {held_steps} steps (~{held_steps} s) past every deadline"


# -- B. stage_bytes is exceeded while a lookup batch is being staged -----------------------


def _consumer_without_widths(tmp_path: Path, stage_bytes: int) -> tuple[Any, Any, Any]:
    """A pure consumer as ECRedisConnector builds it: no measured encoder widths (they are
    measured on producers only), so reservations assume the LM hidden size."""
    from ec_redis.config import ConnectorOptions
    from ec_redis.connector.checks import TensorCheck
    from ec_redis.connector.scheduler import SchedulerSide
    from ec_redis.connector.transport import FileTransport
    from tests.connector.test_scheduler_states import GatedCache

    cache, clock = GatedCache(), Clock()
    side = SchedulerSide(
        cache,  # type: ignore[arg-type]
        ConnectorOptions(
            consumer_wait_s=0.0, recheck_s=0.001, lookup_wait_s=0, stage_bytes=stage_bytes
        ),
        TensorCheck(torch.bfloat16, lambda modality: None, WIDTH),  # connector.py: no widths
        is_producer=False,
        is_consumer=True,
        transport=FileTransport(str(tmp_path)),
        clock=clock,
    )
    return side, cache, clock


def test_a_lookup_batch_stages_more_than_stage_bytes(tmp_path: Path) -> None:
    """Reservations are estimates (rows x the LM hidden size); the real bytes are known only
    after the read, and ``Stager._run`` stages (writes to ``stage_dir``) *every* item of the
    batch before ``_settle_locked`` checks the budget. A DeepStack model (Qwen3-VL: encoder
    output 4x the hidden size, unknown to a pure consumer) or a client whose metadata-only item
    claims few rows makes one batch write several times ``stage_bytes`` to the tmpfs."""
    item = 16 * 4 * WIDTH * 2  # 16 rows, DeepStack width (4 x hidden), bf16
    stage_bytes = 3 * item
    side, cache, _ = _consumer_without_widths(tmp_path, stage_bytes)
    names = [f"i{n}" for n in range(8)]
    for n, name in enumerate(names):
        cache.stored[name] = embedding(16, 4 * WIDTH, seed=n)
    peak = [0]
    keep = side._stager._keep

    def watched(found: Any) -> Any:
        out = keep(found)
        used = sum(
            p.stat().st_size for p in tmp_path.glob("ec_redis-stage-*") if p.suffix != ".owner"
        )
        peak[0] = max(peak[0], used)
        return out

    side._stager._keep = watched
    req = request("r1", *((name, 16) for name in names))  # honest rows
    assert side.ensure_cache_available(req, 0) is False  # 8 x (16 x 128 x 2) reserved: fits
    _return(side, cache)
    state = side.live_state()
    assert state["staged_bytes"] <= stage_bytes  # the books are right afterwards...
    # ...but the tmpfs held all 8 items (2.7 x stage_bytes) at once
    assert peak[0] <= stage_bytes, (
        f"peak {peak[0]} B staged in stage_dir, stage_bytes {stage_bytes}"
    )


# -- C. a repeated item the request already loaded is looked up again ----------------------


def test_a_repeat_of_an_item_vllm_already_holds_fails_a_metadata_only_request() -> None:
    """One metadata-only request (an EPD proxy's multi-turn chat: the same image, the same
    uuid, twice) is prefilled in chunks. The first occurrence is loaded; vLLM keeps that
    encoder output until the *last* occurrence is consumed (encoder_cache_manager: one
    reference per request), so the second needs nothing. The gate does not know: the load let
    go of the staging entry, the running request's second occurrence counts as needed, a new
    lookup runs, and once Redis has evicted the item the request is failed as retryable
    (``unavailable_absent``), although vLLM alone would have served it."""
    from vllm.v1.request import RequestStatus

    side, cache, _ = make_side()  # default on_missing: encode; the item has no media
    cache.stored["img"] = embedding(16, WIDTH)
    req = request("r1", ("img", 16), ("img", 16), media=False)
    assert side.ensure_cache_available(req, 0) is False
    _return(side, cache)
    assert side.ensure_cache_available(req, 0) is True
    assert side.has_cache_item("img") is True  # first occurrence (chunk 1 covers only it)
    side.update_state_after_alloc(req, 0)
    assert len(side.build_connector_meta(None).loads) == 1
    # vLLM ran chunk 1 (tokens 0..21); the image now sits in vLLM's encoder cache
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = 21
    del cache.stored["img"]  # Redis (allkeys-lru) and the CPU tier evict it meanwhile
    verdicts = []
    for _ in range(3):
        verdicts.append(side.ensure_cache_available(req, 21))
        side.build_connector_meta(None)
        if side._stager.in_flight:
            _return(side, cache)
    failed = side.take_unavailable_requests()
    assert failed == set() and verdicts[-1] is True, (
        f"ensure {verdicts}, failed {failed}: a request vLLM could finish was failed"
    )


# -- D. an encoder never publishes a salted request's item that vLLM's own cache holds ------


@pytest.mark.redis
def test_an_encoder_publishes_each_salt_of_an_image_it_already_holds(
    tiny_model: Path, private_redis: Any
) -> None:
    """E/PD with cache_salt: tenant A's request for an image (EPD proxy uuid = sha256(url))
    is encoded and published under A's salt. Tenant B sends the same image while it is still
    in the encoder's vLLM encoder cache: vLLM serves B from that cache (check_and_update_cache
    hits before has_cache_item is asked), so nothing is allocated, ``save_as`` never names B's
    id and B's salted entry is never written. PD (a pure consumer, metadata-only request) then
    finds nothing under B's salt and fails B after consumer_wait_s, and every retry of B does
    the same while the encoder keeps the image."""
    from ec_redis.connector.ids import cache_id
    from tests.connector.scheduler_driver import EngineDriver, build_vllm_config
    from tests.connector.test_tenants import SHAPE, run, salted

    extra = {
        "redis_url": private_redis.url,
        "consumer_wait_s": 0.0,
        "recheck_s": 0.01,
        "producer_check_wait_s": 0.5,
    }
    encoder = build_vllm_config(tiny_model, "ec_producer", extra, SHAPE)
    driver = EngineDriver(encoder, SHAPE)  # one encoder instance serves both tenants
    try:
        for request in (salted("a", "img", "tenant-a"), salted("b", "img", "tenant-b")):
            driver.add_request(request)
            for _ in range(400):
                if not driver.alive or not driver.has_requests():
                    break
                if driver.step() == 0:
                    wait_for(lambda: True, 0.005, "")
        assert driver.failures == [], driver.failures
        assert driver.worker_connector._worker._cache.flush(10)
    finally:
        driver.close()
    keys = {str(k) for k in private_redis.call("KEYS", "*")}

    def stored(salt: str) -> bool:
        key = cache_id("img", salt)
        assert key is not None
        escaped = "".join(c if c.isalnum() or c in "._-" else f"%{ord(c):02X}" for c in key)
        return any(k.endswith("." + escaped + "}") for k in keys)

    assert stored("tenant-a"), keys
    # PD, as docs/configuration.md recommends for metadata-only requests: on_missing fail
    pd = build_vllm_config(tiny_model, "ec_consumer", {**extra, "on_missing": "fail"}, SHAPE)
    _, _, counters = run(pd, [salted("pd-b", "img", "tenant-b")])
    assert counters["unavailable_requests"] == 0, f"PD failed tenant-b's request: {counters}"
    assert stored("tenant-b"), f"tenant-b's entry was never published: {sorted(keys)}"


@pytest.mark.redis
def test_an_encoder_republishes_an_evicted_item_it_still_holds(
    tiny_model: Path, private_redis: Any
) -> None:
    """Unsalted variant of D: Redis (allkeys-lru) evicts a hot item the encoder published;
    the encoder's vLLM encoder cache still holds it, so the next request for it is served by
    vLLM without asking the connector, nothing is republished, and every PD request for that
    item misses (and, metadata-only or ``on_missing: fail``, fails) until the encoder happens
    to evict it too. Issue 14 point 4 ("a head without its chunks is republished") only holds
    for items vLLM asks the connector about."""
    from tests.connector.scheduler_driver import EngineDriver, build_vllm_config, image_request
    from tests.connector.test_tenants import SHAPE

    extra = {"redis_url": private_redis.url, "producer_check_wait_s": 0.5}
    driver = EngineDriver(build_vllm_config(tiny_model, "ec_producer", extra, SHAPE), SHAPE)
    try:
        for n in range(2):
            driver.add_request(image_request(f"e{n}", ["hot"], [2, 3], max_tokens=1))
            for _ in range(400):
                if not driver.alive or not driver.has_requests():
                    break
                if driver.step() == 0:
                    wait_for(lambda: True, 0.005, "")
            assert driver.worker_connector._worker._cache.flush(10)
            if n == 0:
                assert private_redis.call("DBSIZE") == 1
                private_redis.call("FLUSHALL")  # eviction of the entry
        assert driver.failures == [], driver.failures
    finally:
        driver.close()
    assert private_redis.call("DBSIZE") == 1, "the evicted item was not published again"


# -- E. an item that outgrew its reservation is refused for good while anyone wants it -----


def test_an_overflow_is_sticky_and_fails_at_once_under_on_missing_fail(tmp_path: Path) -> None:
    """docs/operating.md: "staging is full -> ... with on_missing: fail looked for again until
    consumer_wait_s ends". That holds for a refusal before the fetch (no entry is made), not
    after it: an item whose real size exceeds what is left (``stage_overflow``, e.g. every item
    of a DeepStack model on a pure consumer, whose reservation assumes the hidden size) becomes
    a REFUSED entry, which ``Stager.fetch`` joins and never looks up again while any request
    wants it; the gate treats REFUSED as "wrong dtype/width" and fails the request at once
    (``unavailable_refused``), although staging frees up a moment later."""
    from ec_redis.config import ConnectorOptions
    from ec_redis.connector.checks import TensorCheck
    from ec_redis.connector.scheduler import SchedulerSide
    from tests.connector.test_scheduler_states import GatedCache

    item = 16 * 4 * WIDTH * 2
    cache, clock = GatedCache(), Clock()
    side = SchedulerSide(
        cache,  # type: ignore[arg-type]
        ConnectorOptions(
            consumer_wait_s=5.0,
            recheck_s=0.01,
            lookup_wait_s=0,
            stage_bytes=item + item // 2,
            on_missing="fail",
        ),
        TensorCheck(torch.bfloat16, lambda modality: None, WIDTH),
        is_producer=False,
        is_consumer=True,
        clock=clock,
    )
    cache.stored["a"] = embedding(16, 4 * WIDTH, seed=1)
    cache.stored["c"] = embedding(16, 4 * WIDTH, seed=2)
    r1, r2 = request("r1", ("a", 16)), request("r2", ("c", 16))
    assert side.ensure_cache_available(r1, 0) is False
    _return(side, cache)
    assert side.ensure_cache_available(r1, 0) is True  # a staged: 1 x item of 1.5 x item
    assert side.ensure_cache_available(r2, 0) is False  # c reserves item/4: fits, is fetched
    _return(side, cache)  # ... and is item bytes: stage_overflow, REFUSED
    side.build_connector_meta(None)
    clock.now += 0.02
    side.request_finished(r1)  # staging is empty again
    clock.now += 0.02
    ready = side.ensure_cache_available(r2, 0)
    if side._stager.in_flight:
        _return(side, cache)
        ready = side.ensure_cache_available(r2, 0)
    assert side.take_unavailable_requests() == set(), (
        f"r2 failed ({side.snapshot()['unavailable_refused']} unavailable_refused) with "
        f"{side.live_state()['staged_bytes']} bytes staged, 0.04 s into a 5 s wait"
    )
    assert ready is True


# -- F. a load is skipped when the worker still holds an evicted, re-allocated tensor -------


@pytest.mark.redis
def test_a_load_replaces_the_tensor_vllm_evicted_in_the_same_pass(
    tiny_model: Path, private_redis: Any
) -> None:
    """vLLM's scheduler can evict an encoder-cache entry early in a pass (``can_allocate``
    for another item) and allocate the same id again later in that pass; then it does not
    tell the worker to drop it (``get_freed_mm_hashes``: "keep its worker-side tensor"), since
    the new encode overwrites it. A connector load must overwrite it too; the worker half
    instead skips any load whose id is already in the dict (``worker.py`` start_load_caches),
    so the request reads the evicted tensor: another request's rows (here 16 rows where 8 are
    needed: vLLM silently slices them), or, for a reused client uuid or another cache_salt,
    another image's embedding."""
    from tests.connector.scheduler_driver import (
        EngineDriver,
        EngineShape,
        Item,
        build_vllm_config,
        image_request,
        publish,
    )

    shape = EngineShape(encoder_cache_tokens=24, encoder_compute_tokens=64)
    extra = {"redis_url": private_redis.url, "consumer_wait_s": 0.0, "recheck_s": 0.01}
    width = int(
        build_vllm_config(tiny_model, "ec_consumer", extra, shape).model_config.get_hidden_size()
    )
    publish(build_vllm_config(tiny_model, "ec_producer", extra, shape), {"X": 8}, width)
    driver = EngineDriver(build_vllm_config(tiny_model, "ec_consumer", extra, shape), shape)

    def serve(*requests: Any) -> None:
        for req in requests:
            driver.add_request(req)
        for _ in range(400):
            if not driver.alive or not driver.has_requests():
                break
            if driver.step() == 0:
                wait_for(lambda: True, 0.005, "")

    try:
        # A reuses the id for a 16-row image: Redis's 8 rows do not fit, vLLM encodes it
        serve(image_request("a", [Item("X", 16)], [2, 2], max_tokens=1))
        assert driver.failures == [] and not driver.has_requests()
        # B's first image Y (16 rows, encoded) evicts X (freeable) from vLLM's 24-token
        # encoder cache; B's second, X (8 rows), is then allocated again in the same pass and
        # promised by the connector (Redis has those 8 rows)
        serve(image_request("b", [Item("Y", 16), Item("X", 8)], [2, 2, 2], max_tokens=1))
        if os.environ.get("REVIEW_TRACE"):
            for event in driver.trace:
                print(event)
        assert driver.failures == [], driver.failures
    finally:
        driver.close()
