"""vLLM's V1 model runner reduced to the encoder cache and the EC connector calls.

Mirrors ``GPUModelRunner``: ``_update_states`` (finished requests, freed encoder outputs, new
and cached requests), the EC context of ``ECConnectorModelRunnerMixin`` (vLLM's own code:
bind, start_save, start_load, ..., get_finished, worker meta, clear), ``_execute_mm_encoder`` /
``_cache_encoder_output`` (encode, cache, offer to save) and ``_gather_mm_embeddings`` (every
item overlapping a scheduled token range must be cached). "Encoding" an item yields
``truth(id)``, the same tensor producers publish, so every load is checked bit-exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

SAMPLED_TOKEN_ID = 11  # never the EOS id (None): requests stop at max_tokens


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
    local_encodes: int = 0
    split_images: int = 0  # a step's token range covered only part of an image
    preemptions: int = 0
    aborts: int = 0
    finished: int = 0


def truth(identifier: str, num_embeds: int, width: int) -> torch.Tensor:
    """The encoder output of item ``identifier``: bf16 ``[num_embeds, width]``, from its id."""
    seed = int.from_bytes(hashlib.sha256(identifier.encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randn(num_embeds, width, generator=gen).to(torch.bfloat16)


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
    encoder_cache: dict[str, torch.Tensor] = field(default_factory=dict)
    requests: dict[str, _RequestState] = field(default_factory=dict)
    step: int = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
        from vllm.v1.worker.ec_connector_model_runner_mixin import (
            ECConnectorModelRunnerMixin as Mixin,
        )

        self._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT  # V1 skips the EC context on empty steps
        before = set(self.encoder_cache)
        with Mixin.maybe_get_ec_connector_output(
            scheduler_output, encoder_cache=self.encoder_cache
        ) as ec_connector_output:
            self._check_loads(set(self.encoder_cache) - before)
            self._execute_mm_encoder(scheduler_output)
            self._gather_mm_embeddings(scheduler_output)
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

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """``GPUModelRunner._update_states``: forget finished requests, drop freed encoder
        outputs (``_process_encoder_cache_scheduler_output``), take in new and cached ones."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for mm_hash in scheduler_output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        for new in scheduler_output.scheduled_new_reqs:
            prompt_len = len(new.prompt_token_ids or ())
            self.requests[new.req_id] = _RequestState(
                list(new.mm_features), prompt_len, new.num_computed_tokens
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.requests[req_id].num_computed_tokens = num_computed

    def _check_loads(self, loaded: set[str]) -> None:
        """Every tensor the connector put into the encoder cache is the truth for its id."""
        rows = {f.identifier: f.mm_position.get_num_embeds() for f in self._all_features()}
        for identifier in sorted(loaded):
            self.stats.loads += 1
            got = self.encoder_cache[identifier]
            if identifier not in rows:
                self._fail("start_load_caches", f"loaded {identifier!r}, which no request has")
            elif not bit_exact(got, truth(identifier, rows[identifier], self.width)):
                self._fail(
                    "start_load_caches",
                    f"loaded {identifier!r} {tuple(got.shape)} {got.dtype}: not the bytes "
                    f"encoded for it ({rows[identifier]} x {self.width} bf16)",
                )

    def _execute_mm_encoder(self, scheduler_output: SchedulerOutput) -> None:
        """``_execute_mm_encoder`` + ``_cache_encoder_output``: encode, cache, offer to save."""
        from vllm.v1.worker.ec_connector_model_runner_mixin import (
            ECConnectorModelRunnerMixin as Mixin,
        )

        for req_id, input_ids in scheduler_output.scheduled_encoder_inputs.items():
            for input_id in input_ids:
                feature = self.requests[req_id].mm_features[input_id]
                position = feature.mm_position
                output = truth(feature.identifier, position.get_num_embeds(), self.width)
                self.stats.local_encodes += 1
                self.encoder_cache[feature.identifier] = output
                Mixin.maybe_save_ec_to_connector(self.encoder_cache, feature.identifier)

    def _gather_mm_embeddings(self, scheduler_output: SchedulerOutput) -> None:
        """``_gather_mm_embeddings``: every item overlapping a scheduled token range must be
        in the encoder cache (else vLLM raises "Encoder cache miss"), with the right bytes."""
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
                if first == last:
                    continue
                self.stats.split_images += int(end_idx - start_idx < position.length)
                got = self.encoder_cache.get(feature.identifier)
                if got is None:
                    self._fail(
                        "_gather_mm_embeddings",
                        f"Encoder cache miss for {feature.identifier} (request {req_id})",
                    )
                    raise EngineDied(feature.identifier)
                want = truth(feature.identifier, position.get_num_embeds(), self.width)
                if not bit_exact(got, want):
                    self._fail(
                        "_gather_mm_embeddings",
                        f"request {req_id} would read {feature.identifier!r} "
                        f"{tuple(got.shape)}: not its bytes",
                    )

    def _all_features(self) -> Iterator[MultiModalFeatureSpec]:
        for state in self.requests.values():
            yield from state.mm_features

    def _fail(self, where: str, message: str) -> None:
        self.failures.append(Failure(self.step, where, message))
