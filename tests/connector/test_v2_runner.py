"""The connector under vLLM's Model Runner V2 contract, driven by vLLM's own
``ActiveECConnector`` (``vllm/v1/worker/gpu/ec_connector.py``, ``maybe_get_output`` and
``no_forward``), which imports on CPU.

What V2 does differently from V1 (``ECConnectorModelRunnerMixin``), and what we check:
- ``save_caches`` runs only on producers, after the step body, once for each encoder-cache
  key that is new since the loads (V1 calls it per encoded item, on every instance): loaded
  items are never saved back; freshly encoded ones are saved exactly once.
- the worker's ``get_ec_connector_stats`` is read every step (V1 never reads it): ours
  reports nothing there, the scheduler half reports the worker's counters (stats channel),
  so each is counted once under both runners.
- ``no_forward`` runs the connector context on empty steps too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import pytest
import redis
import torch

from ec_redis.connector.metadata import ECRedisMetadata, ECRedisWorkerMetadata
from tests.conftest import bit_exact, embedding, wait_for
from tests.connector.conftest import publish, request, wait_ready
from tests.counters import count

pytestmark = [pytest.mark.vllm, pytest.mark.redis]
Make = Callable[..., Any]


class StepOutput:
    """The two fields of vLLM's SchedulerOutput the EC context reads."""

    def __init__(self, meta: ECRedisMetadata) -> None:
        self.ec_connector_metadata = meta
        self.finished_req_ids: set[str] = set()


@contextmanager
def v2_runner(worker: Any, encoder_cache: dict[str, torch.Tensor]) -> Iterator[Any]:
    """vLLM's V2 EC context over our worker half (vLLM finds it as the process singleton)."""
    from vllm.v1.worker.gpu import ec_connector as v2

    with patch.object(v2, "get_ec_transfer", return_value=worker):
        yield v2.ActiveECConnector(None, encoder_cache)  # type: ignore[arg-type]


def reported(scheduler: Any, counter: str, want: int) -> int:
    """Sum what the scheduler half reports for ``counter`` until it reaches ``want``."""
    total = [0]

    def enough() -> bool:
        stats = scheduler.get_ec_connector_stats()
        total[0] += count(stats.data, counter) if stats is not None else 0
        return total[0] >= want

    wait_for(enough, 10, f"{counter} to reach {want}")
    return total[0]


def test_a_v2_producer_saves_each_new_encoder_output_once_and_reports_it_once(
    make_connector: Make, redis_url: str
) -> None:
    scheduler = make_connector("ec_producer")
    worker = make_connector("ec_producer", "worker")
    encoder_cache: dict[str, torch.Tensor] = {}
    with v2_runner(worker, encoder_cache) as runner:
        for step, item in enumerate(("a", "b")):
            with runner.maybe_get_output(StepOutput(ECRedisMetadata(step=step))) as output:
                encoder_cache[item] = embedding(16, 128, seed=step)  # the encoder ran
            assert output.ec_connector_stats is None  # reported by the scheduler half
            assert isinstance(output.ec_connector_worker_meta, ECRedisWorkerMetadata)
        # An empty step (no_forward) still runs the context; nothing new to save.
        empty = runner.no_forward(StepOutput(ECRedisMetadata(step=2)))
        assert empty.ec_connector_output is not None
    assert worker._cache.flush(10)
    assert redis.Redis.from_url(redis_url).dbsize() == 2
    assert worker.stats_snapshot()["saved_items"] == 2
    assert reported(scheduler, "saved_items", 2) == 2


def test_a_v2_consumer_loads_what_the_scheduler_promised_and_never_saves(
    make_connector: Make, redis_url: str
) -> None:
    tensors = {"img": embedding(16, 128, seed=7)}
    publish(make_connector, tensors)
    scheduler = make_connector("ec_consumer")
    worker = make_connector("ec_consumer", "worker")
    req = request("r1", ("img", 16))
    assert wait_ready(scheduler, req) and scheduler.has_cache_item("img")
    scheduler.update_state_after_alloc(req, 0)
    meta = scheduler.build_connector_meta(None)
    encoder_cache: dict[str, torch.Tensor] = {}
    with (
        v2_runner(worker, encoder_cache) as runner,
        runner.maybe_get_output(StepOutput(meta)) as output,
    ):
        assert bit_exact(encoder_cache["img"], tensors["img"])  # before the model runs
    scheduler.update_connector_output(output)
    assert count(worker.stats_snapshot(), "saved_items") == 0
    assert reported(scheduler, "loaded_items", 1) == 1
    assert redis.Redis.from_url(redis_url).dbsize() == 1


def test_a_v2_ec_both_saves_what_it_encoded_but_not_what_it_loaded(
    make_connector: Make, redis_url: str
) -> None:
    publish(make_connector, {"old": embedding(16, 128, seed=1)})
    scheduler = make_connector("ec_both")
    worker = make_connector("ec_both", "worker")
    req = request("r1", ("old", 16), ("new", 16))
    assert wait_ready(scheduler, req)
    assert scheduler.has_cache_item("old") and not scheduler.has_cache_item("new")
    scheduler.update_state_after_alloc(req, 0)
    scheduler.update_state_after_alloc(req, 1)
    meta = scheduler.build_connector_meta(None)
    encoder_cache: dict[str, torch.Tensor] = {}
    with (
        v2_runner(worker, encoder_cache) as runner,
        runner.maybe_get_output(StepOutput(meta)),
    ):
        assert "old" in encoder_cache  # loaded on entry
        encoder_cache["new"] = embedding(16, 128, seed=2)  # encoded in the body
    assert worker._cache.flush(10)
    snapshot = worker.stats_snapshot()
    assert snapshot["loaded_items"] == 1 and snapshot["saved_items"] == 1
    assert redis.Redis.from_url(redis_url).dbsize() == 2
    worker.shutdown()  # V2 shuts workers down through ensure_ec_transfer_shutdown
    worker.shutdown()  # ... and a second call is harmless
