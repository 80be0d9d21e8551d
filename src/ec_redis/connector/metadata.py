"""What the scheduler half sends the worker half each step, and what comes back.

Both are small and picklable: vLLM pickles the step metadata to every worker process each
step. A load names an item the scheduler half already fetched and validated before it
promised it: its bytes travel inline (workers in the scheduler's process) or as a host-local
file every rank reads (``transport.py``), never over the network again.
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
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    tensor: torch.Tensor | None = None  # inline transport
    path: str | None = None  # file transport


@dataclass
class ECRedisMetadata(ECConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)
    step: int = -1  # the scheduler half's step number (acknowledged by the workers)
    # Items encoded this step for requests with a cache_salt: the cache ids to save them
    # under (``ids.cache_id``); any other item is saved under its own identifier.
    save_as: dict[str, list[str]] = field(default_factory=dict)
    # Producers: (identifier, cache id, rows) of items Redis lacks that vLLM's own encoder
    # cache serves this step: written from there (``start_save_caches``).
    republish: list[tuple[str, str, int]] = field(default_factory=list)
    # Per stats-channel file: the last worker observation the scheduler half has reported
    # (channel.py); the worker that publishes it drops those.
    stats_ack: dict[str, int] = field(default_factory=dict)


@dataclass
class ECRedisWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker -> scheduler: writes still queued for Redis (summed over ranks) and the last
    step whose loads the workers ran (the scheduler may then drop those loads' files)."""

    pending_writes: int = 0
    loaded_step: int = -1

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if not isinstance(other, ECRedisWorkerMetadata):
            return self
        return ECRedisWorkerMetadata(
            self.pending_writes + other.pending_writes, max(self.loaded_step, other.loaded_step)
        )
