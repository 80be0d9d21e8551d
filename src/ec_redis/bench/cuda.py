"""CUDA figures: spill (GPU->CPU) and load (CPU->GPU) through the tiers' Transfer, against
``tensor.copy_`` of pinned memory in the same run, timed with CUDA events."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ec_redis.bench.results import Row, make_row
from ec_redis.bench.timing import Timing
from ec_redis.bench.workload import Item, activation_like
from ec_redis.tiers.pinned import PinnedPool
from ec_redis.tiers.transfer import Transfer


def _cuda_time(fn: Callable[[], object], repeat: int) -> Timing:
    samples = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return Timing(tuple(samples))


def cuda_rows(items: Sequence[Item], repeat: int) -> list[Row]:
    transfer = Transfer(torch.device("cuda"), PinnedPool(4 << 30))
    rows: list[Row] = []
    for item in items:
        rows += _item_rows(transfer, item, max(5, repeat * 4))
    return rows


def _item_rows(transfer: Transfer, item: Item, runs: int) -> list[Row]:
    gpu = activation_like(item.rows).to(transfer.device)
    pinned = torch.empty(gpu.shape, dtype=gpu.dtype).pin_memory()
    host = transfer.to_host(gpu)  # also warms the pool and the side stream
    host.wait()
    if not torch.equal(transfer.to_device(host).cpu(), gpu.cpu()):
        raise RuntimeError("CUDA round trip returned a wrong tensor: refusing to report")

    def spill() -> None:
        transfer.to_host(gpu).wait()

    def d2h() -> None:
        pinned.copy_(gpu, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def load() -> None:
        transfer.to_device(host)

    def h2d() -> None:
        gpu.copy_(pinned, non_blocking=True)

    return [
        make_row(item, "cuda spill GPU->CPU (pooled pinned)", _cuda_time(spill, runs),
                 "pinned copy_ D2H", _cuda_time(d2h, runs)),
        make_row(item, "cuda load CPU->GPU", _cuda_time(load, runs),
                 "pinned copy_ H2D", _cuda_time(h2d, runs)),
    ]  # fmt: skip
