"""Adversarial review of the writer process (``offload/``): each test here reproduces a
suspected defect and FAILS while the defect is present. Real redis-server processes on free
ports (never the machine's own Redis)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

import ec_redis
from ec_redis import TieredCache
from ec_redis.config import CacheConfig
from ec_redis.embedded.server import EmbeddedRedis
from ec_redis.offload import sink as sink_module
from ec_redis.offload import wire
from ec_redis.offload.arena import KEEP_BYTES
from tests.conftest import bit_exact, embedding

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    srv = EmbeddedRedis.start_server()  # redis-server, a free port, its own directory
    yield srv
    srv.stop()


@pytest.fixture
def url(server: EmbeddedRedis) -> str:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.close()
    return server.url


@pytest.fixture
def own_server() -> Iterator[EmbeddedRedis]:
    srv = EmbeddedRedis.start_server()
    yield srv
    srv.stop()


def settings(url: str, **more: Any) -> dict[str, Any]:
    return {
        "redis_url": url,
        "namespace": "review",
        "device": "cpu",
        "gpu_cache_bytes": 0,
        "cpu_cache_bytes": 0,  # a hit can then only come from Redis
        "writer_process": True,  # the default may be off: these tests are about the child
        **more,
    }


def reader(url: str) -> TieredCache:
    return TieredCache.from_config(settings(url, writer_process=False))


def wstat(cache: TieredCache, name: str) -> float:
    return float(cache.stats()["writer"].get(name, 0))


def proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (``Z``: zombie), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def alive(pid: int) -> bool:
    return proc_state(pid) not in (None, "Z")


# -- 1. an item id too long for one SEQPACKET datagram -----------------------------------------


def test_a_long_item_id_is_written_like_in_process(url: str) -> None:
    """Item ids of any length are valid (keys.py hashes long ones). In-process such a write
    succeeds; through the writer process the request datagram exceeds the socket's send
    buffer (~208 KiB, EMSGSIZE), which is taken for a dead child: a healthy child is killed,
    a second one started and killed, and the write is lost (and the 250 KB id is logged)."""
    key = "x" * 250_000
    item = embedding(16, 16, seed=1)

    plain = reader(url)
    try:
        assert plain.put(key, item) and plain.flush(30)
        assert plain.stats()["writer"]["written"] == 1  # the in-process path stores it
        plain.delete(key)
    finally:
        plain.close()

    cache = TieredCache.from_config(settings(url))
    try:
        assert cache.warm_writes(60)
        assert cache.put(key, item) and cache.flush(60)
        stats = cache.stats()["writer"]
        assert stats["process_deaths"] == 0, f"healthy children killed: {stats}"
        assert stats["written"] == 1, stats
    finally:
        cache.close()
    other = reader(url)
    try:
        assert bit_exact(other.get(key), item)
    finally:
        other.close()


# -- 2. a child that dies while idle --------------------------------------------------------


def test_an_idle_child_that_dies_is_reaped_and_not_reported_alive(url: str) -> None:
    """A writer process killed between writes (the OOM killer picks it) stays a zombie for as
    long as no write comes, and ``process_alive`` keeps counting it: nothing polls idle
    children."""
    cache = TieredCache.from_config(settings(url))
    try:
        assert cache.warm_writes(60) and cache.process_sink is not None
        (pid,) = cache.process_sink.pids()
        os.kill(pid, signal.SIGKILL)
        time.sleep(3.0)
        assert proc_state(pid) != "Z", f"writer process {pid} left a zombie while idle"
        assert wstat(cache, "process_alive") == 0, "a dead child is reported alive"
    finally:
        cache.close()


# -- 3. the arena is truncated under a child that is still alive -------------------------------


def test_a_timed_out_child_is_killed_before_its_arena_is_truncated(url: str) -> None:
    """The docstrings promise a hung child is "killed and reaped before its arena is dropped".
    ``_Child.put``'s ``finally`` trims the arena (ftruncate to 0 after an item larger than
    KEEP_BYTES) *before* ``_lost`` kills the child: a child still reading its mapping then
    takes SIGBUS (a core dump where they are enabled) instead of the SIGKILL."""
    seen: list[tuple[bool, int]] = []
    real_kill = sink_module._Child.kill

    def recording_kill(self: Any) -> None:
        if self.proc is not None and self.arena.fd >= 0:
            seen.append((self.proc.poll() is None, os.fstat(self.arena.fd).st_size))
        real_kill(self)

    cache = TieredCache.from_config(settings(url, write_queue_bytes="256MiB"))
    try:
        assert cache.warm_writes(60) and cache.process_sink is not None
        sink_module._Child.kill = recording_kill  # type: ignore[method-assign]
        (pid,) = cache.process_sink.pids()
        cache.process_sink._reply_timeout_s = 1.0
        os.kill(pid, signal.SIGSTOP)  # alive, silent: reads its mapping when it resumes
        video = embedding(KEEP_BYTES // 2048 + 1024, 1024, seed=3)
        assert cache.put("video", video) and cache.flush(60)
        assert seen, "the hung child was never killed"
        was_alive, size = seen[0]
        assert was_alive
        assert size >= video.numel() * 2, (
            f"the arena was truncated to {size} bytes while its child was still alive"
        )
    finally:
        sink_module._Child.kill = real_kill  # type: ignore[method-assign]
        cache.close()


# -- 4. the lost-write lease ending asks a breaker that no longer sees the writes -------------


def _lease_end_seconds_after_failed_write(server: EmbeddedRedis, offload: bool) -> float:
    client = redis.Redis.from_url(server.url)
    client.flushall()
    client.close()
    cache = TieredCache.from_config(
        settings(
            server.url, writer_process=offload, breaker_failures=1, breaker_cooldown_s=60,
            breaker_max_cooldown_s=60, redis_retries=0, redis_socket_timeout_s=1.0,
            redis_connect_timeout_s=1.0,
        )
    )  # fmt: skip
    try:
        assert cache.warm_writes(60)
        assert cache.put("warm", embedding(8, 8)) and cache.flush(30)
        assert server.process is not None
        os.kill(server.process.pid, signal.SIGSTOP)  # a blackholed Redis: calls time out
        try:
            assert cache.put("a", embedding(8, 8, seed=1)) and cache.flush(30)
            assert cache.stats()["writer"]["failed"] == 1
            started = time.monotonic()
            assert cache._write_lost("dropped") is False  # what the writer thread runs
            return time.monotonic() - started
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
    finally:
        cache.close()


def test_ending_a_lost_writes_lease_skips_redis_once_writes_failed(
    own_server: EmbeddedRedis,
) -> None:
    """In-process, the write that failed opened the tier's breaker, and ``_write_lost``
    (``end_lease``, on the writer thread, once per batch of writes the full queue dropped)
    returns at once. With the writer process the failure opened the *child's* breaker; the
    parent's, which ``end_lease`` consults, stays closed, so every batch of lost writes costs
    a full socket timeout against the dead Redis on the writer thread."""
    in_process = _lease_end_seconds_after_failed_write(own_server, offload=False)
    assert in_process < 0.3, in_process  # the breaker it shares with the writes is open
    offloaded = _lease_end_seconds_after_failed_write(own_server, offload=True)
    assert offloaded < 0.3, (
        f"end_lease tried the dead Redis for {offloaded:.2f}s: the parent's breaker never "
        "heard of the child's failed writes"
    )


# -- 5. a child that starts but dies on every write: no back-off, no fallback ----------------


def test_children_that_die_on_every_write_do_not_cost_every_write(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """A writer process that answers ``ready`` but dies on each write (an environment the
    child cannot write from: a shadowed or mismatched module, a crashing extension, the OOM
    killer) is replaced at once, with no back-off, and the write retried in another such
    child: every write made while a child is up is lost (the parent, which can write, never
    does) and costs two interpreter + torch start-ups on the engine's host. The back-off and
    the fallback exist only for children that fail *before* ``ready``."""

    def dying_command(sock_fd: int, arena_fd: int) -> list[str]:
        code = (
            "import os, sys\n"
            "from ec_redis.offload import child\n"
            "child._serve = lambda *a: os._exit(7)\n"
            "sys.exit(child.main(sys.argv[1:]))\n"
        )
        return [sys.executable, "-c", code, str(sock_fd), str(arena_fd)]

    monkeypatch.setattr(sink_module, "command", dying_command)
    cache = TieredCache.from_config(settings(url))
    items = {f"img{i}": embedding(32, 32, seed=i) for i in range(2)}
    try:
        for key, item in items.items():
            assert cache.warm_writes(60)  # a child is up (as between sparse writes)
            assert cache.put(key, item) and cache.flush(60)
        stats = cache.stats()["writer"]
    finally:
        cache.close()
    other = reader(url)
    try:
        published = [key for key in items if other.get(key) is not None]
    finally:
        other.close()
    assert published == list(items), (
        f"published {published} of {list(items)}; {stats['process_starts']:.0f} starts, "
        f"{stats['process_deaths']:.0f} deaths, {stats['process_fallback_writes']:.0f} "
        "fallback writes"
    )


# -- 6. the child resolves imports from the engine's working directory ------------------------


def test_the_childs_imports_do_not_come_from_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str
) -> None:
    """``python -m ec_redis.offload.child`` puts the current directory first on the child's
    ``sys.path`` (``vllm serve``, a console script, does not have it on the engine's). A file
    in the directory vLLM was started from that is named like a module the child imports
    (``redis.py``, ``json.py``, ``socket.py``, ``mmap.py``...) is imported *instead* in the
    child only: here the writer process never starts, and the parent logs only "Connection
    reset by peer" (a module that imports cleanly but behaves differently would run in the
    child unnoticed, holding the Redis password)."""
    shadow = "raise ImportError('a redis.py of the working directory')\n"
    (tmp_path / "redis.py").write_text(shadow)
    monkeypatch.chdir(tmp_path)
    cache = TieredCache.from_config(settings(url))
    try:
        started = cache.warm_writes(60)
        assert started, f"the writer process did not start: {cache.stats()['writer']}"
    finally:
        cache.close()


# -- 7. a fork of the engine keeps the writer process alive after the engine dies ------------


def test_the_writer_exits_when_its_parent_dies_even_if_the_parent_forked(url: str) -> None:
    """The child's only sign of its parent's death is end of stream on its socket. The
    parent's end is close-on-exec, but a plain ``fork()`` (``multiprocessing``'s default
    start method on Linux, a forking server, user code) copies it: after the engine is
    killed the writer process lives on, as long as the fork does (and a ``close()`` of the
    parent waits its full timeout for a child that never sees end of stream)."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from ec_redis import TieredCache
        cache = TieredCache.from_config({settings(url)!r})
        assert cache.warm_writes(60)
        fork = os.fork()
        if fork == 0:
            time.sleep(120)
            os._exit(0)
        print(cache.process_sink.pids()[0], fork, flush=True)
        sys.stdin.read()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    writer = fork = -1
    try:
        assert parent.stdout is not None
        writer, fork = map(int, parent.stdout.readline().split())
        assert alive(writer)
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 15
        while alive(writer) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(writer), f"writer process {writer} outlived its parent (fork {fork})"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for pid in (fork, writer):  # the processes this test made, by pid
            if pid > 0 and alive(pid):
                os.kill(pid, signal.SIGKILL)


# -- 8. a configuration the engine's process accepts but the child cannot rebuild ------------


def test_a_config_the_cache_accepts_also_starts_a_writer_process(url: str) -> None:
    """``CacheConfig`` is public and frozen, built by code as well as by ``from_dict``
    (demo/hooks.py does). The child gets ``dataclasses.asdict(config)`` as JSON and re-parses
    it with ``from_dict``: a value the cache itself runs with but that JSON cannot carry (a
    ``torch.device``, which ``_resolve_device`` takes) or that ``from_dict`` would refuse
    makes every start fail, forever (a new interpreter every 10 s), and the writes stay on
    the engine's threads."""
    config = CacheConfig(
        redis_url=url, namespace="review", device=torch.device("cpu"),  # type: ignore[arg-type]
        gpu_cache_bytes=0, cpu_cache_bytes=0, writer_process=True,
    )  # fmt: skip
    cache = TieredCache(config)
    try:
        item = embedding(8, 8)
        assert cache.put("works-in-process", item) and cache.flush(30)  # the cache runs
        assert cache.warm_writes(60), f"no writer process: {cache.stats()['writer']}"
    finally:
        cache.close()


# -- 9. no version handshake between the engine's code and the child's ------------------------


def test_a_child_running_other_ec_redis_code_than_its_parent_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str
) -> None:
    """The child imports ``ec_redis`` from disk when it starts, which can be long after the
    engine did: after ``pip install -U ec_redis`` on a running server, every child started
    later (after a death, a back-off, a second cache) runs the *new* code under the old
    parent. The setup message carries no version, so nothing notices. Simulated here with a
    copy of the package whose next release bumped the format version: the child writes
    entries under keys this process's own readers never look at, and counts them written."""
    newer = tmp_path / "site"
    shutil.copytree(Path(ec_redis.__file__).parent, newer / "ec_redis")
    init = newer / "ec_redis" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"', '__version__ = "0.2.0"'))
    fmt = newer / "ec_redis" / "codec" / "format.py"
    fmt.write_text(fmt.read_text().replace("FORMAT_VERSION = 2", "FORMAT_VERSION = 3"))
    real_env = sink_module._child_env

    def upgraded_env() -> dict[str, str]:
        env = real_env()
        env["PYTHONPATH"] = str(newer)  # what the interpreter would find after the upgrade
        return env

    monkeypatch.setattr(sink_module, "_child_env", upgraded_env)
    cache = TieredCache.from_config(settings(url))
    item = embedding(16, 16, seed=9)
    try:
        started = cache.warm_writes(60)
        assert cache.put("img", item) and cache.flush(30)
        stats = cache.stats()["writer"]
    finally:
        cache.close()
    other = reader(url)
    try:
        got = other.get("img")
    finally:
        other.close()
    assert got is not None and bit_exact(got, item), (
        f"writer process started={started}, stats {stats}: the write was counted but this "
        "code cannot find it"
    )


# -- 10. a child handed back to the pool while it still reads the arena -----------------------


def test_an_error_after_the_request_was_sent_never_lets_the_arena_be_refilled_under_the_child(
    monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """``ProcessSink.__call__`` treats only ``ChildGone`` as a lost child; any other
    exception from ``child.put`` (``except BaseException: self._give_back(child)``) returns
    the child to the pool although the request may already be sent and the child be reading
    the arena. Here the exception is a ``MemoryError`` out of ``receive`` (its 1 MiB buffer
    is allocated right after the send; a ``RecursionError`` from ``json.loads`` would do
    too). The next write refills the arena while the child is still on the first request:
    the child stores the *second* item's bytes under the *first* item's id, with a valid
    checksum, and every reader is handed the wrong tensor."""

    def slow_command(sock_fd: int, arena_fd: int) -> list[str]:
        code = (
            "import sys, time\n"
            "from ec_redis.offload import child\n"
            "real = child.RedisTier.put\n"
            "def put(self, key, tensor):\n"
            "    time.sleep(2.0)  # descheduled before it reads the arena (a busy host)\n"
            "    return real(self, key, tensor)\n"
            "child.RedisTier.put = put\n"
            "sys.exit(child.main(sys.argv[1:]))\n"
        )
        return [sys.executable, "-c", code, str(sock_fd), str(arena_fd)]

    monkeypatch.setattr(sink_module, "command", slow_command)
    cache = TieredCache.from_config(settings(url))
    first = embedding(64, 64, seed=101)
    second = embedding(64, 64, seed=202)
    try:
        assert cache.warm_writes(60)
        real_receive = wire.receive
        calls = {"n": 0}

        def receive(sock: Any) -> dict[str, Any]:
            calls["n"] += 1
            if calls["n"] == 1:
                raise MemoryError  # after the request went out
            reply: dict[str, Any] = real_receive(sock)
            return reply

        monkeypatch.setattr(wire, "receive", receive)
        assert cache.put("first", first) and cache.flush(30)  # "failed": not published
        assert cache.put("second", second) and cache.flush(60)
    finally:
        cache.close()
    other = reader(url)
    try:
        got = other.get("first")
    finally:
        other.close()
    assert got is None or bit_exact(got, first), (
        "Redis serves the second item's tensor under the first item's id"
        if got is not None and bit_exact(got, second)
        else "Redis serves a wrong tensor under the first item's id"
    )
