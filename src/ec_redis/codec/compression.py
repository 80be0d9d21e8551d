"""Payload compression: lz4 block, an "auto" probe that stores raw when lz4 does not pay, and
byte-shuffle.

lz4 has no entropy coder, so it barely shrinks float activations (ratio ~1.005); only the
exponent bytes carry redundancy. Byte-shuffle groups byte k of every element together so lz4
can find the runs in the exponent plane (bf16: ~1.17x).
"""

from __future__ import annotations

from collections.abc import Callable

import lz4.block
import numpy as np

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


def probe_ratio(
    data: memoryview, transform: Callable[[memoryview], memoryview] | None = None
) -> float:
    """Estimate lz4's ratio from a few samples spread over ``data`` (microseconds, not ms).

    Samples are aligned to 64 bytes so a ``transform`` (byte-shuffle) sees whole elements.
    """
    size = len(data)
    if size <= _SAMPLE_BYTES * _SAMPLES:
        samples = [data]
    else:
        step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1) // 64 * 64
        samples = [data[i * step : i * step + _SAMPLE_BYTES] for i in range(_SAMPLES)]
    if transform is not None:
        samples = [transform(s) for s in samples]
    raw = sum(len(s) for s in samples)
    packed = sum(len(lz4_compress(s)) for s in samples)
    return raw / max(packed, 1)


def shuffle(data: memoryview, itemsize: int) -> memoryview:
    """Byte-shuffle ``itemsize``-byte elements: plane k holds byte k of every element."""
    if itemsize == 1:
        return data
    elements = np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize)
    count = elements.shape[0]
    out = np.empty(len(data), dtype=np.uint8)
    for k in range(itemsize):  # numpy strided copies: ~8x faster than torch's transpose here
        out[k * count : (k + 1) * count] = elements[:, k]
    return out.data


def unshuffle(data: memoryview, itemsize: int) -> memoryview:
    """Invert ``shuffle``."""
    if itemsize == 1:
        return data
    planes = np.frombuffer(data, dtype=np.uint8)
    count = len(planes) // itemsize
    out = np.empty(len(planes), dtype=np.uint8)
    elements = out.reshape(-1, itemsize)
    for k in range(itemsize):
        elements[:, k] = planes[k * count : (k + 1) * count]
    return out.data
