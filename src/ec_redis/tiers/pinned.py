"""Pinned host memory for CUDA copies: a few page-locked slabs, carved into blocks.

Why slabs: PyTorch's caching host allocator rounds every pinned allocation up to a power of
two and keeps freed blocks pinned, so one ``pin_memory`` buffer per item is bounded by nothing
we count. Here each slab is a single allocation whose size *is* a power of two (so what is
counted is what is pinned), made lazily — on the first copy that needs it, never when a cache
is built — and kept for the pool's life. An ``Arena`` carves blocks out of it.

A block's life::

    acquire ──► copies record their events on it ──► release (a finalizer: no lock, a queue)
            ──► retired until every recorded event has completed ──► its range is free again

so a buffer is never rewritten while a transfer still reads or writes it. When no slab has
room, or pinning fails (memlock limit, host memory), ``acquire`` returns ``None`` and the
caller uses pageable memory: slower, never wrong, and the counters say so.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters
from ec_redis.tiers.arena import Arena

GRANULE_BYTES = 64 << 10  # block sizes are multiples of this (and offsets aligned to it)
SLAB_BYTES = 256 << 20  # one pinned allocation; larger items use pageable memory
_MIN_SLAB_BYTES = 1 << 20  # capacity left below this is not pinned at all

LIVE, RETURNED, FREE, QUARANTINED = "live", "returned", "free", "quarantined"


class HostAllocator:
    """Where slabs come from: ``torch.empty(pin_memory=True)``. Tests pass a fake."""

    def pin(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release_cached(self) -> None:
        """Hand PyTorch's cached (freed but still pinned) host blocks back to the OS."""
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty is None or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return  # nothing was pinned through CUDA in this process
        try:
            empty()
        except Exception:  # closing never fails over a cache of freed memory
            return


@dataclass(eq=False)
class PinnedBlock:
    """One carved range; ``events`` mark the copies that still read or write it."""

    data: torch.Tensor  # uint8, exactly the block's bytes
    slab: int
    offset: int
    events: list[torch.cuda.Event] = field(default_factory=list)
    state: str = LIVE

    @property
    def nbytes(self) -> int:
        """What the block holds (and every budget counts): the request rounded up."""
        return self.data.numel()

    def view(self, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The block's first bytes as a tensor of ``dtype`` and ``shape``."""
        count = math.prod(shape) * dtype.itemsize
        return self.data[:count].view(dtype).view(shape)


def slab_plan(capacity_bytes: int, slab_bytes: int = SLAB_BYTES) -> list[int]:
    """Power-of-two slab sizes, largest first, that add up to at most ``capacity_bytes``."""
    sizes = [slab_bytes] * (capacity_bytes // slab_bytes)
    rest, piece = capacity_bytes % slab_bytes, slab_bytes // 2
    while piece >= _MIN_SLAB_BYTES:
        if rest >= piece:
            sizes.append(piece)
            rest -= piece
        piece //= 2
    return sizes


class PinnedPool:
    """Hands out pinned blocks within ``capacity_bytes`` of real pinned memory."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        slab_bytes: int = SLAB_BYTES,
        granule_bytes: int = GRANULE_BYTES,
        allocator: HostAllocator | None = None,
    ) -> None:
        for name, value in (("slab_bytes", slab_bytes), ("granule_bytes", granule_bytes)):
            if value <= 0 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        self.capacity_bytes = capacity_bytes
        self._plan = slab_plan(max(0, capacity_bytes), slab_bytes)  # slabs not yet pinned
        self.max_block_bytes = self._plan[0] if self._plan else 0
        self._granule = granule_bytes
        self._allocator = allocator or HostAllocator()
        self._slabs: list[tuple[torch.Tensor, Arena]] = []
        self._returned: deque[PinnedBlock] = deque()  # appended by finalizers, lock-free
        self._retired: list[PinnedBlock] = []  # returned; some copy may still be running
        self._lock = threading.Lock()
        self.pinned_bytes = 0  # slab bytes really pinned
        self.in_use_bytes = 0  # blocks handed out, retired or quarantined
        self.counters = Counters()
        self._log = RateLimitedLog()
        self._closed = False

    def acquire(self, nbytes: int) -> PinnedBlock | None:
        """A block of at least ``nbytes`` whose earlier copies have all completed, or
        ``None``: use pageable memory (no room, too big, pinning failed, closed)."""
        if nbytes <= 0:
            return None
        size = -(-nbytes // self._granule) * self._granule
        with self._lock:
            block = None if self._closed or size > self.max_block_bytes else self._take(size)
            if block is None:
                self.counters.inc("pageable_fallbacks")
                return None
            self.in_use_bytes += size
            return block

    def release(self, block: PinnedBlock) -> None:
        """Give a block back; its range is reused only once every event recorded on it has
        completed. Takes no lock, so a finalizer may call it from any thread."""
        if block.state == LIVE and not self._closed:
            block.state = RETURNED
            self._returned.append(block)

    def add_event(self, block: PinnedBlock, event: torch.cuda.Event) -> None:
        """Record a copy that reads or writes ``block``; completed ones are forgotten."""
        with self._lock:
            block.events = [e for e in block.events if not e.query()]  # type: ignore[no-untyped-call]
            block.events.append(event)

    def quarantine(self, block: PinnedBlock) -> None:
        """Never reuse ``block``: a copy into or out of it failed half-way, so whether the
        device still touches it is unknown. Its bytes stay counted as in use."""
        with self._lock:
            if block.state == LIVE:
                block.state = QUARANTINED
                self.counters.inc("quarantined_bytes", block.nbytes)

    def close(self) -> None:
        """Forget the slabs (blocks still referenced keep their memory alive until dropped)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pinned = self.pinned_bytes > 0
            self._slabs.clear()
            self._retired.clear()
            self._returned.clear()
        if pinned:
            self._allocator.release_cached()

    # -- under the lock ---------------------------------------------------------------------

    def _take(self, size: int) -> PinnedBlock | None:
        self._collect(wait=False)
        block = self._carve(size)
        while block is None and self._pin_next_slab(size):
            block = self._carve(size)
        if block is None and self._retired:  # full: wait for copies still using blocks
            self._collect(wait=True)
            block = self._carve(size)
        return block

    def _carve(self, size: int) -> PinnedBlock | None:
        for index, (slab, arena) in enumerate(self._slabs):
            offset = arena.allocate(size)
            if offset is not None:
                return PinnedBlock(slab[offset : offset + size], index, offset)
        return None

    def _pin_next_slab(self, size: int) -> bool:
        if not self._plan or self._plan[0] < size:
            return False
        slab_bytes = self._plan.pop(0)
        try:
            slab = self._allocator.pin(slab_bytes)
        except Exception as exc:  # memlock limit, host OOM: pageable from now on
            self._plan.clear()
            self.counters.inc("pin_failures")
            self._log.warning(
                "pin", "ec_redis: cannot pin %d bytes of host memory (%r); using pageable "
                "memory beyond the %d bytes already pinned", slab_bytes, exc, self.pinned_bytes,
            )  # fmt: skip
            return False
        self._slabs.append((slab, Arena(slab_bytes)))
        self.pinned_bytes += slab_bytes
        return True

    def _collect(self, *, wait: bool) -> None:
        """Free retired blocks whose copies completed (``wait``: wait for them first)."""
        while self._returned:
            self._retired.append(self._returned.popleft())
        still: list[PinnedBlock] = []
        for block in self._retired:
            if self._copies_done(block, wait):
                self._slabs[block.slab][1].free(block.offset, block.nbytes)
                self.in_use_bytes -= block.nbytes
                block.state, block.events = FREE, []
            else:
                still.append(block)
        self._retired = still

    def _copies_done(self, block: PinnedBlock, wait: bool) -> bool:
        for event in block.events:
            if not event.query():  # type: ignore[no-untyped-call]
                if not wait:
                    return False
                self.counters.inc("event_waits")
                event.synchronize()
        return True

    def stats(self) -> dict[str, float]:
        with self._lock:
            free = sum(arena.free_bytes for _, arena in self._slabs)
            out = {
                "pinned_bytes": float(self.pinned_bytes),
                "pinned_in_use_bytes": float(self.in_use_bytes),
                "pinned_free_bytes": float(free),
                "pinned_slabs": float(len(self._slabs)),
            }
        for name, value in self.counters.snapshot().items():
            out[f"pinned_{name}"] = value
        return out
