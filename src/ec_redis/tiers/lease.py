"""Single-flight leases: of the instances that miss a new item at once, one encodes it.

A lease is one Redis string next to the entry it stands for, ``<head>:lease``
(``KeyBuilder.lease``): the same namespace, model fingerprint (weights and tenant salt
included) and escaped item id (a request's salt included), so it is keyed exactly like the
entry and lives in the entry's Cluster slot. Its value is ``<rows>|<token>``: how many
embedding rows the claimant's request has, and the claiming process's random token. It is
set with ``PX`` (the deadline) and so always expires by itself.

The claim rides in the lookup's own round trip, after the reads, as one script per item
(``CLAIM``), atomic against writers: if the entry's head exists there is nothing to claim;
else the lease is set if free; else the holder's value and remaining time come back. A
claimant whose own lease is already there (its request was preempted and looked again) gets
it back without a longer deadline. Nothing here ever says an item is loadable: a lease only
decides who encodes and how long the others hold a request.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ec_redis.keys import KeyBuilder

# CLAIM. KEYS: the entry's head, its lease. ARGV: the value to set, the deadline in ms, "1"
# to only look (an item the claimant could not encode: it may wait, never claim).
# Replies: [0] the head exists or, looking only, no lease (no claim), [1, ms left, 1] claimed
# now, [1, ms left, 0] ours
# already, [2, value's first VALUE_PREFIX bytes, ms left] somebody else's (never the whole
# of a value planted there: a reply is read into a bounded buffer). A lease key of another
# type answers with its error.
VALUE_PREFIX = 96
CLAIM_SCRIPT = f"""
if redis.call('EXISTS', KEYS[1]) == 1 then return {{0}} end
local held = redis.call('GET', KEYS[2])
if not held then
  if ARGV[3] == '1' then return {{0}} end
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
  return {{1, tonumber(ARGV[2]), 1}}
end
if held == ARGV[1] then return {{1, redis.call('PTTL', KEYS[2]), 0}} end
return {{2, string.sub(held, 1, {VALUE_PREFIX}), redis.call('PTTL', KEYS[2])}}
"""

# RELEASE. KEYS: the lease. ARGV: the value it was claimed with. Deletes only one's own.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

NO_CLAIM, CLAIMED, HELD = 0, 1, 2
# What the connector counts of its leases (``connector/stats.py`` says what each means).
LEASE_COUNTERS = (
    "lease_claims",
    "lease_waits",
    "lease_loads",
    "lease_skips",
    "lease_takeovers",
    "lease_encodes_saved",
    "lease_releases",
)


def new_token(producer_id: str = "") -> str:
    """A token unique to this process: who holds a lease (never a '|', never empty)."""
    who = "".join(c for c in producer_id if c.isalnum() or c in "._-")[:64] or "ec"
    return f"{who}.{os.getpid()}.{secrets.token_hex(8)}"


def claim_value(rows: int, token: str) -> bytes:
    """A lease's value: the claimant request's rows and the claiming process's token."""
    return f"{rows}|{token}".encode()


@dataclass(frozen=True)
class Lease:
    """What a claim found: ``won`` (this process encodes; ``rows``: its own claim's rows,
    ``fresh``: set by this claim, not one it held already), or another holder's ``rows``
    (-1: unreadable) and the time it has left (``ttl_s``)."""

    won: bool
    rows: int
    ttl_s: float
    fresh: bool = False


@dataclass
class Claim:
    """Claims to make in a lookup's round trip: the rows of the request behind each item's
    look (only items named here are claimed), this process's token and the deadline. The
    reader fills ``results`` for the items it could ask Redis about; an item the entry was
    found for, or whose node was down or refused the script, has none (so: encode, no wait)."""

    token: str
    ttl_ms: int
    rows: Mapping[str, int]
    results: dict[str, Lease] = field(default_factory=dict)
    look_only: frozenset[str] = frozenset()  # items whose holder is asked for, never claimed

    def value(self, item: str) -> bytes:
        return claim_value(self.rows[item], self.token)

    def commands(self, items: Sequence[str], head_keys: Sequence[str]
                 ) -> tuple[list[str], list[tuple[Any, ...]]]:  # fmt: skip
        """The claimed items among ``items`` (whose entries' heads are ``head_keys``) and one
        ``EVAL`` per claimed item."""
        chosen: list[str] = []
        commands: list[tuple[Any, ...]] = []
        for item, head in zip(items, head_keys, strict=True):
            if item in self.rows:
                chosen.append(item)
                peek = "1" if item in self.look_only else "0"
                lease = KeyBuilder.lease_of(head)
                commands.append(
                    ("EVAL", CLAIM_SCRIPT, 2, head, lease, self.value(item), self.ttl_ms, peek)
                )
        return chosen, commands

    def settle_all(
        self, items: Sequence[str], replies: Sequence[Any], refused: Callable[[Exception], None]
    ) -> None:
        """Record the replies of ``commands``' scripts; ``refused`` hears each error reply
        (it may raise: a redirection sends the node's part of the batch elsewhere)."""
        for item, reply in zip(items, replies, strict=True):
            if isinstance(reply, Exception):
                refused(reply)  # that item is encoded, nobody waits for it
            self.settle(item, reply)

    def settle(self, item: str, reply: Any) -> None:
        """Record the script's reply for ``item`` (an error reply, or one of another shape,
        records nothing: that item is encoded without waiting)."""
        lease = parse(reply, self.value(item), self.ttl_ms)
        if lease is not None:
            self.results[item] = lease


def parse(reply: Any, own: bytes, ttl_ms: int) -> Lease | None:
    if isinstance(reply, Exception) or not isinstance(reply, (list, tuple)) or not reply:
        return None
    kind = reply[0]
    if kind == CLAIMED and len(reply) == 3:
        left = max(_ms(reply[1], ttl_ms), 0) / 1000
        return Lease(True, _rows(own), left, fresh=reply[2] == 1)
    if kind == HELD and len(reply) == 3:
        left = _ms(reply[2], ttl_ms)
        if left == -2:  # expired between GET and PTTL: nobody holds it now
            return None
        # A lease without a TTL is nobody's doing of ours: wait for it no longer than ours.
        return Lease(False, _rows(reply[1]), (ttl_ms if left < 0 else left) / 1000)
    return None


def _ms(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _rows(value: Any) -> int:
    """The rows in a lease value ``<rows>|<token>``; -1 when it is not one of ours."""
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes):
        return -1
    rows, sep, token = value.partition(b"|")
    if not sep or not token or not rows.isdigit() or len(rows) > 12:
        return -1
    return int(rows)
