"""Step-metadata benchmark (a script, not part of the package: it pickles to measure): what
shipping one step's EC metadata to two tensor-parallel ranks
costs through vLLM's own multiprocess broadcast queue (``MessageQueue``), with the staged
bytes inline in the metadata (as before) or as tmpfs files the ranks read (``transport.py``).

Per step it measures the pickled metadata size and the time from the scheduler enqueuing the
step until both ranks hold the item, loaded as the CPU worker half loads it (a clone of the
unpickled tensor, or a private mapping of the staged file), with every page of it touched
once: a mapping costs nothing until it is read, and the first read (vLLM's forward) pays the
page faults, so leaving them out would flatter the files. Staging a file happens on a lookup
thread before the step and is reported separately.

Usage: ``.venv/bin/python scripts/bench_step_metadata.py [--steps 20]`` (needs vLLM).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ec_redis.connector.metadata import ECRedisMetadata
from ec_redis.connector.staging import Found
from ec_redis.connector.transport import FileTransport, InlineTransport, read_staged

ITEMS = {"16 MiB image": 16 << 20, "150 MiB video": 150 << 20}
WIDTH = 3584  # Qwen2.5-VL-7B's hidden size
RANKS = 2
PAGE_BYTES = 4096


@dataclass
class MetaRow:
    item: str
    transport: str
    metadata_bytes: int
    step_p50_ms: float
    step_max_ms: float
    stage_ms: float  # writing the staged file, off the scheduling path (0 inline)


def _rank(handle: Any, rank: int, results: Any) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    queue = MessageQueue.create_from_handle(handle, rank)
    queue.wait_until_ready()
    while True:
        message = queue.dequeue()
        if message is None:
            return
        sent_at, meta = message
        for load in meta.loads:
            tensor = read_staged(load)
            if load.tensor is not None:
                tensor = tensor.clone()  # a rank never hands vLLM memory it does not own
            _touch_pages(tensor)
        results.put((rank, time.monotonic() - sent_at))


def _touch_pages(tensor: torch.Tensor) -> None:
    """Read one byte of every page (a mapped file's pages come in on first read)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    int(flat[::PAGE_BYTES].sum())


def run(steps: int, progress: Callable[[str], None]) -> list[MetaRow]:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    context = mp.get_context("spawn")
    results = context.Queue()
    queue = MessageQueue(RANKS, RANKS)  # vLLM's defaults: 24 MiB chunks, overflow via ZMQ
    ranks = [
        context.Process(target=_rank, args=(queue.export_handle(), r, results), daemon=True)
        for r in range(RANKS)
    ]
    for process in ranks:
        process.start()
    queue.wait_until_ready()
    rows: list[MetaRow] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ec_redis_meta_", dir="/dev/shm") as directory:
            for label, nbytes in ITEMS.items():
                tensor = torch.randn(nbytes // (2 * WIDTH), WIDTH).to(torch.bfloat16)
                found = Found(tensor.dtype, tuple(tensor.shape), tensor)
                for transport in (InlineTransport(), FileTransport(directory)):
                    progress(f"metadata: {label}, {transport.name}, {steps} steps")
                    rows.append(_measure(queue, results, transport, label, found, steps))
                    transport.close()
    finally:
        queue.enqueue(None)
        for process in ranks:
            process.join(10)
    return rows


def _measure(
    queue: Any, results: Any, transport: InlineTransport, label: str, found: Found, steps: int
) -> MetaRow:
    started = time.perf_counter()
    staged = transport.stage(found)
    stage_ms = (time.perf_counter() - started) * 1e3 if staged.path else 0.0
    seconds: list[float] = []
    size = 0
    for step in range(steps):
        meta = ECRedisMetadata(loads=[transport.load(label, staged, step)], step=step)
        size = len(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
        queue.enqueue((time.monotonic(), meta))
        seconds.append(max(results.get(timeout=120)[1] for _ in range(RANKS)))
        transport.step_done(step)
    transport.discard(staged)
    return MetaRow(
        label,
        transport.name,
        size,
        statistics.median(seconds) * 1e3,
        max(seconds) * 1e3,
        stage_ms,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per item and transport")
    args = parser.parse_args()
    print(render(run(args.steps, lambda line: print(line, file=sys.stderr))))


def render(rows: list[MetaRow]) -> str:
    lines = [
        "| staged item | transport | metadata bytes / step | step p50 ms | step max ms "
        "| staging write ms (off the step) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.item} | {row.transport} | {row.metadata_bytes:,} | {row.step_p50_ms:.2f} "
            f"| {row.step_max_ms:.2f} | {row.stage_ms:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
