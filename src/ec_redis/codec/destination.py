"""Where a decoded tensor's bytes land: a fresh buffer, unless the caller lends one.

A reader that knows where the bytes must end up (the scheduler half staging an item as a
file the workers map, ``connector/spares.py``) lends buffers for the duration of a lookup;
the Redis read then lands in them directly instead of in fresh memory that is copied later.
A lent buffer is only a destination: decoding checks every byte exactly as for a fresh one,
and it stays the lender's (a cache keeps no lent buffer in its own tiers: ``is_lent``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

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
    return torch.empty(nbytes, dtype=torch.uint8)


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
