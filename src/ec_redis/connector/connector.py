"""ECRedisConnector: vLLM's Encoder-Cache connector over ec_redis's tiered cache.

A thin facade: vLLM builds one instance per role — the scheduler half in the engine core,
the worker half in every worker process — and each delegates to ``SchedulerSide`` or
``WorkerSide``. Configuration comes from ``ec_connector_extra_config`` (parsed once; a bad key
fails engine start-up with the key and an example); the model identity comes from vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from ec_redis.config import parse_extra_config
from ec_redis.connector import channel, shared, transport
from ec_redis.connector.checks import TensorCheck
from ec_redis.connector.ids import check_item_ids
from ec_redis.connector.metadata import ECRedisMetadata
from ec_redis.connector.reporting import Reporter
from ec_redis.connector.scheduler import SchedulerSide
from ec_redis.connector.stats import ECRedisPromMetrics, ECRedisStats
from ec_redis.connector.worker import WorkerSide
from ec_redis.fingerprint import weights_fingerprint
from ec_redis.keys import ModelIdentity
from ec_redis.logutil import logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class ECRedisConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config
        config, options = parse_extra_config(extra)
        check_item_ids(vllm_config, options.trust_client_uuids)
        self.identity = model_identity(vllm_config, config)
        if role == ECConnectorRole.WORKER and transport.workers_in_other_processes(vllm_config):
            # Nothing ever reads a worker process's local tiers (lookups are the scheduler
            # half's): it keeps only its write queue, not a second cpu_cache_bytes.
            config = dataclasses.replace(config, cpu_cache_bytes=0, gpu_cache_bytes=0)
        self._cache = shared.acquire(config, self.identity)  # host reads: no CUDA (shared.py)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._reporter: Reporter | None = None
        self._publisher: channel.Publisher | None = None
        stage_dir = options.stage_dir or transport.default_directory()
        key = channel.channel_key(
            str(vllm_config.ec_transfer_config.engine_id), _dp_rank(vllm_config)
        )
        if role == ECConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                self._cache,
                options,
                TensorCheck(
                    _model_dtype(vllm_config), _width_lookup(vllm_config), self.identity.width
                ),
                is_producer=self.is_producer,
                is_consumer=self.is_consumer,
                transport=transport.choose(
                    vllm_config, options.stage_transport, stage_dir, options.stage_spare_bytes
                ),
            )
            self._reporter = Reporter(self._scheduler, self._cache, channel.Reader(stage_dir, key))
        else:
            # One rank speaks for the instance, saves and metrics: TP and prefill-context
            # ranks hold the same encoder outputs, and only the first pipeline stage has any.
            speaks = not any(_parallel_ranks())
            self._worker = WorkerSide(
                self._cache,
                _rank_device(),
                is_producer=self.is_producer,
                saves=self.is_producer and speaks,
                # Only a pure producer has consumers waiting for what it just encoded.
                save_wait_s=options.save_wait_s if not self.is_consumer else 0.0,
            )
            if speaks:
                self._publisher = channel.Publisher(stage_dir, key, self._worker.channel_snapshot)
        logger.info(
            "ec_redis: %s connector (%s) for %s; redis %s",
            role.name.lower(),
            vllm_config.ec_transfer_config.ec_role,
            self.identity,
            config.describe()["redis_url"] or "off (local tiers only)",
        )
        self._closed = False

    # -- worker side ------------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_caches(encoder_cache, self._connector_metadata)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        if self._worker is not None and self.is_producer:  # V1 calls this on consumers too
            self._worker.save_caches(encoder_cache, mm_hash, self._connector_metadata)

    def start_save_caches(self, **kwargs: Any) -> None:
        encoder_cache = kwargs.get("encoder_cache")
        if self._worker is not None and self.is_producer and encoder_cache is not None:
            self._worker.start_save_caches(encoder_cache, self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        """The end of every step (V1 and V2): after the step's saves have landed (a pure
        producer waits for them), publish what the step did before vLLM hands its output to
        the scheduler half, which reports it while processing that output."""
        if self._worker is None:
            return None
        meta = self._connector_metadata
        worker_meta = self._worker.worker_meta(meta)
        if self._publisher is not None:
            if isinstance(meta, ECRedisMetadata):
                self._worker.forget_observations(meta.stats_ack.get(self._publisher.name, 0))
            self._publisher.publish()
        return worker_meta

    # -- scheduler side ---------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        return self._scheduler is not None and self._scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self._scheduler is None:
            return True
        return self._scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        assert self._scheduler is not None, "build_connector_meta is a scheduler-side hook"
        meta = self._scheduler.build_connector_meta(scheduler_output)
        if self._reporter is not None:
            try:
                meta.stats_ack = self._reporter.acks()
            except Exception as exc:  # workers then simply keep their observations longer
                self._scheduler.internal_error("build_connector_meta", exc)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def update_state_after_free(self, request: Request, index: int) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_free(request, index)

    def take_unavailable_requests(self) -> set[str]:
        return self._scheduler.take_unavailable_requests() if self._scheduler else set()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # -- both sides -------------------------------------------------------------------------

    def get_ec_connector_stats(self) -> ECRedisStats | None:
        """Per-interval increments, reported by the scheduler half for the whole instance (its
        own and the worker halves', ``channel.py``); a worker half reports nothing here, so
        V1 (which never asks a worker) and V2 (which does) count everything exactly once."""
        if self._reporter is None:
            return None
        try:
            data = self._reporter.take()
        except Exception as exc:
            if self._scheduler is not None:
                self._scheduler.internal_error("get_ec_connector_stats", exc)
            return None
        return ECRedisStats(data=data) if data else None

    def live_state(self) -> dict[str, int]:
        """Sizes of the scheduler half's tables (per request, per item, per step) and its
        staging bytes; empty on the worker half."""
        return self._scheduler.live_state() if self._scheduler is not None else {}

    def stats_snapshot(self) -> dict[str, Any]:
        """Cumulative counters of this half (the scheduler half: its lookups and its cache's
        read side; a worker half: its saves and loads)."""
        if self._worker is not None:
            return self._worker.snapshot()
        assert self._reporter is not None
        return self._reporter.snapshot()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        steps: list[Callable[[], None]] = []
        if self._scheduler is not None:
            steps.append(self._scheduler.shutdown)
        if self._publisher is not None:
            steps.append(self._publisher.close)
        if self._reporter is not None:
            steps.append(self._reporter.close)
        steps.append(lambda: shared.release(self._cache))
        for step in steps:
            try:  # each part lets go of its files, threads and sockets whatever the others do
                step()
            except Exception as exc:
                logger.warning("ec_redis: shutdown step failed: %r", exc)

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECRedisStats | None:
        return ECRedisStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECRedisPromMetrics:
        return ECRedisPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def model_identity(vllm_config: Any, config: Any) -> ModelIdentity:
    """The model identity every key carries; explicit config values override vLLM's. The
    weights part comes from the checkpoint vLLM loads unless ``model_fingerprint`` pins it."""
    model = vllm_config.model_config
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    return ModelIdentity(
        name=config.model_name or str(model.model),
        revision=config.model_revision or str(model.revision or ""),
        dtype=config.model_dtype or str(_model_dtype(vllm_config)).removeprefix("torch."),
        width=config.embed_width or int(model.get_hidden_size()),
        weights=config.model_fingerprint
        or weights_fingerprint(
            str(model.model),
            str(model.revision) if model.revision else None,
            hub_cache_dirs=[download_dir] if isinstance(download_dir, str) else [],
        ),
    )


def _model_dtype(vllm_config: Any) -> torch.dtype:
    dtype = vllm_config.model_config.dtype
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))


def _width_lookup(vllm_config: Any) -> Any:
    """Encoder output width per modality: measured at producer start-up, else unknown."""

    def width_for(modality: str) -> int | None:
        widths = getattr(vllm_config.ec_transfer_config, "mm_encoder_output_widths", None) or {}
        width = widths.get(modality)
        return int(width) if width else None

    return width_for


def _dp_rank(vllm_config: Any) -> int:
    rank = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0)
    return rank if isinstance(rank, int) else 0


def _rank_device() -> torch.device:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return torch.device(f"{current_platform.device_type}:{current_platform.current_device()}")
    return torch.device("cpu")


def _parallel_ranks() -> tuple[int, ...]:
    """This worker's (tensor, pipeline, prefill-context) parallel ranks; zeros outside a
    distributed setup."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return (0,)
    ranks = [ps.get_tensor_model_parallel_rank(), ps.get_pp_group().rank_in_group]
    pcp = getattr(ps, "_PCP", None)  # prefill context parallel (vLLM >= 0.11)
    if pcp is not None:
        ranks.append(pcp.rank_in_group)
    return tuple(ranks)
