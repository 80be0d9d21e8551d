"""Scheduler-cost benchmark: what the connector's scheduler hooks add to one ``schedule()``
when N waiting requests have their items still in flight.

vLLM calls ``ensure_cache_available`` for every waiting request with multimodal items on
every step, then ``build_connector_meta`` once. Here the Redis behind the consumer accepts
connections and never answers (a black hole), so every lookup stays in flight for the whole
run, as under a stalled or distant Redis. Each step is timed twice: a *busy* step (other
requests were scheduled) and an *idle* one (nothing was scheduled; the connector may spend
its one bounded wait there).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ec_redis.bench.timing import percentile
from ec_redis.demo.drive import build_connectors, vllm_request

WAITING = (1, 64, 256)


@dataclass
class CostRow:
    waiting: int
    step: str  # "busy" or "idle"
    p50_ms: float
    p99_ms: float


@dataclass
class _Output:
    """The one field of vLLM's SchedulerOutput the connector reads at the end of a step."""

    total_num_scheduled_tokens: int


@contextmanager
def black_hole() -> Iterator[str]:
    """A Redis URL whose server accepts connections and never replies."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)  # the kernel completes handshakes; nothing ever reads or answers
        yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


def measure(waiting: int, steps: int, scheduler: Any, tag: str) -> tuple[list[float], list[float]]:
    """Seconds the hooks take per busy and per idle step with ``waiting`` held requests."""
    requests = [vllm_request(f"{tag}-r{i}", (f"{tag}-img-{i}", 256)) for i in range(waiting)]
    for req in requests:  # first sight: lookups start (and stay in flight)
        scheduler.ensure_cache_available(req, 0)
    scheduler.build_connector_meta(_Output(1))
    busy: list[float] = []
    idle: list[float] = []
    for n in range(2 * steps):
        output = _Output(1 if n % 2 == 0 else 0)
        started = time.perf_counter()
        for req in requests:
            if scheduler.ensure_cache_available(req, 0):
                raise RuntimeError("an item became ready behind a black hole: refusing to report")
        scheduler.build_connector_meta(output)
        (busy if output.total_num_scheduled_tokens else idle).append(time.perf_counter() - started)
    for req in requests:
        scheduler.request_finished(req)
    return busy, idle


def run(steps: int, progress: Callable[[str], None]) -> list[CostRow]:
    rows: list[CostRow] = []
    with black_hole() as url:
        extra = {
            "redis_url": url,
            "redis_check_on_start": False,
            "redis_socket_timeout_s": 600,  # lookups stay in flight for the whole run
            "redis_connect_timeout_s": 600,
            "redis_retries": 0,
            "consumer_wait_s": 600,
        }
        connectors = build_connectors("ECRedisConnector", extra, width=1024)
        scheduler = connectors[1]
        try:
            for waiting in WAITING:
                progress(f"scheduler cost: {waiting} waiting requests x {steps} steps")
                busy, idle = measure(waiting, steps, scheduler, f"w{waiting}")
                rows.append(CostRow(waiting, "busy", *_ms(busy)))
                rows.append(CostRow(waiting, "idle", *_ms(idle)))
        finally:
            for connector in connectors:
                connector.shutdown()
    return rows


def _ms(seconds: list[float]) -> tuple[float, float]:
    """p50 and p99 of ``seconds``, in milliseconds."""
    return percentile(seconds, 50) * 1e3, percentile(seconds, 99) * 1e3


def render(rows: list[CostRow]) -> str:
    lines = [
        "| waiting requests (items in flight) | step | hooks p50 ms | hooks p99 ms |",
        "|---:|---|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row.waiting} | {row.step} | {row.p50_ms:.3f} | {row.p99_ms:.3f} |")
    return "\n".join(lines)
