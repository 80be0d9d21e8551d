"""Redis cold tier: versioned entries (a head, chunks named by the write), switched atomically,
each node of a cluster behind its own breaker.

An entry is a head key (header, plus the whole blob when small) and, for large entries, chunk
keys named by the write's random id (``tiers/layout.py``), all in the head's Cluster hash slot.
A write stores its chunks and head value under a grace TTL, then one Lua script
(``tiers/scripts.py``) checks they are all there, renames the head value onto the head key,
gives them the entry's TTL and puts the grace TTL on the chunks of the version it replaced. A
reader (``tiers/entry_read.py``) fetches the head, then the chunks that head names: one whole
version or a miss, whatever other writers do meanwhile. ``describe_many`` says which entries
are whole, from their heads alone (``tiers/describe.py``).

Every call is split by node (``tiers/nodes.py``): one server is one node; on Redis Cluster each
master gets the part of a batch that lives on it, on its own connection and under its own
circuit breaker, so a dead or failing-over master costs only the items in its slots. Every
failure is a miss or False plus a counter; nothing raises out of this tier, and every call a
breaker admits settles it. One key's error reply (a key of another type) costs that key alone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
import torch

from ec_redis.breaker import CLOSED, Breakers, CircuitBreaker
from ec_redis.codec import encode_parts
from ec_redis.codec.format import new_write_id
from ec_redis.keys import KeyBuilder
from ec_redis.logutil import RateLimitedLog
from ec_redis.stats import Counters
from ec_redis.tiers import describe, entry_ops
from ec_redis.tiers.base import Tier, tensor_nbytes
from ec_redis.tiers.entry_read import EntryReader
from ec_redis.tiers.guard import REDIS_ERRORS, Guard
from ec_redis.tiers.layout import PROBE_BYTES, part_size
from ec_redis.tiers.lease import RELEASE_SCRIPT, Claim
from ec_redis.tiers.nodes import REDIRECTS, Node, nodes_for

T = TypeVar("T")
# A node that does not answer: its slots may have moved (a failover); re-read the slot map.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


@dataclass(frozen=True)
class RedisTierOptions:
    """The subset of the configuration the Redis tier uses."""

    chunk_bytes: int = 4 * 1024 * 1024
    max_blob_bytes: int = 512 * 1024 * 1024
    ttl_s: float = 0.0
    ttl_sliding: bool = True
    orphan_grace_s: float = 30.0
    compression: str = "none"
    compression_min_ratio: float = 1.1
    byte_shuffle: bool = False
    producer_id: str = ""
    model: str = ""  # written into blob headers for operators' tools
    announce: bool = True  # PUBLISH each stored entry's id on the model's channel


class RedisTier(Tier):
    name = "redis"

    def __init__(
        self,
        client: Any,
        keys: KeyBuilder,
        options: RedisTierOptions,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        """``breaker``: the breaker of the one server (Cluster: of the keys no master is known
        for yet); every Cluster master gets a fresh one with the same settings."""
        self.client = client
        self.keys = keys
        self.options = options
        self.counters = Counters()
        self._log = RateLimitedLog()
        self._nodes = nodes_for(client)
        template = breaker or CircuitBreaker()
        self.breakers = Breakers(template.fresh)
        self.breakers.set(self._nodes.default_address, template)
        self._guard = Guard(self.breakers, self.counters, self._log)
        self._ttl_ms = int(options.ttl_s * 1000) if options.ttl_s > 0 else None
        renew_ms = self._ttl_ms if options.ttl_sliding else None
        # No head this tier's own writers make is longer than a chunk (or the largest blob):
        # read that much of each head in the first round trip, longer ones only when needed.
        head_bytes = max(min(options.chunk_bytes, options.max_blob_bytes), PROBE_BYTES)
        self._reader = EntryReader(self._guard, options.max_blob_bytes, renew_ms, head_bytes)
        self._grace_ms = max(1, int(options.orphan_grace_s * 1000))

    @property
    def breaker(self) -> CircuitBreaker:
        """The one server's breaker (Cluster: that of keys no master is known for yet)."""
        return self.breakers.get(self._nodes.default_address)

    @breaker.setter
    def breaker(self, breaker: CircuitBreaker) -> None:
        self.breakers.set(self._nodes.default_address, breaker)

    # -- one call per node ---------------------------------------------------------------

    def _per_node(
        self,
        op: str,
        head_keys: Sequence[str],
        call: Callable[[Any, list[int]], T],
        skipped: Callable[[list[int]], T],
    ) -> list[tuple[list[int], T | None]]:
        """``call(client, indices)`` once per node serving some of ``head_keys``, under that
        node's breaker. A node whose breaker is open gives ``skipped(indices)``, one whose
        call failed ``None``: a failure costs the keys of that node only."""
        results: list[tuple[list[int], T | None]] = []
        for node, indices in self._nodes.split(head_keys):
            if not self._guard.allow(node.address):
                self._nodes.unreachable(node.address)  # has its slot moved meanwhile?
                results.append((indices, skipped(indices)))
                continue
            results.append(
                (indices, self._guard.run(node.address, op, self._bind(node, call, indices), None))
            )
        return results

    def _bind(
        self, node: Node, call: Callable[[Any, list[int]], T], indices: list[int]
    ) -> Callable[[], T]:
        return lambda: self._on(node, lambda client: call(client, indices))

    def _on(self, node: Node, call: Callable[[Any], T]) -> T:
        """``call`` on the node's client; through the cluster client if the node says the slot
        lives elsewhere (a migration, a failover the slot map has not seen yet)."""
        try:
            return call(node.client)
        except REDIRECTS:
            self.counters.inc("redirects")
            return call(self._nodes.redirected())
        except UNREACHABLE:
            self._nodes.unreachable(node.address)
            raise

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> torch.Tensor | None:
        return self.get_many([key])[key]

    def get_many(
        self, keys: Iterable[str], claim: Claim | None = None
    ) -> dict[str, torch.Tensor | None]:
        """The entries of ``keys`` (misses as ``None``); with ``claim``, the single-flight
        claims of its items go in the same round trip (``tiers/lease.py``)."""
        items = list(dict.fromkeys(keys))
        head_keys = [self.keys.head(item) for item in items]  # bad ids raise before the probe
        out: dict[str, torch.Tensor | None] = dict.fromkeys(items)
        started = time.perf_counter()

        def read(client: Any, indices: list[int]) -> dict[str, torch.Tensor | None]:
            return self._reader.read(
                client,
                [items[i] for i in indices],
                [head_keys[i] for i in indices],
                claim,
            )

        served = 0
        for indices, got in self._per_node("read", head_keys, read, lambda _: None):
            if got is not None:
                out.update(got)
                served += len(indices)
        if not served:
            return out
        hits = sum(t is not None for t in out.values())
        self.counters.inc("hits", hits)
        self.counters.inc("misses", served - hits)
        self.counters.inc(
            "bytes_read", sum(tensor_nbytes(t) for t in out.values() if t is not None)
        )
        self.counters.inc("read_us", int((time.perf_counter() - started) * 1e6))
        return out

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[key]

    def contains_many(self, keys: Iterable[str]) -> dict[str, bool]:
        items = list(dict.fromkeys(keys))
        head_keys = [self.keys.head(item) for item in items]  # bad ids raise before the probe
        out = dict.fromkeys(items, False)

        def exists(client: Any, indices: list[int]) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for i in indices:
                pipe.exists(head_keys[i])
            return [bool(n) for n in pipe.execute()]

        for indices, found in self._per_node("exists", head_keys, exists, lambda _: None):
            for i, there in zip(indices, found or [], strict=False):
                out[items[i]] = there
        return out

    def describe_many(
        self, keys: Iterable[str], claim: Claim | None = None
    ) -> dict[str, tuple[torch.dtype, tuple[int, ...]] | None]:
        """dtype and shape of whole stored entries (the head and every chunk it names), from a
        bounded prefix of each head: no tensor bytes move. A missing, foreign or corrupt head,
        or one whose chunks are not all there, is ``None``. With ``claim``, as ``get_many``."""
        items = list(dict.fromkeys(keys))
        head_keys = [self.keys.head(item) for item in items]  # bad ids raise before the probe
        out: dict[str, tuple[torch.dtype, tuple[int, ...]] | None] = dict.fromkeys(items)

        def probe(client: Any, indices: list[int]) -> list[describe.Description | None]:
            chosen = [head_keys[i] for i in indices]
            claimed: list[str] = []
            claims: list[tuple[Any, ...]] = []
            if claim is not None:
                claimed, claims = claim.commands([items[i] for i in indices], chosen)
            found, replies = describe.describe(
                client, chosen, self.options.max_blob_bytes, self._guard, claims
            )
            if claim is not None:  # describe raised for a redirection already
                claim.settle_all(
                    claimed, replies, lambda exc: self._guard.refused_key("claim", exc)
                )
            return found

        for indices, found in self._per_node("describe", head_keys, probe, lambda _: None):
            for i, description in zip(indices, found or [], strict=False):
                out[items[i]] = description
        return out

    # -- writes --------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Encode and store a host tensor; False (and a counter) on any failure."""
        write_id = new_write_id()
        try:
            parts = encode_parts(
                tensor,
                compression=self.options.compression,
                min_ratio=self.options.compression_min_ratio,
                byte_shuffle=self.options.byte_shuffle,
                producer_id=self.options.producer_id,
                part_bytes=part_size(self.options.chunk_bytes),
                max_blob_bytes=self.options.max_blob_bytes,
                model=self.options.model,
                write_id=write_id,
            )
        except ValueError as exc:
            self.counters.inc("write_rejected")
            self._log.warning("encode", "ec_redis: not storing %r: %s", key, exc)
            self.end_lease(key)  # never stored: whoever waits for it encodes it now
            return False
        head_key = self.keys.head(key)  # a bad id raises before taking a half-open probe
        started = time.perf_counter()

        def write(client: Any, _: list[int]) -> bool:
            return self._write(client, key, head_key, parts, write_id)

        def skipped(_: list[int]) -> bool:
            self.counters.inc("write_skipped_breaker_open")
            return False

        ((_, stored),) = self._per_node("write", [head_key], write, skipped)
        if not stored:
            return False
        self.counters.inc("writes")
        self.counters.inc("bytes_written", sum(len(p) for p in parts))
        self.counters.inc("write_us", int((time.perf_counter() - started) * 1e6))
        return True

    def _write(
        self, client: Any, item: str, head_key: str, parts: Sequence[Any], write_id: int
    ) -> bool:
        announce = (self.keys.channel(), item.encode("utf-8", "surrogatepass"))
        outcome = entry_ops.write_entry(
            client,
            head_key,
            parts,
            write_id,
            self._ttl_ms,
            self._grace_ms,
            announce if self.options.announce else ("", b""),
        )
        if outcome != entry_ops.STORED:
            self.counters.inc(f"write_{outcome}")  # write_conflict, write_incomplete
        return outcome == entry_ops.STORED

    def release(self, key: str, claim_value: bytes) -> bool:
        """Delete the single-flight lease of ``key`` if it is still the one claimed with
        ``claim_value`` (a holder that will not encode after all); False if not reached."""
        lease_key = self.keys.lease(key)

        def release(client: Any, _: list[int]) -> bool:
            client.execute_command("EVAL", RELEASE_SCRIPT, 1, lease_key, claim_value)
            return True

        ((_, done),) = self._per_node("release", [self.keys.head(key)], release, lambda _: False)
        return bool(done)

    def end_lease(self, key: str) -> bool:
        """Delete the single-flight lease of ``key``, whoever holds it: this process's write
        of it will not land, and a waiter must not wait for it (at worst one more encode).
        Best effort, and never a breaker's business: only while the entry's node is
        healthy, and a failure is neither counted nor raised. False if not done."""
        head_key = self.keys.head(key)
        try:
            ((node, _),) = self._nodes.split([head_key])
            if self.breakers.get(node.address).state != CLOSED:
                return False
            self._on(node, lambda client: client.unlink(self.keys.lease_of(head_key)))
        except Exception:  # best effort: the lease expires by itself
            return False
        return True

    def delete(self, key: str) -> None:
        """Delete the entry's head and the chunks it names, atomically."""
        head_key = self.keys.head(key)

        def delete(client: Any, _: list[int]) -> bool:
            if not entry_ops.delete_entry(client, head_key):
                self.counters.inc("delete_conflicts")
            return True

        def skipped(_: list[int]) -> bool:
            self.counters.inc("delete_skipped_breaker_open")
            return False

        self._per_node("delete", [head_key], delete, skipped)

    def stats(self) -> dict[str, float]:
        current = self._nodes.addresses()
        if current is not None:  # a master whose replica took over is called no more:
            self.breakers.retain(current)  # its open breaker must not stay in the state
        out = self.counters.snapshot()
        out.update(self.breakers.stats())
        return out

    def close(self) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            self.client.close()
