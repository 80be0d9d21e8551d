"""Issue 14: a yes is a load, ``on_missing`` means what it says, a wait on a lookup ends, and
``stage_bytes`` bounds every staged byte that exists. Each test here failed on ``e6f457e``.

Most drive the scheduler half directly, with a cache whose lookups the test releases by hand
(``test_scheduler_states.GatedCache``) and a clock it sets; the first drives vLLM's real
``Scheduler`` (``scheduler_driver``), where a broken promise is an encoder-cache miss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ec_redis.embedded import EmbeddedRedis
from tests.conftest import embedding, wait_for
from tests.connector import test_scheduler_states as states
from tests.connector.conftest import request
from tests.connector.test_scheduler_states import WIDTH, GatedCache, settle

pytestmark = pytest.mark.vllm


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_side(
    role: str = "ec_consumer", transport: Any = None, **options: Any
) -> tuple[Any, GatedCache, Clock]:
    clock = Clock()
    side, cache = states.make_side(role, transport, clock, **options)
    return side, cache, clock


def looked_up(side: Any, cache: GatedCache, req: Any, lookups: int = 1) -> None:
    """ensure (held: lookups start) -> the lookups return."""
    generation = side._stager.generation
    assert side.ensure_cache_available(req, 0) is False
    cache.open(lookups)
    settle(side, generation)
    wait_for(lambda: side._stager.in_flight == 0, 10, "lookups to return")


def counter(side: Any, name: str) -> int:
    snapshot = side.snapshot()
    assert name in snapshot, f"no counter {name!r}: {sorted(snapshot)}"
    return int(snapshot[name])


# -- 1. a promise is a load ---------------------------------------------------------------


def test_an_id_reused_within_a_request_for_another_size_never_kills_vllms_step(
    tiny_model: Path, private_redis: EmbeddedRedis
) -> None:
    """A client uuid names a 16-row image and, later in the same prompt, a 24-row one. The
    first has left vLLM's encoder cache when the second is scheduled. On ``e6f457e``
    ``has_cache_item`` checked rows against the first feature, said yes, and no load was
    emitted: vLLM's gather raised "Encoder cache miss"."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from ec_redis.demo.tiny_model import IMAGE_TOKEN_ID, NUM_IMAGE_TOKENS
    from tests.connector.scheduler_driver import (
        TEXT_TOKEN_ID,
        EngineDriver,
        EngineShape,
        build_vllm_config,
        publish,
    )

    shape = EngineShape()
    extra = {"redis_url": private_redis.url, "consumer_wait_s": 0.05, "recheck_s": 0.01}
    config = build_vllm_config(tiny_model, "ec_consumer", extra, shape)
    producer = build_vllm_config(tiny_model, "ec_producer", extra, shape)
    publish(producer, {"uuid-1": NUM_IMAGE_TOKENS}, WIDTH)  # the first image's embedding

    tokens: list[int] = [TEXT_TOKEN_ID] * 2
    features = []
    for rows, text_after in ((NUM_IMAGE_TOKENS, 60), (NUM_IMAGE_TOKENS + 8, 2)):
        features.append(
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),
                modality="image",
                identifier="uuid-1",
                mm_position=PlaceholderRange(offset=len(tokens), length=rows),
            )
        )
        tokens += [IMAGE_TOKEN_ID] * rows + [TEXT_TOKEN_ID] * text_after
    driver = EngineDriver(config, shape)
    try:
        driver.add_request(
            Request(
                request_id="reuser",
                prompt_token_ids=tokens,
                sampling_params=SamplingParams(max_tokens=2),
                pooling_params=None,
                mm_features=features,
            )
        )
        for _ in range(500):
            if not driver.alive or not driver.has_requests():
                break
            if driver.step() == 0:
                wait_for(lambda: True, 0.01, "")
        assert driver.failures == [], driver.failures
        assert not driver.has_requests(), "the request never finished"
        snapshot = driver.connector.stats_snapshot()
        assert snapshot["rejected_items"] >= 1  # the stored 16 rows fit only one feature
        assert snapshot["internal_errors"] == 0
        assert driver.stats.local_encodes >= 1  # vLLM encoded what it could not be given
    finally:
        driver.close()


def test_a_yes_holds_its_bytes_until_the_load_even_if_the_entry_dies(tmp_path: Path) -> None:
    """Between the yes and the allocation the staging entry dies (its last wanter let go):
    the load still names a file that exists."""
    from ec_redis.connector.transport import FileTransport, read_staged

    side, cache, _ = make_side(transport=FileTransport(str(tmp_path)))
    cache.stored["a"] = embedding(16, WIDTH, seed=4)
    req = request("r1", ("a", 16))
    looked_up(side, cache, req)
    assert side.ensure_cache_available(req, 0) is True
    assert side.has_cache_item("a") is True
    side._stager.release("a", "r1")  # the entry dies between the yes and the allocation
    assert side.live_state()["items"] == 0
    side.update_state_after_alloc(req, 0)
    (load,) = side.build_connector_meta(None).loads
    assert torch.equal(read_staged(load), cache.stored["a"])
    side.update_connector_output(_worker_output(loaded_step=0))
    side.request_finished(req)
    assert list(tmp_path.glob("ec_redis-stage-*-*[0-9]")) == []


# -- 2. on_missing means what it says -----------------------------------------------------


def _fails(side: Any, req: Any, why: str) -> None:
    assert side.ensure_cache_available(req, 0) is False  # held until vLLM fails it
    assert side.has_cache_item(req.mm_features[0].identifier) is False
    assert side.take_unavailable_requests() == {req.request_id}
    assert counter(side, f"unavailable_{why}") == 1
    assert counter(side, "unavailable_requests") == 1
    side.request_finished(req)
    assert side.live_state()["requests"] == 0


@pytest.mark.parametrize("media", [True, False], ids=["on_missing-fail", "media-less"])
def test_no_room_in_staging_fails_the_request_instead_of_encoding(media: bool) -> None:
    options = {"on_missing": "fail"} if media else {}
    side, _, _ = make_side(stage_bytes=1024, **options)  # smaller than the item
    _fails(side, request("r1", ("big", 16), media=media), "stage_full")


@pytest.mark.parametrize("media", [True, False], ids=["on_missing-fail", "media-less"])
def test_rows_that_disagree_fail_the_request_instead_of_encoding(media: bool) -> None:
    options = {"on_missing": "fail"} if media else {}
    side, cache, _ = make_side(**options)
    cache.stored["u"] = embedding(16, WIDTH)
    req = request("r1", ("u", 20), media=media)
    generation = side._stager.generation
    assert side.ensure_cache_available(req, 0) is False
    cache.open()
    settle(side, generation)
    _fails(side, req, "rows")


def test_a_wrong_dtype_fails_the_request_under_on_missing_fail() -> None:
    side, cache, _ = make_side(on_missing="fail")
    cache.stored["f"] = embedding(16, WIDTH).float()
    req = request("r1", ("f", 16))
    generation = side._stager.generation
    assert side.ensure_cache_available(req, 0) is False
    cache.open()
    settle(side, generation)
    _fails(side, req, "refused")


def test_an_item_that_can_never_fit_fails_the_request_under_on_missing_fail() -> None:
    # Reserved for 8 rows (the request's size); the stored item has 64: no room for it, ever.
    side, cache, _ = make_side(on_missing="fail", stage_bytes=8 * WIDTH * 2 + 100)
    cache.stored["u"] = embedding(64, WIDTH)
    req = request("r1", ("u", 8))
    generation = side._stager.generation
    assert side.ensure_cache_available(req, 0) is False
    cache.open()
    settle(side, generation)
    assert counter(side, "stage_overflow") == 1
    _fails(side, req, "stage_full")  # looked for again with its real size: never fits


def test_an_internal_error_fails_a_media_less_request_instead_of_encoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side, _, _ = make_side()

    def broken(*args: Any) -> bool:
        raise RuntimeError("injected")

    monkeypatch.setattr(side._gate, "_evaluate_loads", broken)
    with_media = request("r0", ("a", 16))
    assert side.ensure_cache_available(with_media, 0) is True  # it can be encoded here
    assert side.has_cache_item("a") is False
    side.request_finished(with_media)
    _fails(side, request("r1", ("a", 16), media=False), "error")
    assert counter(side, "internal_errors") == 2


def test_an_absent_item_of_a_media_less_request_fails_it_even_under_encode() -> None:
    side, cache, _ = make_side()  # on_missing "encode", consumer_wait_s 0
    req = request("r1", ("gone", 16), media=False)
    looked_up(side, cache, req)
    _fails(side, req, "absent")


def test_a_media_less_item_whose_id_is_never_cached_fails_its_request() -> None:
    side, _, _ = make_side()
    for identifier in ("renderer0-mm-7-image-0", "\x00forged"):  # request-scoped, reserved
        req = request(f"r-{identifier[:3]}", (identifier, 16), media=False)
        assert side.ensure_cache_available(req, 0) is False
        assert side.take_unavailable_requests() == {req.request_id}
        side.request_finished(req)
    assert counter(side, "unavailable_uncacheable") == 2


# -- 6. a wait on a lookup ends -----------------------------------------------------------


@pytest.mark.parametrize("on_missing", ["encode", "fail"])
def test_a_request_waits_on_a_stuck_lookup_at_most_fetch_wait_s(on_missing: str) -> None:
    side, cache, clock = make_side(on_missing=on_missing, fetch_wait_s=5.0, consumer_wait_s=1.0)
    req = request("r1", ("a", 16))
    assert side.ensure_cache_available(req, 0) is False  # the lookup hangs (Redis paused)
    clock.now += 4.9
    assert side.ensure_cache_available(req, 0) is False
    clock.now += 0.2
    if on_missing == "encode":
        assert side.ensure_cache_available(req, 0) is True
        assert side.has_cache_item("a") is False  # encoded locally
        assert side.take_unavailable_requests() == set()
    else:
        assert side.ensure_cache_available(req, 0) is False
        assert side.take_unavailable_requests() == {"r1"}
        assert counter(side, "unavailable_timeout") == 1
    side.request_finished(req)
    cache.open()  # the stuck lookup returns at last: nothing is left behind
    wait_for(lambda: side.live_state()["lookups_in_flight"] == 0, 10, "the lookup")
    assert side.live_state()["items"] == 0


# -- 6. stage_bytes bounds what exists ----------------------------------------------------


def _worker_output(loaded_step: int) -> Any:
    from vllm.v1.outputs import ECConnectorOutput

    from ec_redis.connector.metadata import ECRedisWorkerMetadata

    return ECConnectorOutput(
        finished_sending=None,
        finished_recving=None,
        ec_connector_worker_meta=ECRedisWorkerMetadata(0, loaded_step),
    )


def _staged_file_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("ec_redis-stage-*-*"))


def test_stage_bytes_bounds_files_in_transit_under_async_scheduling(tmp_path: Path) -> None:
    """Async scheduling: step 0's loads are still in transit (its output has not come back)
    while steps 1 and 2 stage more. On ``e6f457e`` a loaded item left the count at once,
    so the files in ``stage_dir`` grew to (steps in flight + 1) x ``stage_bytes``."""
    from ec_redis.connector.transport import FileTransport

    item_bytes = 16 * WIDTH * 2
    transport = FileTransport(str(tmp_path), spare_bytes=0)
    side, cache, _ = make_side(transport=transport, stage_bytes=2 * item_bytes)
    for name in "abcdef":
        cache.stored[name] = embedding(16, WIDTH, seed=ord(name))
    peak, states = 0, []
    for step, names in enumerate(("ab", "cd", "ef")):
        reqs = [request(f"r-{n}", (n, 16)) for n in names]
        for req in reqs:
            generation = side._stager.generation
            if side.ensure_cache_available(req, 0) is False:
                cache.open()
                settle(side, generation)
        for req in reqs:
            if side.ensure_cache_available(req, 0) and side.has_cache_item(
                req.mm_features[0].identifier
            ):
                side.update_state_after_alloc(req, 0)
        side.build_connector_meta(None)
        peak = max(peak, _staged_file_bytes(tmp_path))
        assert peak <= 2 * item_bytes, f"step {step}: {peak} bytes of staged files > stage_bytes"
        states.append(side.live_state())
        for req in reqs:
            side.request_finished(req)
        # no output has come back yet: every load is still in transit
    for state in states:
        used = state["staged_bytes"] + state["reserved_bytes"] + state["transit_bytes"]
        assert used <= 2 * item_bytes, state
    assert counter(side, "stage_full") >= 1  # the bound did turn items away
    side.update_connector_output(_worker_output(loaded_step=2))  # the outputs come back
    assert _staged_file_bytes(tmp_path) == 0
    assert side.live_state()["transit_bytes"] == 0
    side.shutdown()


def test_one_id_at_two_sizes_in_one_request_leaves_nothing_behind() -> None:
    """The request names "u" at 64 and then 16 rows, and staging has room for the smaller
    reservation only: on the first version of this change the first look was refused and the
    second started, the request never recorded the entry it wanted, and
    ``request_finished`` left it staged (until ``idle_ttl_s``)."""
    side, cache, _ = make_side(stage_bytes=2 * 16 * WIDTH * 2)
    cache.stored["u"] = embedding(16, WIDTH)
    req = request("r1", ("u", 64), ("u", 16))
    side.ensure_cache_available(req, 0)
    cache.open(4)  # whatever lookups started return
    wait_for(lambda: side._stager.in_flight == 0, 10, "lookups to return")
    assert side.ensure_cache_available(req, 0) is True  # no room, or rows disagree: encoded
    assert side.has_cache_item("u") is False
    side.request_finished(req)
    state = side.live_state()
    assert (state["items"], state["staged_bytes"], state["requests"]) == (0, 0, 0), state
