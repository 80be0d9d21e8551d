"""A pool of page-locked host buffers, reused by size class and bounded in bytes.

A fresh ``cudaHostAlloc`` costs milliseconds; a pooled one microseconds. Blocks come back to
the pool only after the CUDA event of their last copy has completed, so a buffer is never
rewritten while a transfer still reads it.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch

_GRANULE = 1 << 20  # 1 MiB size classes: at most 1 MiB lost per buffer


@dataclass
class PinnedBlock:
    """One pooled buffer; ``event`` marks the end of the last copy that touched it."""

    storage: torch.Tensor
    pinned: bool
    event: torch.cuda.Event | None = field(default=None)


class PinnedPool:
    """Hands out host buffers; pinned while the pool has room, pageable beyond it."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.allocated_bytes = 0
        self.pageable_fallbacks = 0
        self._free: defaultdict[int, list[PinnedBlock]] = defaultdict(list)
        self._free_bytes = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> PinnedBlock:
        size = max(_GRANULE, -(-nbytes // _GRANULE) * _GRANULE)
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                block = bucket.pop()
                self._free_bytes -= size
                if block.event is not None:
                    block.event.synchronize()  # normally long complete
                    block.event = None
                return block
            self._make_room(size)
            pinned = self.allocated_bytes + size <= self.capacity_bytes
            if pinned:
                self.allocated_bytes += size
            else:
                self.pageable_fallbacks += 1
        storage = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return PinnedBlock(storage=storage, pinned=pinned)

    def release(self, block: PinnedBlock) -> None:
        if not block.pinned:
            return
        size = block.storage.numel()
        with self._lock:
            self._free[size].append(block)
            self._free_bytes += size

    def _make_room(self, size: int) -> None:
        """Drop free blocks of other sizes until ``size`` fits (caller holds the lock)."""
        for other in list(self._free):
            while self._free[other] and self.allocated_bytes + size > self.capacity_bytes:
                block = self._free[other].pop()
                if block.event is not None:
                    block.event.synchronize()
                self.allocated_bytes -= other
                self._free_bytes -= other

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "pinned_allocated_bytes": self.allocated_bytes,
                "pinned_free_bytes": self._free_bytes,
                "pinned_pageable_fallbacks": self.pageable_fallbacks,
            }
