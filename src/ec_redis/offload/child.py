"""The writer process: ``python -P -m ec_redis.offload.child SOCKET_FD ARENA_FD PARENT_PID``.

It reads one setup message (``handshake.py``: the cache's configuration, the model identity,
the parent's producer id and code fingerprint; and the CPUs to run on,
``process.writer_cpus``). If its own code differs it answers ``refused`` and exits; else it
builds its own ``RedisTier`` and client, answers ``ready`` with its fingerprint, then serves
its requests one at a time, in the order sent, until its parent is gone:

- ``{"op": "put", "id", "key", "dtype", "shape", "nbytes", "size"}``: write the item whose
  bytes the parent put at the start of the arena (``size``: the arena's size then);
- ``{"op": "peek", "id", "key", "dtype", "shape", "nbytes", "address"}``: write the item whose
  bytes are at ``address`` in the parent's memory, read from there (``peek.py``; only if
  the probe of the setup message read back: ``ready`` says ``peek``). A read that fails
  answers ``peek_failed`` and writes nothing;
- ``{"op": "end_lease", "id", "key"}``: end the item's single-flight lease (its write was
  dropped), behind this process's breaker, which saw the writes;
- ``{"op": "ping", "id"}``: answered at once (tests).

Every reply is ``{"id", "ok", "counters", "breakers"}`` (and ``peek_failed``), ``counters``
being what the tier counted for this request (the parent adds them to its own tier's, so
each is counted once) and ``breakers`` its breakers' state after it.

It ignores SIGINT and SIGTERM (a Ctrl-C or a stop sent to the engine's process group must
not cut a write short) and exits once its parent is gone: end of stream on its socket, or,
checked every ``PARENT_CHECK_S`` while idle, a parent pid that is no longer ``PARENT_PID``
(re-parented: a fork of the dead parent may still hold the socket open). A write in flight
when the parent dies is finished first, so what was handed over is still published. (No
parent-death signal: Linux sends it when the *thread* that started the child ends, which is
no sign of the parent's death.)
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import socket
import sys
from typing import Any

import torch

from ec_redis import sched
from ec_redis.cache import redis_tier
from ec_redis.codec import destination
from ec_redis.offload import handshake, peek, wire
from ec_redis.offload.arena import ArenaView
from ec_redis.redis_conn import make_client
from ec_redis.tiers.redis_tier import RedisTier

PARENT_CHECK_S = 1.0  # how often an idle writer process checks that its parent lives


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sched.as_background()  # its wake-ups never preempt the engine's thread (``sched.py``)
    parent = int(argv[2]) if len(argv) > 2 else os.getppid()
    sock = socket.socket(fileno=int(argv[0]))
    arena = ArenaView(int(argv[1]))
    spec = _next(sock, parent)
    if spec is None:
        return 1
    code = handshake.fingerprint()
    if spec.get("code") != code:
        reason = f"it runs ec_redis {code}, its parent {spec.get('code')!s:.80}"
        _answer(sock, {"op": "refused", "reason": reason})
        return 1
    _place(spec.get("cpus"))
    config, identity = handshake.read(spec)
    peeks = peek.probe_works(parent, spec.get("probe"))
    tier = redis_tier(config, identity, make_client(config))
    seen: dict[str, float] = {}
    try:
        if not _answer(sock, {"op": "ready", "code": code, "peek": peeks}):
            return 1
        while (request := _next(sock, parent)) is not None:
            if request.get("op") == "peek":
                ok = _serve_peek(tier, parent, request) if peeks else None
            else:
                ok = _serve(tier, arena, request)
            reply = {"id": request.get("id"), "ok": bool(ok), "counters": _delta(tier, seen),
                     "breakers": tier.breakers.stats()}  # fmt: skip
            if ok is None:
                reply["peek_failed"] = True
            if not _answer(sock, reply):
                break  # the parent is gone
    finally:
        tier.close()
    return 0


def run() -> None:
    """The entry point of ``python -c`` (Python < 3.11, which has no ``-P``)."""
    sys.exit(main(sys.argv[1:]))


def _place(cpus: object) -> None:
    """Run on ``cpus`` (``process.writer_cpus``); where they cannot be had (a cpuset that
    excludes them all, an odd list), stay where the parent's thread was."""
    if not isinstance(cpus, list) or not cpus or not all(isinstance(c, int) for c in cpus):
        return
    with contextlib.suppress(OSError, ValueError, OverflowError):
        os.sched_setaffinity(0, cpus)


def _next(sock: socket.socket, parent: int) -> dict[str, Any] | None:
    """The next message; ``None`` once the parent is gone (or sent garbage)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while not poller.poll(int(PARENT_CHECK_S * 1000)):
        if os.getppid() != parent:
            return None
    try:
        return wire.receive(sock)
    except wire.WireError:
        return None


def _answer(sock: socket.socket, message: dict[str, Any]) -> bool:
    try:
        wire.send(sock, message)
    except wire.WireError:
        return False
    return True


def _serve(tier: RedisTier, arena: ArenaView, request: dict[str, Any]) -> bool:
    op = request.get("op")
    if op == "ping":
        return True
    if op == "end_lease":
        return tier.end_lease(str(request.get("key")))
    if op != "put":
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


def _serve_peek(tier: RedisTier, parent: int, request: dict[str, Any]) -> bool | None:
    """Read the item out of the parent's memory and write it; ``None``: the read failed."""
    try:
        dtype = wire.DTYPES[request["dtype"]]
        shape = [int(n) for n in request["shape"]]
        nbytes, address = int(request["nbytes"]), int(request["address"])
        key = str(request["key"])
    except (KeyError, TypeError, ValueError):
        return False  # a parent bug; the tier counts nothing for it
    if nbytes != math.prod(shape) * dtype.itemsize or min(shape, default=0) < 0:
        return False
    if nbytes == 0:
        return tier.put(key, torch.empty(shape, dtype=dtype))
    buffer = destination.fresh(nbytes)  # recycled: the next item's read lands in it
    try:
        peek.read(parent, address, buffer.data_ptr(), nbytes)
    except OSError:
        return None
    return tier.put(key, buffer.view(dtype).view(shape))


def _delta(tier: RedisTier, seen: dict[str, float]) -> dict[str, float]:
    """What the tier's counters gained since the last reply (gauges are the parent's)."""
    now = tier.counters.snapshot()
    out = {name: value - seen.get(name, 0) for name, value in now.items()}
    seen.update(now)
    return {name: value for name, value in out.items() if value}


if __name__ == "__main__":
    run()
