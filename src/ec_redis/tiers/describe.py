"""Which entries are published (whole in Redis), told from their heads without their bytes.

A pure producer skips encoding an item that is "already published", so an answer of yes must
mean a reader can load it: the head *and every chunk it names*. Under ``allkeys-lru`` a chunk
can be evicted while its head stays; trusting the head alone would skip that item forever.
One script per head (``scripts.DESCRIBE``), all pipelined in one round trip, reads the head's
first ``PROBE_BYTES`` and checks the chunks exist; no tensor bytes move. A head whose chunks
are not all there is not published (``describe_incomplete``); a missing, foreign or corrupt
head is not either (a reader meets it, counts it and cleans up). A published entry is described
by its dtype and shape, as the header has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ec_redis.codec import read_header
from ec_redis.errors import BlobError
from ec_redis.tiers.guard import Guard
from ec_redis.tiers.layout import chunk_keys
from ec_redis.tiers.nodes import REDIRECTS
from ec_redis.tiers.scripts import DESCRIBE, is_noscript

Description = tuple[torch.dtype, tuple[int, ...]]


def describe(
    client: Any,
    head_keys: Sequence[str],
    max_blob_bytes: int,
    guard: Guard,
    claims: Sequence[tuple[Any, ...]] = (),
) -> tuple[list[Description | None], list[Any]]:
    """dtype and shape per head key, ``None`` where no whole entry of this format is there,
    and the replies of ``claims`` (single-flight claims, ``tiers/lease.py``) sent in the same
    round trip after the probes. A redirection raises (the caller asks the node that serves
    the slot now); any other error reply costs its own key only."""
    replies = _run(client, head_keys, claims)
    claimed = replies[len(head_keys) :]
    replies = replies[: len(head_keys)]
    for reply in claimed:
        if isinstance(reply, REDIRECTS):
            raise reply
    out: list[Description | None] = []
    for head_key, reply in zip(head_keys, replies, strict=True):
        if isinstance(reply, REDIRECTS):
            raise reply
        if isinstance(reply, Exception):
            guard.refused_key("describe", reply)
            out.append(None)
        else:
            out.append(_judge(head_key, reply, max_blob_bytes, guard))
    return out, claimed


def _run(client: Any, head_keys: Sequence[str], tail: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The script's reply per key, then ``tail``'s; a server that does not know the script
    yet gets its text (once: it keeps it for the next ``EVALSHA``)."""
    pipe = client.pipeline(transaction=False)
    for key in head_keys:
        pipe.execute_command(*DESCRIBE.command([key], []))
    for command in tail:
        pipe.execute_command(*command)
    replies = list(pipe.execute(raise_on_error=False))
    unknown = [i for i, reply in enumerate(replies[: len(head_keys)]) if is_noscript(reply)]
    if unknown:
        pipe = client.pipeline(transaction=False)
        for i in unknown:
            pipe.execute_command("EVAL", DESCRIBE.text, 1, head_keys[i])
        for i, reply in zip(unknown, pipe.execute(raise_on_error=False), strict=True):
            replies[i] = reply
    return replies


def _judge(head_key: str, reply: Any, max_blob_bytes: int, guard: Guard) -> Description | None:
    prefix, head_len, checked, missing = reply
    if not prefix:
        return None
    try:
        header = read_header(prefix, max_blob_bytes=max_blob_bytes)
        named = chunk_keys(head_key, header, int(head_len))
    except BlobError:
        return None
    # The script and layout.py must agree on the count; a disagreement is never "published".
    if int(missing) or int(checked) != len(named):
        guard.counters.inc("describe_incomplete")
        return None
    return header.dtype.torch_dtype, header.shape
