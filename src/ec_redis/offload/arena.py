"""A memory file two processes map: where the parent puts the bytes of the item the child
writes next.

An anonymous ``memfd`` (never a path under ``/dev/shm``: a container's 64 MiB default there
would turn a large item into a SIGBUS, and no other process can open it). It grows to the
largest item written so far, bounded by the write queue's byte budget (a larger write is
refused before it gets here), and gives its pages back after a write larger than
``KEEP_BYTES`` (a video), so it holds at most that much between writes. The parent writes
one item at a time into it and reuses it only after the child answered for the previous one,
or after that child was reaped.
"""

from __future__ import annotations

import mmap
import os

import torch

PAGE = mmap.PAGESIZE
KEEP_BYTES = 64 << 20  # what an arena may keep between writes (images fit)


class Arena:
    """The parent's side: a memfd and a writable mapping of it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.fd = os.memfd_create("ec_redis-writer", os.MFD_CLOEXEC)
        self.size = 0
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None

    def fill(self, tensor: torch.Tensor) -> int:
        """Copy ``tensor``'s bytes to the start of the arena; returns their count. The copy
        runs in torch with the GIL released."""
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        if nbytes > self.limit:
            raise ValueError(f"{nbytes} bytes exceed the arena's limit of {self.limit}")
        if nbytes > self.size:
            self._grow(nbytes)
        if nbytes:
            assert self._bytes is not None
            self._bytes[:nbytes].copy_(flat)
        return nbytes

    def trim(self, keep: int) -> None:
        """Give the pages back when the arena outgrew ``keep`` (one large item): between two
        writes only, when the child reads nothing (it maps no more than each write's
        ``size``, which the next ``fill`` makes exist again)."""
        if self.size > keep:
            self._unmap()
            os.ftruncate(self.fd, 0)
            self.size = 0

    def _grow(self, nbytes: int) -> None:
        size = min(self.limit, -(-max(nbytes, 2 * self.size) // PAGE) * PAGE)
        size = max(size, -(-nbytes // PAGE) * PAGE)
        self._unmap()
        self.size = 0  # until the file has its new size and is mapped again
        os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.size = size

    def _unmap(self) -> None:
        # Dropped, not closed: a tensor over it may still be alive somewhere; the mapping
        # goes when the last of them does.
        self._bytes = None
        self._map = None

    def close(self) -> None:
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ArenaView:
    """The child's side: maps as much of the parent's memfd as the current item needs."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = 0
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None

    def tensor(self, size: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """The item's bytes as a tensor over the mapping (no copy). ``size``: the arena's size
        when the parent filled it (the file only grows)."""
        if not 0 <= nbytes <= size or os.fstat(self.fd).st_size < size:
            raise ValueError(f"an item of {nbytes} bytes in an arena of {size}")
        if size > self.size:
            self._bytes = self._map = None  # dropped: an earlier item's tensor may live on
            self._map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
            self.size = size
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        assert self._bytes is not None
        return self._bytes[:nbytes].view(dtype).view(shape)
