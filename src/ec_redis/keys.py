"""Redis key layout: namespace, format version, model fingerprint, escaped full item id.

``{namespace}:v{FORMAT}:{{{fingerprint}.{item}}}`` is an entry's head key; the chunks of the
write whose header carries write id ``w`` are ``<head>:{w:016x}:c{i}``, so a rewrite never
touches the chunks readers of the current version are fetching, and ``<head>:{w:016x}:h``
holds that write's head until it is renamed onto the head key. The braces make the whole
fingerprint+item the Redis Cluster hash tag, so an entry's head and every version's chunks
share one slot while different entries spread over every master.

The fingerprint hashes the model identity (name, revision, dtype, width and, when known, the
weights fingerprint of ``ec_redis.fingerprint`` or the ``model_fingerprint`` setting) and the
tenant salt, so two models, two checkpoints under one name, or two tenants sharing one Redis
can never read each other's entries even when a client picks the same item id. An identity
without weights hashes exactly as before that field existed, so its keys did not move.

Item ids are kept whole: characters outside ``[A-Za-z0-9._-]`` are percent-escaped, and very
long ids are replaced by ``%h`` + their full SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from ec_redis.codec.format import FORMAT_VERSION

MAX_ITEM_CHARS = 256
HASHED_PREFIX = "%h"
_SAFE = re.compile(r"[A-Za-z0-9._-]")


@dataclass(frozen=True)
class ModelIdentity:
    """What makes an encoder output reusable: the same model, revision, dtype, width and
    weights (``weights``: a content fingerprint of the checkpoint; empty when unknown)."""

    name: str
    revision: str = ""
    dtype: str = ""
    width: int = 0
    weights: str = ""

    def fingerprint(self, tenant_salt: str = "") -> str:
        """A 128-bit hex digest of the identity and the tenant salt."""
        fields: list[object] = [self.name, self.revision, self.dtype, self.width, tenant_salt]
        if self.weights:  # appended only when known: identities without it keep their keys
            fields.append(self.weights)
        canonical = json.dumps(fields, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def label(self) -> str:
        """How blob headers name the model for operators' tools: ``name`` or ``name@weights``."""
        return f"{self.name}@{self.weights}" if self.weights else self.name


def escape_item(item: str) -> str:
    """Escape a client-chosen item id so it can never alter the key's structure."""
    if not isinstance(item, str) or not item:
        raise ValueError("an item id must be a non-empty string")
    escaped = "".join(c if _SAFE.match(c) else _percent(c) for c in item)
    if len(escaped) > MAX_ITEM_CHARS:
        # Escaping only ever writes '%' before two uppercase hex digits, so "%h" can never
        # start an escaped id: hashed and escaped ids live in disjoint sets.
        return HASHED_PREFIX + hashlib.sha256(item.encode("utf-8", "surrogatepass")).hexdigest()
    return escaped


def _percent(char: str) -> str:
    return "".join(f"%{b:02X}" for b in char.encode("utf-8", "surrogatepass"))


class KeyBuilder:
    """Builds the Redis keys of one (namespace, model, tenant)."""

    def __init__(self, namespace: str, identity: ModelIdentity, tenant_salt: str = "") -> None:
        self.namespace = namespace
        self.identity = identity
        self.fingerprint = identity.fingerprint(tenant_salt)
        self.prefix = f"{namespace}:v{FORMAT_VERSION}:{{{self.fingerprint}."

    def head(self, item: str) -> str:
        """The key holding the entry's header (and the whole blob when it is small)."""
        return f"{self.prefix}{escape_item(item)}}}"

    def lease(self, item: str) -> str:
        """The single-flight lease of the entry of ``item`` (``tiers/lease.py``): keyed like
        the entry, in its Cluster slot, never a head (heads end with the closing brace)."""
        return self.lease_of(self.head(item))

    @staticmethod
    def lease_of(head: str) -> str:
        """The lease of the entry whose head key is ``head``."""
        return f"{head}:lease"

    @staticmethod
    def chunk(head: str, write_id: int, index: int) -> str:
        """The key of chunk ``index`` (1-based) of write ``write_id`` of the entry at ``head``."""
        return f"{head}:{write_id:016x}:c{index}"

    @staticmethod
    def pending(head: str, write_id: int) -> str:
        """Where write ``write_id`` stores its head value until it is switched in."""
        return f"{head}:{write_id:016x}:h"

    @staticmethod
    def chunks(head: str, write_id: int, count: int) -> list[str]:
        """The keys of chunks 1..``count`` of write ``write_id`` of the entry at ``head``."""
        return [f"{head}:{write_id:016x}:c{i}" for i in range(1, count + 1)]

    def channel(self) -> str:
        """The pub/sub channel on which writers announce this model's new entries."""
        return f"{self.namespace}:v{FORMAT_VERSION}:stored:{self.fingerprint}"

    def pattern(self) -> str:
        """A SCAN pattern matching every key of this model (heads and every write's chunks)."""
        return f"{self.namespace}:v{FORMAT_VERSION}:{{{self.fingerprint}.*"
