"""CUDA paths: pinned pool, event-ordered copies, device tiers. Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from ec_redis import TieredCache
from ec_redis.config import CacheConfig
from ec_redis.tiers.cpu import HostTier
from ec_redis.tiers.pinned import PinnedPool
from ec_redis.tiers.transfer import Transfer
from tests.conftest import embedding

pytestmark = pytest.mark.gpu


def _device_embedding(rows: int = 512, width: int = 256, seed: int = 0) -> torch.Tensor:
    return embedding(rows, width, seed).to("cuda")


def test_to_host_lands_in_pinned_memory_and_matches() -> None:
    transfer = Transfer(torch.device("cuda"), PinnedPool(64 << 20))
    gpu = _device_embedding()
    host = transfer.to_host(gpu)
    host.wait()
    assert host.tensor.is_pinned()
    assert torch.equal(host.tensor, gpu.cpu())


def test_copy_is_ordered_after_the_producing_kernel() -> None:
    transfer = Transfer(torch.device("cuda"), PinnedPool(64 << 20))
    big = torch.randn(4096, 4096, device="cuda")
    out = (big @ big).to(torch.bfloat16)  # queued; the copy must wait for it
    host = transfer.to_host(out)
    host.wait()
    torch.cuda.synchronize()
    assert torch.equal(host.tensor, out.cpu())


def test_to_device_round_trip_on_current_stream() -> None:
    transfer = Transfer(torch.device("cuda"), PinnedPool(64 << 20))
    gpu = _device_embedding(seed=3)
    host = transfer.to_host(gpu)
    back = transfer.to_device(host)
    assert back.device.type == "cuda"
    assert torch.equal(back, gpu)


def test_pool_reuses_released_blocks() -> None:
    pool = PinnedPool(64 << 20)
    transfer = Transfer(torch.device("cuda"), pool)
    gpu = _device_embedding()
    first = transfer.to_host(gpu)
    first.wait()
    allocated = pool.allocated_bytes
    del first  # the finalizer hands the block back
    second = transfer.to_host(gpu)
    second.wait()
    assert pool.allocated_bytes == allocated


def test_pool_falls_back_to_pageable_beyond_capacity() -> None:
    pool = PinnedPool(1 << 20)
    transfer = Transfer(torch.device("cuda"), pool)
    keep = [transfer.to_host(_device_embedding(2048, 512, seed=i)) for i in range(3)]
    for host in keep:
        host.wait()
    assert pool.pageable_fallbacks >= 1
    assert pool.allocated_bytes <= pool.capacity_bytes


def test_host_tier_hit_returns_a_device_tensor() -> None:
    tier = HostTier(64 << 20, Transfer(torch.device("cuda"), PinnedPool(128 << 20)))
    gpu = _device_embedding(seed=5)
    tier.put("k", gpu)
    got = tier.get("k")
    assert got is not None and got.device.type == "cuda"
    assert torch.equal(got, gpu)


def test_gpu_eviction_spills_to_pinned_cpu_tier() -> None:
    item = _device_embedding(seed=1)
    nbytes = item.numel() * item.element_size()
    config = CacheConfig(device="cuda", gpu_cache_bytes=nbytes, cpu_cache_bytes=8 * nbytes)
    with TieredCache(config) as cache:
        cache.put("a", item)
        cache.put("b", _device_embedding(seed=2))  # evicts "a" to the CPU tier
        assert not cache.gpu.contains("a") and cache.cpu.contains("a")
        got = cache.get("a")
        assert got is not None and got.device.type == "cuda" and torch.equal(got, item)
        assert cache.stats()["cpu"]["hits"] == 1


def test_on_host_lookups_never_hand_out_pooled_pinned_memory() -> None:
    item = _device_embedding(seed=7)
    nbytes = item.numel() * item.element_size()
    config = CacheConfig(device="cuda", gpu_cache_bytes=0, cpu_cache_bytes=8 * nbytes)
    with TieredCache(config) as cache:
        cache.put("a", item)  # CPU tier: a pooled pinned copy
        got = cache.get_many(["a"], on_host=True)["a"]
        assert got is not None and got.device.type == "cpu" and not got.is_pinned()
        assert torch.equal(got, item.cpu())
