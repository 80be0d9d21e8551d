"""Payload compression: lz4 block, an "auto" probe that stores raw when lz4 does not pay, and
byte-shuffle.

lz4 has no entropy coder, so it barely shrinks float activations (ratio ~1.005); only the
exponent bytes carry redundancy. Byte-shuffle groups byte k of every element together so lz4
can find the runs in the exponent plane (bf16: ~1.17x).
"""

from __future__ import annotations

import lz4.block
import torch

from ec_redis.errors import BlobError

_SAMPLE_BYTES = 32 * 1024
_SAMPLES = 3


def lz4_compress(data: bytes | memoryview) -> bytes:
    """Compress with lz4 block format (no size prefix; the blob header records it)."""
    out: bytes = lz4.block.compress(data, store_size=False)
    return out


def lz4_decompress(payload: bytes | memoryview, raw_len: int) -> bytes:
    """Decompress exactly ``raw_len`` bytes or raise ``BlobError``."""
    try:
        out: bytes = lz4.block.decompress(payload, uncompressed_size=raw_len)
    except (lz4.block.LZ4BlockError, ValueError, MemoryError) as exc:
        raise BlobError(f"lz4 payload is corrupt: {exc}") from None
    if len(out) != raw_len:
        raise BlobError(f"lz4 payload decompressed to {len(out)} bytes, expected {raw_len}")
    return out


def probe_ratio(data: memoryview) -> float:
    """Estimate lz4's ratio from a few samples spread over ``data`` (microseconds, not ms)."""
    size = len(data)
    if size <= _SAMPLE_BYTES * _SAMPLES:
        samples = [data]
    else:
        step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
        samples = [data[i * step : i * step + _SAMPLE_BYTES] for i in range(_SAMPLES)]
    raw = sum(len(s) for s in samples)
    packed = sum(len(lz4_compress(s)) for s in samples)
    return raw / max(packed, 1)


def shuffle(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Byte-shuffle a flat uint8 tensor of ``itemsize``-byte elements (plane k = byte k)."""
    if itemsize == 1:
        return data
    return data.view(-1, itemsize).t().contiguous().view(-1)


def unshuffle(data: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Invert ``shuffle``."""
    if itemsize == 1:
        return data
    return data.view(itemsize, -1).t().contiguous().view(-1)
