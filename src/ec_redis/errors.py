"""The exception hierarchy: one root error, one subclass per broken thing."""

from __future__ import annotations


class ECRedisError(Exception):
    """Root of every error ec_redis raises on purpose."""


class ConfigError(ECRedisError, ValueError):
    """A configuration key is unknown or has a bad value; the message names the key and a fix."""


class BlobError(ECRedisError, ValueError):
    """A stored blob is invalid: corrupt, truncated, foreign, oversized or of another version."""


class BlobTooLargeError(BlobError):
    """A well-formed blob declares more bytes than this reader's ``max_blob_bytes``: a miss for
    this reader, not a corrupt entry (a reader with a larger limit may still use it)."""


class TensorError(ECRedisError, ValueError):
    """A tensor cannot be cached: unsupported dtype, layout or size."""


class RedisSetupError(ECRedisError):
    """Redis answered but refuses this client as configured (credentials, ACL rights, TLS
    trust): a configuration problem that stops start-up, unlike an outage, which degrades."""
