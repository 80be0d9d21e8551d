"""A safetensors document built by hand around a tensor's own memory (no extra copies).

The format is an 8-byte little-endian header length, a JSON header, then the raw bytes.
``safetensors.torch.save`` makes two full copies of the tensor; building the header here costs
microseconds and the tensor bytes are only ever referenced, never copied.
"""

from __future__ import annotations

import json
import struct

from ec_redis.codec.format import TENSOR_NAME, DType
from ec_redis.errors import BlobError

MAX_HEADER_BYTES = 64 * 1024
_LEN = struct.Struct("<Q")


def build_header(dtype: DType, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Return the document's prefix (length + JSON), padded so tensor bytes are 8-aligned."""
    meta = {
        TENSOR_NAME: {
            "dtype": dtype.safetensors_name,
            "shape": list(shape),
            "data_offsets": [0, nbytes],
        }
    }
    body = json.dumps(meta, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return _LEN.pack(len(body)) + body


def parse_header(prefix: bytes | memoryview, dtype: DType, shape: tuple[int, ...]) -> None:
    """Validate that ``prefix`` is exactly the document header of the expected tensor."""
    if len(prefix) < _LEN.size:
        raise BlobError("safetensors document truncated before its header length")
    (length,) = _LEN.unpack_from(prefix, 0)
    if length > MAX_HEADER_BYTES or _LEN.size + length != len(prefix):
        raise BlobError(f"safetensors header length {length} disagrees with the blob header")
    try:
        meta = json.loads(bytes(prefix[_LEN.size :]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BlobError(f"safetensors header is not UTF-8 JSON: {exc}") from None
    if not isinstance(meta, dict) or set(meta) - {TENSOR_NAME, "__metadata__"}:
        raise BlobError(f"safetensors header must hold exactly one tensor, {TENSOR_NAME!r}")
    nbytes = _numel(shape) * dtype.itemsize
    expected = {"dtype": dtype.safetensors_name, "shape": list(shape), "data_offsets": [0, nbytes]}
    if meta.get(TENSOR_NAME) != expected:
        raise BlobError(f"safetensors entry disagrees with the blob header {expected!r}")


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
