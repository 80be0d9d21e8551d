"""Connector benchmark: drive the hooks the way vLLM does, ECRedisConnector next to vLLM's
ECExampleConnector (safetensors files on local disk), in one run on the same machine.

Per item: producer ``save_caches`` -> (consumer scheduler) ``ensure_cache_available`` until
ready -> ``has_cache_item`` -> ``update_state_after_alloc`` -> ``build_connector_meta`` ->
(consumer worker) ``bind`` + ``start_load_caches`` + ``clear``. Reports p50/p99 per hook and
the time from ``save_caches`` returning to the item being loadable. The connectors get a real
``VllmConfig`` (vLLM's ``EngineArgs`` over the demo's tiny LLaVA, built in a temporary
directory), with ``embed_width`` set to the items' width.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ec_redis.bench.workload import Item, activation_like

HOOKS = ("save_caches", "visible_after_save", "has_cache_item", "alloc+meta", "start_load_caches")


@dataclass(frozen=True)
class IdleStep:
    """What ``build_connector_meta`` gets from an engine step that scheduled nothing."""

    total_num_scheduled_tokens: int = 0


IDLE_STEP = IdleStep()


def vllm_request(request_id: str, *items: tuple[str, int], media: bool = True) -> Any:
    """A real ``vllm.v1.request.Request`` (status WAITING, nothing computed) whose image
    items ``(identifier, num_embeds)`` sit one after another from token 4; ``media=False``:
    metadata-only items (no data to encode, as an EPD proxy sends PD)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features, offset = [], 4
    for identifier, rows in items:
        position = PlaceholderRange(offset=offset, length=rows)
        data = MultiModalKwargsItem.dummy() if media else None
        features.append(MultiModalFeatureSpec(data, "image", identifier, position))
        offset += rows + 2
    return Request(
        request_id=request_id,
        prompt_token_ids=[0] * (offset + 4),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=features,
    )


@dataclass
class HookRow:
    connector: str
    item: str
    hook: str
    p50_ms: float
    p99_ms: float


def engine_config(model_dir: Path) -> Any:
    """A real ``VllmConfig`` for the model in ``model_dir``, as a CPU engine would get it
    (no engine starts; nothing is downloaded)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256
    ).create_engine_config()


def build_connectors(name: str, extra: dict[str, Any], width: int) -> tuple[Any, Any, Any]:
    """An encoder's worker half, and a PD instance's scheduler and worker halves, for items
    ``width`` wide."""
    from vllm.config import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from ec_redis.demo.tiny_model import build_tiny_llava

    with tempfile.TemporaryDirectory(prefix="ec_redis_bench_model_") as tmp:
        # The connectors read the checkpoint (its weights fingerprint) only while they start.
        base = engine_config(build_tiny_llava(Path(tmp)))
        if name == "ECRedisConnector":
            extra = {**extra, "embed_width": width}  # the tiny model is narrower than the items

        module = "ec_redis.connector" if name == "ECRedisConnector" else None

        def make(role: str, side: ECConnectorRole, more: dict[str, Any]) -> Any:
            config = copy.copy(base)  # one VllmConfig per role; only the EC config differs
            config.ec_transfer_config = ECTransferConfig(
                ec_connector=name,
                ec_connector_module_path=module,
                ec_role=role,
                ec_connector_extra_config={**extra, **more},
            )
            return ECConnectorFactory.get_connector_class(config.ec_transfer_config)(config, side)

        # The producer gets its own in-process cache (another producer_id), so every load
        # below really crosses Redis, as between two instances.
        producer_extra = {"producer_id": "bench-encoder"} if name == "ECRedisConnector" else {}
        return (
            make("ec_producer", ECConnectorRole.WORKER, producer_extra),
            make("ec_consumer", ECConnectorRole.SCHEDULER, {}),
            make("ec_consumer", ECConnectorRole.WORKER, {}),
        )


def run_hooks(
    name: str, extra: dict[str, Any], items: tuple[Item, ...], runs: int,
    progress: Callable[[str], None],
) -> list[HookRow]:  # fmt: skip
    producer, scheduler, worker = build_connectors(name, extra, items[0].width)
    rows: list[HookRow] = []
    try:
        for item in items:
            progress(f"{name}: {item.label} ({item.nbytes / 2**20:.1f} MiB) x{runs}")
            samples = _one_size(producer, scheduler, worker, item, runs, name)
            rows += [
                HookRow(name, item.label, hook, _pct(v, 50) * 1e3, _pct(v, 99) * 1e3)
                for hook, v in samples.items()
            ]
    finally:
        for connector in (producer, scheduler, worker):
            connector.shutdown()
    return rows


def _one_size(
    producer: Any, scheduler: Any, worker: Any, item: Item, runs: int, tag: str
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {hook: [] for hook in HOOKS}
    for run in range(runs):
        for hook, seconds in one_item(producer, scheduler, worker, item, run, tag).items():
            samples[hook].append(seconds)
    return samples


def one_item(
    producer: Any, scheduler: Any, worker: Any, item: Item, run: int, tag: str,
    done: Callable[[str], object] | None = None,
) -> dict[str, float]:  # fmt: skip
    """One item through every hook, in vLLM's order; seconds per hook. Raises if the loaded
    tensor differs from the saved one. ``done(mm_hash)`` runs at the end (untimed)."""
    out: dict[str, float] = {}
    tensor = activation_like(item.rows, item.width, seed=run)
    mm_hash = f"{tag}-{item.rows}-{run}-{time.time_ns()}"
    req = vllm_request(f"req-{mm_hash}", (mm_hash, item.rows))
    out["save_caches"] = _timed(
        lambda: producer.save_caches(encoder_cache={mm_hash: tensor}, mm_hash=mm_hash)
    )
    saved = time.perf_counter()
    # Step after step, as an engine would: a step whose only request is held schedules
    # nothing, and its build_connector_meta does the connector's bounded idle wait (a loop
    # spinning on ensure_cache_available alone would starve the lookup threads of the GIL).
    while not (scheduler.ensure_cache_available(req, 0) and scheduler.has_cache_item(mm_hash)):
        if time.perf_counter() - saved > 30:
            raise RuntimeError(f"{tag}: item never became loadable")
        scheduler.build_connector_meta(IDLE_STEP)
    out["visible_after_save"] = time.perf_counter() - saved
    out["has_cache_item"] = _timed(lambda: scheduler.has_cache_item(mm_hash))
    start = time.perf_counter()
    scheduler.update_state_after_alloc(req, 0)
    meta = scheduler.build_connector_meta(None)
    out["alloc+meta"] = time.perf_counter() - start
    loaded: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    worker.bind_connector_metadata(meta)
    worker.start_load_caches(loaded)
    worker.clear_connector_metadata()
    out["start_load_caches"] = time.perf_counter() - start
    if not torch.equal(loaded[mm_hash], tensor):
        raise RuntimeError(f"{tag} loaded a wrong tensor: refusing to report")
    scheduler.request_finished(req)
    if done is not None:
        done(mm_hash)
    return out


def run(
    redis_url: str, items: tuple[Item, ...], runs: int, progress: Callable[[str], None]
) -> list[HookRow]:
    ours = run_hooks(
        "ECRedisConnector",
        {"redis_url": redis_url, "namespace": "benchconn", "recheck_s": 0.005},
        items, runs, progress,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ec_example_") as path:
        theirs = run_hooks("ECExampleConnector", {"shared_storage_path": path}, items, runs,
                           progress)  # fmt: skip
    return ours + theirs


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _pct(values: list[float], pct: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[pct - 1]


def render(rows: list[HookRow]) -> str:
    lines = [
        "| item | hook | ECRedisConnector p50 ms | p99 ms | ECExampleConnector p50 ms | p99 ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    by_key = {(r.connector, r.item, r.hook): r for r in rows}
    for item in dict.fromkeys(r.item for r in rows):
        for hook in HOOKS:
            ours = by_key.get(("ECRedisConnector", item, hook))
            theirs = by_key.get(("ECExampleConnector", item, hook))
            if ours is None or theirs is None:
                continue
            lines.append(
                f"| {item} | {hook} | {ours.p50_ms:.3f} | {ours.p99_ms:.3f} "
                f"| {theirs.p50_ms:.3f} | {theirs.p99_ms:.3f} |"
            )
    return "\n".join(lines)
