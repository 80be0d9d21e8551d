"""Decoding blobs whose chunks were read straight into one buffer (``tiers/bulk_read.py``).

For a chunked blob of the right layout the reader allocates one buffer and has each chunk's
reply land in its slice: a raw blob's buffer is the tensor itself, an lz4 blob's is the
compressed payload, decompressed into the tensor's memory. No bytes object per chunk, no join.
"""

from __future__ import annotations

import torch
import xxhash

from ec_redis.codec import _as_tensor, _check, _decode_lz4
from ec_redis.codec.format import CODEC_NONE, BlobHeader
from ec_redis.codec.landing import Landing
from ec_redis.errors import BlobError

Buffer = bytes | memoryview


def direct_layout(header: BlobHeader, head_len: int) -> list[int] | None:
    """Chunk lengths of a chunked blob whose chunks can be read straight into one buffer, in
    order: a raw blob's tensor bytes (its head holds exactly the safetensors prefix), or an
    lz4 blob's compressed payload (its head holds none of it); ``None`` for any other layout
    (use ``decode_parts``)."""
    if header.part_bytes <= 0:
        return None
    if header.codec == CODEC_NONE:
        st_len = header.raw_len - header.tensor_nbytes
        if header.tensor_nbytes == 0 or head_len != header.payload_offset + st_len:
            return None
        total = header.tensor_nbytes
    else:
        if head_len != header.payload_offset:
            return None
        total = header.payload_len
    part = header.part_bytes
    return [min(part, total - start) for start in range(0, total, part)]


def finish_direct(
    header: BlobHeader, head: Buffer, data: torch.Tensor, landing: Landing | None = None
) -> torch.Tensor:
    """Validate and decode a blob whose chunks were read straight into ``data`` (see
    ``direct_layout``). Raw: ``data`` holds the tensor's bytes and becomes the tensor; the
    checksum covers the head's prefix and every byte of it (``landing``: computed as the
    bytes landed, seeded with that prefix: ``raw_landing``; else hashed here). lz4: ``data``
    holds the payload, decompressed here (into the tensor's memory, as ``decode_parts``
    does)."""
    if header.codec != CODEC_NONE:
        if data.numel() != header.payload_len or len(head) != header.payload_offset:
            raise BlobError("directly read blob does not match its header")
        return _decode_lz4(header, data.numpy().data)
    prefix = memoryview(head)[header.payload_offset :]
    if data.numel() != header.tensor_nbytes or len(prefix) != header.raw_len - data.numel():
        raise BlobError("directly read blob does not match its header")
    digest = None if landing is None else landing.digest(0, data.numel())
    if digest is None:
        hasher = xxhash.xxh3_64(prefix)
        hasher.update(data.numpy().data)
        digest = hasher.intdigest()
    _check(header, digest, prefix)
    return _as_tensor(header, data)


def raw_landing(header: BlobHeader, head: Buffer, data: memoryview) -> Landing | None:
    """The running checksum of a raw blob's tensor bytes landing in ``data`` (for
    ``finish_direct``): seeded with the head's safetensors prefix; ``None`` for lz4 blobs,
    whose checksum covers the decompressed bytes."""
    if header.codec != CODEC_NONE:
        return None
    return Landing(data, 0, seed=memoryview(head)[header.payload_offset :])
