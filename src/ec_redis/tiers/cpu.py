"""CPU tier: a byte-bounded LRU of host copies (pinned pool blocks for copies from a GPU).

Each entry counts the bytes it really holds (its pool block, rounded up, or its tensor's whole
storage). A hit costs at most one copy: none for plain host tensors read on the host, one
asynchronous host->device copy with CUDA, a clone for pinned bytes read on the host (pool
memory never escapes). Evictions are dropped; Redis holds the entry.
"""

from __future__ import annotations

import torch

from ec_redis.tiers.local import LocalTier
from ec_redis.tiers.transfer import HostCopy, Transfer


class HostTier(LocalTier[HostCopy]):
    name = "cpu"

    def __init__(self, capacity_bytes: int, transfer: Transfer) -> None:
        super().__init__(capacity_bytes, lambda host: host.nbytes)
        self._transfer = transfer

    def get(self, key: str) -> torch.Tensor | None:
        host = self._lookup(key)
        return None if host is None else self._transfer.to_device(host)

    def get_host_copy(self, key: str) -> HostCopy | None:
        """The stored host copy itself (a counted hit or miss), without a device copy."""
        return self._lookup(key)

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Store a copy of ``tensor`` (an asynchronous D2H copy for device tensors)."""
        if not self.enabled:
            return False
        return self.put_host(key, self._transfer.to_host(tensor))

    def put_host(self, key: str, host: HostCopy) -> bool:
        """Store an existing host copy (shared with, e.g., a pending Redis write)."""
        return self.enabled and self._insert(key, host) is not None

    def stats(self) -> dict[str, float]:
        out = super().stats()
        if self._transfer.pool is not None:
            out.update(self._transfer.pool.stats())
        return out
