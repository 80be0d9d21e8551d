"""The writer process: ``python -m ec_redis.offload.child SOCKET_FD ARENA_FD``.

It reads one setup message (the cache's configuration, the model identity and the parent's
producer id), builds its own ``RedisTier`` and client, answers ``ready``, then serves one
request at a time until its socket closes:

- ``{"op": "put", "id", "key", "dtype", "shape", "nbytes", "size"}``: write the item whose
  bytes the parent put at the start of the arena (``size``: the arena's size then); the reply
  is ``{"id", "ok", "counters", "breakers"}``, ``counters`` being what the tier counted for
  this request (the parent adds them to its own tier's, so each is counted once) and
  ``breakers`` its breakers' state after it;
- ``{"op": "ping", "id"}``: answered at once (tests and start-up).

It ignores SIGINT and SIGTERM (a Ctrl-C or a stop sent to the engine's process group must
not cut a write short) and exits when its socket reaches end of stream: the parent closed it,
or died. A write in flight when the parent dies is finished first, so what was handed over is
still published. (No parent-death signal: Linux sends it when the *thread* that started the
child ends, which is no sign of the parent's death.)
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import sys
from typing import Any

from ec_redis.cache import redis_tier
from ec_redis.config import CacheConfig
from ec_redis.keys import ModelIdentity
from ec_redis.offload import wire
from ec_redis.offload.arena import ArenaView
from ec_redis.redis_conn import make_client
from ec_redis.tiers.redis_tier import RedisTier


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    arena = ArenaView(int(argv[1]))
    try:
        tier = _setup(wire.receive(sock))
    except wire.WireError:
        return 1
    wire.send(sock, {"op": "ready"})
    seen: dict[str, float] = {}
    while True:
        try:
            request = wire.receive(sock)
        except wire.WireError:
            break  # the parent closed its end (or died): nothing is in flight
        ok = _serve(tier, arena, request)
        wire.send(sock, {
            "id": request.get("id"), "ok": ok, "counters": _delta(tier, seen),
            "breakers": tier.breakers.stats(),
        })  # fmt: skip
    tier.close()
    return 0


def _setup(spec: dict[str, Any]) -> RedisTier:
    config = dataclasses.replace(
        CacheConfig.from_dict(spec["config"]), producer_id=str(spec["producer_id"])
    )
    identity = ModelIdentity(**spec["identity"])
    return redis_tier(config, identity, make_client(config))


def _serve(tier: RedisTier, arena: ArenaView, request: dict[str, Any]) -> bool:
    if request.get("op") == "ping":
        return True
    if request.get("op") != "put":
        return False
    try:
        tensor = arena.tensor(
            int(request["size"]),
            int(request["nbytes"]),
            wire.DTYPES[request["dtype"]],
            [int(n) for n in request["shape"]],
        )
    except (KeyError, TypeError, ValueError, RuntimeError):
        return False  # a parent bug; the tier counts nothing for it
    try:
        return tier.put(str(request["key"]), tensor)
    finally:
        del tensor  # the arena may be remapped for the next item


def _delta(tier: RedisTier, seen: dict[str, float]) -> dict[str, float]:
    """What the tier's counters gained since the last reply (gauges are the parent's)."""
    now = tier.counters.snapshot()
    out = {name: value - seen.get(name, 0) for name, value in now.items()}
    seen.update(now)
    return {name: value for name, value in out.items() if value}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
