"""Single flight: N ``ec_both`` instances get the same new item at the same moment; with
``single_flight`` one of them encodes it and the others wait for its entry and load it,
without it every instance that misses encodes (and writes) it. Both settings run in one
process, in the same run, item by item in turn.

Each instance is a scheduler half and a worker half of ECRedisConnector built through vLLM's
own connector factory from a real ``VllmConfig`` (``demo/drive.py``'s machinery; the
demo's tiny LLaVA, ``embed_width`` set to the items'), with its own ``producer_id`` and so
its own in-process cache: every item an instance loads crosses Redis. The config is vLLM's
default layout (workers in processes of their own), so, as there, the worker half keeps its
own write queue and the scheduler half stages what it fetches as tmpfs files. Each instance's
request is a real ``vllm.v1.request.Request``, driven on its own thread step by step in
vLLM's order: ``ensure_cache_available`` until it lets the request through (a step that
scheduled nothing ends with ``build_connector_meta`` of an idle output: the connector's
bounded idle wait), then ``has_cache_item`` and ``update_state_after_alloc``,
``build_connector_meta``, and on the worker half ``bind_connector_metadata`` +
``start_load_caches`` (a load) or the *encode* — ``encode_ms`` of sleep, the GIL released,
as for an encoder on its own accelerator — and ``save_caches``; then ``request_finished``.
Every tensor that ends in an instance's encoder cache is compared bit for bit with the item.

Per setting and item size it reports: encodes per item (summed over instances), the Redis
commands per item by Redis's own account (``INFO commandstats``: ``SET`` calls, from the
writes and the claims' script, and every script call), the bytes Redis received per item
(``INFO stats``), the time each request was held (from its arrival until
``ensure_cache_available`` let it through) and its time to embedding (arrival until the
embedding is in its encoder cache, loaded or encoded: what time to first token waits for),
p50 / p99 over every (instance, item) pair, and the lease counters.
"""

from __future__ import annotations

import copy
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ec_redis.bench.timing import percentile
from ec_redis.demo.drive import IDLE_STEP, engine_config, vllm_request
from ec_redis.demo.workload import Item, activation_like

SETTINGS: dict[str, dict[str, object]] = {
    "on": {"single_flight": True},
    "off": {"single_flight": False},
}
LEASE_COUNTERS = ("lease_claims", "lease_waits", "lease_loads", "lease_takeovers")
WARMUP = 1  # untimed items per setting and size (connections, spare staging buffers)
ITEM_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class BusyStep:
    """What ``build_connector_meta`` gets from a step that scheduled the request."""

    total_num_scheduled_tokens: int = 1


@dataclass
class Sample:
    encoded: bool
    held_s: float
    ready_s: float


@dataclass
class SingleFlightRow:
    item: str
    mib: float
    setting: str  # "on" or "off"
    instances: int
    items: int
    encode_ms: float
    encodes_per_item: float
    set_per_item: float | None  # None: the server keeps no command statistics (fakeredis)
    scripts_per_item: float | None
    mib_in_per_item: float | None
    held_p50_ms: float
    held_p99_ms: float
    ready_p50_ms: float
    ready_p99_ms: float
    leases: dict[str, int] = field(default_factory=dict)


class Instance:
    """One ``ec_both`` engine's two connector halves (one process-wide cache per instance)."""

    def __init__(self, base: Any, extra: dict[str, Any]) -> None:
        from vllm.config import ECTransferConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        def make(side: ECConnectorRole) -> Any:
            config = copy.copy(base)
            config.ec_transfer_config = ECTransferConfig(
                ec_connector="ECRedisConnector",
                ec_connector_module_path="ec_redis.connector",
                ec_role="ec_both",
                ec_connector_extra_config=dict(extra),
            )
            return ECConnectorFactory.get_connector_class(config.ec_transfer_config)(config, side)

        self.scheduler = make(ECConnectorRole.SCHEDULER)
        self.worker = make(ECConnectorRole.WORKER)

    def serve(
        self, request: Any, mm_hash: str, item: torch.Tensor, encode_s: float, arrived: float
    ) -> Sample:
        """One request in vLLM's call order, from its arrival until its embedding is in the
        encoder cache; raises if that embedding is not ``item``."""
        scheduler, worker = self.scheduler, self.worker
        while not scheduler.ensure_cache_available(request, 0):
            if time.perf_counter() - arrived > ITEM_TIMEOUT_S:
                raise RuntimeError(f"{mm_hash}: held for over {ITEM_TIMEOUT_S} s")
            scheduler.build_connector_meta(IDLE_STEP)
        admitted = time.perf_counter()
        hit = scheduler.has_cache_item(mm_hash)
        scheduler.update_state_after_alloc(request, 0)
        meta = scheduler.build_connector_meta(BusyStep())
        encoder_cache: dict[str, torch.Tensor] = {}
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(encoder_cache)
        if not hit:
            time.sleep(encode_s)  # the vision tower, on this instance's own accelerator
            encoder_cache[mm_hash] = item
            worker.save_caches(encoder_cache=encoder_cache, mm_hash=mm_hash)
        worker.clear_connector_metadata()
        ready = time.perf_counter()
        got = encoder_cache.get(mm_hash)
        if got is None or not torch.equal(got, item):
            raise RuntimeError(f"{mm_hash}: a wrong embedding: refusing to report")
        scheduler.request_finished(request)
        return Sample(not hit, admitted - arrived, ready - arrived)

    def leases(self) -> dict[str, int]:
        snapshot = self.scheduler.stats_snapshot()
        return {name: int(snapshot.get(name, 0)) for name in LEASE_COUNTERS}

    def flush(self) -> None:
        """Wait until this instance's Redis writes are done (they run on its worker half's
        writer: in vLLM's default layout the worker half has a cache of its own)."""
        if not self.worker._cache.flush(ITEM_TIMEOUT_S):
            raise RuntimeError("a Redis write never finished: refusing to report")

    def forget(self, mm_hash: str) -> None:
        """Drop the item from Redis and from this instance's local tiers."""
        for half in (self.scheduler, self.worker):
            half._cache.delete(mm_hash)

    def shutdown(self) -> None:
        for half in (self.worker, self.scheduler):
            half.shutdown()


class ServerStats:
    """Redis's own account of the commands and bytes it received (deltas; nothing reset)."""

    def __init__(self, redis_url: str) -> None:
        import redis

        self._client = redis.Redis.from_url(redis_url)

    def read(self) -> dict[str, int] | None:
        try:
            commands = self._client.info("commandstats")
            received = self._client.info("stats")["total_net_input_bytes"]
        except Exception:  # fakeredis: no command statistics
            return None
        calls = {
            name.removeprefix("cmdstat_"): int(entry["calls"]) for name, entry in commands.items()
        }
        return {
            "set": calls.get("set", 0),
            "scripts": sum(calls.get(n, 0) for n in ("eval", "evalsha", "eval_ro", "evalsha_ro")),
            "bytes_in": int(received),
        }

    def close(self) -> None:
        self._client.close()


def one_round(
    instances: list[Instance], item: Item, seed: int, encode_s: float, tag: str
) -> tuple[str, list[Sample]]:
    """One new item to every instance at once (their threads start on one barrier); its id
    and a sample per instance, once every instance's writes are done."""
    tensor = activation_like(item.rows, item.width, seed=seed)
    mm_hash = f"{tag}-{item.rows}-{seed}-{time.time_ns()}"
    start = threading.Barrier(len(instances))
    samples: list[Sample | BaseException | None] = [None] * len(instances)

    def run(n: int, instance: Instance) -> None:
        request = vllm_request(f"req-{n}-{mm_hash}", (mm_hash, item.rows))
        try:
            start.wait()
            samples[n] = instance.serve(request, mm_hash, tensor, encode_s, time.perf_counter())
        except BaseException as exc:  # re-raised on the calling thread
            samples[n] = exc

    threads = [
        threading.Thread(target=run, args=(n, inst), daemon=True)
        for n, inst in enumerate(instances)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(ITEM_TIMEOUT_S + 30)
    out: list[Sample] = []
    for sample in samples:
        if isinstance(sample, BaseException):
            raise RuntimeError(f"{tag}: an instance failed: {sample!r}") from sample
        if sample is None:
            raise RuntimeError(f"{tag}: an instance never finished")
        out.append(sample)
    for instance in instances:
        instance.flush()
    return mm_hash, out


def run(
    redis_url: str,
    items: tuple[Item, ...],
    runs: int,
    encode_ms: float,
    progress: Callable[[str], None],
    instances: int = 3,
) -> list[SingleFlightRow]:
    from ec_redis.demo.tiny_model import build_tiny_llava

    with tempfile.TemporaryDirectory(prefix="ec_redis_bench_model_") as tmp:
        base = engine_config(build_tiny_llava(Path(tmp)))
        fleets = {
            setting: [
                Instance(
                    base,
                    {
                        "redis_url": redis_url,
                        "namespace": f"benchsf-{setting}",
                        "producer_id": f"benchsf-{setting}-{n}",
                        "embed_width": items[0].width,
                        **extra,
                    },
                )
                for n in range(instances)
            ]
            for setting, extra in SETTINGS.items()
        }
    stats = ServerStats(redis_url)
    rows: list[SingleFlightRow] = []
    try:
        for item in items:
            progress(
                f"single flight: {item.label} ({item.nbytes / 2**20:.1f} MiB) x{runs}, "
                f"{instances} instances, encode {encode_ms:g} ms, on and off in turn"
            )
            rows += _one_size(fleets, stats, item, runs, encode_ms / 1000)
    finally:
        stats.close()
        for fleet in fleets.values():
            for instance in fleet:
                instance.shutdown()
    return rows


def _one_size(
    fleets: dict[str, list[Instance]], stats: ServerStats, item: Item, runs: int, encode_s: float
) -> list[SingleFlightRow]:
    samples: dict[str, list[Sample]] = {s: [] for s in fleets}
    server: dict[str, dict[str, int]] = {s: {} for s in fleets}
    leases_before = {s: _leases(fleet) for s, fleet in fleets.items()}
    for run in range(WARMUP + runs):
        for setting, fleet in fleets.items():  # on, off, on, off, ...: both meet one machine
            before = stats.read()
            mm_hash, got = one_round(fleet, item, run, encode_s, f"sf-{setting}")
            after = stats.read()
            for instance in fleet:  # the item leaves Redis: every round meets a server alike
                instance.forget(mm_hash)
            if run < WARMUP:
                if run == WARMUP - 1:
                    leases_before[setting] = _leases(fleet)
                continue
            samples[setting] += got
            if before is not None and after is not None:
                for name, value in after.items():
                    server[setting][name] = server[setting].get(name, 0) + value - before[name]
    rows = []
    for setting, fleet in fleets.items():
        leases = {
            name: value - leases_before[setting][name] for name, value in _leases(fleet).items()
        }
        done, held, ready = samples[setting], [], []
        for sample in done:
            held.append(sample.held_s)
            ready.append(sample.ready_s)
        counted = server[setting]
        rows.append(
            SingleFlightRow(
                item=item.label,
                mib=item.nbytes / 2**20,
                setting=setting,
                instances=len(fleet),
                items=runs,
                encode_ms=encode_s * 1000,
                encodes_per_item=sum(s.encoded for s in done) / runs,
                set_per_item=counted["set"] / runs if counted else None,
                scripts_per_item=counted["scripts"] / runs if counted else None,
                mib_in_per_item=counted["bytes_in"] / runs / 2**20 if counted else None,
                held_p50_ms=percentile(held, 50) * 1e3,
                held_p99_ms=percentile(held, 99) * 1e3,
                ready_p50_ms=percentile(ready, 50) * 1e3,
                ready_p99_ms=percentile(ready, 99) * 1e3,
                leases=leases,
            )
        )
    return rows


def _leases(fleet: list[Instance]) -> dict[str, int]:
    out = dict.fromkeys(LEASE_COUNTERS, 0)
    for instance in fleet:
        for name, value in instance.leases().items():
            out[name] += value
    return out


def render(rows: list[SingleFlightRow]) -> str:
    lines = [
        "| item | MiB | single_flight | encodes / item | SET / item | scripts / item "
        "| MiB into Redis / item | held p50 / p99 ms | time to embedding p50 / p99 ms "
        "| lease claims / waits / loads / takeovers |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]

    def num(value: float | None, digits: int = 2) -> str:
        return "n/a" if value is None else f"{value:.{digits}f}"

    for row in rows:
        leases = " / ".join(str(row.leases.get(name, 0)) for name in LEASE_COUNTERS)
        lines.append(
            f"| {row.item} | {row.mib:.2f} | {row.setting} | {row.encodes_per_item:.2f} "
            f"| {num(row.set_per_item)} | {num(row.scripts_per_item)} "
            f"| {num(row.mib_in_per_item)} | {row.held_p50_ms:.1f} / {row.held_p99_ms:.1f} "
            f"| {row.ready_p50_ms:.1f} / {row.ready_p99_ms:.1f} | {leases} |"
        )
    if rows:
        first = rows[0]
        lines.append(
            f"\n({first.instances} ec_both instances, the same new item to all at once, "
            f"{first.items} items per row, encode {first.encode_ms:g} ms; held: arrival -> "
            "ensure_cache_available yes; time to embedding: arrival -> in the encoder cache)"
        )
    return "\n".join(lines)
