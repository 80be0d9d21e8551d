"""Host <-> device copies: pinned staging, one side stream, ordering by CUDA events.

Without CUDA every method degrades to plain host tensors, so the tiers' logic is the same
(and tested) everywhere. With CUDA, device->host copies land in pooled pinned buffers on a
side stream; readers wait on the copy's event, never on the whole device.
"""

from __future__ import annotations

import weakref

import torch

from ec_redis.tiers.pinned import PinnedBlock, PinnedPool


class HostCopy:
    """A host tensor plus what keeps it valid: the D2H event and its pooled block.

    The block returns to the pool when this object is garbage collected, after the event of
    the last copy that read it. Pool memory never escapes: callers get device copies or clones.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        ready: torch.cuda.Event | None = None,
        block: PinnedBlock | None = None,
        pool: PinnedPool | None = None,
    ) -> None:
        self.tensor = tensor
        self.ready = ready
        self.pooled = block is not None
        if block is not None and pool is not None:
            self._block = block
            weakref.finalize(self, pool.release, block)

    def wait(self) -> None:
        """Block until the bytes are on the host (no-op without CUDA)."""
        if self.ready is not None:
            self.ready.synchronize()

    def record_use(self, event: torch.cuda.Event) -> None:
        """Remember a later copy reading this buffer; the pool waits for it before reuse."""
        if self.pooled:
            self._block.event = event

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class Transfer:
    """Copies between host memory and one device."""

    def __init__(self, device: torch.device, pool: PinnedPool | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pool = pool
        self._stream = (
            torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        )

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Start a copy of ``tensor`` to host memory; CPU tensors are taken as they are."""
        if tensor.device.type == "cpu":
            return HostCopy(compact(tensor))
        assert self._stream is not None and self.pool is not None
        nbytes = tensor.numel() * tensor.element_size()
        block = self.pool.acquire(nbytes)
        host = block.storage[:nbytes].view(tensor.dtype).view(tensor.shape)
        producer = torch.cuda.current_stream(tensor.device)
        self._stream.wait_stream(producer)  # the encoder's writes come first
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)  # the allocator keeps it until the copy ends
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(self._stream)
        return HostCopy(host, ready, block, self.pool)

    def to_device(self, host: HostCopy) -> torch.Tensor:
        """Copy to the device, ordered before later work on the current stream (no host sync)."""
        if not self.cuda:
            return host.tensor
        assert self._stream is not None
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            if host.ready is not None:
                self._stream.wait_event(host.ready)
            out = torch.empty(host.tensor.shape, dtype=host.tensor.dtype, device=self.device)
            out.copy_(host.tensor, non_blocking=host.tensor.is_pinned())
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
        host.record_use(done)
        consumer.wait_event(done)
        out.record_stream(consumer)
        return out

    def to_device_from_cpu(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copy a plain (pageable) host tensor to the device; identity without CUDA."""
        if not self.cuda:
            return tensor
        return tensor.to(self.device, non_blocking=False)


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor owning no more storage than its own bytes (views are copied)."""
    tensor = tensor.detach()
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    return tensor.clone() if tensor.is_contiguous() else tensor.contiguous()
