"""Host <-> device copies: pinned blocks, one side stream per device, ordering by CUDA events.

Nothing CUDA happens until a copy needs it: a device's side stream is made on the first copy
from or to that device, pinned slabs on the first copy that wants one, and pinnedness is
tracked here, never asked of torch (``Tensor.is_pinned`` grabs a CUDA context). A process
that only moves host tensors — the connector's scheduler half — never touches CUDA. Without
CUDA every method degrades to plain host tensors, so the tiers' logic is the same everywhere.

``to_host`` (device -> host) runs on the *source tensor's* device, in this order::

    side.wait_stream(producer)   # the producer's queued writes (the encoder) come first
    host.copy_(tensor)           # on the side stream, into a pinned block
    tensor.record_stream(side)   # a freed tensor's memory is not handed out before the copy ends
    ready.record(side)
    producer.wait_event(ready)   # the producer's later work (an in-place write) waits for it
    pool.add_event(block, ready) # the block is reused only after the copy ended

and every reader (the Redis writer, ``to_device``, ``HostCopy.owned``) waits on ``ready``.

What protects vLLM's encoder output while the copy reads it: vLLM stores each output in a
dict entry and never writes into it; a reused entry gets a *new* tensor and the old one is
freed into the caching allocator, which ``record_stream`` stops from handing that memory out
until the copy has ended. ``producer.wait_event(ready)`` covers what record_stream cannot — a
caller writing into the tensor in place (a persistent buffer, a CUDA-graph output; vLLM's
encoder graphs clone their outputs today) — at the cost of the producer's next kernels
starting after the copy (about 0.1 ms per 5 MB at PCIe rates), with no host sync.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ec_redis.tiers.base import tensor_nbytes
from ec_redis.tiers.pinned import PinnedBlock, PinnedPool


class HostCopy:
    """A host tensor plus what keeps it valid: the event of the copy that fills it and, when
    pinned, the pool block it lives in.

    The block returns to its pool when this object is garbage collected; the pool reuses it
    only after every copy recorded on it has ended. Pool memory never escapes: callers get
    device copies or clones (``owned``).
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
        self._block = block
        self._pool = pool
        if block is not None and pool is not None:
            weakref.finalize(self, pool.release, block)

    @property
    def pinned(self) -> bool:
        """Whether the bytes live in a pinned pool block (tracked, never asked of torch)."""
        return self._block is not None

    @property
    def nbytes(self) -> int:
        """Bytes this copy really holds — its block, or its tensor's whole storage — which is
        what the CPU tier's and the write queue's budgets count."""
        if self._block is not None:
            return self._block.nbytes
        return max(tensor_nbytes(self.tensor), self.tensor.untyped_storage().nbytes())

    def wait(self) -> None:
        """Block until the bytes are on the host (no-op without CUDA)."""
        if self.ready is not None:
            self.ready.synchronize()

    def record_use(self, event: torch.cuda.Event) -> None:
        """Remember a later copy reading this buffer; the pool waits for it before reuse."""
        if self._block is not None and self._pool is not None:
            self._pool.add_event(self._block, event)

    def owned(self) -> torch.Tensor:
        """The bytes as a host tensor that owns its memory (pinned blocks are cloned)."""
        self.wait()
        return self.tensor.clone() if self.pinned else self.tensor


class Transfer:
    """Copies between host memory and CUDA devices; ``device`` is where ``to_device`` copies
    to unless told otherwise (a cache's reads device)."""

    def __init__(self, device: torch.device, pool: PinnedPool | None = None) -> None:
        self.device = device
        self.pool = pool
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of ``device`` (with an index), made on its first copy."""
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
                self._streams[device] = stream
            return stream

    # -- device -> host ----------------------------------------------------------------------

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Start a copy of ``tensor`` to host memory and return at once (CPU tensors are kept
        as they are). Readers wait on the copy's ``ready`` event."""
        if tensor.device.type == "cpu":
            return HostCopy(compact(tensor))
        if tensor.device.type != "cuda":
            return HostCopy(tensor.to("cpu"))  # another accelerator: a synchronous copy
        side = self.side_stream(tensor.device)
        block = self.pool.acquire(tensor_nbytes(tensor)) if self.pool is not None else None
        if block is None:
            host = torch.empty(tensor.shape, dtype=tensor.dtype)  # pageable: a blocking copy
        else:
            host = block.view(tensor.dtype, tensor.shape)
        try:
            ready = self._copy_to_host(tensor, host, side, pinned=block is not None)
        except BaseException:
            self._quarantine(block)
            raise
        if block is not None:
            assert self.pool is not None
            self.pool.add_event(block, ready)
        return HostCopy(host, ready, block, self.pool)

    @staticmethod
    def _copy_to_host(
        tensor: torch.Tensor, host: torch.Tensor, side: torch.cuda.Stream, *, pinned: bool
    ) -> torch.cuda.Event:
        with torch.cuda.device(tensor.device):
            producer = torch.cuda.current_stream(tensor.device)
            side.wait_stream(producer)
            with torch.cuda.stream(side):
                host.copy_(tensor, non_blocking=pinned)
            tensor.record_stream(side)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(side)
            producer.wait_event(ready)
        return ready

    # -- host -> device ----------------------------------------------------------------------

    def to_device(self, host: HostCopy, device: torch.device | None = None) -> torch.Tensor:
        """A copy of ``host`` on ``device`` (default ``self.device``), ordered before later
        work on that device's current stream; no host sync when the bytes are pinned.
        Pageable bytes go through a pinned block when the pool has room. On the host: the
        host tensor itself, or a clone of pool memory."""
        device = self.device if device is None else device
        if device.type != "cuda":
            owned = host.owned()
            return owned if device.type == "cpu" else owned.to(device)
        device = _with_index(device)
        side = self.side_stream(device)
        source, ready, staged = host.tensor, host.ready, None
        if not host.pinned and self.pool is not None:
            staged = self.pool.acquire(tensor_nbytes(source))
        try:
            if staged is not None:
                host.wait()
                source, ready = staged.view(source.dtype, source.shape), None
                source.copy_(host.tensor)  # a host memcpy: the caller may free its tensor now
            out, done = self._copy_to_device(
                source, ready, side, device, pinned=host.pinned or staged is not None
            )
        except BaseException:
            self._quarantine(staged)
            raise
        if staged is not None:
            assert self.pool is not None
            self.pool.add_event(staged, done)
            self.pool.release(staged)
        else:
            host.record_use(done)
        return out

    @staticmethod
    def _copy_to_device(
        source: torch.Tensor,
        ready: torch.cuda.Event | None,
        side: torch.cuda.Stream,
        device: torch.device,
        *,
        pinned: bool,
    ) -> tuple[torch.Tensor, torch.cuda.Event]:
        with torch.cuda.device(device):
            consumer = torch.cuda.current_stream(device)
            if ready is not None:
                side.wait_event(ready)  # the bytes must have landed on the host first
            with torch.cuda.stream(side):
                out = torch.empty(source.shape, dtype=source.dtype, device=device)
                out.copy_(source, non_blocking=pinned)  # pageable: returns once consumed
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(side)
            consumer.wait_event(done)
            out.record_stream(consumer)  # freed later on the consumer's stream: wait for it
        return out, done

    def upload(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of host ``tensor`` on ``device`` that owns its memory; ``tensor`` may be
        freed or changed as soon as this returns (its bytes went through a pinned block, or
        were copied synchronously)."""
        if device.type != "cuda":
            return tensor.clone() if device.type == "cpu" else tensor.to(device)
        return self.to_device(HostCopy(tensor), device)

    def close(self) -> None:
        """Forget the side streams and the pool's slabs."""
        with self._lock:
            self._streams.clear()
        if self.pool is not None:
            self.pool.close()

    def _quarantine(self, block: PinnedBlock | None) -> None:
        if block is not None and self.pool is not None:
            self.pool.quarantine(block)


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device), so one device has one side stream."""
    index: int | None = device.index  # typed int by torch's stubs, None for a bare "cuda"
    return device if index is not None else torch.device("cuda", torch.cuda.current_device())


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor owning no more storage than its own bytes (views are copied)."""
    tensor = tensor.detach()
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    return tensor.clone() if tensor.is_contiguous() else tensor.contiguous()
