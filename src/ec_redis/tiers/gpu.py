"""GPU tier: a byte-bounded LRU of device tensors; evictions go to a spill callback.

Tensors are held by reference (no copy). Views into larger buffers are compacted first so
the byte budget counts what is really kept alive. Without CUDA it holds CPU tensors, so the
same logic runs and is tested on any machine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ec_redis.tiers.base import tensor_nbytes
from ec_redis.tiers.local import LocalTier
from ec_redis.tiers.transfer import compact

SpillFn = Callable[[str, torch.Tensor], None]


class DeviceTier(LocalTier[torch.Tensor]):
    name = "gpu"

    def __init__(self, capacity_bytes: int, on_evict: SpillFn | None = None) -> None:
        super().__init__(capacity_bytes, tensor_nbytes)
        self._on_evict = on_evict

    def get(self, key: str) -> torch.Tensor | None:
        return self._lookup(key)

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        if not self.enabled:
            return False
        evicted = self._insert(key, compact(tensor))
        if evicted is None:
            return False
        if self._on_evict is not None:
            for old_key, old in evicted:  # outside the lock: spilling copies
                self._on_evict(old_key, old)
        return True
