"""The connector's CUDA contract against a recording fake of ``torch.cuda`` (real vLLM, real
Redis): the scheduler half never touches CUDA, a worker copies on its rank's device, and no
failure inside a save escapes ``save_caches``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ec_redis.connector.connector as connector_module
from ec_redis.connector.metadata import ECRedisMetadata, LoadItem
from tests.conftest import embedding
from tests.connector.conftest import request, wait_ready
from tests.counters import count
from tests.fake_cuda import FakeCuda

pytestmark = [pytest.mark.vllm, pytest.mark.redis]
Make = Callable[..., Any]


def test_a_scheduler_half_makes_no_cuda_call_on_a_gpu_machine(
    make_connector: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = make_connector("ec_producer", "worker")
    producer.save_caches(encoder_cache={"img": embedding(16, 128)}, mm_hash="img")
    assert producer._cache.flush(10)
    producer.shutdown()  # the consumer's cache starts empty: its lookup goes to Redis
    req = request("r1", ("img", 16))  # imports vLLM's request module (which probes CUDA)
    fake = FakeCuda(monkeypatch)  # from here on, a GPU "exists" and every call is recorded
    scheduler = make_connector("ec_consumer", extra={"device": "auto"})
    assert wait_ready(scheduler, req) and scheduler.has_cache_item("img")
    scheduler.update_state_after_alloc(req, 0)
    meta = scheduler.build_connector_meta(None)
    assert [load.mm_hash for load in meta.loads] == ["img"]
    assert scheduler.get_ec_connector_stats() is not None
    scheduler.shutdown()
    assert fake.calls == []  # no stream, event, is_pinned, device query or context


def test_a_worker_loads_onto_its_ranks_device_through_pinned_memory(
    make_connector: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(connector_module, "_rank_device", lambda: torch.device("cuda", 1))
    worker = make_connector("ec_consumer", "worker", extra={"device": "cuda:0"})
    staged = embedding(16, 128, seed=3)
    want = staged.clone()
    load = LoadItem("img", 16, "bfloat16", tuple(staged.shape), staged)
    worker.bind_connector_metadata(ECRedisMetadata(loads=[load]))
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    worker.clear_connector_metadata()
    staged.zero_()  # vLLM may drop the metadata (and its tensor) as soon as the hook returns
    loaded = encoder_cache["img"]
    assert loaded.device == torch.device("cuda", 1)
    assert torch.equal(loaded.as_subclass(torch.Tensor), want)
    streams = [call[1] for call in fake.calls if call[0] == "Stream"]
    assert len(streams) == 1 and streams[0].endswith(":1")  # the rank's device, not cuda:0
    assert ("op", "copy_", streams[0], True) in fake.calls  # from a pinned block: async
    assert ("wait_event", "current:1", fake.events[-1].name) in fake.calls
    assert not {"is_pinned", "synchronize"} & set(fake.names())


@pytest.mark.parametrize("failure", ["record_stream", "pin", "put", None])
def test_no_failure_inside_a_save_escapes_save_caches(
    make_connector: Make, monkeypatch: pytest.MonkeyPatch, failure: str | None
) -> None:
    fake = FakeCuda(monkeypatch)
    worker = make_connector("ec_producer", "worker", extra={"gpu_cache_bytes": "1MiB"})
    cache = worker._cache
    if failure == "pin":
        fake.pin_error = RuntimeError("CUDA error: out of memory (injected cudaHostAlloc)")
    elif failure == "record_stream":
        fake.failures["record_stream"] = AssertionError("injected, like the old assert")
    elif failure == "put":

        def broken_put(key: str, tensor: torch.Tensor) -> bool:
            raise AssertionError("injected")

        monkeypatch.setattr(cache, "put", broken_put)
    encoder_cache = {"img": fake.cuda_tensor(embedding(16, 128, seed=1))}
    worker.save_caches(encoder_cache=encoder_cache, mm_hash="img")
    worker.start_save_caches(encoder_cache=encoder_cache)
    snapshot = worker.stats_snapshot()
    stats = cache.stats()
    if failure in ("record_stream", "put"):  # nothing was stored: counted, tried only once
        assert snapshot["save_errors"] == 1 and "saved_items" not in snapshot
    else:  # no failure, or only the pinned block was lost (pageable instead)
        assert count(snapshot, "save_errors") == 0 and snapshot["saved_items"] == 1
        assert cache.flush(10) and stats["writer"]["submitted"] == 1
        assert stats["cpu"]["entries"] == 1
    internal = 1 if failure == "record_stream" else 0
    assert count(stats, "internal_errors") == internal  # counted (and logged) by the cache
    assert stats["gpu"]["entries"] == 0  # vLLM's encoder outputs are never held on the GPU
    assert stats["cpu"]["pinned_in_use_bytes"] <= stats["cpu"]["pinned_bytes"]
