"""The blob header: a fixed little-endian struct that makes every stored value self-describing.

Layout of one blob (all integers little-endian)::

    offset size field
       0    4  magic               b"ECRB"
       4    2  version             FORMAT_VERSION
       6    1  codec               0 none, 1 lz4 (block)
       7    1  flags               bit 0: tensor bytes byte-shuffled before compression
       8    1  dtype               code from DTYPES
       9    1  ndim                1..MAX_NDIM
      10    2  producer_len        bytes of producer JSON (padded to 8) after the header
      12    4  reserved            0
      16   32  shape               MAX_NDIM x u64, unused dims 0
      48    8  raw_len             bytes of the uncompressed safetensors document
      56    8  payload_len         bytes of the stored payload (raw or compressed)
      64    8  checksum            xxh3-64 of the uncompressed safetensors document
      72    8  part_bytes          0: one value; else size of the data parts after the head
      80    8  write_id            random, never 0, new for every write: names the chunk keys
                                   of a chunked entry and makes every head's header unique
      88    8  header_checksum     xxh3-64 of bytes [0, 88) plus the producer bytes
      96    .  producer JSON, then the payload

The payload is a safetensors document holding one tensor named ``"ec_cache"``.

Version 2 added ``write_id`` (the header grew from 88 to 96 bytes): a rewrite stores its chunks
under new keys, so readers of the entry it replaces never see them (see ``tiers/layout.py``).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import torch

MAGIC = b"ECRB"
FORMAT_VERSION = 2
TENSOR_NAME = "ec_cache"
MAX_NDIM = 4
MAX_PRODUCER_BYTES = 1024
HEADER = struct.Struct("<4sHBBBBHI4QQQQQQQ")
HEADER_SIZE = HEADER.size  # 96
CHECKED_SIZE = HEADER_SIZE - 8
# offsets the Redis tier's Lua scripts read without parsing the header
PRODUCER_LEN_AT = 10
PAYLOAD_LEN_AT = 56
PART_BYTES_AT = 72
WRITE_ID_AT = 80

CODEC_NONE = 0
CODEC_LZ4 = 1
CODEC_NAMES = {CODEC_NONE: "none", CODEC_LZ4: "lz4"}
FLAG_SHUFFLED = 1
KNOWN_FLAGS = FLAG_SHUFFLED


@dataclass(frozen=True)
class DType:
    code: int
    torch_dtype: torch.dtype
    safetensors_name: str
    itemsize: int


DTYPES: tuple[DType, ...] = (
    DType(1, torch.bfloat16, "BF16", 2),
    DType(2, torch.float16, "F16", 2),
    DType(3, torch.float32, "F32", 4),
    DType(4, torch.float64, "F64", 8),
    DType(5, torch.uint8, "U8", 1),
    DType(6, torch.int8, "I8", 1),
    DType(7, torch.int16, "I16", 2),
    DType(8, torch.int32, "I32", 4),
    DType(9, torch.int64, "I64", 8),
    DType(10, torch.bool, "BOOL", 1),
    DType(11, torch.float8_e4m3fn, "F8_E4M3", 1),
    DType(12, torch.float8_e5m2, "F8_E5M2", 1),
)
BY_CODE = {d.code: d for d in DTYPES}
BY_TORCH = {d.torch_dtype: d for d in DTYPES}


@dataclass(frozen=True)
class BlobHeader:
    """The decoded fixed header of a blob (validated by ``ec_redis.codec.read_header``)."""

    version: int
    codec: int
    flags: int
    dtype: DType
    shape: tuple[int, ...]
    producer: dict[str, object]
    raw_len: int
    payload_len: int
    checksum: int
    part_bytes: int
    write_id: int
    payload_offset: int

    @property
    def total_len(self) -> int:
        """Length of the whole blob: header, producer info and payload."""
        return self.payload_offset + self.payload_len

    @property
    def tensor_nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize

    @property
    def codec_name(self) -> str:
        return CODEC_NAMES.get(self.codec, str(self.codec))

    @property
    def shuffled(self) -> bool:
        return bool(self.flags & FLAG_SHUFFLED)


def new_write_id() -> int:
    """A random, non-zero 64-bit write id (see the ``write_id`` header field)."""
    return int.from_bytes(os.urandom(8), "little") or 1
