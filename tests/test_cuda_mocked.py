"""The CUDA paths against a recording fake of ``torch.cuda`` (tests/fake_cuda.py), on any
machine: which calls are made, in which order, on which device and stream — and that a
failure inside them never escapes ``put``. tests/test_cuda.py runs the same paths on a GPU."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from ec_redis.cache import TieredCache
from ec_redis.config import CacheConfig
from ec_redis.tiers.cpu import HostTier
from ec_redis.tiers.pinned import GRANULE_BYTES, PinnedPool
from ec_redis.tiers.transfer import HostCopy, Transfer
from ec_redis.writer import BackgroundWriter
from tests.conftest import embedding
from tests.counters import count
from tests.fake_cuda import Call, FakeCuda

HOST = torch.device("cpu")
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
ITEM_BYTES = 16 * 128 * 2  # embedding(16, 128): 4 KiB, one 64 KiB granule once pinned


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda(monkeypatch, events_complete=False)


def plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor)


def in_order(calls: list[Call], *expected: Call) -> None:
    """``expected`` appear in ``calls`` in this order (other calls may come between)."""
    position = 0
    for call in expected:
        for index in range(position, len(calls)):
            if calls[index][: len(call)] == call:
                position = index + 1
                break
        else:
            raise AssertionError(f"{call} not found after position {position} in {calls}")


# -- nothing CUDA where no device tensor is involved -------------------------------------------


def test_a_host_reads_cache_serving_host_tensors_makes_no_cuda_call(
    fake: FakeCuda, fake_client: Any
) -> None:
    """What the connector's scheduler half does with its cache (built as connector/shared.py
    builds it), on a machine with a GPU; tests/connector/test_connector_cuda.py checks the
    connector itself."""
    config = CacheConfig(device="auto", gpu_cache_bytes=1 << 20, cpu_cache_bytes=1 << 20)
    with TieredCache(config, device=HOST) as cache:
        cache.put("a", embedding(16, 128, seed=1))
        cache.cpu.put("b", embedding(16, 128, seed=2))
        assert cache.get_many(["a", "b", "c"], on_host=True)["b"] is not None
        cache.describe_many(["a", "c"])
        assert cache.contains("a") and cache.get("b") is not None
        cache.stats()
    with TieredCache(config, redis_client=fake_client, device=HOST) as cache:
        cache.put("r", embedding(16, 128, seed=3))
        assert cache.flush(5)
        cache.gpu.delete("r")
        cache.cpu.delete("r")
        assert cache.get_many(["r"], on_host=True)["r"] is not None
    assert fake.calls == []  # no stream, event, is_pinned, device query or context


def test_building_a_cache_touches_no_stream_event_or_pinned_memory(fake: FakeCuda) -> None:
    with TieredCache(CacheConfig(device="auto")) as cache:
        assert cache.device.type == "cuda"  # "auto" asked whether CUDA exists, nothing more
    assert fake.names() == ["is_available"]


# -- to_host: order, device, stream --------------------------------------------------------


def test_to_host_orders_the_copy_after_the_producer_and_stores_ready_on_the_block(
    fake: FakeCuda,
) -> None:
    transfer = Transfer(HOST, PinnedPool(1 << 20))
    assert fake.calls == []  # streams and slabs are made by the first copy, not here
    source = embedding(16, 128, seed=4)
    host = transfer.to_host(fake.cuda_tensor(source))
    side = next(c[1] for c in fake.calls if c[0] == "Stream")
    ready = host.ready
    assert ready is not None and host.pinned and host.nbytes == GRANULE_BYTES
    in_order(
        fake.calls,
        ("device_enter", 0),
        ("wait_stream", side, "current:0"),  # the encoder's queued writes come first
        ("stream_enter", side),
        ("op", "copy_", side, True),  # on the side stream, asynchronous (pinned)
        ("stream_exit", side),
        ("record_stream", side),  # the caching allocator keeps the source until the copy ends
        ("record", ready.name, side),
        ("wait_event", "current:0", ready.name),  # later producer work waits for the read
        ("device_exit", 0),
    )
    assert ready in host._block.events  # type: ignore[union-attr]  # the block waits for it
    assert "event_synchronize" not in fake.names()  # the host never blocked
    assert not {"is_pinned", "synchronize", "current_device"} & set(fake.names())
    host.wait()
    assert ("event_synchronize", ready.name) in fake.calls
    assert torch.equal(host.tensor, source)


def test_copies_run_on_the_source_tensors_own_device_and_stream(fake: FakeCuda) -> None:
    """A rank on cuda:1 copies on cuda:1's streams, whatever device the cache reads on."""
    transfer = Transfer(CUDA0, PinnedPool(1 << 20))
    host = transfer.to_host(fake.cuda_tensor(embedding(16, 128), index=1))
    assert host.ready is not None and host.ready.recorded_on is not None
    assert host.ready.recorded_on.endswith(":1")
    streams = [c[1] for c in fake.calls if c[0] == "Stream"]
    assert len(streams) == 1 and streams[0].endswith(":1")
    assert ("device_enter", 1) in fake.calls and ("device_enter", 0) not in fake.calls
    assert not any("current:0" in map(str, call) for call in fake.calls)


def test_one_side_stream_per_device_made_on_its_first_copy(fake: FakeCuda) -> None:
    transfer = Transfer(HOST, PinnedPool(1 << 20))
    for index in (0, 0, 1, 1, 0):
        transfer.to_host(fake.cuda_tensor(embedding(4, 128), index=index))
    assert [c[1][-2:] for c in fake.calls if c[0] == "Stream"] == [":0", ":1"]


def test_without_pinned_room_the_copy_is_pageable_blocking_and_counted_exactly(
    fake: FakeCuda,
) -> None:
    transfer = Transfer(HOST, PinnedPool(0))
    host = transfer.to_host(fake.cuda_tensor(embedding(16, 128)))
    assert not host.pinned and host.nbytes == ITEM_BYTES
    assert ("op", "copy_", next(c[1] for c in fake.calls if c[0] == "Stream"), False) in (
        fake.calls
    )
    assert "pin_memory_alloc" not in fake.names()


# -- to_device and the worker's upload -----------------------------------------------------


def test_to_device_waits_for_the_host_bytes_and_orders_the_consumer_after_the_copy(
    fake: FakeCuda,
) -> None:
    transfer = Transfer(CUDA0, PinnedPool(1 << 20))
    source = embedding(16, 128, seed=5)
    host = transfer.to_host(fake.cuda_tensor(source))
    assert host.ready is not None
    side = next(c[1] for c in fake.calls if c[0] == "Stream")
    fake.calls.clear()
    out = transfer.to_device(host)
    done = fake.events[-1]
    in_order(
        fake.calls,
        ("device_enter", 0),
        ("wait_event", side, host.ready.name),  # the D2H copy landed first
        ("stream_enter", side),
        ("empty_cuda", 0, side),
        ("op", "copy_", side, True),
        ("record", done.name, side),
        ("stream_exit", side),
        ("wait_event", "current:0", done.name),  # the consumer's later work comes after
        ("record_stream", "current:0"),
        ("device_exit", 0),
    )
    assert done in host._block.events  # type: ignore[union-attr]  # reuse waits for the read
    assert out.device == CUDA0 and torch.equal(plain(out), source)


def test_upload_goes_through_a_pinned_block_that_is_reused_only_after_the_copy(
    fake: FakeCuda,
) -> None:
    pool = PinnedPool(1 << 20)
    transfer = Transfer(HOST, pool)
    staged = embedding(16, 128, seed=6)
    want = staged.clone()
    out = transfer.upload(staged, CUDA0)
    staged.zero_()  # the caller may drop or reuse its tensor as soon as upload returns
    assert torch.equal(plain(out), want)
    side = next(c[1] for c in fake.calls if c[0] == "Stream")
    assert ("op", "copy_", side, True) in fake.calls  # from pinned memory: asynchronous
    done = fake.events[-1]
    assert not done.done and pool.in_use_bytes == GRANULE_BYTES  # retired, copy running
    other = pool.acquire(ITEM_BYTES)
    assert other is not None and other.offset == GRANULE_BYTES  # not the staging block
    done.done = True
    again = pool.acquire(ITEM_BYTES)
    assert again is not None and again.offset == 0  # reused once the copy has ended


def test_upload_onto_the_host_is_an_owned_clone(fake: FakeCuda) -> None:
    staged = embedding(16, 128)
    out = Transfer(HOST, PinnedPool(1 << 20)).upload(staged, HOST)
    assert torch.equal(out, staged) and out.data_ptr() != staged.data_ptr()
    assert fake.calls == []


def test_host_reads_of_pinned_entries_wait_and_clone_never_handing_out_pool_memory(
    fake: FakeCuda,
) -> None:
    config = CacheConfig(gpu_cache_bytes=0, cpu_cache_bytes=1 << 20, write_queue_bytes=1 << 20)
    with TieredCache(config, device=HOST) as cache:
        source = embedding(16, 128, seed=7)
        assert cache.put("k", fake.cuda_tensor(source))
        host = cache.cpu.get_host_copy("k")
        assert host is not None and host.pinned and host.ready is not None
        for got in (cache.get_many(["k"], on_host=True)["k"], cache.get("k")):
            assert got is not None and torch.equal(got, source)
            assert got.data_ptr() != host.tensor.data_ptr()
        assert ("event_synchronize", host.ready.name) in fake.calls
        assert "is_pinned" not in fake.names()


# -- failures never escape a put -------------------------------------------------------------


def cuda_cache(fake: FakeCuda, redis_client: Any = None, **overrides: Any) -> TieredCache:
    """A cache reading on cuda:0 (its GPU tier holds cuda:0 tensors)."""
    config = dict(gpu_cache_bytes=1 << 20, cpu_cache_bytes=1 << 20, write_queue_bytes=1 << 20)
    config.update(overrides)
    return TieredCache(CacheConfig(**config), device=CUDA0, redis_client=redis_client)


def test_the_gpu_tier_keeps_only_tensors_on_the_reads_device(fake: FakeCuda) -> None:
    """A host-reads cache (the connector's) never holds a device tensor: no GPU memory kept
    behind vLLM's back, and no later read on another thread's stream."""
    config = CacheConfig(gpu_cache_bytes=1 << 20, cpu_cache_bytes=1 << 20)
    with TieredCache(config, device=HOST) as cache:
        assert cache.put("k", fake.cuda_tensor(embedding(16, 128)))
        assert cache.stats()["gpu"]["entries"] == 0 and cache.cpu.contains("k")
    with cuda_cache(fake) as cache:
        assert cache.put("k", fake.cuda_tensor(embedding(16, 128)))
        assert cache.put("other", fake.cuda_tensor(embedding(16, 128), index=1))
        assert cache.gpu.contains("k") and not cache.gpu.contains("other")


def test_a_cuda_oom_in_the_gpu_tiers_clone_costs_only_the_gpu_copy(fake: FakeCuda) -> None:
    fake.failures["clone"] = torch.OutOfMemoryError("CUDA out of memory (injected)")
    with cuda_cache(fake) as cache:
        base = fake.cuda_tensor(embedding(64, 128, seed=8))
        view = base[:16]  # a view: the GPU tier compacts it with a clone, which fails
        assert cache.put("v", view) is True
        stats = cache.stats()
        assert stats["internal_errors"] == 1 and stats["gpu"]["entries"] == 0
        assert stats["cpu"]["entries"] == 1 and stats["cpu"]["bytes"] == GRANULE_BYTES
        got = cache.get_many(["v"], on_host=True)["v"]
        assert got is not None and torch.equal(got, plain(base)[:16])


def test_a_failed_pinned_allocation_falls_back_to_pageable_with_true_budgets(
    fake: FakeCuda,
) -> None:
    fake.pin_error = RuntimeError("CUDA error: out of memory (injected cudaHostAlloc)")
    with cuda_cache(fake, gpu_cache_bytes=0) as cache:
        for i in range(3):
            assert cache.put(f"k{i}", fake.cuda_tensor(embedding(16, 128, seed=i)))
        cpu = cache.stats()["cpu"]
        assert cpu["entries"] == 3 and cpu["bytes"] == 3 * ITEM_BYTES  # pageable: exact
        assert cpu["pinned_bytes"] == 0 and cpu["pinned_in_use_bytes"] == 0
        assert cpu["pinned_pin_failures"] == 1 and fake.names().count("pin_memory_alloc") == 1
        got = cache.get_many(["k1"], on_host=True)["k1"]
        assert got is not None and torch.equal(got, embedding(16, 128, seed=1))


@pytest.mark.parametrize(
    "error", [AssertionError("injected"), RuntimeError("CUDA error: an illegal memory access")]
)
def test_an_error_inside_the_copy_never_escapes_and_quarantines_its_block(
    fake: FakeCuda, fake_client: Any, error: Exception
) -> None:
    fake.failures["record_stream"] = error
    with cuda_cache(fake, fake_client, gpu_cache_bytes=0) as cache:
        assert cache.put("k", fake.cuda_tensor(embedding(16, 128))) is False
        stats = cache.stats()
        assert stats["internal_errors"] == 1 and stats["cpu"]["entries"] == 0
        assert count(stats["writer"], "submitted") == 0
        assert stats["cpu"]["pinned_quarantined_bytes"] == GRANULE_BYTES
        assert stats["cpu"]["pinned_in_use_bytes"] == GRANULE_BYTES  # never handed out again
        del fake.failures["record_stream"]
        assert cache.put("k2", fake.cuda_tensor(embedding(16, 128)))
        assert cache.stats()["cpu"]["pinned_in_use_bytes"] == 2 * GRANULE_BYTES


def test_a_failed_spill_is_counted_and_the_put_that_evicted_still_lands(fake: FakeCuda) -> None:
    with cuda_cache(fake, gpu_cache_bytes=ITEM_BYTES) as cache:
        assert cache.put("old", fake.cuda_tensor(embedding(16, 128, seed=1)))
        fake.failures["record_stream"] = RuntimeError("injected")
        assert cache.put("new", fake.cuda_tensor(embedding(16, 128, seed=2)))  # spills "old"
        stats = cache.stats()
        assert stats["internal_errors"] == 1 and count(stats, "spills") == 0
        assert cache.gpu.contains("new") and not cache.cpu.contains("old")


# -- budgets count what is really held ------------------------------------------------------


def test_the_cpu_tier_counts_pinned_blocks_at_their_rounded_size(fake: FakeCuda) -> None:
    budget = GRANULE_BYTES + GRANULE_BYTES // 2  # 24 tensors' bytes, but 1.5 blocks
    tier = HostTier(budget, Transfer(HOST, PinnedPool(1 << 20)))
    for key in ("a", "b"):
        assert tier.put(key, fake.cuda_tensor(embedding(16, 128)))
    stats = tier.stats()
    assert stats["entries"] == 1 and stats["evictions"] == 1
    assert stats["bytes"] == GRANULE_BYTES  # not the 4 KiB the tensor has


def test_the_write_queue_counts_pinned_blocks_at_their_rounded_size(fake: FakeCuda) -> None:
    transfer = Transfer(HOST, PinnedPool(1 << 20))
    release = threading.Event()
    seen: list[str] = []

    def sink(key: str, host: HostCopy) -> bool:
        seen.append(key)
        return release.wait(10)

    writer = BackgroundWriter(sink, max_items=10, max_bytes=2 * GRANULE_BYTES + 1)
    try:
        for key in ("a", "b", "c", "d"):
            host = transfer.to_host(fake.cuda_tensor(embedding(16, 128)))
            if host.ready is not None:
                host.ready.done = True
            writer.submit(key, host)
        _, queued = writer.depth()
        # "a" may already be in flight; at most two 64 KiB blocks fit the byte bound, though
        # the tensors themselves (4 KiB each) would all fit many times over.
        assert queued <= 2 * GRANULE_BYTES and queued % GRANULE_BYTES == 0
        assert writer.stats()["dropped"] >= 1
    finally:
        release.set()
        writer.close(5)


def test_the_writer_reads_a_host_copy_only_after_its_ready_event(fake: FakeCuda) -> None:
    transfer = Transfer(HOST, PinnedPool(1 << 20))
    host = transfer.to_host(fake.cuda_tensor(embedding(16, 128, seed=9)))
    assert host.ready is not None and not host.ready.done
    observed: list[bool] = []

    def sink(key: str, copy: HostCopy) -> bool:
        assert copy.ready is not None
        observed.append(copy.ready.done)
        return True

    writer = BackgroundWriter(sink, max_items=4, max_bytes=1 << 20)
    writer.submit("k", host)
    assert writer.flush(5)
    writer.close(5)
    assert observed == [True]
    assert ("event_synchronize", host.ready.name) in fake.calls
