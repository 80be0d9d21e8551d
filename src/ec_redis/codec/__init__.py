"""Blob codec: a tensor <-> one self-describing, checksummed, versioned value (or its parts).

``encode_parts`` returns the parts of a blob (one part when it fits ``part_bytes``); the
concatenation of the parts is always exactly one blob, so ``decode_blob(b"".join(parts))``
and ``decode_parts(parts)`` agree. Decoding validates every field before allocating and never
unpickles; any inconsistency raises ``BlobError``.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Sequence

import torch
import xxhash

from ec_redis.codec import destination
from ec_redis.codec.compression import (
    lz4_compress,
    lz4_decompress,
    probe_ratio,
    shuffle,
    unshuffle,
)
from ec_redis.codec.format import (
    BY_CODE,
    BY_TORCH,
    CHECKED_SIZE,
    CODEC_LZ4,
    CODEC_NONE,
    FLAG_SHUFFLED,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    KNOWN_FLAGS,
    MAGIC,
    MAX_NDIM,
    MAX_PRODUCER_BYTES,
    BlobHeader,
    DType,
    new_write_id,
)
from ec_redis.codec.landing import Landing
from ec_redis.codec.safetensors_doc import MAX_HEADER_BYTES, build_header, parse_header
from ec_redis.errors import BlobError, BlobTooLargeError, TensorError

__all__ = [
    "DEFAULT_MAX_BLOB_BYTES",
    "BlobHeader",
    "decode_blob",
    "decode_parts",
    "encode_blob",
    "encode_parts",
    "read_header",
]

DEFAULT_MAX_BLOB_BYTES = 512 * 1024 * 1024
Buffer = bytes | memoryview

# Decoded tensors alias the received bytes (zero copy); torch warns that bytes are read-only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


def encode_parts(
    tensor: torch.Tensor,
    *,
    compression: str = "none",
    min_ratio: float = 1.1,
    byte_shuffle: bool = False,
    producer_id: str = "",
    part_bytes: int = 0,
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    created_s: float | None = None,
    model: str = "",
    write_id: int | None = None,
) -> list[Buffer]:
    """Encode a host tensor into blob parts; part 0 is the head and carries the header.

    With ``part_bytes == 0`` or a blob that fits in ``part_bytes``, one part is returned.
    Larger blobs are cut into parts of ``part_bytes``: the head (the header and the payload's
    first bytes) and data parts that reference the tensor's (or the compressed payload's)
    memory without copying it. ``write_id`` (default:
    a fresh random one) goes into the header; a storage layer names the parts' keys with it.
    """
    if write_id is None:
        write_id = new_write_id()
    if not 0 < write_id < 2**64:
        raise TensorError(f"write_id must be a non-zero 64-bit integer, got {write_id}")
    dtype, shape = _check_tensor(tensor)
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    data = flat.numpy().data
    st_prefix = build_header(dtype, shape, len(data))
    raw_len = len(st_prefix) + len(data)
    hasher = xxhash.xxh3_64(st_prefix)
    hasher.update(data)
    checksum = hasher.intdigest()

    codec, flags = CODEC_NONE, 0
    payload: list[Buffer] = [st_prefix, data]
    if compression not in ("none", "lz4", "auto"):
        raise TensorError(f"unknown compression {compression!r}; use none, lz4 or auto")
    wanted = len(data) > 0 and (
        compression == "lz4"
        or (
            compression == "auto"
            and _worth_compressing(data, dtype.itemsize, byte_shuffle, min_ratio)
        )
    )
    if wanted:
        body = shuffle(data, dtype.itemsize) if byte_shuffle else data
        packed = lz4_compress(b"".join((st_prefix, body)))
        if compression == "lz4" or raw_len / max(len(packed), 1) >= min_ratio:
            codec, flags = CODEC_LZ4, FLAG_SHUFFLED if byte_shuffle else 0
            payload = [memoryview(packed)]

    payload_len = sum(len(p) for p in payload)
    producer = _producer_bytes(producer_id, time.time() if created_s is None else created_s, model)
    total = HEADER_SIZE + len(producer) + payload_len
    if total > max_blob_bytes:
        raise TensorError(f"blob of {total} bytes exceeds max_blob_bytes={max_blob_bytes}")
    chunked = part_bytes > 0 and total > part_bytes
    padded_shape = list(shape) + [0] * (MAX_NDIM - len(shape))
    fields = [
        MAGIC, FORMAT_VERSION, codec, flags, dtype.code, len(shape), len(producer), 0,
        *padded_shape, raw_len, payload_len, checksum, part_bytes if chunked else 0, write_id,
    ]  # fmt: skip
    checked = HEADER.pack(*fields, 0)[:CHECKED_SIZE]
    header_sum = xxhash.xxh3_64(checked + producer).intdigest()
    head = checked + header_sum.to_bytes(8, "little") + producer
    if not chunked:
        return [b"".join((head, *payload))]
    rest = memoryview(payload[-1])  # raw: the tensor bytes; lz4: the compressed payload
    if codec == CODEC_NONE:
        head += st_prefix
    # The head is the blob's first part: its header and the payload's first bytes (one copy of
    # a part, made here, off the engine's step). A reader learns the chunk keys from the
    # header's first bytes and sends their GETs while the rest of the head is still streaming
    # in: a chunked read costs one round trip, not two (``tiers/bulk_read.read_streamed``).
    # How much payload the head carries does not depend on the producer info (it holds a
    # timestamp of varying length): the same tensor is always cut into the same chunks.
    in_head = max(part_bytes - (len(head) - len(producer)) - MAX_PRODUCER_BYTES, 0)
    head = b"".join((head, rest[:in_head]))
    return [head] + [rest[i : i + part_bytes] for i in range(in_head, len(rest), part_bytes)]


def encode_blob(tensor: torch.Tensor, **options: object) -> bytes:
    """Encode a host tensor into one blob (see ``encode_parts`` for the options)."""
    options.pop("part_bytes", None)
    (blob,) = encode_parts(tensor, **options)  # type: ignore[arg-type]
    return bytes(blob)


def read_header(head: Buffer, *, max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES) -> BlobHeader:
    """Parse and validate the header at the start of ``head``; raise ``BlobError`` if invalid."""
    if len(head) < HEADER_SIZE:
        raise BlobError(f"blob truncated: {len(head)} bytes is shorter than the header")
    (
        magic, version, codec, flags, dtype_code, ndim, producer_len, reserved,
        d0, d1, d2, d3, raw_len, payload_len, checksum, part_bytes, write_id, header_sum,
    ) = HEADER.unpack_from(head, 0)  # fmt: skip
    if magic != MAGIC:
        raise BlobError(f"not an ec_redis blob (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise BlobError(f"blob format version {version}; this build reads {FORMAT_VERSION}")
    if producer_len > MAX_PRODUCER_BYTES or len(head) < HEADER_SIZE + producer_len:
        raise BlobError(f"producer info of {producer_len} bytes is oversized or truncated")
    producer_raw = bytes(head[HEADER_SIZE : HEADER_SIZE + producer_len])
    expected_sum = xxhash.xxh3_64(bytes(head[:CHECKED_SIZE]) + producer_raw).intdigest()
    if header_sum != expected_sum:
        raise BlobError("blob header checksum mismatch")
    dtype = BY_CODE.get(dtype_code)
    if dtype is None:
        raise BlobError(f"unknown dtype code {dtype_code}")
    if codec not in (CODEC_NONE, CODEC_LZ4) or flags & ~KNOWN_FLAGS or reserved:
        raise BlobError(f"unknown codec {codec} or flags {flags:#x}")
    if codec == CODEC_NONE and flags:
        raise BlobError("raw payloads cannot be byte-shuffled")
    if write_id == 0:
        raise BlobError("blob has no write id")
    dims = (d0, d1, d2, d3)
    if not 1 <= ndim <= MAX_NDIM or any(dims[ndim:]):
        raise BlobError(f"invalid rank {ndim} for shape {dims}")
    shape = tuple(dims[:ndim])
    if raw_len > max_blob_bytes or payload_len > max_blob_bytes:
        raise BlobTooLargeError(
            f"blob declares {max(raw_len, payload_len)} bytes > {max_blob_bytes}"
        )
    numel, span = 1, 1
    for dim in shape:
        numel *= dim
        span *= max(dim, 1)
    if span >= 2**63:  # an empty shape is not bounded by numel; torch cannot hold this one
        raise BlobError(f"shape {shape} is too large")
    st_len = raw_len - numel * dtype.itemsize
    if not 8 <= st_len <= 8 + MAX_HEADER_BYTES:
        raise BlobError("declared sizes disagree with dtype and shape")
    if codec == CODEC_NONE and payload_len != raw_len:
        raise BlobError("raw payload length differs from the document length")
    try:
        producer = json.loads(producer_raw.decode("utf-8")) if producer_len else {}
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BlobError(f"producer info is not UTF-8 JSON: {exc}") from None
    if not isinstance(producer, dict):
        raise BlobError("producer info must be a JSON object")
    return BlobHeader(
        version=version,
        codec=codec,
        flags=flags,
        dtype=dtype,
        shape=shape,
        producer=producer,
        raw_len=raw_len,
        payload_len=payload_len,
        checksum=checksum,
        part_bytes=part_bytes,
        write_id=write_id,
        payload_offset=HEADER_SIZE + producer_len,
    )


def decode_blob(data: Buffer, *, max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES) -> torch.Tensor:
    """Decode one complete blob into its tensor, or raise ``BlobError``.

    A raw (uncompressed) blob decodes without copying: the tensor aliases ``data``.
    """
    if not isinstance(data, (bytes, memoryview)):
        raise BlobError(f"a blob must be bytes, got {type(data).__name__}")
    header = read_header(data, max_blob_bytes=max_blob_bytes)
    if len(data) != header.total_len:
        raise BlobError(f"blob is {len(data)} bytes, its header declares {header.total_len}")
    return decode_parts([data], max_blob_bytes=max_blob_bytes, header=header)


def decode_parts(
    parts: Sequence[Buffer],
    *,
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES,
    header: BlobHeader | None = None,
    landing: Landing | None = None,
) -> torch.Tensor:
    """Decode a blob given as consecutive parts (head first) with at most one copy.
    ``landing``: the running checksum of a one-part blob as its bytes landed (``landing.py``;
    used only when it covers exactly the payload, else the payload is hashed here)."""
    if not parts:
        raise BlobError("no blob parts")
    if header is None:
        header = read_header(parts[0], max_blob_bytes=max_blob_bytes)
    if sum(len(p) for p in parts) != header.total_len:
        raise BlobError("blob parts do not add up to the length its header declares")
    pieces = [memoryview(p) for p in parts]
    pieces[0] = pieces[0][header.payload_offset :]
    st_len = header.raw_len - header.tensor_nbytes
    if header.codec == CODEC_NONE:
        return _decode_raw(header, parts[0], pieces, st_len, landing)
    payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    return _decode_lz4(header, payload)


def _decode_lz4(header: BlobHeader, payload: Buffer) -> torch.Tensor:
    """Decompress the whole payload into the tensor's memory (the one pass over the bytes:
    the tensor aliases lz4's output), then check it."""
    st_len = header.raw_len - header.tensor_nbytes
    doc = memoryview(lz4_decompress(payload, header.raw_len))
    body = unshuffle(doc[st_len:], header.dtype.itemsize) if header.shuffled else doc[st_len:]
    hasher = xxhash.xxh3_64(doc[:st_len])
    hasher.update(body)
    _check(header, hasher.intdigest(), doc[:st_len])
    if not header.tensor_nbytes:
        return _as_tensor(header, None)
    return _as_tensor(header, torch.frombuffer(body, dtype=torch.uint8))


def _decode_raw(
    header: BlobHeader,
    head: Buffer,
    pieces: list[memoryview],
    st_len: int,
    landing: Landing | None = None,
) -> torch.Tensor:
    if len(pieces) == 1:
        first = pieces[0]
        digest = None if landing is None else landing.digest(header.payload_offset, len(head))
        if digest is None:
            digest = xxhash.xxh3_64_intdigest(first)
        _check(header, digest, first[:st_len])
        if not header.tensor_nbytes:
            return _as_tensor(header, None)
        offset = header.payload_offset + st_len
        data = torch.frombuffer(head, dtype=torch.uint8, offset=offset, count=len(first) - st_len)
        return _as_tensor(header, data)
    # Chunked: stream every piece into one buffer, hashing as we go (the one copy).
    stream = _Concat(pieces)
    prefix: bytes | memoryview = stream.take(st_len)
    out = destination.buffer(header.tensor_nbytes)
    hasher = xxhash.xxh3_64(prefix)
    stream.copy_into(out.numpy().data, hasher)
    _check(header, hasher.intdigest(), prefix)
    return _as_tensor(header, out)


class _Concat:
    """Reads a sequence of buffers as one stream without joining them."""

    def __init__(self, pieces: list[memoryview]) -> None:
        self._pieces = [p for p in pieces if len(p)]
        self._index = 0
        self._pos = 0

    def take(self, count: int) -> bytes:
        out = bytearray()
        while len(out) < count and self._index < len(self._pieces):
            piece = self._pieces[self._index]
            grab = piece[self._pos : self._pos + count - len(out)]
            out += grab
            self._advance(len(grab))
        return bytes(out)

    def copy_into(self, target: memoryview, hasher: xxhash.xxh3_64) -> None:
        written = 0
        while self._index < len(self._pieces):
            piece = self._pieces[self._index][self._pos :]
            target[written : written + len(piece)] = piece
            hasher.update(piece)
            written += len(piece)
            self._advance(len(piece))

    def _advance(self, count: int) -> None:
        self._pos += count
        if self._pos >= len(self._pieces[self._index]):
            self._index += 1
            self._pos = 0


def _worth_compressing(
    data: memoryview, itemsize: int, byte_shuffle: bool, min_ratio: float
) -> bool:
    """The "auto" probe: lz4 a few samples (shuffled like the real payload would be)."""
    return (
        probe_ratio(data, (lambda s: shuffle(s, itemsize)) if byte_shuffle else None) >= min_ratio
    )


def _check(header: BlobHeader, actual: int, prefix: Buffer) -> None:
    if actual != header.checksum:
        raise BlobError("payload checksum mismatch (corrupt or truncated blob)")
    parse_header(prefix, header.dtype, header.shape)


def _as_tensor(header: BlobHeader, data: torch.Tensor | None) -> torch.Tensor:
    if data is None:
        return torch.empty(header.shape, dtype=header.dtype.torch_dtype)
    return data.view(header.dtype.torch_dtype).view(header.shape)


def _check_tensor(tensor: torch.Tensor) -> tuple[DType, tuple[int, ...]]:
    if not isinstance(tensor, torch.Tensor):
        raise TensorError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    dtype = BY_TORCH.get(tensor.dtype)
    if dtype is None:
        raise TensorError(f"dtype {tensor.dtype} is not supported")
    if tensor.device.type != "cpu":
        raise TensorError("encode a host tensor; copy device tensors to the CPU first")
    if not 1 <= tensor.dim() <= MAX_NDIM:
        raise TensorError(f"tensors of rank 1..{MAX_NDIM} are supported, got {tensor.dim()}")
    if tensor.is_sparse or tensor.is_quantized or tensor.is_complex():
        raise TensorError("dense real tensors only")
    return dtype, tuple(int(d) for d in tensor.shape)


def _producer_bytes(producer_id: str, created_s: float, model: str = "") -> bytes:
    fields: dict[str, object] = {"id": producer_id[:200], "ts": round(created_s, 3)}
    if model:  # for operators' tools (ec-redis ls/inspect); keys already hash the identity
        fields["model"] = model[:400]
    info = json.dumps(fields).encode()
    return info + b" " * (-len(info) % 8)
