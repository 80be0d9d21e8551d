"""Drive vLLM's real v1 ``Scheduler`` and a worker-role EC connector the way the engine does.

One process, as vLLM's single-process (``uni``) executor has it: the ``Scheduler`` builds the
scheduler half of the connector through vLLM's factory; the worker half is vLLM's per-process
singleton (``ensure_ec_transfer_initialized``, as ``gpu_worker`` does), driven by the
simulated model runner in ``simulated_worker``. ``EngineDriver.step`` is ``EngineCore.step``
(schedule, execute, process aborts, ``update_from_output``) or, with ``async_scheduling``,
``EngineCore.step_with_batch_queue`` over vLLM's ``AsyncScheduler``: step N+1 is scheduled
and executed before the output of step N is processed (a batch queue of two, as the ``uni``
executor's ``max_concurrent_batches`` is under async scheduling; its ``execute_model`` runs
the worker at once, so the worker sees steps in schedule order).

An exception that escapes a scheduler or connector call ends the engine, as in vLLM, and is
recorded as a ``Failure``; so is an encoder-cache miss (vLLM: ``RuntimeError: Encoder cache
miss``) and a tensor in the encoder cache that is not the truth for its id and rows.
Observers run after every scheduler and connector call (``add_request``, aborts, ``schedule``,
the worker's step, ``update_from_output``), and everything that decides what happens next
is appended to ``trace``, so two runs of one seed can be compared event by event.
"""

from __future__ import annotations

import os
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

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
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

TEXT_TOKEN_ID = 10
BATCH_QUEUE_SIZE = 2  # the uni executor's max_concurrent_batches under async scheduling


@dataclass(frozen=True)
class EngineShape:
    """Limits small enough that chunked prefill splits images and KV blocks run out.

    ``encoder_cache_tokens`` / ``encoder_compute_tokens`` override what vLLM derives from
    ``max_num_batched_tokens`` (``SchedulerConfig.encoder_cache_size`` and
    ``max_num_encoder_input_tokens``): items far larger than the tiny model's own 16-token
    images need room in the encoder cache without a step of that many tokens."""

    max_num_seqs: int = 4
    max_num_batched_tokens: int = 48
    block_size: int = 16
    num_kv_blocks: int = 12
    max_model_len: int = 256
    max_images_per_prompt: int = 3
    encoder_cache_tokens: int | None = None
    encoder_compute_tokens: int | None = None
    # vLLM admits a request only if its whole prompt fits the KV cache (True, its default),
    # or once its first chunk does (``--no-scheduler-reserve-full-isl``): then prefills
    # preempt each other.
    reserve_full_isl: bool = True


class Item(NamedTuple):
    """One multimodal item of a prompt: its id, its rows (= placeholder tokens) and whether
    the request carries its media (a proxy's metadata-only rewrite has none)."""

    identifier: str
    rows: int
    media: bool = True


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
        scheduler_reserve_full_isl=shape.reserve_full_isl,
        ec_transfer_config=ec_config,
    )
    # The tiny model has 512 positions; the scheduler never runs it, so longer prompts (items
    # of many rows) are fine here.
    with _env("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1"):
        config = args.create_engine_config()
    if shape.encoder_cache_tokens is not None:
        config.scheduler_config.encoder_cache_size = shape.encoder_cache_tokens
    if shape.encoder_compute_tokens is not None:
        config.scheduler_config.max_num_encoder_input_tokens = shape.encoder_compute_tokens
    return config


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def build_scheduler(
    vllm_config: VllmConfig, shape: EngineShape, *, async_scheduling: bool = False
) -> Scheduler:
    """vLLM's Scheduler (``AsyncScheduler`` with ``async_scheduling``) over one
    full-attention KV group of ``shape.num_kv_blocks`` blocks (as vLLM's
    ``tests/v1/core/utils.py: create_scheduler`` builds it)."""
    import torch
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
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
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=shape.block_size,
        log_stats=False,
    )


def image_request(
    request_id: str,
    images: Sequence[str | Item],
    text_lengths: Sequence[int],
    max_tokens: int,
) -> Request:
    """A prompt ``text, image, text, image, ..., text`` (``len(images) + 1`` text runs), as a
    real ``vllm.v1.request.Request``. An image given by id alone has the tiny model's
    ``NUM_IMAGE_TOKENS`` rows and its media; an ``Item`` says both."""
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalKwargsItem,
        PlaceholderRange,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from ec_redis.demo.tiny_model import IMAGE_TOKEN_ID, NUM_IMAGE_TOKENS

    assert len(text_lengths) == len(images) + 1
    tokens: list[int] = [TEXT_TOKEN_ID] * text_lengths[0]
    features: list[MultiModalFeatureSpec] = []
    for image, text_after in zip(images, text_lengths[1:], strict=True):
        item = image if isinstance(image, Item) else Item(image, NUM_IMAGE_TOKENS)
        features.append(
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy() if item.media else None,
                modality="image",
                identifier=item.identifier,
                mm_position=PlaceholderRange(offset=len(tokens), length=item.rows),
            )
        )
        tokens += [IMAGE_TOKEN_ID] * item.rows + [TEXT_TOKEN_ID] * text_after
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        pooling_params=None,
        mm_features=features,
    )


class Producer:
    """An encoder instance's worker half (``ec_producer``) alive for a whole run: publishes
    ``truth`` for items as its ``save_caches`` would, and waits for the Redis writes.

    Give it a configuration whose cache settings differ from the consumer's (e.g. its own
    ``producer_id``): one process shares one ``TieredCache`` per configuration
    (``ec_redis.connector.shared``), and a producer sharing the consumer's would hand it
    every item through the local tiers, never through Redis."""

    def __init__(self, producer_config: VllmConfig, width: int) -> None:
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

        from ec_redis.connector import ECRedisConnector

        self.width = width
        self.connector = ECRedisConnector(producer_config, ECConnectorRole.WORKER)
        self.published = 0

    def publish(self, items: Iterable[tuple[str, int]], timeout_s: float = 10.0) -> bool:
        """Save each (id, rows) and wait for its Redis write (stored or failed) before the
        next: the writer replaces a queued write of the same id with a newer one, so two
        versions of one id saved back to back would reach Redis once or twice, as the
        writer thread happens to run. True if every write was done within ``timeout_s``."""
        done = True
        for identifier, rows in items:
            encoder_cache = {identifier: truth(identifier, rows, self.width)}
            self.connector.save_caches(encoder_cache=encoder_cache, mm_hash=identifier)
            self.published += 1
            done = self.flush(timeout_s) and done
        return done

    def flush(self, timeout_s: float = 10.0) -> bool:
        return flush_writes(self.connector, timeout_s)

    def redis_stats(self) -> dict[str, float]:
        """The Redis tier's counters of the producer's cache (writes, OOM refusals, ...)."""
        cache = getattr(self.connector, "_cache", None)
        stats = cache.stats() if cache is not None else {}
        return dict(stats.get("redis", {}))

    def close(self) -> None:
        self.connector.shutdown()


def flush_writes(connector: Any, timeout_s: float = 10.0) -> bool:
    """Wait for the Redis writes queued by ``connector``'s cache (its writer thread).

    No public hook says "your writes are done"; the cache is the connector's ``_cache``."""
    cache = getattr(connector, "_cache", None)
    return cache is None or bool(cache.flush(timeout_s))


def publish(producer_config: VllmConfig, items: Mapping[str, int], width: int) -> None:
    """Save ``truth`` for each item (id -> num_embeds) through a producer's worker half, wait
    for the Redis writes, shut it down."""
    producer = Producer(producer_config, width)
    try:
        assert producer.publish(items.items()), "publishing to Redis took over 10 s"
    finally:
        producer.close()


class EngineDriver:
    """The engine loop (``EngineCore.step``, or ``step_with_batch_queue`` with
    ``async_scheduling``): schedule, execute, abort, update_from_output."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        shape: EngineShape,
        *,
        async_scheduling: bool = False,
        own_worker: bool = False,
        width: int | None = None,
        encoder_only: bool = False,
    ) -> None:
        """``own_worker``: the worker half is this driver's own, not vLLM's per-process
        singleton, so several instances (each its own scheduler and worker half) run in one
        process; it is installed as the singleton only while this driver's worker step runs.
        ``width``: the encoder outputs' width (default the model's hidden size; give the
        connector the same ``embed_width``). ``encoder_only``: the worker runs as vLLM's
        runner does on an instance that is not a consumer (``ec_producer``, which vLLM makes
        ``mm_encoder_only``): the encoder and the EC context only, no gather, no tokens."""
        from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized, has_ec_transfer

        if not own_worker:
            assert not has_ec_transfer(), "another test left vLLM's worker EC connector behind"
        self.failures: list[Failure] = []
        self.stats = DriverStats()
        self.trace: list[tuple[object, ...]] = []
        self.alive = True
        self.closed = False
        self.async_scheduling = async_scheduling
        self.scheduler = build_scheduler(vllm_config, shape, async_scheduling=async_scheduling)
        self._own_worker: Any = None
        if own_worker:
            from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
            from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

            # Built as ensure_ec_transfer_initialized builds the singleton.
            self._own_worker = ECConnectorFactory.create_connector(
                config=vllm_config, role=ECConnectorRole.WORKER
            )
        else:
            ensure_ec_transfer_initialized(vllm_config)  # the worker half, as gpu_worker does
        width = width or int(vllm_config.model_config.get_hidden_size())
        self.worker = SimulatedWorker(
            width, self.failures, self.stats, self.trace, encoder_only=encoder_only
        )
        self.observers: list[Callable[[str], None]] = []
        self.finish_reasons: dict[str, str] = {}  # request id -> vLLM's finish reason
        self._during: Callable[[str], None] | None = None
        self._batch_queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    @property
    def connector(self) -> Any:
        """The scheduler half of the connector (built by vLLM's factory in the scheduler)."""
        return self.scheduler.get_ec_connector()

    @property
    def worker_connector(self) -> Any:
        """The worker half (vLLM's per-process singleton, or this driver's own)."""
        from vllm.distributed.ec_transfer import get_ec_transfer

        return self._own_worker if self._own_worker is not None else get_ec_transfer()

    @contextmanager
    def _as_worker(self) -> Iterator[None]:
        """With ``own_worker``: this driver's worker half is vLLM's singleton meanwhile."""
        if self._own_worker is None:
            yield
            return
        from vllm.distributed.ec_transfer import ec_transfer_state

        before = ec_transfer_state._EC_CONNECTOR_AGENT
        ec_transfer_state._EC_CONNECTOR_AGENT = self._own_worker
        try:
            yield
        finally:
            ec_transfer_state._EC_CONNECTOR_AGENT = before

    def add_request(self, request: Request) -> None:
        if not self.alive:
            return
        self.trace.append(("add", request.request_id))
        try:
            with self._guard("Scheduler.add_request"):
                self.scheduler.add_request(request)
            self._notify(f"add_request {request.request_id}")
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

    def step(
        self,
        abort_mid_step: Callable[[SchedulerOutput], Iterable[str]] | None = None,
        during: Callable[[str], None] | None = None,
    ) -> int:
        """One engine step; returns the tokens scheduled. ``abort_mid_step`` picks requests to
        abort while the step executes (``EngineCore._process_aborts_queue``); ``during`` is
        called after ``schedule`` and after the worker's step, before the output is
        processed: what background threads (lookups) may do while a step is in flight."""
        if not self.alive:
            return 0
        self.stats.steps += 1
        self.worker.step = self.stats.steps
        self._during = during
        try:
            if self.async_scheduling:
                scheduled = self._step_with_batch_queue(abort_mid_step)
            else:
                scheduler_output = self._schedule()
                model_output = self._execute(scheduler_output)
                self._update(scheduler_output, model_output, abort_mid_step)
                scheduled = int(scheduler_output.total_num_scheduled_tokens)
        except EngineDied:
            return 0
        finally:
            self._during = None
        self.stats.empty_steps += int(scheduled == 0)
        return scheduled

    def _step_with_batch_queue(
        self, abort_mid_step: Callable[[SchedulerOutput], Iterable[str]] | None
    ) -> int:
        """``EngineCore.step_with_batch_queue``: fill the queue first; process the oldest
        output only when the queue is full or nothing more can be scheduled."""
        scheduled = 0
        if self.scheduler.has_requests():
            scheduler_output = self._schedule()
            model_output = self._execute(scheduler_output)
            scheduled = int(scheduler_output.total_num_scheduled_tokens)
            self._batch_queue.appendleft((scheduler_output, model_output))
            if len(self._batch_queue) < BATCH_QUEUE_SIZE and (
                scheduled > 0 or self.scheduler.has_requests()
            ):
                return scheduled
        elif not self._batch_queue:
            return 0
        oldest, model_output = self._batch_queue.pop()
        self._update(oldest, model_output, abort_mid_step)
        return scheduled

    def _schedule(self) -> SchedulerOutput:
        with self._guard("Scheduler.schedule"):
            scheduler_output = self.scheduler.schedule()
        preempted = sorted(scheduler_output.preempted_req_ids or ())
        self.stats.preemptions += len(preempted)
        self.trace.append(
            (
                "schedule",
                self.stats.steps,
                tuple(sorted(scheduler_output.num_scheduled_tokens.items())),
                tuple(
                    (req_id, tuple(ids))
                    for req_id, ids in sorted(scheduler_output.scheduled_encoder_inputs.items())
                ),
                tuple(preempted),
                tuple(sorted(scheduler_output.finished_req_ids)),
            )
        )
        self._notify("schedule")
        self._meanwhile("after schedule")
        return scheduler_output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        with self._guard("worker.execute_model"), self._as_worker():
            model_output = self.worker.execute_model(scheduler_output)
        self._notify("worker.execute_model")
        self._meanwhile("after the worker's step")
        return model_output

    def _update(
        self,
        scheduler_output: SchedulerOutput,
        model_output: ModelRunnerOutput,
        abort_mid_step: Callable[[SchedulerOutput], Iterable[str]] | None,
    ) -> None:
        if abort_mid_step is not None:
            self._abort(abort_mid_step(scheduler_output), "mid-step")
        with self._guard("Scheduler.update_from_output"):
            outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        finished: list[tuple[str, str]] = []
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.finish_reason is not None:
                    reason = str(getattr(output.finish_reason, "name", output.finish_reason))
                    finished.append((output.request_id, reason))
        for request_id, reason in finished:
            self.finish_reasons[request_id] = reason
            self.stats.finished += 1
            self.stats.errored += int(reason == "ERROR")
        self.trace.append(("update", self.stats.steps, tuple(sorted(finished))))
        self._notify("update_from_output")

    def _abort(self, request_ids: Iterable[str], where: str) -> int:
        from vllm.v1.request import RequestStatus

        wanted = sorted(request_ids)
        with self._guard(f"Scheduler.finish_requests ({where})"):
            aborted = self.scheduler.finish_requests(wanted, RequestStatus.FINISHED_ABORTED)
        ids = sorted(r.request_id for r in aborted)
        for request_id in ids:
            self.finish_reasons[request_id] = "ABORT"
        self.stats.aborts += len(aborted)
        self.trace.append(("abort", where, tuple(ids)))
        self._notify(f"finish_requests ({where}) {ids}")
        return len(aborted)

    def has_requests(self) -> bool:
        """Whether the engine loop would step (vLLM: requests, or a batch in flight)."""
        return bool(self.scheduler.has_requests()) or bool(self._batch_queue)

    def features(self, request_id: str) -> list[MultiModalFeatureSpec]:
        request = self.scheduler.requests.get(request_id)
        return list(request.mm_features) if request is not None else []

    def close(self) -> None:
        """Shut both halves down (vLLM: ``Scheduler.shutdown``, ``ensure_ec_transfer_shutdown``);
        a second call does nothing."""
        from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown

        if self.closed:
            return
        self.closed = True
        try:
            self.scheduler.shutdown()
        finally:
            if self._own_worker is not None:
                self._own_worker.shutdown()
            else:
                ensure_ec_transfer_shutdown()

    def _notify(self, phase: str) -> None:
        for observer in self.observers:
            observer(phase)

    def _meanwhile(self, phase: str) -> None:
        if self._during is not None:
            self._during(phase)

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
