"""Process plumbing shared by the embedded topologies: free ports, one-shot commands, waiting
for a port or a condition, and stopping many servers at once."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

_T = TypeVar("_T")


class Stoppable(Protocol):
    def stop(self) -> None: ...


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (see ``retry_start``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def call(port: int, *args: str | int, timeout_s: float = 2.0) -> Any:
    """Send one command on a fresh connection to 127.0.0.1:``port``; the decoded reply."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s, decode_responses=True,
        retry=Retry(NoBackoff(), 0),  # one try: callers poll, and a dead node must fail fast
    )  # fmt: skip
    try:
        return client.execute_command(*args)  # type: ignore[no-untyped-call]
    finally:
        client.close()


def terminate(process: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """Stop ``process``: SIGTERM, then SIGKILL when it is still running after ``grace_s``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(grace_s)


def check_owner(port: int, process: subprocess.Popen[bytes] | None) -> None:
    """Fail when the server answering on ``port`` is not ``process`` (a port race lost to
    another program that bound the "free" port first)."""
    if process is None:
        return
    import redis

    try:
        pid = int(call(port, "INFO", "server").get("process_id", -1))
    except (redis.AuthenticationError, redis.ResponseError):
        return  # a server that wants credentials (--requirepass, ACLs): it cannot be asked
    except Exception as exc:  # not Redis, or not answering: not ours either way
        raise RuntimeError(f"port {port} is served by another process ({exc!r})") from None
    if pid != process.pid:
        raise RuntimeError(f"port {port} is served by another process (pid {pid})")


def retry_start(start: Callable[[], _T], attempts: int = 3) -> _T:
    """Run ``start`` again (fresh free ports) when a port was taken between pick and bind."""
    for attempt in range(attempts):
        try:
            return start()
        except RuntimeError as exc:
            lost_race = "already in use" in str(exc) or "another process" in str(exc)
            if not lost_race or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def wait_until(
    check: Callable[[], bool], timeout_s: float, what: Callable[[], str], interval_s: float = 0.05
) -> None:
    """Poll ``check`` (errors count as "not yet") until it holds; ``TimeoutError`` naming
    ``what()`` (the state seen last) when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while True:
        try:
            if check():
                return
            last_error = ""
        except Exception as exc:  # a node still starting or just killed: keep polling
            last_error = f" (last error: {type(exc).__name__}: {exc})"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"after {timeout_s:.1f}s still waiting for {what()}{last_error}")
        time.sleep(interval_s)


def wait_for_port(
    port: int,
    process: subprocess.Popen[bytes] | None,
    log_path: str | None,
    name: str = "the server",
    timeout_s: float = 10,
) -> None:
    """Wait until 127.0.0.1:``port`` accepts connections; ``RuntimeError`` with the server's
    log when ``process`` exits first (e.g. "Address already in use"), or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            with open(log_path or os.devnull, errors="replace") as log:
                raise RuntimeError(f"{name} exited at start: {log.read().strip()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"{name} did not answer on 127.0.0.1:{port} within {timeout_s}s")


def stop_all(servers: Iterable[Stoppable]) -> None:
    """Stop every server, even when stopping one of them fails; re-raise the first error."""
    first: BaseException | None = None
    for server in servers:
        try:
            server.stop()
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
