"""Configuration: one frozen dataclass, parsed once from the plain dict users write.

The same dict goes into vLLM's ``ec_connector_extra_config``. Unknown keys are rejected with
the list of valid ones; a bad value names its key and a valid example. Nothing below this
module reads dicts or environment variables.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ec_redis.errors import ConfigError
from ec_redis.redis_url import mask_url
from ec_redis.redis_url import validate as validate_redis_url
from ec_redis.units import parse_bytes

COMPRESSIONS = ("none", "lz4", "auto")
_SECRET_KEYS = ("sentinel_password", "tenant_salt")
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_FINGERPRINT_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_MiB = 1024**2
_GiB = 1024**3


def _size(value: object) -> int:
    return parse_bytes(value)


def _positive_size(value: object) -> int:
    size = parse_bytes(value)
    if size <= 0:
        raise ValueError("must be greater than zero")
    return size


def _float_at_least(minimum: float) -> Callable[[object], float]:
    def parse(value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        number = float(value)
        if not math.isfinite(number) or not number >= minimum:  # rejects NaN and inf
            raise ValueError(f"must be a finite number >= {minimum}, got {value!r}")
        return number

    return parse


def _int_at_least(minimum: int) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        number = int(value)
        if number < minimum:
            raise ValueError(f"must be >= {minimum}, got {value!r}")
        return number

    return parse


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ValueError(f"expected true or false, got {value!r}")


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _name(value: object) -> str:
    text = _text(value)
    if not _NAME_RE.fullmatch(text):
        raise ValueError("use 1-64 characters from A-Z a-z 0-9 . _ -")
    return text


def _fingerprint(value: object) -> str:
    text = _text(value)
    if text and not _FINGERPRINT_RE.fullmatch(text):
        raise ValueError("use 1-128 characters from A-Z a-z 0-9 . _ : - (empty: computed)")
    return text


def _choice(*choices: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        text = _text(value).lower()
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text

    return parse


_compression = _choice(*COMPRESSIONS)


def _redis_url(value: object) -> str | None:
    if value is None or value == "":
        return None
    text = _text(value)
    validate_redis_url(text)
    return text


def _device(value: object) -> str:
    text = _text(value)
    if text != "auto" and not re.fullmatch(r"^(cpu|cuda(:\d+)?)$", text):
        raise ValueError("use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    return text


def _key(parse: Callable[[object], Any], example: str, doc: str) -> dict[str, Any]:
    return {"parse": parse, "example": example, "doc": doc}


@dataclass(frozen=True)
class CacheConfig:
    """Every setting of the tiered cache; names carry their unit."""

    redis_url: str | None = field(
        default=None,
        metadata=_key(
            _redis_url,
            '"redis://:password@redis-host:6379/0"',
            "Redis server for the shared cold tier; null/empty turns the Redis tier off.",
        ),
    )
    tls_ca_file: str = field(
        default="",
        metadata=_key(_text, '"/etc/redis/tls/ca.crt"', "CA bundle that signs the server's cert."),
    )
    tls_cert_file: str = field(
        default="",
        metadata=_key(_text, '"/etc/redis/tls/client.crt"', "Client cert (mutual TLS)."),
    )
    tls_key_file: str = field(
        default="",
        metadata=_key(_text, '"/etc/redis/tls/client.key"', "Client key (mutual TLS)."),
    )
    tls_verify: str = field(
        default="required",
        metadata=_key(
            _choice("required", "none"), '"required"', "Verify the server certificate, or not."
        ),
    )
    tls_check_hostname: bool = field(
        default=True,
        metadata=_key(_bool, "true", "Check the server certificate names the host dialled."),
    )
    sentinel_password: str = field(
        default="",
        metadata=_key(_text, '"sentinel-secret"', "Password of the Sentinels themselves, if any."),
    )
    redis_check_on_start: bool = field(
        default=True,
        metadata=_key(
            _bool, "true", "PING at start: bad credentials or TLS fail start-up; an outage warns."
        ),
    )
    namespace: str = field(
        default="ecr",
        metadata=_key(_name, '"ecr"', "Key prefix; separates deployments sharing one Redis."),
    )
    model_name: str = field(
        default="",
        metadata=_key(
            _text,
            '"Qwen/Qwen2.5-VL-7B-Instruct"',
            "Model identity, part of every key (connector: vLLM's model when empty).",
        ),
    )
    model_revision: str = field(
        default="",
        metadata=_key(_text, '"main"', "Model revision, part of every key."),
    )
    model_dtype: str = field(
        default="",
        metadata=_key(_text, '"bfloat16"', "Encoder output dtype, part of every key."),
    )
    embed_width: int = field(
        default=0,
        metadata=_key(_int_at_least(0), "3584", "Encoder output width (0: unknown), part of keys."),
    )
    model_fingerprint: str = field(
        default="",
        metadata=_key(
            _fingerprint,
            '"my-finetune-2026-11-30"',
            "Pins the weights identity in every key (empty: computed from the checkpoint).",
        ),
    )
    tenant_salt: str = field(
        default="",
        metadata=_key(_text, '"tenant-42-secret"', "Optional salt: tenants never see each other."),
    )
    device: str = field(
        default="auto",
        metadata=_key(_device, '"cuda:0"', "Device that get() returns tensors on."),
    )
    gpu_cache_bytes: int = field(
        default=0,
        metadata=_key(_size, '"2GiB"', "GPU tier budget; 0 turns the GPU tier off."),
    )
    cpu_cache_bytes: int = field(
        default=1 * _GiB,
        metadata=_key(_size, '"8GiB"', "CPU tier budget (pinned when CUDA is present); 0: off."),
    )
    ttl_s: float = field(
        default=0.0,
        metadata=_key(_float_at_least(0.0), "86400", "Redis entry lifetime; 0 keeps entries."),
    )
    ttl_sliding: bool = field(
        default=True,
        metadata=_key(_bool, "true", "Reads renew the TTL (GETEX), so hot entries stay."),
    )
    orphan_grace_s: float = field(
        default=30.0,
        metadata=_key(
            _float_at_least(0.1),
            "30",
            "Lifetime of keys no head names (being written, replaced, left by a crash); "
            "longer than any write or read of one entry.",
        ),
    )
    compression: str = field(
        default="auto",
        metadata=_key(_compression, '"auto"', "none | lz4 | auto (lz4 only where it pays)."),
    )
    compression_min_ratio: float = field(
        default=1.1,
        metadata=_key(_float_at_least(1.0), "1.1", "auto: compress only at this ratio or better."),
    )
    byte_shuffle: bool = field(
        default=False,
        metadata=_key(_bool, "true", "Byte-shuffle before lz4 (bf16: ~1.17x smaller, 2x slower)."),
    )
    chunk_bytes: int = field(
        default=4 * _MiB,
        metadata=_key(_positive_size, '"4MiB"', "Values above this are split into chunks."),
    )
    max_blob_bytes: int = field(
        default=512 * _MiB,
        metadata=_key(_positive_size, '"512MiB"', "Largest entry stored or accepted on read."),
    )
    redis_connect_timeout_s: float = field(
        default=1.0,
        metadata=_key(_float_at_least(0.001), "1.0", "TCP/TLS connect timeout."),
    )
    redis_socket_timeout_s: float = field(
        default=2.0,
        metadata=_key(_float_at_least(0.001), "2.0", "Per-read/write socket timeout."),
    )
    redis_max_connections: int = field(
        default=16,
        metadata=_key(_int_at_least(1), "16", "Connection pool bound (blocking pool)."),
    )
    redis_retries: int = field(
        default=1,
        metadata=_key(_int_at_least(0), "1", "Retries of a failed Redis call (with backoff)."),
    )
    redis_backoff_s: float = field(
        default=0.02,
        metadata=_key(_float_at_least(0.0), "0.02", "Base of the exponential retry backoff."),
    )
    breaker_failures: int = field(
        default=3,
        metadata=_key(_int_at_least(1), "3", "Consecutive failures that open the breaker."),
    )
    breaker_cooldown_s: float = field(
        default=1.0,
        metadata=_key(_float_at_least(0.0), "1.0", "First cool-down; doubles per failed probe."),
    )
    breaker_max_cooldown_s: float = field(
        default=60.0,
        metadata=_key(_float_at_least(0.0), "60", "Cool-down ceiling."),
    )
    write_queue_items: int = field(
        default=64,
        metadata=_key(_int_at_least(1), "64", "Pending Redis writes; the oldest is dropped."),
    )
    write_queue_bytes: int = field(
        default=1 * _GiB,
        metadata=_key(_positive_size, '"1GiB"', "Bytes held by pending writes; oldest dropped."),
    )
    writer_threads: int = field(
        default=1,
        metadata=_key(_int_at_least(1), "1", "Background threads writing to Redis."),
    )
    writer_process: bool = field(
        default=False,
        metadata=_key(
            _bool,
            "true",
            "Run Redis writes in a child process fed through shared memory, so they take "
            "the engine's GIL only to hand each item over (experimental: off by default); "
            "false: on threads in the engine's process.",
        ),
    )
    announce_writes: bool = field(
        default=True,
        metadata=_key(
            _bool,
            "true",
            "PUBLISH each stored entry's id on the model's channel, so waiting readers hear of "
            "it at once (one small message per write).",
        ),
    )
    producer_id: str = field(
        default="",
        metadata=_key(_text, '"encoder-0"', "Written into each blob header; default host:pid."),
    )

    def __post_init__(self) -> None:
        if self.chunk_bytes < 64 * 1024:
            raise ConfigError(_message("chunk_bytes", "must be at least 64KiB", self.chunk_bytes))
        if self.breaker_max_cooldown_s < self.breaker_cooldown_s:
            raise ConfigError(
                _message(
                    "breaker_max_cooldown_s",
                    "must be >= breaker_cooldown_s",
                    self.breaker_max_cooldown_s,
                )
            )

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every valid configuration key, in declaration order."""
        return _keys(cls)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None = None) -> CacheConfig:
        """Parse a plain dict; raise ``ConfigError`` naming the first bad key."""
        raw = dict(raw or {})
        _reject_unknown(raw, cls.keys())
        return cls(**_parse_fields(cls, raw))

    def check_files(self) -> None:
        """Raise ``ConfigError`` for a TLS file that does not exist (checked when the client
        is built, so a config can be parsed on a machine without the files)."""
        for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            path = getattr(self, key)
            if path and not os.path.isfile(path):
                raise ConfigError(_message(key, "no such file", path))

    def describe(self) -> dict[str, Any]:
        """The settings as a dict, with any password in ``redis_url`` masked (safe to log)."""
        out = dataclasses.asdict(self)
        out["redis_url"] = mask_url(self.redis_url)
        out["tenant_salt"] = "***" if self.tenant_salt else ""
        out["sentinel_password"] = "***" if self.sentinel_password else ""
        return out

    def __repr__(self) -> str:
        # the dataclass repr would show the password in redis_url and the secrets verbatim
        shown = ", ".join(f"{key}={value!r}" for key, value in self.describe().items())
        return f"CacheConfig({shown})"


@dataclass(frozen=True)
class ConnectorOptions:
    """Settings of the vLLM connector on top of the cache's (same dict, other keys)."""

    consumer_wait_s: float = field(
        default=5.0,
        metadata=_key(
            _float_at_least(0.0),
            "5.0",
            "ec_consumer: how long a request waits for an item to appear in Redis.",
        ),
    )
    fetch_wait_s: float = field(
        default=10.0,
        metadata=_key(
            _float_at_least(0.001),
            "10.0",
            "Consumers: longest a request waits on one lookup in flight (a paused or slow "
            "Redis), and beyond consumer_wait_s in all; then the item counts as undeliverable "
            "(on_missing decides).",
        ),
    )
    on_missing: str = field(
        default="encode",
        metadata=_key(
            _choice("encode", "fail"),
            '"encode"',
            "Item still missing after the wait: encode locally, or fail the request (retryable).",
        ),
    )
    stage_bytes: int = field(
        default=2 * _GiB,
        metadata=_key(_size, '"2GiB"', "Bytes of fetched items held until their step loads them."),
    )
    stage_transport: str = field(
        default="auto",
        metadata=_key(
            _choice("auto", "inline", "file"),
            '"auto"',
            "How staged bytes reach the workers: in the step metadata (inline), or as files in "
            "stage_dir that every rank reads (file); auto: file when vLLM's workers are other "
            "processes on this host.",
        ),
    )
    stage_dir: str = field(
        default="",
        metadata=_key(
            _text, '"/dev/shm"', "Where staged files go (a tmpfs); empty: /dev/shm or the tmp dir."
        ),
    )
    stage_spare_bytes: int = field(
        default=64 * _MiB,
        metadata=_key(
            _size,
            '"64MiB"',
            "Bytes of staging buffers made ahead of time (tmpfs files with file staging), so "
            "fetches land in allocated pages; 0 turns them off.",
        ),
    )
    lookup_threads: int = field(
        default=2,
        metadata=_key(_int_at_least(1), "2", "Scheduler-side threads fetching from Redis."),
    )
    lookup_wait_s: float = field(
        default=0.001,
        metadata=_key(
            _float_at_least(0.0),
            "0.001",
            "Longest an idle scheduler step (nothing scheduled) waits for in-flight lookups, "
            "once per step for all requests (0: never waits).",
        ),
    )
    producer_check_wait_s: float = field(
        default=0.02,
        metadata=_key(
            _float_at_least(0.0),
            "0.02",
            "ec_producer: longest a request is held while checking whether its items are "
            "already published (then it encodes); 0: never held.",
        ),
    )
    save_wait_s: float = field(
        default=2.0,
        metadata=_key(
            _float_at_least(0.0),
            "2.0",
            "ec_producer: longest a step that saved items waits for their Redis writes, so "
            "the encoder answers only once PD can find them (ec_both never waits); 0: never.",
        ),
    )
    trust_client_uuids: bool = field(
        default=False,
        metadata=_key(
            _bool,
            "true",
            "Start even though vLLM names items by a per-process counter "
            "(mm_processor_cache_gb 0 and no prefix caching): every item carries a client uuid.",
        ),
    )
    push_notifications: bool = field(
        default=True,
        metadata=_key(
            _bool,
            "true",
            "ec_consumer: subscribe to the writers' announcements and fetch an awaited item "
            "the moment it lands (polling every recheck_s stays the fallback).",
        ),
    )
    recheck_s: float = field(
        default=0.05,
        metadata=_key(_float_at_least(0.001), "0.05", "Interval between looks for a missing item."),
    )
    single_flight: bool = field(
        default=True,
        metadata=_key(
            _bool,
            "true",
            "ec_both and ec_producer: an instance that misses a new item claims it in Redis "
            "(in the lookup's round trip); one claimant encodes it, the others wait for its "
            "entry at most its lease's deadline, then encode it themselves. false: every "
            "instance that misses an item encodes it.",
        ),
    )
    lease_ttl_s: float = field(
        default=0.0,
        metadata=_key(
            _float_at_least(0.0),
            "2.0",
            "single_flight: the lease deadline, and the longest a request waits on another "
            "instance's lease; 0: derived from this instance's measured claim-to-stored time "
            "(encode plus write; 3x its p90 within 1-5 s, 2 s until measured).",
        ),
    )

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return _keys(cls)


def parse_extra_config(raw: Mapping[str, Any] | None) -> tuple[CacheConfig, ConnectorOptions]:
    """Split vLLM's ``ec_connector_extra_config`` into the cache's and the connector's keys."""
    raw = dict(raw or {})
    cache_keys, connector_keys = CacheConfig.keys(), ConnectorOptions.keys()
    _reject_unknown(raw, cache_keys + connector_keys)
    cache = CacheConfig(**_parse_fields(CacheConfig, {k: raw[k] for k in raw if k in cache_keys}))
    options = ConnectorOptions(
        **_parse_fields(ConnectorOptions, {k: raw[k] for k in raw if k in connector_keys})
    )
    return cache, options


def _keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _reject_unknown(raw: Mapping[str, Any], valid: tuple[str, ...]) -> None:
    unknown = sorted(k for k in raw if k not in valid)
    if unknown:
        raise ConfigError(
            f"unknown ec_redis config key(s) {unknown}; valid keys: {', '.join(valid)}"
        )


def _parse_fields(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        try:
            parsed[f.name] = f.metadata["parse"](raw[f.name])
        except (TypeError, ValueError) as exc:
            shown = _masked(raw[f.name]) if f.name == "redis_url" else raw[f.name]
            problem = str(exc)
            if f.name in _SECRET_KEYS:  # e.g. a numeric password: never echo it
                shown, problem = "***", f"expected a string, got {type(raw[f.name]).__name__}"
            raise ConfigError(_message(f.name, problem, shown, f.metadata["example"])) from None
    return parsed


def _message(key: str, problem: str, value: object, example: str | None = None) -> str:
    if example is None:
        example = CacheConfig.__dataclass_fields__[key].metadata["example"]
    return (
        f"ec_redis config key {key!r}: {problem} (got {value!r}); example: {{{key!r}: {example}}}"
    )


def _masked(value: object) -> object:
    """A rejected redis_url as it may appear in an error message (password hidden)."""
    if not isinstance(value, str):
        return value
    try:
        return mask_url(value)
    except ValueError:
        return "***"
