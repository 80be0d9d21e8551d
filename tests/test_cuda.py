"""CUDA paths on a real GPU: pinned pool, event-ordered copies, device tiers. Skipped cleanly
without one (tests/test_cuda_mocked.py checks the same contracts on any machine).

No test synchronises the device before comparing: each compares host bytes read after the
copy's own event only, so a missing wait shows up as wrong bytes. Producers are delayed with
``torch.cuda._sleep`` so that a copy which did not wait for them would read too early.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_redis import TieredCache
from ec_redis.config import CacheConfig
from ec_redis.tiers.cpu import HostTier
from ec_redis.tiers.pinned import PinnedPool
from ec_redis.tiers.transfer import Transfer
from tests.conftest import embedding

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.device("cuda", 0)
HOST = torch.device("cpu")
SLEEP_CYCLES = 100_000_000  # ~50 ms at 2 GHz: long enough for an unordered copy to run first


def expected(rows: int = 512, width: int = 256, seed: int = 0) -> torch.Tensor:
    return embedding(rows, width, seed)


def late(want: torch.Tensor, device: torch.device = CUDA) -> torch.Tensor:
    """A device tensor whose bytes are written ~50 ms after this returns (queued work)."""
    out = torch.zeros(want.shape, dtype=want.dtype, device=device)
    source = want.to(device)
    torch.cuda._sleep(SLEEP_CYCLES)
    out.copy_(source)
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- device -> host ----------------------------------------------------------------------------


def test_to_host_lands_in_pinned_memory_after_the_producer_without_a_device_sync() -> None:
    transfer = Transfer(HOST, PinnedPool(64 << 20))
    want = expected()
    host = transfer.to_host(late(want))
    assert host.pinned and host.tensor.is_pinned()  # really page-locked (a test may ask)
    host.wait()  # the copy's event only
    assert torch.equal(host.tensor, want)


def test_a_producer_on_a_non_default_stream_is_waited_for() -> None:
    transfer = Transfer(HOST, PinnedPool(64 << 20))
    want = expected(seed=1)
    producer = torch.cuda.Stream()
    with torch.cuda.stream(producer):
        host = transfer.to_host(late(want))
    host.wait()
    assert torch.equal(host.tensor, want)


def test_the_source_may_be_freed_and_its_memory_reused_right_after_to_host() -> None:
    transfer = Transfer(HOST, PinnedPool(64 << 20))
    want = expected(seed=2)
    source = want.to(CUDA)
    with torch.cuda.stream(transfer.side_stream(CUDA)):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy starts ~50 ms from now
    host = transfer.to_host(source)
    del source  # vLLM drops the entry; the allocator must not hand its memory out yet
    clobber = [torch.full(want.shape, 7.0, dtype=want.dtype, device=CUDA) for _ in range(8)]
    host.wait()
    assert torch.equal(host.tensor, want)
    del clobber


def test_a_pool_block_is_not_reused_while_its_device_to_host_copy_runs() -> None:
    first, second = expected(2048, seed=3), expected(2048, seed=4)  # 1 MiB each
    pool = PinnedPool(1 << 20, slab_bytes=1 << 20)  # room for exactly one block
    transfer = Transfer(HOST, pool)
    assert pool.max_block_bytes == nbytes(first)
    copy = transfer.to_host(late(first))
    del copy  # its block goes back while the copy into it is still queued
    again = transfer.to_host(second.to(CUDA))
    again.wait()
    assert again.pinned  # it got the same block, and only after the first copy ended
    assert torch.equal(again.tensor, second)
    assert pool.stats()["pinned_event_waits"] >= 1


def test_a_pool_block_is_not_reused_while_a_host_to_device_copy_reads_it() -> None:
    first, second = expected(2048, seed=5), expected(2048, seed=6)  # 1 MiB each
    pool = PinnedPool(1 << 20, slab_bytes=1 << 20)  # room for exactly one block
    transfer = Transfer(CUDA, pool)
    host = transfer.to_host(first.to(CUDA))
    with torch.cuda.stream(transfer.side_stream(CUDA)):
        torch.cuda._sleep(SLEEP_CYCLES)  # the H2D copy below starts ~50 ms from now
    back = transfer.to_device(host)
    del host  # the block goes back while the H2D copy still has to read it
    other = transfer.to_host(second.to(CUDA))  # wants that block: must wait for the read
    assert torch.equal(back.cpu(), first)
    other.wait()
    assert torch.equal(other.tensor, second)


# -- host -> device ----------------------------------------------------------------------------


def test_to_device_round_trip_is_ordered_on_the_current_stream() -> None:
    transfer = Transfer(CUDA, PinnedPool(64 << 20))
    want = expected(seed=7)
    back = transfer.to_device(transfer.to_host(late(want)))
    assert back.device.type == "cuda"
    assert torch.equal(back.cpu(), want)  # .cpu() runs on the current stream, after the copy


def test_upload_lets_the_caller_change_the_staged_tensor_at_once() -> None:
    """The worker's load path: vLLM may drop the step metadata right after the hook."""
    transfer = Transfer(HOST, PinnedPool(64 << 20))
    staged = expected(seed=8)
    want = staged.clone()
    out = transfer.upload(staged, CUDA)
    staged.fill_(3.0)
    assert torch.equal(out.cpu(), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
def test_a_second_device_copies_on_its_own_streams() -> None:
    device = torch.device("cuda", 1)
    transfer = Transfer(CUDA, PinnedPool(64 << 20))
    want = expected(seed=9)
    before = torch.cuda.current_device()
    host = transfer.to_host(late(want, device))
    host.wait()
    assert torch.equal(host.tensor, want)
    assert transfer.side_stream(device).device == device
    assert torch.equal(transfer.to_device(host, device).cpu(), want)
    assert torch.cuda.current_device() == before


# -- the tiers and the cache -------------------------------------------------------------------


def test_host_tier_hit_returns_a_device_tensor() -> None:
    tier = HostTier(64 << 20, Transfer(CUDA, PinnedPool(128 << 20)))
    want = expected(seed=10)
    tier.put("k", late(want))
    got = tier.get("k")
    assert got is not None and got.device.type == "cuda"
    assert torch.equal(got.cpu(), want)


def test_gpu_eviction_spills_to_the_pinned_cpu_tier() -> None:
    item = expected(seed=11).to(CUDA)
    config = CacheConfig(device="cuda", gpu_cache_bytes=nbytes(item), cpu_cache_bytes=1 << 20)
    with TieredCache(config) as cache:
        cache.put("a", item)
        cache.put("b", expected(seed=12).to(CUDA))  # evicts "a" to the CPU tier
        assert not cache.gpu.contains("a") and cache.cpu.contains("a")
        got = cache.get("a")
        assert got is not None and got.device.type == "cuda" and torch.equal(got, item)
        assert cache.stats()["cpu"]["hits"] == 1


def test_on_host_lookups_never_hand_out_pool_memory() -> None:
    want = expected(seed=13)
    config = CacheConfig(device="cuda", gpu_cache_bytes=0, cpu_cache_bytes=1 << 20)
    with TieredCache(config) as cache:
        cache.put("a", late(want))  # CPU tier: a pinned pool copy
        got = cache.get_many(["a"], on_host=True)["a"]
        assert got is not None and got.device.type == "cpu" and not got.is_pinned()
        assert torch.equal(got, want)


def test_a_redis_entry_written_from_a_device_tensor_holds_the_producers_bytes(
    fake_client: Any,
) -> None:
    """The writer checksums what it reads: it must read after the copy, or the entry is
    consistent and wrong."""
    want = expected(seed=14)
    config = CacheConfig(device="cpu", gpu_cache_bytes=0, cpu_cache_bytes=0)
    with TieredCache(config, redis_client=fake_client) as cache:
        assert cache.put("k", late(want))
        assert cache.flush(10)
    with TieredCache(config, redis_client=fake_client) as reader:
        got = reader.get("k")
        assert got is not None and torch.equal(got, want)


def test_budgets_count_pinned_blocks_at_their_real_size() -> None:
    config = CacheConfig(device="cuda", gpu_cache_bytes=0, cpu_cache_bytes=1 << 20)
    with TieredCache(config) as cache:
        cache.put("small", torch.ones(10, device=CUDA))  # 40 bytes in a 64 KiB block
        stats = cache.stats()["cpu"]
        assert stats["bytes"] == 64 << 10
        assert stats["pinned_bytes"] <= cache.transfer.pool.capacity_bytes  # type: ignore[union-attr]


# -- the scheduler's cache never touches CUDA -------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )


def test_a_host_reads_cache_leaves_cuda_uninitialised() -> None:
    """The cache the connector's scheduler half gets (connector/shared.py), used the way it
    uses it, on a machine with a GPU: no CUDA context is created."""
    out = _python(
        "import torch\n"
        "from ec_redis.cache import TieredCache\n"
        "from ec_redis.config import CacheConfig\n"
        "from tests.conftest import embedding\n"
        "config = CacheConfig(device='auto', gpu_cache_bytes=1 << 20)\n"
        "with TieredCache(config, device=torch.device('cpu')) as cache:\n"
        "    cache.put('a', embedding())\n"
        "    assert cache.get_many(['a', 'b'], on_host=True)['a'] is not None\n"
        "    cache.describe_many(['a']); cache.stats()\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "print('ok')\n"
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.vllm
def test_building_a_scheduler_role_connector_leaves_cuda_uninitialised() -> None:
    out = _python(
        "import torch\n"
        "from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole\n"
        "from ec_redis.connector import ECRedisConnector\n"
        "from tests.connector.conftest import request, vllm_config\n"
        "extra = {'redis_url': '', 'device': 'auto', 'model_fingerprint': 'w'}\n"
        "c = ECRedisConnector(vllm_config('ec_consumer', extra), ECConnectorRole.SCHEDULER)\n"
        "c.ensure_cache_available(request('r1', ('img', 16)), 0)\n"
        "c.build_connector_meta(None); c.get_ec_connector_stats(); c.shutdown()\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "print('ok')\n"
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_benchs_cuda_rows_are_produced_and_checked() -> None:
    from ec_redis.bench.cuda import cuda_rows
    from ec_redis.demo.workload import QUICK_ITEMS

    rows = cuda_rows(QUICK_ITEMS[:1], 1)
    ops = " / ".join(row.op for row in rows)
    for part in ("pinned pool", "spill GPU->CPU", "event ordering", "load CPU->GPU", "upload"):
        assert part in ops
    assert all(row.ms > 0 and row.baseline_ms for row in rows)
