"""What the scheduler half sends the worker half each step, and what comes back.

Both are small and picklable: vLLM ships the step metadata to every worker process. A load
carries the staged host tensor itself, fetched and validated by the scheduler half before it
promised the item, so the worker never has a network call or a failure mode left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)


@dataclass
class LoadItem:
    """One item the worker must put into vLLM's encoder cache this step."""

    mm_hash: str
    num_embeds: int
    tensor: torch.Tensor


@dataclass
class ECRedisMetadata(ECConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)


@dataclass
class ECRedisWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker -> scheduler: writes still queued for Redis (summed over ranks)."""

    pending_writes: int = 0

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if not isinstance(other, ECRedisWorkerMetadata):
            return self
        return ECRedisWorkerMetadata(self.pending_writes + other.pending_writes)
