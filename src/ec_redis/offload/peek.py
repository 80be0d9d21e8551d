"""A writer process reading an item's bytes straight out of its parent's memory.

``process_vm_readv(2)``: the kernel copies from the parent's address space into the child's,
on the child's time. The parent hands over an item with one small message naming where its
bytes are (``dispatch`` in ``sink.py``): no copy, no thread, nothing more on its side, so an
engine's step can pass a write on and end at once.

Allowed where the child may trace its parent: the same user and, under the Yama security
module's ``ptrace_scope`` 1 (Ubuntu's default), only once the parent names the child
(``allow``: ``PR_SET_PTRACER``; one process at a time). Scope 2 or 3, a seccomp filter
without the call, or another user: the child's probe at its start fails and every write
goes through the arena as before. Reading never changes the parent.

What the parent promises while a request is out: the bytes stay where it said and as they
were (it holds the tensor; nothing writes an encoder output or a host copy after it was
saved). If the parent dies first, the read fails (no such process) and nothing is written.
"""

from __future__ import annotations

import ctypes
import errno
import os

_PR_SET_PTRACER = 0x59616D61
_libc = ctypes.CDLL(None, use_errno=True)  # ctypes calls release the GIL


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.argtypes = [
        ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
        ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong,
    ]  # fmt: skip
    _readv.restype = ctypes.c_ssize_t


def allow(pid: int) -> None:
    """Let process ``pid`` (a writer process just started) read this process's memory under
    Yama ``ptrace_scope`` 1; a no-op without Yama (EINVAL), best effort otherwise."""
    _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)


def read(pid: int, address: int, into: int, nbytes: int) -> None:
    """Copy ``nbytes`` at ``address`` in process ``pid`` to ``into`` in this one, whole;
    ``OSError`` otherwise (refused, no such process, a range not mapped there)."""
    if _readv is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available")
    done = 0
    while done < nbytes:
        local = _IoVec(into + done, nbytes - done)
        remote = _IoVec(address + done, nbytes - done)
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"process_vm_readv from {pid}: {os.strerror(code)}")
        done += got


class Probe:
    """A few random bytes of the parent's, for the child to read back at its start: whether
    ``read`` works between the two (the setup message carries ``spec()``)."""

    def __init__(self) -> None:
        self.data = os.urandom(32)
        self._buffer = ctypes.create_string_buffer(self.data, len(self.data))

    def spec(self) -> dict[str, object]:
        return {"address": ctypes.addressof(self._buffer), "hex": self.data.hex()}


def probe_works(pid: int, spec: object) -> bool:
    """(The child.) Whether the parent's probe reads back as it says."""
    if not isinstance(spec, dict):
        return False
    try:
        expected = bytes.fromhex(str(spec["hex"]))
        into = ctypes.create_string_buffer(len(expected))
        read(pid, int(spec["address"]), ctypes.addressof(into), len(expected))
    except (KeyError, ValueError, TypeError, OSError):
        return False
    return into.raw == expected
