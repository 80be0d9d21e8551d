"""What is in Redis: entries found by SCAN (bounded), their headers, per-model totals, purge.

Works on any topology (redis-py's cluster client scans every master). Reads only headers
(``GETRANGE``) unless asked to verify an entry. An entry is its head key: the chunks of the
version the head names are counted with it; chunks of replaced or unfinished writes (which
expire after ``orphan_grace_s``) are not entries, and ``purge`` removes them with the rest.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from ec_redis.codec import decode_parts, read_header
from ec_redis.codec.format import BlobHeader
from ec_redis.errors import BlobError
from ec_redis.keys import HASHED_PREFIX
from ec_redis.tiers.layout import PROBE_BYTES, chunk_count, chunk_keys

_HEAD = re.compile(
    r"^(?P<ns>[A-Za-z0-9._-]+):v(?P<version>\d+):\{(?P<fp>[0-9a-f]{32})\.(?P<item>[^}]*)\}$"
)
_BATCH = 200
Progress = Callable[[int], None]


@dataclass
class Entry:
    """One cache entry as seen from its head key."""

    key: str
    namespace: str
    fingerprint: str
    item: str
    stored_bytes: int = 0
    head_bytes: int = 0
    ttl_s: float | None = None
    header: BlobHeader | None = None
    problem: str = ""

    def as_dict(self) -> dict[str, Any]:
        h = self.header
        return {
            "key": self.key,
            "namespace": self.namespace,
            "fingerprint": self.fingerprint,
            "item": self.item,
            "model": (h.producer.get("model", "") if h else ""),
            "dtype": h.dtype.safetensors_name if h else None,
            "shape": list(h.shape) if h else None,
            "codec": h.codec_name if h else None,
            "raw_bytes": h.raw_len if h else None,
            "stored_bytes": self.stored_bytes,
            "chunks": _chunks(h, self.head_bytes) if h else None,
            "producer": h.producer.get("id", "") if h else "",
            "age_s": round(time.time() - _number(h.producer.get("ts")), 1) if h else None,
            "ttl_s": self.ttl_s,
            "problem": self.problem,
        }


@dataclass
class Totals:
    namespace: str
    fingerprint: str
    model: str = ""
    entries: int = 0
    stored_bytes: int = 0
    raw_bytes: int = 0
    unreadable: int = 0
    models: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        saved = 1 - self.stored_bytes / self.raw_bytes if self.raw_bytes else 0.0
        return {
            "namespace": self.namespace, "fingerprint": self.fingerprint,
            "model": ", ".join(sorted(self.models)), "entries": self.entries,
            "stored_bytes": self.stored_bytes, "raw_bytes": self.raw_bytes,
            "compression_savings": round(saved, 4), "unreadable": self.unreadable,
        }  # fmt: skip


def parse_head_key(key: str) -> tuple[str, str, str] | None:
    """``(namespace, fingerprint, item id)`` of a head key, or ``None`` for other keys."""
    match = _HEAD.match(key)
    if match is None:
        return None
    item = match["item"]
    shown = f"(sha256 of a long id) {item[2:]}" if item.startswith(HASHED_PREFIX) else unquote(item)
    return match["ns"], match["fp"], shown


def pattern(namespace: str | None, fingerprint: str | None) -> str:
    """A SCAN pattern for the heads and chunks of a namespace (and model)."""
    ns = namespace or "*"
    return f"{ns}:v*:{{{fingerprint}.*" if fingerprint else f"{ns}:v*:{{*"


def scan_heads(client: Any, match: str, max_keys: int, progress: Progress | None = None
               ) -> Iterator[str]:  # fmt: skip
    """Head keys matching ``match``, at most ``max_keys`` keys looked at (SCAN, not KEYS)."""
    for seen, raw in enumerate(client.scan_iter(match=match, count=1000), start=1):
        key = raw.decode() if isinstance(raw, bytes) else raw
        if progress is not None and seen % 5000 == 0:
            progress(seen)
        if seen > max_keys:
            return
        if parse_head_key(key) is not None:
            yield key


def read_entries(client: Any, keys: list[str]) -> list[Entry]:
    """Header, stored size and TTL of each head key (pipelined, in batches)."""
    out: list[Entry] = []
    for start in range(0, len(keys), _BATCH):
        batch = keys[start : start + _BATCH]
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.getrange(key, 0, PROBE_BYTES - 1)
            pipe.strlen(key)
            pipe.pttl(key)
        replies = pipe.execute()
        for i, key in enumerate(batch):
            prefix, head_len, pttl = replies[3 * i : 3 * i + 3]
            out.append(_entry(key, prefix, head_len, pttl))
    return out


def _entry(key: str, prefix: bytes, head_len: int, pttl: int) -> Entry:
    parsed = parse_head_key(key)
    assert parsed is not None
    entry = Entry(key, *parsed, stored_bytes=head_len, head_bytes=head_len)
    entry.ttl_s = pttl / 1000 if pttl and pttl > 0 else None
    try:
        entry.header = read_header(prefix)
        entry.stored_bytes = entry.header.total_len
    except BlobError as exc:
        entry.problem = str(exc)
    return entry


def totals(entries: list[Entry]) -> list[Totals]:
    groups: dict[tuple[str, str], Totals] = {}
    for e in entries:
        group = groups.setdefault((e.namespace, e.fingerprint), Totals(e.namespace, e.fingerprint))
        group.entries += 1
        group.stored_bytes += e.stored_bytes
        if e.header is None:
            group.unreadable += 1
            continue
        group.raw_bytes += e.header.raw_len
        model = str(e.header.producer.get("model", ""))
        if model:
            group.models.add(model)
    return sorted(groups.values(), key=lambda t: -t.stored_bytes)


def verify(client: Any, entry: Entry) -> str:
    """Fetch every part of an entry and check it completely: ``"ok"`` or the problem."""
    if entry.header is None:
        return entry.problem or "unreadable header"
    head = client.get(entry.key)
    if head is None:
        return "gone"
    try:
        header = read_header(head)
        keys = chunk_keys(entry.key, header, len(head))
    except BlobError as exc:
        return f"corrupt: {exc}"
    parts = [head, *(client.get(key) for key in keys)]
    if any(p is None for p in parts):
        return "incomplete: a chunk is missing (evicted?)"
    try:
        decode_parts(parts, header=header)
    except BlobError as exc:
        return f"corrupt: {exc}"
    return "ok"


def purge(client: Any, match: str, max_keys: int, progress: Progress | None = None) -> int:
    """UNLINK every key matching ``match`` (heads and every write's chunks, current or not),
    in batches; returns the count."""
    removed, batch = 0, []
    for raw in client.scan_iter(match=match, count=1000):
        batch.append(raw)
        if len(batch) >= 500:
            removed += _unlink(client, batch)
            batch = []
            if progress is not None:
                progress(removed)
        if removed + len(batch) >= max_keys:
            break
    return removed + (_unlink(client, batch) if batch else 0)


def _unlink(client: Any, keys: list[Any]) -> int:
    # UNLINK, not DEL: freeing large values must not block Redis. One key per command so a
    # Redis Cluster never sees a cross-slot request.
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.unlink(key)
    return sum(int(n) for n in pipe.execute())


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def _chunks(header: BlobHeader, head_len: int) -> int:
    """Chunk keys after a head (0 for a one-value entry or a header no tier would follow)."""
    if head_len >= header.total_len:
        return 0
    try:
        return chunk_count(header, head_len)
    except BlobError:
        return 0
