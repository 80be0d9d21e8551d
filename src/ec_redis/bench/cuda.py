"""CUDA figures: the pinned pool, side-stream spills, event ordering and loads, each next to
its plain-PyTorch baseline in the same run. Device times come from CUDA events.

Rows per item: pool acquire+release vs ``torch.empty(pin_memory=True)`` (host time); spill
GPU->CPU through ``Transfer.to_host`` (side stream, pinned block) vs pinned ``copy_`` D2H;
event ordering, i.e. a kernel queued after ``to_host`` (the producer waits on ``ready``) vs
the kernel alone; load CPU->GPU from a pinned host copy vs pinned ``copy_`` H2D; and the
worker's upload of a pageable tensor (staged through the pool) vs pageable ``tensor.to``.
Run alone with ``python -m ec_redis.bench.cuda [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict

import torch

from ec_redis.bench.report import render
from ec_redis.bench.results import Report, Row, make_row
from ec_redis.bench.timing import Timing, measure
from ec_redis.bench.workload import ITEMS
from ec_redis.demo.workload import QUICK_ITEMS, Item, activation_like
from ec_redis.tiers.pinned import PinnedPool
from ec_redis.tiers.transfer import Transfer

KERNEL_SIZE = 8192  # a bf16 matmul of this size: ~1.4 ms on an H200, the "next kernel"


def _cuda_time(fn: Callable[[], object], repeat: int) -> Timing:
    """Seconds on the current stream from before ``fn`` to after all it queued there."""
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
    device = torch.device("cuda", torch.cuda.current_device())
    transfer = Transfer(device, PinnedPool(4 << 30))
    a = torch.randn(KERNEL_SIZE, KERNEL_SIZE, device=device, dtype=torch.bfloat16)
    rows: list[Row] = []
    try:
        for item in items:
            rows += _item_rows(transfer, item, max(5, repeat * 4), lambda: a @ a)
    finally:
        transfer.close()
    return rows


def _item_rows(
    transfer: Transfer, item: Item, runs: int, kernel: Callable[[], object]
) -> list[Row]:
    device = transfer.device
    want = activation_like(item.rows)
    gpu = want.to(device)
    pinned = torch.empty(gpu.shape, dtype=gpu.dtype).pin_memory()
    host = transfer.to_host(gpu)  # also pins the first slab and makes the side stream
    host.wait()
    if not (torch.equal(host.tensor, want) and torch.equal(transfer.to_device(host).cpu(), want)):
        raise RuntimeError("CUDA round trip returned a wrong tensor: refusing to report")
    pool = transfer.pool
    assert pool is not None

    def acquire_release() -> None:
        block = pool.acquire(item.nbytes)
        if block is not None:
            pool.release(block)

    def pin_alloc() -> None:
        torch.empty(item.nbytes, dtype=torch.uint8, pin_memory=True)

    def spill() -> None:
        transfer.to_host(gpu).wait()

    def d2h() -> None:
        pinned.copy_(gpu, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def ordered_kernel() -> None:
        transfer.to_host(gpu)
        kernel()

    def load() -> None:
        transfer.to_device(host)

    def h2d() -> None:
        gpu.copy_(pinned, non_blocking=True)

    def upload() -> None:
        transfer.upload(want, device)

    def pageable_to() -> None:
        want.to(device)

    return [
        make_row(item, "pinned pool acquire+release (host)", measure(acquire_release, runs * 20),
                 "torch.empty(pin_memory=True)", measure(pin_alloc, runs * 20)),
        make_row(item, "cuda spill GPU->CPU (side stream, pinned pool)", _cuda_time(spill, runs),
                 "pinned copy_ D2H", _cuda_time(d2h, runs)),
        make_row(item, "event ordering: kernel after to_host", _cuda_time(ordered_kernel, runs),
                 f"{KERNEL_SIZE}^3 bf16 matmul alone", _cuda_time(kernel, runs)),
        make_row(item, "cuda load CPU->GPU (pinned host copy)", _cuda_time(load, runs),
                 "pinned copy_ H2D", _cuda_time(h2d, runs)),
        make_row(item, "upload pageable CPU->GPU (staged via pool)", _cuda_time(upload, runs),
                 "pageable tensor.to(cuda)", _cuda_time(pageable_to, runs)),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="two item sizes, fewer runs")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    rows = cuda_rows(QUICK_ITEMS if args.quick else ITEMS, 2 if args.quick else args.repeat)
    machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    print(render(Report(server="none (CUDA rows only)", machine=machine, rows=rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
