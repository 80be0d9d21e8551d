"""Driving the connector's hooks the way vLLM does, in this process, with no engine: the
demo's ``--hooks-only`` walk, and the connector benchmarks (``bench/connector_hooks.py`` and
its neighbours), which time what it does.

The connectors get a real ``VllmConfig`` (vLLM's ``EngineArgs`` over the demo's tiny LLaVA,
built in a temporary directory), with ``embed_width`` set to the items' width. Importing this
module needs vLLM (the connector is imported here): without it, an ``ImportError``.
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ec_redis.connector  # noqa: F401  (needs vLLM: without it, an ImportError here)
from ec_redis.demo.workload import Item, activation_like


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


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
