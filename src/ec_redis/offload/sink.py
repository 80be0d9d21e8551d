"""The parent's side of the writer processes: a ``writer.Sink`` that hands each write to a
child (``child.py``) and sleeps until it answers.

Children are kept in a pool, one per writer thread at most, started on the first write (or by
``warm``). Per write: copy the item into the child's arena, send one message, wait for the
reply, add the counters it carries to the parent tier's. A child that dies, answers out of
turn or stays silent past ``reply_timeout_s`` is killed and reaped before its arena is
dropped, and the write is retried once in a fresh child (a second failure is a failed write:
the item stays in the local tiers). When no child can be started the write runs on the
calling thread through ``fallback`` (counted), and the next start is tried after
``retry_after_s``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import ec_redis
from ec_redis.logutil import RateLimitedLog
from ec_redis.offload import wire
from ec_redis.offload.arena import KEEP_BYTES, Arena
from ec_redis.stats import Counters
from ec_redis.tiers.transfer import HostCopy

Fallback = Callable[[str, HostCopy], bool]


class ChildGone(Exception):
    """A writer process died, hung or broke the protocol."""


class _Child:
    """One writer process, its socket and its arena."""

    def __init__(self, spec: Mapping[str, Any], arena_limit: int, start_timeout_s: float) -> None:
        self.arena = Arena(arena_limit)
        self._next_id = 0
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            ours, theirs = wire.pair()
        except BaseException:
            self.arena.close()
            raise
        self.sock = ours
        try:
            self.proc = subprocess.Popen(
                command(theirs.fileno(), self.arena.fd),
                pass_fds=(theirs.fileno(), self.arena.fd),
                stdin=subprocess.DEVNULL,
                env=_child_env(),
            )  # fmt: skip
            theirs.close()
            ours.settimeout(start_timeout_s)
            wire.send(ours, dict(spec))
            if wire.receive(ours).get("op") != "ready":
                raise ChildGone("the writer process did not answer ready")
        except BaseException:
            theirs.close()
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def put(self, key: str, tensor: torch.Tensor, timeout_s: float) -> dict[str, Any]:
        nbytes = self.arena.fill(tensor)
        try:
            return self.call(
            {"op": "put", "key": key, "dtype": wire.dtype_name(tensor.dtype),
             "shape": list(tensor.shape), "nbytes": nbytes, "size": self.arena.size},
                timeout_s,
            )  # fmt: skip
        finally:
            if self.arena.fd >= 0:  # not killed meanwhile
                self.arena.trim(KEEP_BYTES)

    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self._next_id += 1
        request["id"] = self._next_id
        try:
            self.sock.settimeout(timeout_s)
            wire.send(self.sock, request)
            reply = wire.receive(self.sock)
        except wire.WireError as exc:
            raise ChildGone(str(exc)) from exc
        if reply.get("id") != self._next_id or not isinstance(reply.get("counters"), dict):
            raise ChildGone(f"a reply out of turn: {reply!r:.200}")
        return reply

    def stop(self, timeout_s: float) -> None:
        """End of stream: the child finishes nothing (it is idle) and exits."""
        self.sock.close()
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        self.kill()

    def kill(self) -> None:
        """Kill and reap the child, then drop its arena (never while the child may read it)."""
        self.sock.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:  # unkillable (D state): leak the arena too
                return
        self.arena.close()


class ProcessSink:
    """Writes items through writer processes (see the module docstring)."""

    def __init__(
        self,
        spec: Mapping[str, Any],
        counters: Counters,
        fallback: Fallback,
        *,
        arena_limit: int,
        reply_timeout_s: float,
        max_children: int = 1,
        start_timeout_s: float = 120.0,
        retry_after_s: float = 10.0,
    ) -> None:
        self._spec = dict(spec)
        self._tier_counters = counters  # the parent tier's: the children's deltas go there
        self._fallback = fallback
        self._arena_limit = arena_limit
        self._reply_timeout_s = reply_timeout_s
        self._start_timeout_s = start_timeout_s
        self._retry_after_s = retry_after_s
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()
        self._cond = threading.Condition()
        self._starting = 0
        self._starters: list[threading.Thread] = []
        self._max_children = max_children
        self._no_start_until = 0.0
        self._closed = False
        self.counters = Counters()
        for name in ("starts", "start_failures", "deaths", "retried_writes", "fallback_writes"):
            self.counters.inc(name, 0)  # reported from the start, never missing
        self._log = RateLimitedLog()

    def __call__(self, key: str, host: HostCopy) -> bool:
        child = self._take()
        if child is None:  # none ready yet (starting, backed off) or closed: write here
            self.counters.inc("fallback_writes")
            return self._fallback(key, host)
        for attempt in range(2):
            try:
                reply = child.put(key, host.tensor, self._reply_timeout_s)
            except ChildGone as exc:
                self._lost(child, key, exc)
                if attempt == 1:
                    break
                child = self._take(wait_for_start=True)  # never retried on this thread:
                if child is None:  # the item may be what killed the child
                    break
                self.counters.inc("retried_writes")
                continue
            except BaseException:
                self._give_back(child)
                raise
            self._give_back(child)
            self._add(reply["counters"])
            self._breakers(reply.get("breakers"))
            return bool(reply.get("ok"))
        return False  # the write failed; the item stays in the local tiers

    def warm(self) -> None:
        """Start a child now, on a thread of its own, so that the first write finds it."""
        with self._cond:
            if not self._idle and not self._busy and not self._starting:
                self._start_async()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until a child is up (tests, benchmarks); False if none is after ``timeout_s``
        or starting failed."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._idle and not self._busy:
                remaining = deadline - time.monotonic()
                if self._closed or not self._starting or remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def _take(self, *, wait_for_start: bool = False) -> _Child | None:
        """An idle child. Else, while fewer than ``max_children`` exist, one is started on
        another thread, and ``None`` is returned at once (a write never waits for a start)
        unless ``wait_for_start``; with every child busy, the next one given back. ``None``
        while starting is backed off, or once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._idle:
                    child = self._idle.pop()
                    self._busy.add(child)
                    return child
                backed_off = time.monotonic() < self._no_start_until
                if not backed_off and len(self._busy) + self._starting < self._max_children:
                    self._start_async()
                if backed_off or (self._starting and not wait_for_start):
                    return None
                self._cond.wait()

    def _start_async(self) -> None:
        """(Under the lock.) Start one child on a thread of its own."""
        self._starting += 1
        thread = threading.Thread(target=self._start, name="ec_redis-writer-start", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread
            self._start_failed(exc)
            return
        self._starters = [t for t in self._starters if t.is_alive()] + [thread]

    def _start(self) -> None:
        try:
            child = _Child(self._spec, self._arena_limit, self._start_timeout_s)
        except Exception as exc:  # EMFILE, ENOMEM, no memfd, a broken interpreter...
            with self._cond:
                self._start_failed(exc)
            return
        self.counters.inc("starts")
        with self._cond:
            self._starting -= 1
            self._cond.notify_all()
            if not self._closed:
                self._idle.append(child)
                return
        child.stop(1.0)

    def _start_failed(self, exc: BaseException) -> None:
        """(Under the lock.)"""
        self._starting -= 1
        self._no_start_until = time.monotonic() + self._retry_after_s
        self._cond.notify_all()
        self.counters.inc("start_failures")
        self._log.warning(
            "start", "ec_redis: cannot start a writer process (%r); writing on the engine's "
            "thread for %.0f s", exc, self._retry_after_s,
        )  # fmt: skip

    def _give_back(self, child: _Child) -> None:
        with self._cond:
            self._busy.discard(child)
            self._cond.notify_all()
            if not self._closed:
                self._idle.append(child)
                return
        child.stop(1.0)

    def _lost(self, child: _Child, key: str, exc: ChildGone) -> None:
        with self._cond:
            self._busy.discard(child)
            self._cond.notify_all()
        child.kill()
        self.counters.inc("deaths")
        self._log.warning(
            "gone", "ec_redis: writer process %d lost while writing %r (%s); replaced",
            child.pid, key, exc,
        )  # fmt: skip

    def _add(self, counters: Mapping[str, Any]) -> None:
        for name, value in counters.items():
            if isinstance(name, str) and isinstance(value, int) and value > 0:
                self._tier_counters.inc(name, value)

    def _breakers(self, stats: object) -> None:
        """The writer processes' breakers as gauges (``process_breaker_state`` ...): the
        parent's own breaker sees none of their writes."""
        if isinstance(stats, dict):
            for name, value in stats.items():
                if isinstance(name, str) and isinstance(value, int | float):
                    self.counters.set(f"breaker_{name.removeprefix('breaker_')}", float(value))

    def pids(self) -> list[int]:
        """The writer processes' pids (tests and tools)."""
        with self._cond:
            return [c.pid for c in (*self._idle, *self._busy)]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the idle children and those being started (within ``timeout_s``); a busy one
        stops when its write returns."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            starters, self._starters = self._starters, []
            self._cond.notify_all()
        for child in idle:
            child.stop(timeout_s)
        for thread in starters:  # a child being started is stopped as soon as it is up
            thread.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict[str, float]:
        out = {f"process_{name}": value for name, value in self.counters.snapshot().items()}
        with self._cond:
            out["process_alive"] = float(len(self._idle) + len(self._busy))
        return out


def command(sock_fd: int, arena_fd: int) -> list[str]:
    """How a writer process is started: this interpreter, ``child.py``, its two descriptors."""
    return [sys.executable, "-m", "ec_redis.offload.child", str(sock_fd), str(arena_fd)]


def _child_env() -> dict[str, str]:
    """The parent's environment, with ``ec_redis`` importable however the parent found it."""
    env = dict(os.environ)
    root = Path(ec_redis.__file__).resolve().parent.parent
    if root.is_relative_to(Path(sys.prefix).resolve()):
        return env  # installed: the interpreter finds it (and site-packages stays behind)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(root) not in paths:  # a source checkout, or a module path handed to vLLM
        env["PYTHONPATH"] = os.pathsep.join([str(root), *paths])
    return env
