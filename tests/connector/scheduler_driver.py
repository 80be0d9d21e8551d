"""Drive vLLM's real v1 ``Scheduler`` and a worker-role EC connector the way the engine does.

One process, as vLLM's single-process (``uni``) executor has it: the ``Scheduler`` builds the
scheduler half of the connector through vLLM's factory; the worker half is vLLM's per-process
singleton (``ensure_ec_transfer_initialized``, as ``gpu_worker`` does), driven by the
simulated model runner in ``simulated_worker``. ``EngineDriver.step`` is ``EngineCore.step``:
schedule, execute, process aborts, ``update_from_output``.

An exception that escapes a scheduler or connector call ends the engine, as in vLLM, and is
recorded as a ``Failure``; so is an encoder-cache miss (vLLM: ``RuntimeError: Encoder cache
miss``) and a tensor in the encoder cache that is not the truth for its id.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ec_redis.demo.tiny_model import IMAGE_TOKEN_ID, NUM_IMAGE_TOKENS
from tests.connector.simulated_worker import (
    DriverStats,
    EngineDied,
    Failure,
    SimulatedWorker,
    truth,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

TEXT_TOKEN_ID = 10


@dataclass(frozen=True)
class EngineShape:
    """Limits small enough that chunked prefill splits images and KV blocks run out."""

    max_num_seqs: int = 4
    max_num_batched_tokens: int = 48
    block_size: int = 16
    num_kv_blocks: int = 12
    max_model_len: int = 256
    max_images_per_prompt: int = 3


def build_vllm_config(
    model_dir: Path, role: str, extra: Mapping[str, Any], shape: EngineShape
) -> VllmConfig:
    """A real ``VllmConfig`` for the tiny LLaVA with ECRedisConnector in ``role``."""
    from vllm.config import ECTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    ec_config = ECTransferConfig(
        ec_connector="ECRedisConnector",
        ec_connector_module_path="ec_redis.connector",
        ec_role=role,
        ec_connector_extra_config=dict(extra),
    )
    args = EngineArgs(
        model=str(model_dir),
        dtype="bfloat16",
        enforce_eager=True,
        seed=0,
        max_model_len=shape.max_model_len,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        block_size=shape.block_size,
        enable_prefix_caching=False,
        limit_mm_per_prompt={"image": shape.max_images_per_prompt},
        ec_transfer_config=ec_config,
    )
    return args.create_engine_config()


def build_scheduler(vllm_config: VllmConfig, shape: EngineShape) -> Scheduler:
    """vLLM's Scheduler over one full-attention KV group of ``shape.num_kv_blocks`` blocks
    (as vLLM's ``tests/v1/core/utils.py: create_scheduler`` builds it)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(
        block_size=shape.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=shape.num_kv_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = shape.num_kv_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=shape.block_size,
        log_stats=False,
    )


def image_request(
    request_id: str, images: Sequence[str], text_lengths: Sequence[int], max_tokens: int
) -> Request:
    """A prompt ``text, image, text, image, ..., text`` (``len(images) + 1`` text runs; each
    image is ``NUM_IMAGE_TOKENS`` placeholder tokens), as a real ``vllm.v1.request.Request``."""
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    assert len(text_lengths) == len(images) + 1
    tokens: list[int] = [TEXT_TOKEN_ID] * text_lengths[0]
    features: list[MultiModalFeatureSpec] = []
    for identifier, text_after in zip(images, text_lengths[1:], strict=True):
        features.append(
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),
                modality="image",
                identifier=identifier,
                mm_position=PlaceholderRange(offset=len(tokens), length=NUM_IMAGE_TOKENS),
            )
        )
        tokens += [IMAGE_TOKEN_ID] * NUM_IMAGE_TOKENS + [TEXT_TOKEN_ID] * text_after
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        mm_features=features,
    )


def publish(producer_config: VllmConfig, items: Mapping[str, int], width: int) -> None:
    """Save ``truth`` for each item (id -> num_embeds) through a producer's worker half, wait
    for the Redis writes (its cache's ``flush``; shutting down drains them too), shut it down."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ec_redis.connector import ECRedisConnector

    producer = ECRedisConnector(producer_config, ECConnectorRole.WORKER)
    try:
        for identifier, num_embeds in items.items():
            encoder_cache = {identifier: truth(identifier, num_embeds, width)}
            producer.save_caches(encoder_cache=encoder_cache, mm_hash=identifier)
        cache = getattr(producer, "_cache", None)
        assert cache is None or cache.flush(10.0), "publishing to Redis took over 10 s"
    finally:
        producer.shutdown()


class EngineDriver:
    """The engine loop (``EngineCore.step``): schedule, execute, abort, update_from_output."""

    def __init__(self, vllm_config: VllmConfig, shape: EngineShape) -> None:
        from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized, has_ec_transfer

        assert not has_ec_transfer(), "another test left vLLM's worker EC connector behind"
        self.failures: list[Failure] = []
        self.stats = DriverStats()
        self.alive = True
        self.scheduler = build_scheduler(vllm_config, shape)
        ensure_ec_transfer_initialized(vllm_config)  # the worker half, as gpu_worker does
        width = int(vllm_config.model_config.get_hidden_size())
        self.worker = SimulatedWorker(width, self.failures, self.stats)
        self.observers: list[Callable[[str], None]] = []

    @property
    def connector(self) -> Any:
        """The scheduler half of the connector (built by vLLM's factory in the scheduler)."""
        return self.scheduler.get_ec_connector()

    def add_request(self, request: Request) -> None:
        if not self.alive:
            return
        try:
            with self._guard("Scheduler.add_request"):
                self.scheduler.add_request(request)
        except EngineDied:
            pass

    def abort(self, request_ids: Iterable[str]) -> int:
        """``Scheduler.finish_requests(..., FINISHED_ABORTED)`` between steps (the engine's
        input queue); returns how many requests it ended."""
        if not self.alive:
            return 0
        try:
            return self._abort(request_ids, "between steps")
        except EngineDied:
            return 0

    def step(self, abort_mid_step: Callable[[SchedulerOutput], Iterable[str]] | None = None) -> int:
        """One engine step; returns the tokens scheduled. ``abort_mid_step`` picks requests to
        abort while the step executes (``EngineCore._process_aborts_queue``)."""
        if not self.alive:
            return 0
        self.stats.steps += 1
        self.worker.step = self.stats.steps
        try:
            with self._guard("Scheduler.schedule"):
                scheduler_output = self.scheduler.schedule()
            self.stats.preemptions += len(scheduler_output.preempted_req_ids or ())
            self._notify("schedule")
            with self._guard("worker.execute_model"):
                model_output = self.worker.execute_model(scheduler_output)
            if abort_mid_step is not None:
                self._abort(abort_mid_step(scheduler_output), "mid-step")
            with self._guard("Scheduler.update_from_output"):
                before = len(self.scheduler.requests)
                self.scheduler.update_from_output(scheduler_output, model_output)
            self.stats.finished += max(before - len(self.scheduler.requests), 0)
            self._notify("update_from_output")
        except EngineDied:
            return 0
        scheduled = int(scheduler_output.total_num_scheduled_tokens)
        self.stats.empty_steps += int(scheduled == 0)
        return scheduled

    def _abort(self, request_ids: Iterable[str], where: str) -> int:
        from vllm.v1.request import RequestStatus

        with self._guard(f"Scheduler.finish_requests ({where})"):
            aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.stats.aborts += len(aborted)
        return len(aborted)

    def has_requests(self) -> bool:
        return bool(self.scheduler.has_requests())

    def close(self) -> None:
        """Shut both halves down (vLLM: ``Scheduler.shutdown``, ``ensure_ec_transfer_shutdown``)."""
        from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown

        try:
            self.scheduler.shutdown()
        finally:
            ensure_ec_transfer_shutdown()

    def _notify(self, phase: str) -> None:
        for observer in self.observers:
            observer(phase)

    @contextmanager
    def _guard(self, where: str) -> Iterator[None]:
        """An exception escaping ``where`` kills the engine: record it, end the step."""
        try:
            yield
        except EngineDied:
            self.alive = False
            raise
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            origin = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
            self.failures.append(
                Failure(self.stats.steps, where, f"{type(exc).__name__}: {exc} (at {origin})")
            )
            self.alive = False
            raise EngineDied(where) from exc
