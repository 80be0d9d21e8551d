"""One writer process seen from its parent: its start, its requests and its end.

The rule that keeps the arena safe: once a request went out, the child may read the arena
until it answers that request, so ``in_flight`` stays set through every way out of ``call``
but a valid reply to it. The pool (``sink.py``) hands a child an arena write only when
``in_flight`` is clear; any other child is killed and reaped, and only then is its arena
dropped. A request the socket cannot carry (``wire.TooLarge``) was never sent: the child
stays clean.

Requests to read an item where it is (``send_peek``) use no arena, so several may be out at
once: the child serves them in the order sent and answers each in that order, and every
reply must name the oldest request still out (else the child broke the protocol). They are
sent without ever blocking (``wire.Full`` when the socket has no room: nothing was sent).

A fork of the parent (``multiprocessing``'s default start method, a forking server) copies
this object. The copy forgets the child at once: it closes its end of the socket (else the
child would never see end of stream when the parent dies), never signals or waits for a
process that is not its own, and never writes into the arena the child reads.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import weakref
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import ec_redis
from ec_redis.offload import peek, wire
from ec_redis.offload.arena import KEEP_BYTES, Arena


class ChildGone(Exception):
    """A writer process died, hung or broke the protocol."""


class ChildRefused(ChildGone):
    """A writer process refused to serve: it runs other ec_redis code than its parent."""


_LIVE: weakref.WeakSet[WriterProcess] = weakref.WeakSet()


class WriterProcess:
    """A writer process (``child.py``), the parent's end of its socket, and its arena."""

    def __init__(self, spec: Mapping[str, Any], arena_limit: int, start_timeout_s: float) -> None:
        self.arena = Arena(arena_limit)
        self.proc: subprocess.Popen[bytes] | None = None
        self.gone = False  # killed, or forgotten in a fork
        self.pidfd = -1  # readable once the child exited (-1: no pidfd_open here)
        self._next_id = 0
        self._out: deque[int] = deque()  # ids of the requests sent and not answered, oldest first
        self._tx: socket.socket | None = None  # sends handed requests, never blocking
        try:
            ours, theirs = wire.pair()
        except BaseException:
            self.arena.close()
            raise
        self.sock = ours
        self._theirs: socket.socket | None = theirs  # the child's end, until it has it
        self.capacity = 0  # the longest request its socket carries
        self.peeks = False  # it reads items out of this process's memory (``peek.py``)
        probe = peek.Probe()
        _LIVE.add(self)
        try:
            self.capacity = wire.capacity(ours)
            self.proc = subprocess.Popen(
                command(theirs.fileno(), self.arena.fd),
                pass_fds=(theirs.fileno(), self.arena.fd),
                stdin=subprocess.DEVNULL,
                env=child_env(),
            )
            self.pidfd = _pidfd(self.proc.pid)
            peek.allow(self.proc.pid)
            theirs.close()
            self._theirs = None
            ours.settimeout(start_timeout_s)
            wire.send(ours, {**spec, "probe": probe.spec(), "cpus": writer_cpus()})
            ready = wire.receive(ours)
            _check_ready(ready, str(spec.get("code")))
            self.peeks = ready.get("peek") is True
            # A second handle on the same socket, non-blocking, for handed requests: its
            # timeout is its own, so a thread receiving on ``sock`` meanwhile keeps its own.
            self._tx = ours.dup()
            self._tx.settimeout(0.0)
        except BaseException:
            theirs.close()
            self.kill()
            raise

    @property
    def in_flight(self) -> bool:
        """A request went out and no valid reply to it came back."""
        return bool(self._out)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def put(self, key: str, tensor: torch.Tensor, timeout_s: float) -> dict[str, Any]:
        """Write ``tensor`` under ``key`` through the child; its reply."""
        nbytes = self.arena.fill(tensor)  # no request is out: the child reads nothing now
        reply = self.call(
            {"op": "put", "key": key, "dtype": wire.dtype_name(tensor.dtype),
             "shape": list(tensor.shape), "nbytes": nbytes, "size": self.arena.size},
            timeout_s,
        )  # fmt: skip
        self.arena.trim(KEEP_BYTES)  # answered: the child is done reading
        return reply

    def send_peek(self, key: str, tensor: torch.Tensor) -> None:
        """Ask the child to write ``tensor`` (contiguous, on the host) under ``key``, reading
        its bytes where they are (``peek.py``); returns once the request is out, never
        waiting, also with other requests out (the child answers in order). The caller keeps
        ``tensor`` alive and unchanged until its reply was taken or the child was killed.
        ``wire.Full`` (or ``wire.TooLarge``): not sent. ``ChildGone`` otherwise."""
        request = {
            "op": "peek", "key": key, "dtype": wire.dtype_name(tensor.dtype),
            "shape": list(tensor.shape), "nbytes": tensor.numel() * tensor.element_size(),
            "address": tensor.data_ptr(), "id": self._next_id + 1,
        }  # fmt: skip
        if self.gone or self._tx is None:
            raise ChildGone("the writer process was already given up")
        data = wire.encode(request, self.capacity)  # TooLarge here: nothing went out
        try:
            wire.send_now(self._tx, data)
        except wire.TooLarge:  # Full included: refused whole, nothing went out
            raise
        except wire.WireError as exc:
            raise self._gone(str(exc)) from exc
        self._next_id += 1
        self._out.append(self._next_id)

    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send ``request``, return the child's reply to it. ``wire.TooLarge``: not sent.
        ``ChildGone`` (or any other exception) once sent: ``in_flight`` stays set."""
        self.send(request, timeout_s)
        return self.await_reply(timeout_s)

    def send(self, request: dict[str, Any], timeout_s: float) -> None:
        """Send ``request`` (numbered here); ``in_flight`` from then on (see ``call``)."""
        if self.gone:
            raise ChildGone("the writer process was already given up")
        request["id"] = self._next_id + 1
        data = wire.encode(request, self.capacity)  # TooLarge here: nothing went out
        self._next_id += 1
        self._out.append(self._next_id)
        try:
            self.sock.settimeout(timeout_s)
            wire.send_bytes(self.sock, data)
        except wire.TooLarge:
            self._out.pop()  # EMSGSIZE: the datagram was refused whole
            raise
        except wire.WireError as exc:
            raise self._gone(str(exc)) from exc

    def await_reply(self, timeout_s: float) -> dict[str, Any]:
        """The reply to the oldest request out (see ``call``); one thread at a time."""
        try:
            self.sock.settimeout(timeout_s)
            reply = wire.receive(self.sock)
        except wire.WireError as exc:
            raise self._gone(str(exc)) from exc
        oldest = self._out[0] if self._out else None
        if reply.get("id") != oldest or not isinstance(reply.get("counters"), dict):
            raise self._gone(f"a reply out of turn: {reply!r:.200}")
        self._out.popleft()
        return reply

    def answered(self) -> bool:
        """Whether a reply (or end of stream) waits on its socket; never blocks. False for a
        child already given up (its writer thread's ``await_reply`` says so)."""
        return not (self.gone or self.sock.fileno() < 0 or self.quiet())

    def quiet(self) -> bool:
        """For an idle child: nothing waits on its socket. An idle child sends nothing, so
        anything there (end of stream, above all) means it is dead or broken."""
        if self.gone or self.sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        return not poller.poll(0)

    def stop(self, timeout_s: float) -> None:
        """End of stream: an idle child exits by itself (one that does not in ``timeout_s``,
        or one with a request out, is killed)."""
        if not self.in_flight:
            self.sock.close()
            self._close_tx()
            if self.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout_s)
        self.kill()

    def kill(self) -> None:
        """Kill and reap the child, then drop its arena (never while the child may read it)."""
        self.gone = True
        self.sock.close()
        self._close_tx()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:  # unkillable (D state): leak the arena too
                return
        self._close_pidfd()
        self.arena.close()

    def _close_tx(self) -> None:
        if self._tx is not None:
            with contextlib.suppress(OSError):
                self._tx.close()

    def _close_pidfd(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def _gone(self, why: str) -> ChildGone:
        self.gone = True
        return ChildGone(why)

    def _forget(self) -> None:
        """(In a fork.) Let go of the child without touching it."""
        self.gone = True
        self.proc = None  # not this process's child: never signalled, never waited for
        with contextlib.suppress(OSError):
            self.sock.close()
            self._close_tx()
            if self._theirs is not None:  # forked while the child was being started
                self._theirs.close()
            self._close_pidfd()
        self.arena.close()  # this copy's mapping and descriptor only


def _check_ready(reply: dict[str, Any], code: str) -> None:
    if reply.get("op") == "refused":
        raise ChildRefused(f"the writer process refused to serve: {reply.get('reason')!s:.300}")
    if reply.get("op") != "ready":
        raise ChildGone(f"the writer process did not answer ready: {reply!r:.200}")
    if reply.get("code") != code:  # an older child that does not check
        raise ChildRefused(
            f"the writer process runs ec_redis {reply.get('code')!s:.80}, this process {code}"
        )


# OpenMP's thread binding (libgomp, Intel's and LLVM's runtimes): vLLM's CPU backend sets one
# for each worker, and the runtime binds the worker's main thread by it.
OMP_BINDING = ("GOMP_CPU_AFFINITY", "KMP_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND")
_NO_BINDING = ("", "false", "disabled", "none")  # values that bind nothing


def writer_cpus() -> list[int]:
    """The CPUs a writer process runs on: this thread's. Where an OpenMP binding in the
    environment explains them (vLLM's CPU backend binds each worker's compute threads, its
    main thread included, to cores of their own, where a child held to them ran only when the
    worker's busy loop let it: on two cores with two engines, writes waited seconds for a
    core; docs/benchmarks.md), also those of the process that started this one, the engine,
    as the operator placed it (``taskset`` and cpusets apply to it too). Without such a
    binding a narrower set is the operator's choice, and the child keeps it."""
    cpus = os.sched_getaffinity(0)
    values = (os.environ.get(name, "").strip().lower() for name in OMP_BINDING)
    if any(value not in _NO_BINDING for value in values):
        with contextlib.suppress(OSError):  # the parent gone, or hidden from this process
            cpus |= os.sched_getaffinity(os.getppid())
    return sorted(cpus)


def _pidfd(pid: int) -> int:
    """A pidfd of ``pid``, or -1 where the kernel (before 5.3) or a seccomp filter has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


def _forget_all_in_fork() -> None:
    for child in list(_LIVE):
        child._forget()


os.register_at_fork(after_in_child=_forget_all_in_fork)


def command(sock_fd: int, arena_fd: int) -> list[str]:
    """How a writer process is started: this interpreter, ``child.py``, its two descriptors
    and this process's pid (the child exits once it is no longer its parent's). Never with
    the working directory on its path: ``-P`` (or, before Python 3.11, the same by hand)."""
    args = [str(sock_fd), str(arena_fd), str(os.getpid())]
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "ec_redis.offload.child", *args]
    code = "import sys; del sys.path[0]; from ec_redis.offload.child import run; run()"
    return [sys.executable, "-c", code, *args]


def child_env() -> dict[str, str]:
    """The parent's environment, with ``ec_redis`` importable however the parent found it,
    without an OpenMP binding or thread count meant for the worker's compute threads: the
    child runs no parallel region, and an inherited binding would pin its thread to the
    worker's cores again when it imports torch (``writer_cpus``)."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_BINDING}
    env["OMP_NUM_THREADS"] = "1"
    root = Path(ec_redis.__file__).resolve().parent.parent
    if root.is_relative_to(Path(sys.prefix).resolve()):
        return env  # installed: the interpreter finds it (and site-packages stays behind)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(root) not in paths:  # a source checkout, or a module path handed to vLLM
        env["PYTHONPATH"] = os.pathsep.join([str(root), *paths])
    return env
