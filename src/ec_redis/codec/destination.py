"""Where a decoded tensor's bytes land: a fresh buffer, unless the caller lends one.

A reader that knows where the bytes must end up (the scheduler half staging an item as a
file the workers map, ``connector/spares.py``) lends buffers for the duration of a lookup;
the Redis read then lands in them directly instead of in fresh memory that is copied later.
A lent buffer is only a destination: decoding checks every byte exactly as for a fresh one,
and it stays the lender's (a cache keeps no lent buffer in its own tiers: ``is_lent``).

Fresh memory of ``RECYCLE_MIN_BYTES`` or more is recycled (``fresh``): the kernel faults in
and zeroes every page of new memory as the socket's bytes first touch it (about 1.5 us a
4 KiB page on a VM: 25 ms for a 64 MiB read, more than the read itself takes to copy).
Such a buffer is a block of private anonymous memory (``MADV_HUGEPAGE``: a fresh one faults
up to 512 times fewer), owned by the tensor handed out; only once that tensor and every view
of it are gone does the block go back to a bounded free list, from which a later read of
about the same size (``SLACK``) takes it already faulted in. A block is never in the free
list and in a live tensor at once, and a read overwrites (and checks) every byte the tensor
shows. The tensor's storage is the whole block, so what a budget counts (a storage's bytes,
``tiers/transfer.HostCopy.nbytes``) is what it holds. Where the kernel refuses a mapping
(``vm.max_map_count``, an overcommit limit), torch's allocator serves the buffer instead.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch

RECYCLE_MIN_BYTES = 1 << 20  # smaller buffers come from torch's allocator
PAGE = mmap.PAGESIZE  # blocks are whole pages
SLACK = 8  # a free block serves a read of at least 1/(1 + 1/SLACK) of its size
DEFAULT_IDLE_BYTES = 256 << 20  # free blocks kept for the next reads, at most

# nbytes -> a writable, contiguous uint8 tensor of exactly nbytes, or None (use fresh memory)
Lender = Callable[[int], torch.Tensor | None]

_LENDING: ContextVar[tuple[Lender, set[int]] | None] = ContextVar(
    "ec_redis_destination", default=None
)


def buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 for a tensor's bytes: lent, or fresh."""
    lending_now = _LENDING.get()
    if lending_now is not None and nbytes > 0:
        lender, lent_addresses = lending_now
        try:
            lent = lender(nbytes)
        except Exception:  # where the bytes land is an optimisation: fresh memory will do
            lent = None
        if lent is not None and lent.dtype == torch.uint8 and lent.numel() == nbytes:
            lent_addresses.add(lent.data_ptr())
            return lent
    return fresh(nbytes)


def fresh(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uint8 that no live tensor uses (uninitialised): a recycled block from
    ``RECYCLE_MIN_BYTES`` on, else torch's allocator."""
    if nbytes < RECYCLE_MIN_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    return RECYCLER.take(nbytes)


class Recycler:
    """Blocks of whole pages for large buffers; a block is free again only once the
    tensor made of it (and every view of it) is gone. At most ``idle_bytes`` of free blocks
    are kept (the least recently freed go first); thread-safe."""

    def __init__(self, idle_bytes: int = DEFAULT_IDLE_BYTES) -> None:
        self.idle_bytes = idle_bytes
        # Re-entrant: a tensor of ours freed by the garbage collector while this thread holds
        # the lock (an allocation under it can start a collection) gives its block back here.
        self._lock = threading.RLock()
        self._free: list[tuple[int, mmap.mmap]] = []  # oldest first
        self._held = 0  # bytes in _free
        self.taken = self.reused = self.returned = self.refused = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of uint8 (a view of a block, whose storage is the whole block)."""
        size = -(-nbytes // PAGE) * PAGE
        block = None
        with self._lock:
            self.taken += 1
            # The most recently freed that fits. Removed by identity, not index: a give-back
            # run re-entrantly in between (see ``__init__``) may have moved or dropped it.
            entry = next(
                (e for e in reversed(self._free) if size <= e[0] <= size + size // SLACK), None
            )
            if entry is not None and _remove(self._free, entry):
                block = entry[1]
                self._held -= entry[0]
                self.reused += 1
        if block is None:
            try:
                block = _new_block(size)
            except OSError:  # no mapping to be had: the allocator's memory is as good
                self.refused += 1
                return torch.empty(nbytes, dtype=torch.uint8)
        owner = np.frombuffer(block, dtype=np.uint8)
        # ``owner`` lives exactly as long as the tensor's storage (every view, every
        # ``numpy()`` of it holds that): when it goes, nothing can reach the block any more.
        weakref.finalize(owner, self._give_back, len(block), block).atexit = False
        return torch.from_numpy(owner)[:nbytes]

    def idle(self) -> int:
        """Bytes of free blocks held now."""
        with self._lock:
            return self._held

    def clear(self) -> None:
        """Drop every free block (their memory goes back to the system)."""
        with self._lock:
            self._free.clear()
            self._held = 0

    def _give_back(self, size: int, block: mmap.mmap) -> None:
        entry = (size, block)
        dropped: list[tuple[int, mmap.mmap]] = []  # unmapped after the lock is released
        with self._lock:
            self.returned += 1
            if size > self.idle_bytes:
                return
            self._free.append(entry)
            self._held += size
            while self._held > self.idle_bytes:
                dropped.append(self._free.pop(0))
                self._held -= dropped[-1][0]

    def _after_fork(self) -> None:
        """In a forked child: a fresh lock (one another thread held at fork() stays held)
        and no free blocks (the child's copies are its own, but it needs none of them)."""
        self._lock = threading.RLock()
        self._free = []
        self._held = 0


def _remove(free: list[tuple[int, mmap.mmap]], entry: tuple[int, mmap.mmap]) -> bool:
    for i, other in enumerate(free):
        if other is entry:
            del free[i]
            return True
    return False


def _new_block(size: int) -> mmap.mmap:
    """Private anonymous memory, advised to be backed by huge pages where the system allows.
    Private, never shared: Python's default for anonymous maps is ``MAP_SHARED``, whose pages
    a forked child (vLLM forks its workers) would share, so two processes taking the same
    free block would write into each other's tensors. A private block is copied on write."""
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # no transparent huge pages: 4 KiB ones, as correct
            block.madvise(advice)
    return block


RECYCLER = Recycler()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=RECYCLER._after_fork)


def is_lent(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes are a buffer lent in the current ``lending`` context."""
    lending_now = _LENDING.get()
    return lending_now is not None and tensor.data_ptr() in lending_now[1]


@contextmanager
def lending(lender: Lender) -> Iterator[None]:
    """Reads in this context (this thread) take their destinations from ``lender``."""
    token = _LENDING.set((lender, set()))
    try:
        yield
    finally:
        _LENDING.reset(token)
