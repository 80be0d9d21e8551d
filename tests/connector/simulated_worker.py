"""vLLM's V1 model runner reduced to the encoder cache and the EC connector calls.

Mirrors ``GPUModelRunner``: ``_update_states`` (finished requests, freed encoder outputs, new
and cached requests), the EC context of ``ECConnectorModelRunnerMixin`` (vLLM's own code:
bind, start_save, start_load, ..., get_finished, worker meta, clear), ``_execute_mm_encoder`` /
``_cache_encoder_output`` (encode, cache, offer to save; a feature without media,
``data is None``, is skipped exactly as ``_batch_mm_inputs_from_scheduler`` skips it) and
``_gather_mm_embeddings`` (every item overlapping a scheduled token range must be cached, else
"Encoder cache miss"; vLLM slices what it finds, so a tensor of other rows would be read
silently: here it is a failure). "Encoding" an item yields ``truth(id, rows)``, the same tensor
producers publish, so every load is checked bit-exactly against what the reading request
needs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

SAMPLED_TOKEN_ID = 11  # never the EOS id (None): requests stop at max_tokens
TRUTH_CACHE_BYTES = 160 * 1024 * 1024  # big items are 4-12 MiB: remember a dozen of them


@dataclass
class Failure:
    """Something the engine or the checks caught: where, at which step, and what."""

    step: int
    where: str
    message: str

    def __str__(self) -> str:
        return f"step {self.step}, {self.where}: {self.message}"


@dataclass
class DriverStats:
    """What one run did (the per-seed summary; the test checks the chaos happened)."""

    steps: int = 0
    empty_steps: int = 0
    loads: int = 0
    loaded_bytes: int = 0
    big_loads: int = 0  # items of at least BIG_BYTES
    local_encodes: int = 0
    split_images: int = 0  # a step's token range covered only part of an image
    preemptions: int = 0
    aborts: int = 0
    finished: int = 0
    errored: int = 0  # finished with FINISHED_ERROR (retryable)
    media_less_loaded: int = 0  # items without media that came from the connector


BIG_BYTES = 4 * 1024 * 1024


class _TruthCache:
    """The last few truths, bounded in bytes: a 12 MiB truth takes ~50 ms to draw."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._items: OrderedDict[tuple[str, int, int], torch.Tensor] = OrderedDict()

    def get(self, identifier: str, num_embeds: int, width: int) -> torch.Tensor:
        key = (identifier, num_embeds, width)
        found = self._items.get(key)
        if found is not None:
            self._items.move_to_end(key)
            return found
        made = _draw_truth(identifier, num_embeds, width)
        self._items[key] = made
        self._bytes += made.numel() * made.element_size()
        while self._bytes > self._max_bytes and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        return made


def _draw_truth(identifier: str, num_embeds: int, width: int) -> torch.Tensor:
    # The row count is part of the seed: a client uuid reused for other content (other
    # rows) has other bytes, so neither a prefix nor an extension of one passes as the other.
    digest = hashlib.sha256(f"{identifier}\0{num_embeds}\0{width}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_embeds, width, generator=gen).to(torch.bfloat16)


_TRUTHS = _TruthCache(TRUTH_CACHE_BYTES)


def truth(identifier: str, num_embeds: int, width: int) -> torch.Tensor:
    """The encoder output of item ``identifier`` with ``num_embeds`` rows: bf16
    ``[num_embeds, width]`` drawn from both (shared: callers must not modify it)."""
    return _TRUTHS.get(identifier, num_embeds, width)


def bit_exact(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
    )


class EngineDied(Exception):
    """A failure that stops a real engine (an escaped exception, an encoder-cache miss)."""


@dataclass
class _RequestState:
    """What the V1 runner keeps per request (``CachedRequestState``), reduced."""

    mm_features: list[MultiModalFeatureSpec]
    num_tokens: int
    num_computed_tokens: int = 0


@dataclass
class SimulatedWorker:
    """vLLM's V1 GPUModelRunner, reduced to the encoder cache and the EC connector calls."""

    width: int
    failures: list[Failure]
    stats: DriverStats
    trace: list[tuple[object, ...]] = field(default_factory=list)
    encoder_cache: dict[str, torch.Tensor] = field(default_factory=dict)
    requests: dict[str, _RequestState] = field(default_factory=dict)
    step: int = 0
    # vLLM's runner on an instance that is not a consumer (an ``mm_encoder_only`` encoder):
    # the EC context and the encoder only, an output without tokens (``execute_model``).
    encoder_only: bool = False
    # identifier -> (rows, the tensor object) already compared bit-exactly with the truth
    _verified: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
        from vllm.v1.worker.ec_connector_model_runner_mixin import (
            ECConnectorModelRunnerMixin as Mixin,
        )

        self._update_states(scheduler_output)
        if self.encoder_only:
            return self._execute_encoder_only(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT  # V1 skips the EC context on empty steps
        before = dict(self.encoder_cache)
        with Mixin.maybe_get_ec_connector_output(
            scheduler_output, encoder_cache=self.encoder_cache
        ) as ec_connector_output:
            loaded = sorted(k for k, v in self.encoder_cache.items() if before.get(k) is not v)
            self._check_loads(scheduler_output, loaded)
            encoded = self._execute_mm_encoder(scheduler_output)
            self._gather_mm_embeddings(scheduler_output)
        self.trace.append(("exec", self.step, tuple(loaded), tuple(encoded)))
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            state = self.requests[req_id]
            end = state.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id]
            done_prompt = end >= state.num_tokens  # a partial prefill's sample is discarded
            sampled.append([SAMPLED_TOKEN_ID] if done_prompt else [])
            state.num_tokens += int(done_prompt)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            ec_connector_output=ec_connector_output,
        )

    def _execute_encoder_only(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """``GPUModelRunner.execute_model`` when the EC connector is not a consumer: the EC
        context (also on an empty step) around the encoder, then an output that carries no
        tokens and, as vLLM's, no ``ec_connector_output``; the scheduler finishes a request
        of an ``mm_encoder_only`` instance once its prompt is consumed."""
        from vllm.v1.outputs import make_empty_encoder_model_runner_output
        from vllm.v1.worker.ec_connector_model_runner_mixin import (
            ECConnectorModelRunnerMixin as Mixin,
        )

        with Mixin.maybe_get_ec_connector_output(
            scheduler_output, encoder_cache=self.encoder_cache
        ):
            encoded = self._execute_mm_encoder(scheduler_output)
        self.trace.append(("exec", self.step, (), tuple(encoded)))
        output: ModelRunnerOutput = make_empty_encoder_model_runner_output(scheduler_output)
        return output

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """``GPUModelRunner._update_states``: forget finished requests, drop freed encoder
        outputs (``_process_encoder_cache_scheduler_output``), take in new and cached ones."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
            self._verified.pop(mm_hash, None)
        for new in scheduler_output.scheduled_new_reqs:
            prompt_len = len(new.prompt_token_ids or ())
            self.requests[new.req_id] = _RequestState(
                list(new.mm_features), prompt_len, new.num_computed_tokens
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.requests[req_id].num_computed_tokens = num_computed

    def _in_window(
        self, scheduler_output: SchedulerOutput
    ) -> Iterator[tuple[str, MultiModalFeatureSpec, int, int]]:
        """Every (request, feature, start_idx, end_idx) whose placeholder overlaps the
        request's scheduled token range this step and holds embeddings there."""
        from vllm.multimodal.utils import get_mm_features_in_window

        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start = state.num_computed_tokens
            lo, hi = get_mm_features_in_window(state.mm_features, start, start + num_scheduled)
            for feature in state.mm_features[lo:hi]:
                position = feature.mm_position
                start_idx = max(start - position.offset, 0)
                end_idx = min(start - position.offset + num_scheduled, position.length)
                first, last = position.get_embeds_indices_in_range(start_idx, end_idx)
                if first != last:
                    yield req_id, feature, start_idx, end_idx

    def _check_loads(self, scheduler_output: SchedulerOutput, loaded: list[str]) -> None:
        """Every tensor the connector put into the encoder cache is the truth for its id at
        the rows of every scheduled request that reads it this step (a client uuid reused
        with other rows must never get the other tensor), else of some live request."""
        readers: dict[str, list[tuple[str, int]]] = {}
        for req_id, feature, _, _ in self._in_window(scheduler_output):
            readers.setdefault(feature.identifier, []).append(
                (req_id, feature.mm_position.get_num_embeds())
            )
        for identifier in loaded:
            got = self.encoder_cache[identifier]
            self.stats.loads += 1
            nbytes = got.numel() * got.element_size()
            self.stats.loaded_bytes += nbytes
            self.stats.big_loads += int(nbytes >= BIG_BYTES)
            wanted = readers.get(identifier)
            if not wanted:  # loaded ahead of the step that reads it: some request's rows
                live = sorted(
                    {
                        f.mm_position.get_num_embeds()
                        for state in self.requests.values()
                        for f in state.mm_features
                        if f.identifier == identifier
                    }
                )
                if not live:
                    self._fail("start_load_caches", f"loaded {identifier!r}, which no request has")
                elif not any(bit_exact(got, self._truth(identifier, rows)) for rows in live):
                    self._fail(
                        "start_load_caches",
                        f"loaded {identifier!r} {tuple(got.shape)} {got.dtype}: the truth for "
                        f"none of the rows live requests need ({live} x {self.width} bf16)",
                    )
                continue
            for req_id, rows in wanted:
                if not bit_exact(got, self._truth(identifier, rows)):
                    self._fail(
                        "start_load_caches",
                        f"loaded {identifier!r} {tuple(got.shape)} {got.dtype} for request "
                        f"{req_id}, which needs {rows} x {self.width} bf16: not its bytes"
                        + (" (other rows)" if got.shape[0] != rows else ""),
                    )
                else:
                    self._verified[identifier] = (rows, got)

    def _execute_mm_encoder(self, scheduler_output: SchedulerOutput) -> list[str]:
        """``_execute_mm_encoder`` + ``_cache_encoder_output``: encode, cache, offer to save.
        A feature without media (``data is None``) is skipped, as vLLM does; its gather
        then fails: that is the engine's death, reported here with the cause."""
        from vllm.v1.worker.ec_connector_model_runner_mixin import (
            ECConnectorModelRunnerMixin as Mixin,
        )

        encoded: list[str] = []
        for req_id, input_ids in sorted(scheduler_output.scheduled_encoder_inputs.items()):
            for input_id in input_ids:
                feature = self.requests[req_id].mm_features[input_id]
                if feature.data is None:
                    self._fail(
                        "_gather_mm_embeddings",
                        f"Encoder cache miss for {feature.identifier} (request {req_id}, "
                        f"input {input_id}): scheduled for a local encode but it has no media "
                        "(data=None); vLLM skips encoding it and the gather fails",
                    )
                    raise EngineDied(feature.identifier)
                rows = feature.mm_position.get_num_embeds()
                output = self._truth(feature.identifier, rows)
                self.stats.local_encodes += 1
                self.encoder_cache[feature.identifier] = output
                self._verified[feature.identifier] = (rows, output)
                encoded.append(feature.identifier)
                Mixin.maybe_save_ec_to_connector(self.encoder_cache, feature.identifier)
        return encoded

    def _gather_mm_embeddings(self, scheduler_output: SchedulerOutput) -> None:
        """``_gather_mm_embeddings``: every item overlapping a scheduled token range must be
        in the encoder cache (else vLLM raises "Encoder cache miss"), with the right bytes
        and rows (vLLM would slice a tensor of other rows without a word)."""
        for req_id, feature, start_idx, end_idx in self._in_window(scheduler_output):
            position = feature.mm_position
            self.stats.split_images += int(end_idx - start_idx < position.length)
            got = self.encoder_cache.get(feature.identifier)
            if got is None:
                self._fail(
                    "_gather_mm_embeddings",
                    f"Encoder cache miss for {feature.identifier} (request {req_id})",
                )
                raise EngineDied(feature.identifier)
            if feature.data is None:
                self.stats.media_less_loaded += int(start_idx == 0)
            rows = position.get_num_embeds()
            verified = self._verified.get(feature.identifier)
            if verified is not None and verified[0] == rows and verified[1] is got:
                continue  # the very tensor already compared with this truth
            if not bit_exact(got, self._truth(feature.identifier, rows)):
                self._fail(
                    "_gather_mm_embeddings",
                    f"request {req_id} would read {feature.identifier!r} {tuple(got.shape)}: "
                    f"not its bytes (it needs {rows} x {self.width} bf16)",
                )
            else:
                self._verified[feature.identifier] = (rows, got)

    def _truth(self, identifier: str, rows: int) -> torch.Tensor:
        return truth(identifier, rows, self.width)

    def _fail(self, where: str, message: str) -> None:
        self.failures.append(Failure(self.step, where, message))
