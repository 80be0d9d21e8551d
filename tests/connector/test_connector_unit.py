"""ECRedisConnector hook by hook, with mocked vLLM configs and a real Redis."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch

from ec_redis.errors import ConfigError
from tests.conftest import embedding, wait_for
from tests.connector.conftest import publish, request, vllm_config, wait_ready
from tests.counters import count

pytestmark = [pytest.mark.vllm, pytest.mark.redis]
Make = Callable[..., Any]


def test_consumer_loads_exactly_what_the_producer_saved(make_connector: Make) -> None:
    tensors = {"img-a": embedding(16, 128, seed=1), "img-b": embedding(32, 128, seed=2)}
    publish(make_connector, tensors)
    scheduler = make_connector("ec_consumer")
    worker = make_connector("ec_consumer", "worker")
    req = request("r1", ("img-a", 16), ("img-b", 32))

    assert wait_ready(scheduler, req)
    assert scheduler.has_cache_item("img-a") and scheduler.has_cache_item("img-b")
    scheduler.update_state_after_alloc(req, 0)
    scheduler.update_state_after_alloc(req, 1)
    meta = scheduler.build_connector_meta(None)
    assert sorted(load.mm_hash for load in meta.loads) == ["img-a", "img-b"]
    assert scheduler.build_connector_meta(None).loads == []  # state reset per step

    worker.bind_connector_metadata(meta)
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    worker.clear_connector_metadata()
    for mm_hash, tensor in tensors.items():
        assert torch.equal(encoder_cache[mm_hash], tensor)
        assert encoder_cache[mm_hash].dtype == torch.bfloat16
    snapshot = scheduler.stats_snapshot()
    assert snapshot["hits_redis"] == 2


def test_metadata_is_small_and_picklable(make_connector: Make) -> None:
    publish(make_connector, {"img": embedding(16, 128)})
    scheduler = make_connector("ec_consumer")
    req = request("r1", ("img", 16))
    assert wait_ready(scheduler, req)
    assert scheduler.has_cache_item("img")
    scheduler.update_state_after_alloc(req, 0)
    meta = scheduler.build_connector_meta(None)
    # vLLM ships step metadata to worker processes with pickle (its own IPC, not ours).
    restored = pickle.loads(pickle.dumps(meta))  # noqa: S301 - our own object, in-process
    assert torch.equal(restored.loads[0].tensor, meta.loads[0].tensor)


def test_has_cache_item_never_blocks_and_is_false_until_staged(
    make_connector: Make, private_redis: Any
) -> None:
    from tests.conftest import paused

    url = private_redis.url
    publish(make_connector, {"img": embedding(16, 128)}, extra={"redis_url": url})
    scheduler = make_connector("ec_consumer", extra={"redis_url": url, "lookup_wait_s": 0})
    req = request("r1", ("img", 16))
    with paused(private_redis):  # the lookup cannot return while Redis is stopped
        started = time.perf_counter()
        assert scheduler.ensure_cache_available(req, 0) is False  # started, not awaited
        assert scheduler.has_cache_item("img") is False
        assert time.perf_counter() - started < 0.5  # bounds "never blocks" (generous)
    assert wait_ready(scheduler, req)
    assert scheduler.has_cache_item("img") is True


def test_locally_computed_items_are_filtered_out(make_connector: Make) -> None:
    scheduler = make_connector("ec_both")
    req = request("r1", ("never-cached", 16))
    assert wait_ready(scheduler, req)  # ec_both does not wait for items to appear
    assert scheduler.has_cache_item("never-cached") is False
    scheduler.update_state_after_alloc(req, 0)  # vLLM reports the local encode too
    assert scheduler.build_connector_meta(None).loads == []


@pytest.mark.parametrize(
    ("stored", "why"),
    [
        (embedding(20, 128), "row count differs from what the request expects"),
        (embedding(16, 96), "width differs (checked against vLLM's measured width)"),
        (embedding(16, 128).float(), "dtype differs from the model's"),
    ],
)
def test_a_mismatching_tensor_is_a_miss_never_handed_to_vllm(
    make_connector: Make, stored: torch.Tensor, why: str
) -> None:
    publish(make_connector, {"img": stored})
    scheduler = make_connector("ec_consumer")
    scheduler._vllm_config.ec_transfer_config.mm_encoder_output_widths["image"] = 128
    req = request("r1", ("img", 16))
    assert wait_ready(scheduler, req), why
    assert scheduler.has_cache_item("img") is False, why
    assert scheduler.stats_snapshot()["rejected_items"] == 1


def test_a_step_waits_for_an_in_flight_lookup_at_most_lookup_wait_s(make_connector: Make) -> None:
    scheduler = make_connector("ec_consumer", extra={"lookup_wait_s": 0.05, "consumer_wait_s": 5})
    req = request("r1", ("absent", 16))
    started = time.perf_counter()
    assert scheduler.ensure_cache_available(req, 0) is False
    assert time.perf_counter() - started < 1.0  # bounded, never the full consumer wait


def test_consumer_waits_for_an_item_still_being_written(make_connector: Make) -> None:
    scheduler = make_connector("ec_consumer", extra={"consumer_wait_s": 5.0})
    req = request("r1", ("late", 16))
    assert scheduler.ensure_cache_available(req, 0) is False
    time.sleep(0.05)
    assert scheduler.ensure_cache_available(req, 0) is False  # absent: still waiting
    publish(make_connector, {"late": embedding(16, 128, seed=9)})
    assert wait_ready(scheduler, req)
    assert scheduler.has_cache_item("late")


def test_consumer_gives_up_after_the_wait_and_encodes_locally(make_connector: Make) -> None:
    scheduler = make_connector("ec_consumer", extra={"consumer_wait_s": 0.2})
    req = request("r1", ("missing", 16))
    started = time.monotonic()
    assert wait_ready(scheduler, req)
    assert time.monotonic() - started >= 0.2
    assert scheduler.has_cache_item("missing") is False
    assert scheduler.take_unavailable_requests() == set()


def test_on_missing_fail_fails_the_request_as_retryable(make_connector: Make) -> None:
    scheduler = make_connector("ec_consumer", extra={"consumer_wait_s": 0.1, "on_missing": "fail"})
    req = request("r1", ("missing", 16))
    failed: set[str] = set()

    def failed_by_now() -> bool:  # step after step, as the scheduler asks, on any host's pace
        assert scheduler.ensure_cache_available(req, 0) is False  # held back, never promised
        failed.update(scheduler.take_unavailable_requests())
        return failed == {"r1"}

    wait_for(failed_by_now, 10, "the request to be failed as unavailable")
    assert scheduler.take_unavailable_requests() == set()
    assert scheduler.stats_snapshot()["unavailable_requests"] == 1


def test_items_already_in_vllms_encoder_cache_do_not_hold_a_chunked_prefill(
    make_connector: Make,
) -> None:
    publish(make_connector, {"img": embedding(16, 128)})
    scheduler = make_connector("ec_consumer")
    req = request("r1", ("img", 16))
    assert wait_ready(scheduler, req)
    assert scheduler.has_cache_item("img")
    scheduler.update_state_after_alloc(req, 0)
    scheduler.build_connector_meta(None)
    # Next chunk of the same prefill: the request runs, the item is mid-consumption and
    # sits in vLLM's encoder cache, so nothing holds the request.
    from vllm.v1.request import RequestStatus

    req.status = RequestStatus.RUNNING
    assert scheduler.ensure_cache_available(req, 10) is True
    assert scheduler.live_state()["items"] == 0  # the load took it; nothing is re-staged


def test_a_waiting_request_past_an_items_start_still_needs_it(make_connector: Make) -> None:
    # A prefix-cache hit can put a *waiting* request's computed tokens inside an image that
    # vLLM's encoder cache does not hold: the item is still needed (and staged).
    publish(make_connector, {"img": embedding(16, 128)})
    scheduler = make_connector("ec_consumer", extra={"lookup_wait_s": 0})
    req = request("r1", ("img", 16))
    assert scheduler.ensure_cache_available(req, 10) is False
    assert wait_ready(scheduler, req) and scheduler.has_cache_item("img")


def test_request_finished_releases_staging_and_returns_no_params(make_connector: Make) -> None:
    publish(make_connector, {"img": embedding(16, 128)})
    scheduler = make_connector("ec_consumer")
    req = request("r1", ("img", 16))
    assert wait_ready(scheduler, req)
    assert scheduler.stats_snapshot()["staged_bytes"] > 0
    assert scheduler.request_finished(req) == (False, None)
    assert scheduler.stats_snapshot()["staged_bytes"] == 0


def test_a_producer_skips_items_already_published(make_connector: Make) -> None:
    publish(make_connector, {"img": embedding(16, 128)})
    scheduler = make_connector("ec_producer", extra={"producer_check_wait_s": 5})
    req = request("r1", ("img", 16))
    assert wait_ready(scheduler, req)  # held only while the head check runs
    assert scheduler.has_cache_item("img") is True  # published: the encoder skips it
    scheduler.update_state_after_alloc(req, 0)
    assert scheduler.build_connector_meta(None).loads == []  # a producer loads nothing
    assert scheduler.stats_snapshot()["skipped_encodes"] == 1
    assert count(scheduler.stats_snapshot(), "hits_redis") == 0  # heads only: no tensor read
    scheduler.request_finished(req)
    assert scheduler.live_state()["items"] == 0 and scheduler.live_state()["requests"] == 0


def test_a_producer_encodes_what_is_not_published(make_connector: Make) -> None:
    scheduler = make_connector("ec_producer", extra={"producer_check_wait_s": 5})
    req = request("r1", ("new-img", 16))
    assert wait_ready(scheduler, req)
    assert scheduler.has_cache_item("new-img") is False


def test_a_producer_encodes_a_published_item_of_other_rows(make_connector: Make) -> None:
    publish(make_connector, {"img": embedding(20, 128)})  # a reused uuid, other content
    scheduler = make_connector("ec_producer", extra={"producer_check_wait_s": 5})
    req = request("r1", ("img", 16))
    assert wait_ready(scheduler, req)
    assert scheduler.has_cache_item("img") is False


def test_a_producer_with_no_check_time_never_holds_a_request(make_connector: Make) -> None:
    scheduler = make_connector("ec_producer", extra={"producer_check_wait_s": 0})
    req = request("r1", ("img", 16))
    assert scheduler.ensure_cache_available(req, 0) is True
    assert scheduler.has_cache_item("img") is False


def test_a_producer_holds_at_most_producer_check_wait_s_on_a_stalled_redis(
    make_connector: Make, private_redis: Any
) -> None:
    from tests.conftest import paused

    scheduler = make_connector(
        "ec_producer",
        extra={"redis_url": private_redis.url, "producer_check_wait_s": 0.05},
    )
    req = request("r1", ("img", 16))
    with paused(private_redis):  # the head check never returns while paused
        started = time.monotonic()
        assert wait_ready(scheduler, req, timeout_s=5.0)
        held_s = time.monotonic() - started
        assert scheduler.has_cache_item("img") is False  # encode rather than wait
    assert held_s < 1.0  # bounds the hold (0.05 s configured), not speed


def test_save_caches_only_on_producers(make_connector: Make, redis_url: str) -> None:
    consumer = make_connector("ec_consumer", "worker")
    consumer.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    consumer._cache.flush(5)
    assert redis.Redis.from_url(redis_url).dbsize() == 0
    both = make_connector("ec_both", "worker")
    both.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    assert both._cache.flush(5)
    assert redis.Redis.from_url(redis_url).dbsize() == 1


@pytest.mark.parametrize("ranks", [(1, 0, 0), (0, 1, 0), (0, 0, 1)], ids=["tp", "pp", "pcp"])
def test_save_caches_only_from_the_first_rank_of_every_parallel_group(
    make_connector: Make, redis_url: str, monkeypatch: pytest.MonkeyPatch, ranks: tuple[int, ...]
) -> None:
    import ec_redis.connector.connector as module

    monkeypatch.setattr(module, "_parallel_ranks", lambda: ranks)
    rank1 = make_connector("ec_producer", "worker")
    rank1.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    rank1.start_save_caches(encoder_cache={"img2": embedding(16, 128)})
    rank1._cache.flush(5)
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_save_caches_returns_fast_and_survives_vllm_freeing_the_entry(
    make_connector: Make,
) -> None:
    worker = make_connector("ec_producer", "worker")
    tensor = embedding(256, 128, seed=4)
    encoder_cache = {"img": tensor.clone()}
    started = time.perf_counter()
    worker.save_caches(encoder_cache=encoder_cache, mm_hash="img")
    elapsed = time.perf_counter() - started
    del encoder_cache["img"]  # vLLM frees the entry right after the step
    assert worker._cache.flush(10)
    # Generous (one sample on a possibly loaded host): that the hook never waits on Redis
    # is shown where waiting would cost seconds (test_save_caches_never_waits_on_redis).
    assert elapsed < 1.0
    consumer = make_connector("ec_consumer")
    req = request("r1", ("img", 256))
    assert wait_ready(consumer, req) and consumer.has_cache_item("img")
    consumer.update_state_after_alloc(req, 0)
    assert torch.equal(consumer.build_connector_meta(None).loads[0].tensor, tensor)


@pytest.mark.parametrize("role", ["ec_producer", "ec_both"])
def test_save_caches_never_waits_on_redis(
    make_connector: Make, private_redis: Any, role: str
) -> None:
    """A 16 MiB save returns while Redis is stopped (SIGSTOP), where a write on the calling
    thread would wait out the 10 s socket timeout; the write lands once Redis is back. The
    README's "save_caches returns in µs" rests on this."""
    from tests.conftest import bit_exact, paused

    socket_timeout_s = 10.0  # what a write inside the hook would cost here
    extra = {"redis_url": private_redis.url, "redis_socket_timeout_s": socket_timeout_s}
    worker = make_connector(role, "worker", extra=extra, hidden=2048)
    writer = worker._cache.writer
    tensor = embedding(4096, 2048, seed=7)  # 16 MiB of bf16
    assert tensor.numel() * tensor.element_size() == 16 * 2**20
    probe = redis.Redis.from_url(private_redis.url, socket_timeout=0.2)
    with paused(private_redis):
        with pytest.raises(redis.TimeoutError):
            probe.ping()  # the fault is real: Redis answers nothing
        started = time.perf_counter()
        worker.save_caches(encoder_cache={"big": tensor}, mm_hash="big")
        elapsed = time.perf_counter() - started
        assert elapsed < 1.0, elapsed  # generous: a blocking save would take >= 10 s
        time.sleep(0.3)
        assert writer.pending("big") is not None  # its write is stuck on the stopped server
    assert worker.stats_snapshot()["saved_items"] == 1
    assert writer.flush(socket_timeout_s + 5)
    assert writer.counters.snapshot()["written"] == 1  # landed after SIGCONT: nothing lost
    worker.shutdown()  # its cache goes with it: the consumer below reads Redis
    consumer = make_connector("ec_consumer", extra=extra, hidden=2048)
    req = request("r1", ("big", 4096))
    assert wait_ready(consumer, req) and consumer.has_cache_item("big")
    consumer.update_state_after_alloc(req, 0)
    assert bit_exact(consumer.build_connector_meta(None).loads[0].tensor, tensor)
    assert consumer.stats_snapshot()["hits_redis"] == 1


def test_start_save_caches_publishes_items_from_earlier_steps_once(
    make_connector: Make, redis_url: str
) -> None:
    worker = make_connector("ec_producer", "worker")
    encoder_cache = {"old": embedding(16, 128, seed=1)}
    worker.start_save_caches(encoder_cache=encoder_cache)
    worker.start_save_caches(encoder_cache=encoder_cache)
    assert worker._cache.flush(5)
    assert worker.stats_snapshot()["saved_items"] == 1
    assert redis.Redis.from_url(redis_url).dbsize() == 1


def test_load_replaces_a_stale_tensor_and_never_aliases_cache_memory(
    make_connector: Make,
) -> None:
    publish(make_connector, {"a": embedding(16, 128, seed=1), "b": embedding(16, 128, seed=2)})
    scheduler = make_connector("ec_consumer")
    worker = make_connector("ec_consumer", "worker")
    req = request("r1", ("a", 16), ("b", 16))
    assert wait_ready(scheduler, req)
    for index in (0, 1):
        assert scheduler.has_cache_item(req.mm_features[index].identifier)
        scheduler.update_state_after_alloc(req, index)
    meta = scheduler.build_connector_meta(None)
    # vLLM evicted "a" this pass and kept the worker's (stale) copy: the load replaces it
    stale = torch.zeros(16, 128, dtype=torch.bfloat16)
    encoder_cache = {"a": stale}
    worker.bind_connector_metadata(meta)
    worker.start_load_caches(encoder_cache)
    for item in ("a", "b"):
        loaded = next(load.tensor for load in meta.loads if load.mm_hash == item)
        assert loaded is not None and torch.equal(encoder_cache[item], loaded)
        assert encoder_cache[item].data_ptr() != loaded.data_ptr()
    assert encoder_cache["a"] is not stale


def test_models_sharing_one_redis_never_read_each_others_entries(make_connector: Make) -> None:
    publish(make_connector, {"same-uuid": embedding(16, 128, seed=1)}, model="model-a")
    other = make_connector("ec_consumer", model="model-b", extra={"consumer_wait_s": 0.1})
    req = request("r1", ("same-uuid", 16))
    assert wait_ready(other, req)
    assert other.has_cache_item("same-uuid") is False
    same = make_connector("ec_consumer", model="model-a")
    assert wait_ready(same, req) and same.has_cache_item("same-uuid")


def test_tenant_salts_isolate_entries(make_connector: Make) -> None:
    publish(make_connector, {"img": embedding(16, 128)}, extra={"tenant_salt": "tenant-a"})
    other = make_connector("ec_consumer", extra={"tenant_salt": "tenant-b", "consumer_wait_s": 0.1})
    req = request("r1", ("img", 16))
    assert wait_ready(other, req) and not other.has_cache_item("img")


def test_a_bad_extra_config_fails_at_start_naming_the_key() -> None:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_redis.connector import ECRedisConnector

    with pytest.raises(ConfigError, match=r"cpu_cache_bytes.*example"):
        ECRedisConnector(
            vllm_config("ec_consumer", {"cpu_cache_bytes": "lots"}), ECConnectorRole.SCHEDULER
        )
    with pytest.raises(ConfigError, match="valid keys"):
        ECRedisConnector(vllm_config("ec_consumer", {"redis": "x"}), ECConnectorRole.WORKER)


def test_worker_meta_reports_pending_writes_and_keeps_a_producer_stepping(
    make_connector: Make,
) -> None:
    from vllm.v1.outputs import ECConnectorOutput

    from ec_redis.connector.metadata import ECRedisWorkerMetadata

    scheduler = make_connector("ec_producer")
    assert scheduler.has_pending_push_work() is False
    output = ECConnectorOutput(ec_connector_worker_meta=ECRedisWorkerMetadata(2))
    scheduler.update_connector_output(output)
    assert scheduler.has_pending_push_work() is True
    scheduler.update_connector_output(
        ECConnectorOutput(ec_connector_worker_meta=ECRedisWorkerMetadata(0))
    )
    assert scheduler.has_pending_push_work() is False
    both = ECRedisWorkerMetadata(1).aggregate(ECRedisWorkerMetadata(3))
    assert isinstance(both, ECRedisWorkerMetadata) and both.pending_writes == 4


def test_shutdown_is_idempotent_and_stops_threads(make_connector: Make) -> None:
    import threading

    before = {t.ident for t in threading.enumerate()}
    scheduler = make_connector("ec_both")
    worker = make_connector("ec_both", "worker")
    worker.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    assert wait_ready(scheduler, request("r1", ("img", 16)))
    for connector in (worker, scheduler, worker, scheduler):
        connector.shutdown()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        leaked = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not leaked:
            break
        time.sleep(0.02)
    assert not leaked, leaked


@pytest.mark.parametrize("push", [True, False], ids=["push", "poll-only"])
def test_a_waiting_consumer_hears_the_moment_the_producer_stores_the_item(
    make_connector: Make, push: bool
) -> None:
    """With recheck_s at 30 s, only the producer's announcement can make the item visible
    within the 5 s this test allows; without push it must not be (the control)."""
    scheduler = make_connector(
        "ec_consumer",
        extra={"consumer_wait_s": 60, "recheck_s": 30, "push_notifications": push},
    )
    req = request("r1", ("late", 16))
    assert scheduler.ensure_cache_available(req, 0) is False
    assert wait_for_absent(scheduler, "late")
    wait_subscribed(scheduler, push)
    producer = make_connector("ec_producer", "worker", extra={"producer_id": "encoder"})
    producer.save_caches(encoder_cache={"late": embedding(16, 128, seed=9)}, mm_hash="late")
    visible = wait_ready(scheduler, req, timeout_s=5.0)
    assert visible is push
    if push:
        assert scheduler.has_cache_item("late")


def wait_for_absent(scheduler: Any, item: str) -> bool:
    from ec_redis.connector.staging import ABSENT

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        entry = scheduler._scheduler._stager.get(item)
        if entry is not None and entry.state == ABSENT:
            return True
        time.sleep(0.005)
    return False


def wait_subscribed(scheduler: Any, push: bool) -> None:
    subscription = scheduler._scheduler._subscription
    assert (subscription is not None) is push
    if subscription is not None:
        assert subscription.connected.wait(5)


def test_a_save_the_cache_refuses_is_counted_once_and_not_retried_every_step(
    make_connector: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_connector("ec_producer", "worker")
    calls: list[str] = []

    def refuse(item: str, tensor: object) -> bool:
        calls.append(item)
        return False

    monkeypatch.setattr(worker._cache, "put", refuse)
    encoder_cache = {"img": embedding(16, 128)}
    worker.save_caches(encoder_cache=encoder_cache, mm_hash="img")
    for _ in range(3):  # later steps: vLLM still holds the entry
        worker.start_save_caches(encoder_cache=encoder_cache)
    assert calls == ["img"]
    assert worker.stats_snapshot()["save_errors"] == 1
    assert count(worker.stats_snapshot(), "saved_items") == 0
