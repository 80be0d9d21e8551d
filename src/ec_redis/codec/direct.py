"""Decoding blobs whose chunks were read straight into one buffer (``tiers/bulk_read.py``).

For a chunked blob of the right layout the reader allocates one buffer and has the bytes the
head carries after its header, then each chunk's reply, land in their slices: a raw blob's
buffer is the tensor itself, an lz4 blob's is the compressed payload, decompressed into the
tensor's memory. No bytes object per chunk, no join.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from ec_redis.codec import _as_tensor, _check, _decode_lz4
from ec_redis.codec.format import CODEC_NONE, BlobHeader
from ec_redis.codec.landing import Landing
from ec_redis.errors import BlobError

Buffer = bytes | memoryview


@dataclass(frozen=True)
class DirectLayout:
    """Where a chunked blob's bytes go when read straight into one buffer."""

    lead: int  # the head's first bytes, kept apart: header, producer info (raw: safetensors prefix)
    size: int  # the buffer: raw, the tensor's bytes; lz4, the compressed payload
    in_head: int  # the buffer's first bytes that the head carries after its lead
    chunks: list[int]  # the lengths of the chunks, in order, that fill the rest of the buffer


def direct_layout(header: BlobHeader, head_len: int) -> DirectLayout | None:
    """How a chunked blob whose head is ``head_len`` bytes long is read straight into one
    buffer: a raw blob's tensor bytes, or an lz4 blob's compressed payload, part of them in
    the head (after its header and, raw, the safetensors prefix) and the rest in its chunks;
    ``None`` for any other layout (use ``decode_parts``)."""
    if header.part_bytes <= 0:
        return None
    if header.codec == CODEC_NONE:
        if header.tensor_nbytes == 0:
            return None
        lead = header.payload_offset + header.raw_len - header.tensor_nbytes
        size = header.tensor_nbytes
    else:
        lead, size = header.payload_offset, header.payload_len
    in_head = head_len - lead
    if not 0 <= in_head < size:
        return None
    part = header.part_bytes
    chunks = [min(part, size - start) for start in range(in_head, size, part)]
    return DirectLayout(lead, size, in_head, chunks)


def finish_direct(
    header: BlobHeader, head: Buffer, data: torch.Tensor, landing: Landing | None = None
) -> torch.Tensor:
    """Validate and decode a blob whose chunks were read straight into ``data`` (see
    ``direct_layout``; ``head``: the head's lead, without the bytes it carried into ``data``).
    Raw: ``data`` holds the tensor's bytes and becomes the tensor; the checksum covers the
    head's safetensors prefix and every byte of ``data`` (``landing``: computed as the bytes
    landed, seeded with that prefix: ``raw_landing``; else hashed here). lz4: ``data`` holds
    the payload, decompressed here (into the tensor's memory, as ``decode_parts`` does)."""
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
