"""The blob codec: bit-exact round trips, pinned bytes, strict validation and fuzzing."""

from __future__ import annotations

import ast
import json
import struct
from collections.abc import Callable
from pathlib import Path

import lz4.block
import pytest
import safetensors.torch
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ec_redis.codec import (
    decode_blob,
    decode_parts,
    encode_blob,
    encode_parts,
    read_header,
)
from ec_redis.codec.format import (
    CHECKED_SIZE,
    CODEC_LZ4,
    CODEC_NONE,
    DTYPES,
    FORMAT_VERSION,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_NDIM,
    MAX_PRODUCER_BYTES,
    PART_BYTES_AT,
    PAYLOAD_LEN_AT,
    PRODUCER_LEN_AT,
    WRITE_ID_AT,
    DType,
)
from ec_redis.codec.safetensors_doc import MAX_HEADER_BYTES, build_header
from ec_redis.errors import BlobError, ECRedisError, TensorError
from tests.conftest import bits, embedding

SRC = Path(__file__).resolve().parents[1] / "src" / "ec_redis"
GOLDEN_WRITE_ID = 0x0807060504030201  # bytes 01..08 in the golden blobs below

# (compression, byte_shuffle) combinations the encoder accepts.
OPTIONS = [("none", False), ("lz4", False), ("lz4", True), ("auto", False), ("auto", True)]
SHAPES = [(7,), (3, 5), (2, 3, 4), (2, 1, 3, 2), (0, 16), (4, 0, 2)]


# ---------------------------------------------------------------------------------------------
# helpers


def assert_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert bits(got) == bits(want)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and infinities included); bools are 0 or 1."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def structured_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Low-entropy contents that lz4 does shrink."""
    numel = 1
    for dim in shape:
        numel *= dim
    values = torch.arange(numel) % 3
    return values.to(dtype).reshape(shape)


def seal(blob: bytes | bytearray) -> bytes:
    """Recompute the header checksum after editing bytes [0, 88) or the producer info."""
    buf = bytearray(blob)
    producer_len = int.from_bytes(buf[10:12], "little")
    producer = bytes(buf[HEADER_SIZE : HEADER_SIZE + producer_len])
    digest = xxhash.xxh3_64_intdigest(bytes(buf[:CHECKED_SIZE]) + producer)
    buf[CHECKED_SIZE:HEADER_SIZE] = digest.to_bytes(8, "little")
    return bytes(buf)


def build_blob(
    doc: bytes,
    *,
    dtype_code: int,
    shape: tuple[int, ...],
    codec: int = CODEC_NONE,
    flags: int = 0,
    producer: bytes = b"{}      ",
    version: int = FORMAT_VERSION,
    payload: bytes | None = None,
    write_id: int = GOLDEN_WRITE_ID,
) -> bytes:
    """Assemble a blob around a safetensors document, computing both checksums like the encoder.

    ``payload`` defaults to ``doc`` (raw) or its lz4 block compression.
    """
    if payload is None:
        payload = doc if codec == CODEC_NONE else lz4.block.compress(doc, store_size=False)
    padded = list(shape) + [0] * (MAX_NDIM - len(shape))
    fields = [
        MAGIC, version, codec, flags, dtype_code, len(shape), len(producer), 0,
        *padded, len(doc), len(payload), xxhash.xxh3_64_intdigest(doc), 0, write_id, 0,
    ]  # fmt: skip
    return seal(HEADER.pack(*fields)[:CHECKED_SIZE] + bytes(8) + producer + payload)


def doc_for(dtype: DType, shape: tuple[int, ...], data: bytes) -> bytes:
    return build_header(dtype, shape, len(data)) + data


F32 = next(d for d in DTYPES if d.torch_dtype == torch.float32)
SMALL = torch.arange(12, dtype=torch.float32).reshape(3, 4)


def small_blob() -> bytes:
    return encode_blob(SMALL, compression="none", producer_id="t", created_s=1.0)


def with_bytes(blob: bytes, offset: int, value: bytes) -> bytes:
    return blob[:offset] + value + blob[offset + len(value) :]


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("dtype", [d.torch_dtype for d in DTYPES], ids=str)
@pytest.mark.parametrize(("compression", "byte_shuffle"), OPTIONS)
def test_every_dtype_rank_and_option_round_trips_bit_exactly(
    dtype: torch.dtype, compression: str, byte_shuffle: bool
) -> None:
    for seed, shape in enumerate(SHAPES):
        for tensor in (random_tensor(dtype, shape, seed), structured_tensor(dtype, shape)):
            blob = encode_blob(tensor, compression=compression, byte_shuffle=byte_shuffle)
            assert_identical(decode_blob(blob), tensor)
            assert_identical(decode_blob(memoryview(blob)), tensor)
            header = read_header(blob)
            assert header.dtype.torch_dtype == dtype
            assert header.shape == shape
            if compression == "none" or tensor.numel() == 0:
                assert header.codec_name == "none"
            elif compression == "lz4":
                assert header.codec_name == "lz4"
                assert header.shuffled == byte_shuffle


def test_non_contiguous_input_round_trips_as_its_logical_values() -> None:
    base = random_tensor(torch.float32, (6, 10), seed=3)
    transposed = base.t()
    assert not transposed.is_contiguous()
    for compression, byte_shuffle in OPTIONS:
        got = decode_blob(
            encode_blob(transposed, compression=compression, byte_shuffle=byte_shuffle)
        )
        assert_identical(got, transposed.contiguous())
        assert torch.equal(got.t(), base)


def test_sliced_and_expanded_inputs_round_trip() -> None:
    base = random_tensor(torch.int32, (8, 9), seed=4)
    for view in (base[1:7:2, ::3], base[:, 4], torch.zeros(3, 1).expand(3, 5)):
        assert_identical(decode_blob(encode_blob(view, compression="lz4")), view.contiguous())


def test_empty_shape_with_a_huge_dimension_round_trips() -> None:
    tensor = torch.empty((0, 2**63 - 1), dtype=torch.bfloat16)
    got = decode_blob(encode_blob(tensor))
    assert got.shape == tensor.shape and got.dtype == torch.bfloat16


def test_raw_decode_aliases_the_blob_bytes() -> None:
    blob = bytearray(encode_blob(SMALL))
    got = decode_blob(memoryview(blob))
    assert torch.equal(got, SMALL)
    header = read_header(bytes(blob))
    offset = header.payload_offset + header.raw_len - header.tensor_nbytes
    blob[offset : offset + 4] = struct.pack("<f", 99.0)  # zero copy: the tensor sees the write
    assert got[0, 0].item() == 99.0


def test_producer_info_and_defaults_are_recorded() -> None:
    header = read_header(
        encode_blob(SMALL, producer_id="enc-1", created_s=1234.56789, compression="none")
    )
    assert header.producer == {"id": "enc-1", "ts": 1234.568}
    assert header.version == FORMAT_VERSION
    assert header.part_bytes == 0
    assert (header.payload_offset - HEADER_SIZE) % 8 == 0
    long_id = read_header(encode_blob(SMALL, producer_id="x" * 5000)).producer["id"]
    assert long_id == "x" * 200


# ---------------------------------------------------------------------------------------------
# parts


def test_encode_parts_splits_a_large_raw_blob_and_both_decoders_agree() -> None:
    tensor = embedding(2048, 256)  # 1 MiB of bf16
    part_bytes = 64 * 1024
    parts = encode_parts(tensor, compression="none", part_bytes=part_bytes)
    assert len(parts) > 1
    head = read_header(parts[0])
    assert head.codec_name == "none"
    assert head.part_bytes == part_bytes
    # the head is the blob's first part: header, producer, safetensors prefix, first data
    # (as much data as fits with the largest producer info: the same cut whatever it holds)
    lead = head.payload_offset + head.raw_len - head.tensor_nbytes
    in_head = part_bytes - (lead - (head.payload_offset - HEADER_SIZE)) - MAX_PRODUCER_BYTES
    assert len(parts[0]) == lead + in_head <= part_bytes
    data = tensor.view(-1).view(torch.uint8).numpy().tobytes()
    assert bytes(parts[0][lead:]) == data[:in_head]
    data_parts = parts[1:]
    assert all(len(p) == part_bytes for p in data_parts[:-1])
    assert 0 < len(data_parts[-1]) <= part_bytes
    assert sum(len(p) for p in parts) == head.total_len
    assert_identical(decode_parts(parts), tensor)
    joined = b"".join(parts)
    assert_identical(decode_blob(joined), tensor)
    # Each part is a separate value in Redis: decoding works from independent bytes objects.
    assert_identical(decode_parts([bytes(p) for p in parts]), tensor)


def test_encode_parts_splits_a_compressed_payload() -> None:
    tensor = torch.zeros(512, 512, dtype=torch.float32)
    parts = encode_parts(tensor, compression="lz4", part_bytes=2048)
    assert len(parts) > 2
    head = read_header(parts[0])
    assert head.codec_name == "lz4"
    # the head is the blob's first part: the header, then the compressed payload's first bytes
    assert head.payload_offset < len(parts[0]) <= 2048
    assert all(0 < len(p) <= 2048 for p in parts[1:])
    assert_identical(decode_parts(parts), tensor)
    assert_identical(decode_blob(b"".join(parts)), tensor)


def test_encode_parts_returns_one_part_when_the_blob_fits() -> None:
    parts = encode_parts(SMALL, part_bytes=1 << 20)
    assert len(parts) == 1
    assert read_header(parts[0]).part_bytes == 0
    header = read_header(parts[0])
    assert bytes(parts[0]) == encode_blob(
        SMALL, created_s=header.producer["ts"], write_id=header.write_id
    )
    assert_identical(decode_parts(parts), SMALL)


def test_encode_blob_ignores_part_bytes() -> None:
    blob = encode_blob(embedding(64, 64), part_bytes=1024)
    assert read_header(blob).part_bytes == 0
    assert_identical(decode_blob(blob), embedding(64, 64))


def test_decode_parts_tolerates_empty_parts_but_not_missing_bytes() -> None:
    parts = encode_parts(embedding(256, 256), part_bytes=16 * 1024)
    assert_identical(decode_parts([*parts[:2], b"", *parts[2:], b""]), embedding(256, 256))
    with pytest.raises(BlobError):
        decode_parts([])
    with pytest.raises(BlobError):
        decode_parts(parts[:-1])
    with pytest.raises(BlobError):
        decode_parts([*parts, b"x"])
    with pytest.raises(BlobError):
        decode_parts([parts[0], parts[2], parts[1], *parts[3:]])
    with pytest.raises(BlobError):
        decode_parts(parts[1:])


# ---------------------------------------------------------------------------------------------
# compression choice


def test_auto_stores_random_bf16_raw() -> None:
    blob = encode_blob(embedding(256, 256), compression="auto")
    assert read_header(blob).codec_name == "none"
    assert len(blob) > 256 * 256 * 2


def test_auto_compresses_highly_compressible_data() -> None:
    for tensor in (
        torch.zeros(256, 256, dtype=torch.bfloat16),
        torch.ones(1000, dtype=torch.int64),
    ):
        blob = encode_blob(tensor, compression="auto")
        header = read_header(blob)
        assert header.codec_name == "lz4"
        assert len(blob) < tensor.numel() * tensor.element_size() // 10
        assert_identical(decode_blob(blob), tensor)


def test_auto_with_byte_shuffle_compresses_bf16_activations() -> None:
    tensor = embedding(256, 256)
    blob = encode_blob(tensor, compression="auto", byte_shuffle=True)
    header = read_header(blob)
    assert header.codec_name == "lz4" and header.shuffled
    assert len(blob) < tensor.numel() * 2
    assert_identical(decode_blob(blob), tensor)


def test_auto_respects_min_ratio() -> None:
    tensor = embedding(256, 256)
    blob = encode_blob(tensor, compression="auto", byte_shuffle=True, min_ratio=5.0)
    header = read_header(blob)
    assert header.codec_name == "none" and not header.shuffled


def test_lz4_is_forced_even_when_it_does_not_pay() -> None:
    tensor = random_tensor(torch.uint8, (4096,), seed=9)
    blob = encode_blob(tensor, compression="lz4")
    assert read_header(blob).codec_name == "lz4"
    assert_identical(decode_blob(blob), tensor)


def test_unknown_compression_is_rejected() -> None:
    for tensor in (torch.zeros(1000), torch.zeros(0, 4)):
        with pytest.raises(TensorError, match="zstd"):
            encode_blob(tensor, compression="zstd")


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(3, dtype=torch.complex64),
        torch.zeros(3, dtype=torch.uint16),
        torch.tensor(1.0),
        torch.zeros(1, 1, 1, 1, 1),
        [1.0, 2.0],
    ],
    ids=["complex", "uint16", "rank0", "rank5", "list"],
)
def test_unsupported_tensors_raise_tensor_error(bad: object) -> None:
    with pytest.raises(TensorError):
        encode_blob(bad)  # type: ignore[arg-type]


def test_encoding_over_max_blob_bytes_raises_tensor_error() -> None:
    with pytest.raises(TensorError, match="max_blob_bytes"):
        encode_blob(torch.zeros(1000), max_blob_bytes=1000)
    assert issubclass(TensorError, ECRedisError)


# ---------------------------------------------------------------------------------------------
# the payload is a safetensors document


def test_raw_payload_is_a_valid_safetensors_document() -> None:
    for tensor in (SMALL, embedding(32, 48), random_tensor(torch.int16, (2, 3, 4), seed=1)):
        blob = encode_blob(tensor, compression="none")
        header = read_header(blob)
        loaded = safetensors.torch.load(blob[header.payload_offset :])
        assert list(loaded) == ["ec_cache"]
        assert_identical(loaded["ec_cache"], tensor)


def test_compressed_payload_decompresses_to_a_safetensors_document() -> None:
    tensor = torch.zeros(64, 64, dtype=torch.float16)
    blob = encode_blob(tensor, compression="lz4")
    header = read_header(blob)
    doc = lz4.block.decompress(blob[header.payload_offset :], uncompressed_size=header.raw_len)
    assert xxhash.xxh3_64_intdigest(doc) == header.checksum
    assert_identical(safetensors.torch.load(doc)["ec_cache"], tensor)


# ---------------------------------------------------------------------------------------------
# golden bytes: the wire format must not drift silently

# Format version 2 (write_id added at offset 80): regenerated deliberately. Against the
# version-1 goldens only the version field, the eight write_id bytes (01..08 below) and the
# header checksum differ; the producer info and the safetensors payload are byte-identical.
GOLDEN_F32 = bytes.fromhex(
    "45435242020000000302280000000000030000000000000004000000000000000000000000000000"
    "000000000000000078000000000000007800000000000000a0b351bf39dcec230000000000000000"
    "0102030405060708ee58e83c2c1b104a7b226964223a2022676f6c64656e222c20227473223a2031"
    "3730303030303030302e307d2020202040000000000000007b2265635f6361636865223a7b226474"
    "797065223a22463332222c227368617065223a5b332c345d2c22646174615f6f666673657473223a"
    "5b302c34385d7d7d000000000000803f0000004000004040000080400000a0400000c0400000e040"
    "00000041000010410000204100003041"
)
GOLDEN_BF16 = bytes.fromhex(
    "45435242020000000102280000000000020000000000000003000000000000000000000000000000"
    "00000000000000005c000000000000005c000000000000009c40df7a9ab01b690000000000000000"
    "0102030405060708d14b45ea5e70e2297b226964223a2022676f6c64656e222c20227473223a2031"
    "3730303030303030302e307d2020202048000000000000007b2265635f6361636865223a7b226474"
    "797065223a2242463136222c227368617065223a5b322c335d2c22646174615f6f66667365747322"
    "3a5b302c31325d7d7d20202020202020803f20c00000494000807f47"
)
GOLDEN_BF16_TENSOR = torch.tensor(
    [[1.0, -2.5, 0.0], [3.140625, -0.0, 65280.0]], dtype=torch.bfloat16
)


@pytest.mark.parametrize(
    ("tensor", "golden"),
    [(SMALL, GOLDEN_F32), (GOLDEN_BF16_TENSOR, GOLDEN_BF16)],
    ids=["f32", "bf16"],
)
def test_golden_bytes(tensor: torch.Tensor, golden: bytes) -> None:
    blob = encode_blob(
        tensor,
        producer_id="golden",
        created_s=1700000000.0,
        compression="none",
        write_id=GOLDEN_WRITE_ID,
    )
    assert blob == golden
    assert_identical(decode_blob(golden), tensor)
    header = read_header(golden)
    assert header.producer == {"id": "golden", "ts": 1700000000.0}
    assert header.payload_offset == HEADER_SIZE + 40


def test_fixed_header_layout() -> None:
    assert HEADER_SIZE == 96
    assert CHECKED_SIZE == 88
    assert FORMAT_VERSION == 2
    assert GOLDEN_F32[0:4] == b"ECRB" == MAGIC
    assert struct.unpack_from("<H", GOLDEN_F32, 4) == (2,)
    codec, flags, dtype, ndim, producer_len, reserved = struct.unpack_from("<BBBBHI", GOLDEN_F32, 6)
    assert (codec, flags, dtype, ndim, producer_len, reserved) == (0, 0, 3, 2, 40, 0)
    assert struct.unpack_from("<4Q", GOLDEN_F32, 16) == (3, 4, 0, 0)
    raw_len, payload_len, checksum, part_bytes, write_id, header_sum = struct.unpack_from(
        "<6Q", GOLDEN_F32, 48
    )
    assert raw_len == payload_len == 8 + 64 + 48
    assert checksum == xxhash.xxh3_64_intdigest(GOLDEN_F32[HEADER_SIZE + 40 :])
    assert part_bytes == 0
    assert write_id == GOLDEN_WRITE_ID == read_header(GOLDEN_F32).write_id
    # the Redis tier's Lua scripts read these
    assert (PRODUCER_LEN_AT, PAYLOAD_LEN_AT, PART_BYTES_AT, WRITE_ID_AT) == (10, 56, 72, 80)
    assert header_sum == xxhash.xxh3_64_intdigest(GOLDEN_F32[:88] + GOLDEN_F32[96:136])


def test_build_blob_helper_reproduces_the_encoder() -> None:
    header = read_header(GOLDEN_F32)
    doc = GOLDEN_F32[header.payload_offset :]
    producer = GOLDEN_F32[HEADER_SIZE : header.payload_offset]
    assert build_blob(doc, dtype_code=3, shape=(3, 4), producer=producer) == GOLDEN_F32


# ---------------------------------------------------------------------------------------------
# decode validation


def test_blob_error_is_an_ec_redis_error() -> None:
    assert issubclass(BlobError, ECRedisError)
    assert issubclass(BlobError, ValueError)


def test_wrong_magic() -> None:
    with pytest.raises(BlobError, match="magic"):
        decode_blob(seal(with_bytes(small_blob(), 0, b"XCRB")))


def test_other_version() -> None:
    blob = seal(with_bytes(small_blob(), 4, struct.pack("<H", FORMAT_VERSION + 1)))
    with pytest.raises(BlobError, match=f"version {FORMAT_VERSION + 1}"):
        decode_blob(blob)
    with pytest.raises(BlobError, match="version"):
        read_header(blob)


# A version-1 blob (88-byte header, no write id): the golden F32 blob of that format.
GOLDEN_F32_V1 = bytes.fromhex(
    "45435242010000000302280000000000030000000000000004000000000000000000000000000000"
    "000000000000000078000000000000007800000000000000a0b351bf39dcec230000000000000000"
    "d2cede276ba1869d7b226964223a2022676f6c64656e222c20227473223a20313730303030303030"
    "302e307d2020202040000000000000007b2265635f6361636865223a7b226474797065223a224633"
    "32222c227368617065223a5b332c345d2c22646174615f6f666673657473223a5b302c34385d7d7d"
    "000000000000803f0000004000004040000080400000a0400000c0400000e0400000004100001041"
    "0000204100003041"
)


def test_a_version_1_blob_is_refused_not_misread() -> None:
    with pytest.raises(BlobError, match="version 1; this build reads 2"):
        decode_blob(GOLDEN_F32_V1)


def test_truncated_and_padded_blobs() -> None:
    blob = small_blob()
    with pytest.raises(BlobError):
        decode_blob(blob[:-1])
    with pytest.raises(BlobError):
        decode_blob(blob + b"\0")
    with pytest.raises(BlobError, match="truncated"):
        decode_blob(blob[: HEADER_SIZE - 1])
    with pytest.raises(BlobError):
        decode_blob(blob[: HEADER_SIZE + 3])  # the producer info is cut


def test_flipped_payload_byte_fails_the_checksum() -> None:
    blob = bytearray(small_blob())
    blob[-3] ^= 0x10
    with pytest.raises(BlobError, match="checksum"):
        decode_blob(bytes(blob))
    compressed = bytearray(encode_blob(embedding(32, 32), compression="lz4", byte_shuffle=True))
    compressed[-1] ^= 0x01
    with pytest.raises(BlobError):
        decode_blob(bytes(compressed))


def test_flipped_header_byte_fails_the_header_checksum() -> None:
    for index in (6, 9, 16, 48, 64, 72, 80, HEADER_SIZE + 2):
        blob = bytearray(small_blob())
        blob[index] ^= 0x01
        with pytest.raises(BlobError, match="checksum"):
            decode_blob(bytes(blob))


def test_every_blob_gets_its_own_non_zero_write_id() -> None:
    ids = {read_header(encode_blob(SMALL)).write_id for _ in range(50)}
    assert len(ids) == 50 and 0 not in ids
    parts = encode_parts(embedding(64, 64), part_bytes=1024, write_id=77)
    assert read_header(parts[0]).write_id == 77
    for bad in (0, -1, 2**64):
        with pytest.raises(TensorError, match="write_id"):
            encode_blob(SMALL, write_id=bad)


def test_a_blob_without_a_write_id_is_rejected() -> None:
    blob = seal(with_bytes(small_blob(), WRITE_ID_AT, bytes(8)))
    with pytest.raises(BlobError, match="write id"):
        decode_blob(blob)


def test_declared_sizes_over_max_blob_bytes() -> None:
    blob = small_blob()
    with pytest.raises(BlobError, match="> 64"):
        decode_blob(blob, max_blob_bytes=64)
    with pytest.raises(BlobError):
        read_header(blob, max_blob_bytes=64)
    with pytest.raises(BlobError):
        decode_parts([blob], max_blob_bytes=64)
    assert_identical(decode_blob(blob, max_blob_bytes=len(blob)), SMALL)
    # A forged header claiming a huge payload is refused before anything is allocated.
    forged = seal(with_bytes(blob, 56, struct.pack("<Q", 1 << 62)))
    with pytest.raises(BlobError):
        decode_blob(forged)


def test_unknown_dtype_code() -> None:
    with pytest.raises(BlobError, match="dtype code 99"):
        decode_blob(seal(with_bytes(small_blob(), 8, b"\x63")))


def test_unknown_codec_flags_and_reserved_bits() -> None:
    blob = small_blob()
    for offset, value in ((6, b"\x07"), (7, b"\x80"), (12, b"\x01"), (7, b"\x01")):
        with pytest.raises(BlobError):
            decode_blob(seal(with_bytes(blob, offset, value)))


def test_invalid_rank() -> None:
    blob = small_blob()
    for ndim in (0, 1, 3, 5):
        with pytest.raises(BlobError):
            decode_blob(seal(with_bytes(blob, 9, bytes([ndim]))))


def test_shape_inconsistent_with_byte_length() -> None:
    blob = small_blob()
    with pytest.raises(BlobError, match="disagree"):
        decode_blob(seal(with_bytes(blob, 16, struct.pack("<2Q", 300, 4))))
    with pytest.raises(BlobError):  # close enough to pass the size check; the document refuses
        decode_blob(seal(with_bytes(blob, 16, struct.pack("<2Q", 3, 5))))
    with pytest.raises(BlobError):  # same byte count, other shape
        decode_blob(seal(with_bytes(blob, 16, struct.pack("<2Q", 4, 3))))


def test_dtype_inconsistent_with_document() -> None:
    with pytest.raises(BlobError, match="disagrees"):
        decode_blob(seal(with_bytes(small_blob(), 8, b"\x08")))  # I32 header over an F32 doc


def test_non_utf8_safetensors_header() -> None:
    body = b"\xff\xfe\xfd" + b" " * 5
    doc = struct.pack("<Q", len(body)) + body + bytes(48)
    for codec in (CODEC_NONE, CODEC_LZ4):
        with pytest.raises(BlobError, match="UTF-8"):
            decode_blob(build_blob(doc, dtype_code=3, shape=(3, 4), codec=codec))


def test_deeply_nested_json_is_a_blob_error() -> None:
    body = b"[" * 8192
    doc = struct.pack("<Q", len(body)) + body + bytes(48)
    with pytest.raises(BlobError, match="safetensors"):
        decode_blob(build_blob(doc, dtype_code=3, shape=(3, 4)))
    good_doc = doc_for(F32, (3, 4), bytes(48))
    nested = b"[" * MAX_PRODUCER_BYTES
    with pytest.raises(BlobError, match="producer"):
        decode_blob(build_blob(good_doc, dtype_code=3, shape=(3, 4), producer=nested))


def test_safetensors_header_with_extra_or_wrong_entries() -> None:
    data = bytes(48)
    bad_metas: list[dict[str, object]] = [
        {"ec_cache": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}, "x": {}},
        {"other": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}},
        {"ec_cache": {"dtype": "F32", "shape": [3, 4], "data_offsets": [8, 56]}},
        {"ec_cache": {"dtype": "F32", "shape": [12], "data_offsets": [0, 48]}},
    ]
    for meta in bad_metas:
        body = json.dumps(meta).encode()
        body += b" " * (-len(body) % 8)
        doc = struct.pack("<Q", len(body)) + body + data
        with pytest.raises(BlobError):
            decode_blob(build_blob(doc, dtype_code=3, shape=(3, 4)))
    for body in (b"[]      ", b"null    "):
        doc = struct.pack("<Q", len(body)) + body + data
        with pytest.raises(BlobError):
            decode_blob(build_blob(doc, dtype_code=3, shape=(3, 4)))


def test_metadata_entry_is_allowed_in_the_safetensors_header() -> None:
    meta = {
        "__metadata__": {"k": "v"},
        "ec_cache": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
    }
    body = json.dumps(meta).encode()
    body += b" " * (-len(body) % 8)
    data = bits(SMALL)
    doc = struct.pack("<Q", len(body)) + body + data
    assert_identical(decode_blob(build_blob(doc, dtype_code=3, shape=(3, 4))), SMALL)


def test_oversized_safetensors_header_length() -> None:
    body = b"{}" + b" " * 6
    for length in (MAX_HEADER_BYTES + 8, 1 << 40, len(body) + 8):
        doc = struct.pack("<Q", length) + body + bytes(48)
        with pytest.raises(BlobError, match="header length"):
            decode_blob(build_blob(doc, dtype_code=3, shape=(3, 4)))


def test_bad_producer_info() -> None:
    doc = doc_for(F32, (3, 4), bytes(48))
    for producer in (b"\xff\xfe      ", b"[1]     ", b"{       ", b"1" * (MAX_PRODUCER_BYTES + 8)):
        with pytest.raises(BlobError, match="producer"):
            decode_blob(build_blob(doc, dtype_code=3, shape=(3, 4), producer=producer))


def test_raw_blob_with_shuffle_flag_or_length_mismatch() -> None:
    doc = doc_for(F32, (3, 4), bytes(48))
    with pytest.raises(BlobError, match="shuffled"):
        decode_blob(build_blob(doc, dtype_code=3, shape=(3, 4), flags=1))
    with pytest.raises(BlobError, match="raw payload length"):
        decode_blob(build_blob(doc, dtype_code=3, shape=(3, 4), payload=doc + bytes(8)))


def test_corrupt_lz4_payload() -> None:
    doc = doc_for(F32, (3, 4), bytes(48))
    for payload in (b"\xff" * 16, lz4.block.compress(doc[:-4], store_size=False)):
        with pytest.raises(BlobError, match="lz4"):
            decode_blob(
                build_blob(doc, dtype_code=3, shape=(3, 4), codec=CODEC_LZ4, payload=payload)
            )


def test_empty_shape_too_large_for_torch() -> None:
    for shape in ((0, 2**64 - 1), (0, 2**40, 2**40)):
        doc = doc_for(F32, shape, b"")
        with pytest.raises(BlobError, match="too large"):
            decode_blob(build_blob(doc, dtype_code=3, shape=shape))


def test_empty_and_non_bytes_input() -> None:
    with pytest.raises(BlobError):
        decode_blob(b"")
    with pytest.raises(BlobError):
        decode_blob(memoryview(b""))
    for bad in (GOLDEN_F32.hex(), bytearray(GOLDEN_F32), None, 42):
        with pytest.raises(BlobError):
            decode_blob(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# no pickle anywhere


def test_source_tree_never_unpickles() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 5
    banned_modules = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal"}
    for path in files:
        text = path.read_text()
        assert "torch.load" not in text, path
        assert "pickle.load" not in text, path
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
                assert not names & banned_modules, (path, names)
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, path
            elif isinstance(node, ast.Name):
                assert "pickle" not in node.id.lower(), (path, node.id)
            elif isinstance(node, ast.Attribute):
                assert "pickle" not in node.attr.lower(), (path, node.attr)


# ---------------------------------------------------------------------------------------------
# fuzzing: a mutated blob decodes to the original or raises BlobError, nothing else

FUZZ_TENSORS = [
    random_tensor(torch.float32, (4, 8), seed=11),
    embedding(8, 16),
    torch.zeros(16, 4, dtype=torch.int64),
    random_tensor(torch.bool, (5, 3, 2), seed=12),
    random_tensor(torch.float8_e4m3fn, (40,), seed=13),
]
FUZZ_OPTIONS = [("none", False), ("lz4", False), ("lz4", True)]
FUZZ_CASES = [
    (encode_blob(t, compression=c, byte_shuffle=s, producer_id="fuzz", created_s=1.0), t)
    for t in FUZZ_TENSORS
    for c, s in FUZZ_OPTIONS
]
FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
Mutation = Callable[[bytes], bytes]


def decodes_to_original_or_blob_error(data: bytes, original: torch.Tensor) -> bool:
    """True when ``data`` decoded to the original; False on BlobError; anything else escapes."""
    try:
        got = decode_blob(data)
    except BlobError:
        return False
    assert_identical(got, original)
    return True


case_index = st.integers(0, len(FUZZ_CASES) - 1)


@FUZZ
@given(case_index, st.data())
def test_fuzz_flip_a_bit(index: int, data: st.DataObject) -> None:
    blob, original = FUZZ_CASES[index]
    pos = data.draw(st.integers(0, len(blob) - 1))
    bit = data.draw(st.integers(0, 7))
    mutated = bytearray(blob)
    mutated[pos] ^= 1 << bit
    decoded = decodes_to_original_or_blob_error(bytes(mutated), original)
    # lz4 may decode an altered match to the same bytes; a raw blob has no such slack.
    assert not (decoded and read_header(blob).codec == CODEC_NONE)


@FUZZ
@given(case_index, st.data())
def test_fuzz_set_a_byte(index: int, data: st.DataObject) -> None:
    blob, original = FUZZ_CASES[index]
    pos = data.draw(st.integers(0, len(blob) - 1))
    value = data.draw(st.integers(0, 255))
    mutated = bytearray(blob)
    mutated[pos] = value
    decoded = decodes_to_original_or_blob_error(bytes(mutated), original)
    if value == blob[pos]:
        assert decoded
    elif read_header(blob).codec == CODEC_NONE:
        assert not decoded


@FUZZ
@given(case_index, st.data())
def test_fuzz_truncate(index: int, data: st.DataObject) -> None:
    blob, original = FUZZ_CASES[index]
    length = data.draw(st.integers(0, len(blob) - 1))
    assert not decodes_to_original_or_blob_error(blob[:length], original)


@FUZZ
@given(case_index, st.binary(min_size=1, max_size=64))
def test_fuzz_append(index: int, extra: bytes) -> None:
    blob, original = FUZZ_CASES[index]
    assert not decodes_to_original_or_blob_error(blob + extra, original)


@FUZZ
@given(case_index, st.data())
def test_fuzz_delete_a_range(index: int, data: st.DataObject) -> None:
    blob, original = FUZZ_CASES[index]
    start = data.draw(st.integers(0, len(blob) - 1))
    stop = data.draw(st.integers(start + 1, len(blob)))
    assert not decodes_to_original_or_blob_error(blob[:start] + blob[stop:], original)


@FUZZ
@given(case_index, st.data(), st.binary(min_size=1, max_size=64))
def test_fuzz_insert(index: int, data: st.DataObject, extra: bytes) -> None:
    blob, original = FUZZ_CASES[index]
    pos = data.draw(st.integers(0, len(blob)))
    assert not decodes_to_original_or_blob_error(blob[:pos] + extra + blob[pos:], original)


@FUZZ
@given(case_index, st.data())
def test_fuzz_header_fields_with_a_resealed_header_checksum(
    index: int, data: st.DataObject
) -> None:
    """Forged headers (valid header checksum) reach every field check; none may slip through."""
    blob, original = FUZZ_CASES[index]
    producer_end = read_header(blob).payload_offset
    edits = data.draw(
        st.lists(
            st.tuples(st.integers(4, producer_end - 1), st.integers(0, 255)),
            min_size=1,
            max_size=4,
        )
    )
    mutated = bytearray(blob)
    for pos, value in edits:
        if not CHECKED_SIZE <= pos < HEADER_SIZE:
            mutated[pos] = value
    decodes_to_original_or_blob_error(seal(mutated), original)


@FUZZ
@given(case_index, st.data())
def test_fuzz_document_with_valid_checksums(index: int, data: st.DataObject) -> None:
    """A forged document with correct checksums is refused or matches its header exactly."""
    blob, _ = FUZZ_CASES[index]
    header = read_header(blob)
    payload = blob[header.payload_offset :]
    if header.codec == CODEC_LZ4:
        doc = lz4.block.decompress(payload, uncompressed_size=header.raw_len)
    else:
        doc = payload
    st_len = header.raw_len - header.tensor_nbytes
    edits = data.draw(
        st.lists(st.tuples(st.integers(0, st_len - 1), st.integers(0, 255)), max_size=4)
    )
    cut = data.draw(st.integers(0, 8))
    mutated = bytearray(doc)
    for pos, value in edits:
        mutated[pos] = value
    forged = build_blob(
        bytes(mutated[: len(mutated) - cut]),
        dtype_code=header.dtype.code,
        shape=header.shape,
        codec=header.codec,
    )
    try:
        got = decode_blob(forged)
    except BlobError:
        return
    assert got.dtype == header.dtype.torch_dtype
    assert tuple(got.shape) == header.shape


PART_CASES = [
    encode_parts(embedding(64, 64), compression="none", part_bytes=1024),
    encode_parts(torch.zeros(4096, dtype=torch.int32), compression="lz4", part_bytes=16),
    encode_parts(embedding(64, 64), compression="lz4", byte_shuffle=True, part_bytes=2048),
]
PART_TENSORS = [embedding(64, 64), torch.zeros(4096, dtype=torch.int32), embedding(64, 64)]


@FUZZ
@given(st.integers(0, len(PART_CASES) - 1), st.data())
def test_fuzz_missing_extra_and_reordered_parts(index: int, data: st.DataObject) -> None:
    parts = PART_CASES[index]
    assert len(parts) > 2
    order = data.draw(st.lists(st.integers(0, len(parts) - 1), max_size=len(parts) + 2))
    chosen = [parts[i] for i in order]
    same_bytes = b"".join(chosen) == b"".join(parts)
    try:
        got = decode_parts(chosen)
    except BlobError:
        assert not same_bytes
        return
    assert same_bytes  # equal parts may swap places; anything else must be refused
    assert_identical(got, PART_TENSORS[index])


def test_a_tensor_is_cut_into_the_same_chunks_whatever_its_producer_info() -> None:
    """The producer info holds a timestamp (and an id) of varying length: the payload the head
    carries, and so every chunk, must not move with it (a replayed run stores the same keys)."""
    tensor = embedding(2048, 256)
    cuts = [
        encode_parts(tensor, part_bytes=64 * 1024, producer_id=pid, created_s=ts, write_id=7)
        for pid, ts in [("", 1.0), ("p", 1234567.891), ("x" * 300, 17.5), ("y" * 5000, 2.0)]
    ]
    assert len({len(parts) for parts in cuts}) == 1
    assert all([bytes(p) for p in parts[1:]] == [bytes(p) for p in cuts[0][1:]] for parts in cuts)
