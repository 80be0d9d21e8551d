"""Configuration parsing: defaults, sizes, helpful errors, masking; and the size units."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from ec_redis.config import CacheConfig, mask_url
from ec_redis.errors import ConfigError, ECRedisError
from ec_redis.units import format_bytes, parse_bytes

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def test_defaults_parse_from_empty_and_none() -> None:
    empty: dict[str, Any] = {}
    for raw in (empty, None):
        config = CacheConfig.from_dict(raw)
        assert config == CacheConfig()
    config = CacheConfig.from_dict(None)
    assert config.redis_url is None
    assert config.namespace == "ecr"
    assert config.compression == "auto"
    assert config.cpu_cache_bytes == GiB
    assert config.chunk_bytes == 4 * MiB
    assert config.max_blob_bytes == 512 * MiB
    assert config.ttl_sliding is True


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (8 * GiB, 8 * GiB),
        ("8GiB", 8 * GiB),
        ("512MB", 512 * 1000**2),
        ("4 MiB", 4 * MiB),
        (" 1.5 GiB ", 3 * GiB // 2),
        ("2k", 2000),
        ("0", 0),
        (0, 0),
    ],
)
def test_sizes_accept_ints_and_strings(value: object, expected: int) -> None:
    assert CacheConfig.from_dict({"cpu_cache_bytes": value}).cpu_cache_bytes == expected
    assert CacheConfig.from_dict({"gpu_cache_bytes": value}).gpu_cache_bytes == expected


def test_values_of_every_kind_parse() -> None:
    config = CacheConfig.from_dict(
        {
            "redis_url": "rediss://:pw@cache.example:6380/2",
            "namespace": "prod.eu-1",
            "device": "cuda:1",
            "ttl_s": "3600",
            "ttl_sliding": "no",
            "compression": "LZ4",
            "byte_shuffle": "yes",
            "redis_max_connections": "32",
            "chunk_bytes": "64KiB",
            "embed_width": 3584,
        }
    )
    assert config.redis_url == "rediss://:pw@cache.example:6380/2"
    assert config.namespace == "prod.eu-1"
    assert config.device == "cuda:1"
    assert config.ttl_s == 3600.0
    assert config.ttl_sliding is False
    assert config.compression == "lz4"
    assert config.byte_shuffle is True
    assert config.redis_max_connections == 32
    assert config.chunk_bytes == 64 * KiB
    assert config.embed_width == 3584
    assert CacheConfig.from_dict({"redis_url": ""}).redis_url is None
    assert CacheConfig.from_dict({"redis_url": "unix:///tmp/r.sock"}).redis_url is not None


def test_unknown_key_lists_the_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"cpu_cache_size": "1GiB", "compresion": "lz4"})
    message = str(info.value)
    assert "cpu_cache_size" in message and "compresion" in message
    listed = message.split("valid keys: ", 1)[1].split(", ")
    assert tuple(listed) == CacheConfig.keys()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("cpu_cache_bytes", "lots"),
        ("cpu_cache_bytes", True),
        ("gpu_cache_bytes", -1),
        ("gpu_cache_bytes", "1.5 PiB"),
        ("compression", "zstd"),
        ("compression", 1),
        ("redis_url", "http://x"),
        ("redis_url", "localhost:6379"),
        ("redis_url", 6379),
        ("ttl_s", -1),
        ("ttl_s", "nan"),
        ("ttl_s", "inf"),
        ("redis_socket_timeout_s", float("inf")),
        ("ttl_s", True),
        ("ttl_sliding", "maybe"),
        ("redis_max_connections", 0),
        ("redis_max_connections", 1.5),
        ("redis_max_connections", False),
        ("namespace", "a:b"),
        ("namespace", ""),
        ("namespace", "x" * 65),
        ("namespace", "ecr\n"),
        ("chunk_bytes", "1KiB"),
        ("chunk_bytes", 0),
        ("max_blob_bytes", 0),
        ("device", "tpu"),
        ("device", "cuda:"),
        ("device", "cpu\n"),
        ("compression_min_ratio", 0.5),
        ("breaker_max_cooldown_s", 0.5),
        ("model_name", None),
        ("model_fingerprint", "two words"),
        ("model_fingerprint", "x" * 129),
        ("model_fingerprint", 7),
    ],
)
def test_bad_value_names_the_key_and_an_example(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({key: value})
    message = str(info.value)
    assert repr(key) in message
    assert "example" in message
    example = CacheConfig.__dataclass_fields__[key].metadata["example"]
    assert example in message


def test_config_error_is_an_ec_redis_value_error() -> None:
    assert issubclass(ConfigError, ECRedisError)
    assert issubclass(ConfigError, ValueError)


def test_rejected_redis_url_does_not_echo_its_password() -> None:
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"redis_url": "http://user:hunter2@h:1/0"})
    assert "hunter2" not in str(info.value)
    assert "redis_url" in str(info.value)


def test_config_is_frozen() -> None:
    config = CacheConfig.from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.namespace = "other"  # type: ignore[misc]
    assert config.namespace == "ecr"


def test_describe_masks_the_password_and_the_salt() -> None:
    config = CacheConfig.from_dict(
        {"redis_url": "redis://user:secret@h:1/0", "tenant_salt": "pepper-42"}
    )
    described = config.describe()
    text = json.dumps(described)
    assert "secret" not in text
    assert "pepper-42" not in text
    assert described["redis_url"] == "redis://user:***@h:1/0"
    assert described["tenant_salt"] == "***"
    assert set(described) == set(CacheConfig.keys())
    assert described["cpu_cache_bytes"] == config.cpu_cache_bytes
    # The config itself keeps the real values.
    assert config.redis_url == "redis://user:secret@h:1/0"
    assert config.tenant_salt == "pepper-42"
    plain = CacheConfig.from_dict({}).describe()
    assert plain["redis_url"] is None and plain["tenant_salt"] == ""


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (None, None),
        ("", ""),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://:pw@h:6379", "redis://:***@h:6379"),
        ("rediss://u:p@ss@h:6380/1", "rediss://u:***@h:6380/1"),
        ("redis://u@h", "redis://u@h"),
    ],
)
def test_mask_url(url: str | None, masked: str | None) -> None:
    assert mask_url(url) == masked


def test_every_key_documents_a_working_example() -> None:
    fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    assert tuple(fields) == CacheConfig.keys()
    assert len(CacheConfig.keys()) > 20
    for key, field in fields.items():
        example, doc = field.metadata["example"], field.metadata["doc"]
        assert isinstance(doc, str) and doc.strip(), key
        value: Any = json.loads(example)
        parsed = getattr(CacheConfig.from_dict({key: value}), key)
        is_size = isinstance(value, str) and type(field.default) is int
        assert parsed == (parse_bytes(value) if is_size else value), key
        assert type(parsed) is (str if field.default is None else type(field.default)), key


def test_keys_are_in_declaration_order_and_unique() -> None:
    keys = CacheConfig.keys()
    assert keys[0] == "redis_url"
    assert len(set(keys)) == len(keys)


# ---------------------------------------------------------------------------------------------
# units


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (4096, 4096),
        (4096.0, 4096),
        ("0", 0),
        ("17", 17),
        ("17B", 17),
        ("1k", 1000),
        ("1KB", 1000),
        ("1kib", 1024),
        ("1Ki", 1024),
        ("4MiB", 4 * MiB),
        ("4 mib", 4 * MiB),
        ("\t8GiB\n", 8 * GiB),
        ("2TiB", 2 * 1024**4),
        ("3tb", 3 * 1000**4),
        ("0.5KiB", 512),
        ("1.5B", 1),
        ("2.01KB", 2010),  # exact decimal arithmetic: float(2.01) * 1000 == 2009.999...
        ("1.15KB", 1150),
        ("0.1GB", 100_000_000),
        (str(2**70), 2**70),
    ],
)
def test_parse_bytes(value: object, expected: int) -> None:
    result = parse_bytes(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "value",
    [True, False, -1, -0.5, 1.5, float("nan"), float("inf"), "", " ", "-1", "1e3", "4 XB",
     "MiB", "1.2.3KB", "4 Mi B", "0x10", None, [1], b"4MiB"],
)  # fmt: skip
def test_parse_bytes_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(value)


def test_parse_bytes_error_shows_an_example() -> None:
    with pytest.raises(ValueError, match="4MiB"):
        parse_bytes("lots")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (16 * MiB, "16.0 MiB"),
        (GiB - 1, "1024.0 MiB"),
        (3 * GiB, "3.0 GiB"),
        (5 * 1024**4, "5120.0 GiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_bytes(value: int, expected: str) -> None:
    assert format_bytes(value) == expected


def test_format_then_parse_round_trips_binary_units() -> None:
    for size in (0, 1, 1000, KiB, 3 * MiB, 7 * GiB):
        assert parse_bytes(format_bytes(size).replace(" ", "")) == size
