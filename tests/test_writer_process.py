"""Redis writes in a writer process (``offload/``), against real redis-server processes: the
bytes arrive whole, counters are counted once, and a child that dies, hangs or cannot start
costs neither the engine nor a half-visible entry."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
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
from ec_redis.errors import ConfigError
from ec_redis.keys import ModelIdentity
from ec_redis.offload import handshake, peek, wire
from ec_redis.offload import process as process_module
from ec_redis.offload.arena import KEEP_BYTES
from ec_redis.offload.backoff import Backoff, Strikes
from tests.conftest import bit_exact, embedding, emptied, paused, wait_for

pytestmark = pytest.mark.redis


def settings(url: str, **more: Any) -> dict[str, Any]:
    return {
        "redis_url": url,
        "namespace": "offload",
        "device": "cpu",
        "gpu_cache_bytes": 0,
        "cpu_cache_bytes": 0,  # a hit can then only come from Redis
        "writer_process": True,
        **more,
    }


def no_peeking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Children that cannot read this process's memory (their probe reads back wrong):
    every write goes through the arena, never handed over (``offload/peek.py``)."""
    real = peek.Probe.spec
    monkeypatch.setattr(peek.Probe, "spec", lambda self: {**real(self), "hex": "00" * 32})


def children_patched(monkeypatch: pytest.MonkeyPatch, patch: str) -> None:
    """Writer processes started from now on run ``patch`` (Python, with ``os``, ``sys``,
    ``time`` and ``child``, the child module, imported) before serving."""

    def command(sock_fd: int, arena_fd: int) -> list[str]:
        code = (
            "import os, sys, time\n"
            "from ec_redis.offload import child\n"
            f"{patch}"
            "sys.exit(child.main(sys.argv[1:]))\n"
        )
        return [sys.executable, "-c", code, str(sock_fd), str(arena_fd)]

    monkeypatch.setattr(process_module, "command", command)


@pytest.fixture
def arena_only(monkeypatch: pytest.MonkeyPatch) -> None:
    no_peeking(monkeypatch)


@pytest.fixture
def writing(redis_url: str) -> Iterator[TieredCache]:
    """A cache whose writer process is up."""
    cache = TieredCache.from_config(settings(redis_url))
    assert cache.warm_writes(60), "the writer process never came up"
    yield cache
    cache.close()


def reader(url: str) -> TieredCache:
    return TieredCache.from_config(settings(url, writer_process=False))


def writer_stat(cache: TieredCache, name: str) -> float:
    stats = cache.stats()["writer"]
    assert name in stats, f"{name} missing from {sorted(stats)}"
    return float(stats[name])


def test_a_write_lands_whole_from_another_process(writing: TieredCache, redis_url: str) -> None:
    item = embedding(4096, 1024, seed=1)  # 8 MiB: two chunks
    assert writing.process_sink is not None
    pids = writing.process_sink.pids()
    assert pids and os.getpid() not in pids
    assert writing.put("img", item) and writing.flush(30)
    other = reader(redis_url)
    try:
        assert bit_exact(other.get("img"), item)
    finally:
        other.close()
    assert writer_stat(writing, "process_fallback_writes") == 0
    assert writer_stat(writing, "written") == 1
    assert writer_stat(writing, "process_breaker_state") == 0  # closed, from the child


def test_counters_are_counted_once_as_if_written_here(redis_url: str) -> None:
    """The tier counters the child sends back equal those of the same write made in-process."""
    item = embedding(1024, 512, seed=2)
    counted = {}
    for offload in (True, False):
        cache = TieredCache.from_config(settings(redis_url, writer_process=offload))
        try:
            assert cache.warm_writes(60)
            assert cache.put(f"img-{offload}", item) and cache.flush(30)
            stats = cache.stats()
            counted[offload] = {k: stats["redis"][k] for k in ("writes", "bytes_written")}
            if offload:
                assert writer_stat(cache, "process_fallback_writes") == 0
        finally:
            cache.close()
    assert counted[True] == counted[False] and counted[True]["writes"] == 1


def test_the_configuration_survives_the_trip_to_the_child() -> None:
    """The child rebuilds the config from JSON: every key of every type must round-trip."""
    config = CacheConfig.from_dict(
        {"redis_url": "redis://127.0.0.1:1/0", "namespace": "n1", "ttl_s": 12.5,
         "compression": "lz4", "write_queue_bytes": "64MiB", "tenant_salt": "s"}
    )  # fmt: skip
    identity = ModelIdentity("m", "main", "bfloat16", 64, "w1")
    message = handshake.setup_message(config, identity, "encoder-0")
    rebuilt, rebuilt_identity = handshake.read(json.loads(json.dumps(message)))
    assert rebuilt == dataclasses.replace(config, producer_id="encoder-0")
    assert rebuilt_identity == identity


def test_a_child_killed_mid_write_shows_nothing_half_and_is_replaced(
    private_redis: EmbeddedRedis,
) -> None:
    """Redis paused, the child blocks mid-write (a 64 MiB value fills its socket); SIGKILL it.
    Nothing of the item is visible meanwhile, its chunks are never immortal, and the write is
    retried in a fresh child once Redis is back."""
    url = emptied(private_redis)
    cache = TieredCache.from_config(settings(url, orphan_grace_s=1.0))
    try:
        assert cache.warm_writes(60)
        assert cache.put("warm", embedding(8, 8)) and cache.flush(30)  # connected
        (pid,) = cache.process_sink.pids()  # type: ignore[union-attr]
        item = embedding(32768, 1024, seed=3)  # 64 MiB
        with paused(private_redis):
            assert cache.put("big", item)
            time.sleep(1.0)  # the child is inside the write, blocked on the paused server
            assert cache.writer is not None and cache.writer.pending("big") is not None
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: writer_stat(cache, "process_deaths") == 1, 30, "the death seen")
        other = reader(url)
        try:  # Redis back, the retry under way: the item is missing or whole, never half
            got = other.get("big")
            assert got is None or bit_exact(got, item)
        finally:
            other.close()
        assert cache.flush(60)
        assert writer_stat(cache, "process_retried_writes") == 1
        (new_pid,) = cache.process_sink.pids()  # type: ignore[union-attr]
        assert new_pid != pid
        other = reader(url)
        try:
            assert bit_exact(other.get("big"), item)
        finally:
            other.close()
        client = redis.Redis.from_url(url)
        try:  # the killed write's chunks expire (orphan grace): what stays is two entries
            wait_for(lambda: all(client.pttl(k) == -1 for k in client.scan_iter("*")), 30)
            left = len(list(client.scan_iter("offload:*")))
            same = TieredCache.from_config(settings(url, namespace="again", writer_process=False))
            assert same.put("warm", embedding(8, 8)) and same.put("big", item)
            assert same.flush(30)
            same.close()
            assert left == len(list(client.scan_iter("again:*")))
        finally:
            client.close()
        assert cache.put("after", embedding(16, 16)) and cache.flush(30)  # engine unharmed
    finally:
        cache.close()


def test_a_hung_child_is_killed_after_the_reply_timeout_and_the_write_retried(
    writing: TieredCache, redis_url: str
) -> None:
    assert writing.process_sink is not None
    (pid,) = writing.process_sink.pids()
    writing.process_sink._reply_timeout_s = 1.0
    os.kill(pid, signal.SIGSTOP)  # silent, not dead
    item = embedding(256, 256, seed=4)
    assert writing.put("img", item)
    assert writing.flush(60)
    assert writer_stat(writing, "process_deaths") == 1
    assert writer_stat(writing, "process_retried_writes") == 1
    wait_for(lambda: not pid_alive(pid), 10, "the hung child reaped")
    other = reader(redis_url)
    try:
        assert bit_exact(other.get("img"), item)
    finally:
        other.close()


def test_a_child_that_cannot_start_costs_nothing(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """A broken interpreter (or no descriptor left): the write is made on the writer thread,
    counted, and no start is retried before the back-off."""
    monkeypatch.setattr(process_module, "command", lambda *_: ["/nonexistent/python3"])
    cache = TieredCache.from_config(settings(redis_url))
    try:
        assert not cache.warm_writes(30)
        item = embedding(64, 64, seed=5)
        assert cache.put("img", item) and cache.flush(30)
        assert writer_stat(cache, "process_start_failures") == 1
        assert writer_stat(cache, "process_fallback_writes") == 1
        assert writer_stat(cache, "process_alive") == 0
        other = reader(redis_url)
        try:
            assert bit_exact(other.get("img"), item)
        finally:
            other.close()
    finally:
        cache.close()


def test_no_memfd_means_the_writer_thread_writes(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    def no_descriptors(*_: Any) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "memfd_create", no_descriptors)
    cache = TieredCache.from_config(settings(redis_url))
    try:
        cache.warm_writes(30)
        wait_for(lambda: writer_stat(cache, "process_start_failures") == 1, 30)
        item = embedding(64, 64, seed=6)
        assert cache.put("img", item) and cache.flush(30)
        assert writer_stat(cache, "process_fallback_writes") == 1
    finally:
        cache.close()


def test_writer_process_false_starts_none(redis_url: str) -> None:
    cache = TieredCache.from_config(settings(redis_url, writer_process=False))
    try:
        assert cache.process_sink is None
        assert cache.put("img", embedding(8, 8)) and cache.flush(10)
        assert "process_starts" not in cache.stats()["writer"]
    finally:
        cache.close()


def test_the_child_exits_when_its_parent_dies(redis_url: str) -> None:
    """An engine killed outright leaves no writer process behind."""
    script = textwrap.dedent(
        f"""
        import os, sys
        from ec_redis import TieredCache
        cache = TieredCache.from_config({settings(redis_url)!r})
        assert cache.warm_writes(60)
        print(cache.process_sink.pids()[0], flush=True)
        sys.stdin.read()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert pid_alive(pid)
        parent.kill()
        parent.wait(30)
        wait_for(lambda: not pid_alive(pid), 30, "the orphaned writer process to exit")
    finally:
        if parent.poll() is None:
            parent.kill()


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_item_of_every_dtype_crosses_whole(writing: TieredCache, redis_url: str) -> None:
    other = reader(redis_url)
    try:
        for i, dtype in enumerate((torch.float32, torch.float16, torch.int8, torch.bool)):
            item = (torch.arange(3 * 257) % 7).reshape(3, 257).to(dtype)
            assert writing.put(f"d{i}", item) and writing.flush(30)
            assert bit_exact(other.get(f"d{i}"), item), dtype
        assert writing.put("empty", torch.empty(0, 16, dtype=torch.bfloat16))
        assert writing.flush(30)
        got = other.get("empty")
        assert got is not None and tuple(got.shape) == (0, 16)
    finally:
        other.close()
    assert writer_stat(writing, "process_fallback_writes") == 0


def test_an_arena_gives_a_videos_pages_back_and_serves_the_next_item(
    arena_only: None, redis_url: str
) -> None:
    """After an item larger than KEEP_BYTES the arena is emptied; the child's older, larger
    mapping of it must then still read the next (smaller, then larger) items right."""
    cache = TieredCache.from_config(settings(redis_url, write_queue_bytes="256MiB"))
    other = reader(redis_url)
    try:
        assert cache.warm_writes(60) and cache.process_sink is not None
        video = embedding(KEEP_BYTES // 2048 + 1024, 1024, seed=7)  # just over KEEP_BYTES
        image = embedding(2048, 1024, seed=8)
        for key, item in (("video", video), ("image", image), ("video2", video)):
            assert cache.put(key, item) and cache.flush(60)
            (child,) = cache.process_sink._idle
            if item is video:
                assert child.arena.size == 0  # its pages given back
            else:
                assert image.numel() * 2 <= child.arena.size <= KEEP_BYTES
            assert bit_exact(other.get(key), item), key
        assert writer_stat(cache, "process_fallback_writes") == 0
        assert writer_stat(cache, "process_deaths") == 0
    finally:
        other.close()
        cache.close()


def test_the_childs_breaker_opens_on_failed_writes_and_is_reported(
    private_redis: EmbeddedRedis,
) -> None:
    """The breaker that sees the writes is the child's: its state is reported from there, and
    its failures are counted once in the parent's tier counters."""
    url = emptied(private_redis)
    cache = TieredCache.from_config(
        settings(url, breaker_failures=1, breaker_cooldown_s=60, redis_retries=0)
    )
    try:
        assert cache.warm_writes(60)
        assert cache.put("ok", embedding(8, 8)) and cache.flush(30)
        assert writer_stat(cache, "process_breaker_state") == 0
        private_redis.stop()
        for i in range(3):
            cache.put(f"lost{i}", embedding(8, 8, seed=i))
        assert cache.flush(60)
        assert writer_stat(cache, "process_breaker_state") == 1  # open
        stats = cache.stats()
        assert stats["redis"]["write_errors"] >= 1
        assert stats["redis"]["write_skipped_breaker_open"] >= 1
        assert stats["redis"]["breaker_state"] == 0  # the parent's own saw none of it
        assert writer_stat(cache, "process_fallback_writes") == 0
    finally:
        cache.close()


def proc_state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (``Z``: zombie), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


# -- the adversarial review (issue 17): one test per defect it found ----------------------------


def test_a_long_item_id_is_written_like_in_process(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Item ids of any length are valid (keys.py hashes long ones). A request naming one can
    exceed what one SEQPACKET datagram carries (~208 KiB, EMSGSIZE): that is no dead child.
    Nothing is sent, the child stays up, the write is made here (counted), and the log line
    shows a few characters of the id, not 250 KB of it."""
    key = "x" * 250_000
    item = embedding(16, 16, seed=1)
    cache = TieredCache.from_config(settings(redis_url))
    try:
        assert cache.warm_writes(60) and cache.process_sink is not None
        (pid,) = cache.process_sink.pids()
        with caplog.at_level(logging.WARNING, logger="ec_redis"):
            assert cache.put(key, item) and cache.flush(60)
        stats = cache.stats()["writer"]
        assert stats["process_deaths"] == 0, f"healthy children killed: {stats}"
        assert stats["written"] == 1 and stats["process_fallback_writes"] == 1, stats
        assert cache.process_sink.pids() == [pid]
        assert cache.put("next", item) and cache.flush(30)  # the same child still serves
        assert writer_stat(cache, "process_fallback_writes") == 1
        assert all(len(r.getMessage()) < 1000 for r in caplog.records), "a whole id logged"
    finally:
        cache.close()
    other = reader(redis_url)
    try:
        assert bit_exact(other.get(key), item)
    finally:
        other.close()


def test_a_message_the_socket_cannot_carry_is_refused_whole() -> None:
    """``EMSGSIZE`` (nothing sent) is ``TooLarge``, not a dead peer; the peer sees nothing."""
    ours, theirs = wire.pair()
    try:
        too_long = b"x" * (ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + 1)
        with pytest.raises(wire.TooLarge):
            wire.send_bytes(ours, too_long)
        with pytest.raises(wire.TooLarge):
            wire.encode({"key": too_long.decode()}, wire.capacity(ours))
        wire.send(ours, {"op": "ping"})
        assert wire.receive(theirs) == {"op": "ping"}  # the first thing the peer sees
    finally:
        ours.close()
        theirs.close()


def test_an_idle_child_that_dies_is_reaped_and_not_reported_alive(redis_url: str) -> None:
    """A writer process killed between writes (the OOM killer picks it) is reaped at once
    (no zombie waiting for the next write) and no longer counted alive."""
    cache = TieredCache.from_config(settings(redis_url))
    try:
        assert cache.warm_writes(60) and cache.process_sink is not None
        (pid,) = cache.process_sink.pids()
        os.kill(pid, signal.SIGKILL)
        time.sleep(3.0)
        assert proc_state(pid) != "Z", f"writer process {pid} left a zombie while idle"
        assert writer_stat(cache, "process_alive") == 0, "a dead child is reported alive"
        assert writer_stat(cache, "process_deaths") == 1
    finally:
        cache.close()


def test_a_timed_out_child_is_killed_before_its_arena_is_truncated(
    arena_only: None, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """A hung child is killed and reaped before its arena is dropped or trimmed: a child
    still reading its mapping of a truncated file would take SIGBUS (a core dump where they
    are enabled) instead of the SIGKILL."""
    seen: list[tuple[bool, int]] = []
    real_kill = process_module.WriterProcess.kill

    def recording_kill(self: process_module.WriterProcess) -> None:
        if self.proc is not None and self.arena.fd >= 0:
            seen.append((self.proc.poll() is None, os.fstat(self.arena.fd).st_size))
        real_kill(self)

    cache = TieredCache.from_config(settings(redis_url, write_queue_bytes="256MiB"))
    try:
        assert cache.warm_writes(60) and cache.process_sink is not None
        monkeypatch.setattr(process_module.WriterProcess, "kill", recording_kill)
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
        cache.close()


def _lease_end_seconds_after_failed_write(server: EmbeddedRedis, offload: bool) -> float:
    cache = TieredCache.from_config(
        settings(
            emptied(server), writer_process=offload, breaker_failures=1, breaker_cooldown_s=60,
            breaker_max_cooldown_s=60, redis_retries=0, redis_socket_timeout_s=1.0,
            redis_connect_timeout_s=1.0,
        )
    )  # fmt: skip
    try:
        assert cache.warm_writes(60)
        assert cache.put("warm", embedding(8, 8)) and cache.flush(30)
        with paused(server):  # a blackholed Redis: calls time out
            assert cache.put("a", embedding(8, 8, seed=1)) and cache.flush(30)
            assert cache.stats()["writer"]["failed"] == 1
            started = time.monotonic()
            assert cache._write_lost("dropped") is False  # what the writer thread runs
            return time.monotonic() - started
    finally:
        cache.close()


def test_ending_a_lost_writes_lease_skips_redis_once_writes_failed(
    private_redis: EmbeddedRedis,
) -> None:
    """In-process, the write that failed opened the tier's breaker, and ``_write_lost``
    (``end_lease``, on the writer thread, once per batch of writes the full queue dropped)
    returns at once. With the writer process the failure opened the *child's* breaker: the
    lease is ended there, behind it, and returns at once too (not after a socket timeout
    against the dead Redis behind the parent's breaker, which never saw the writes)."""
    in_process = _lease_end_seconds_after_failed_write(private_redis, offload=False)
    assert in_process < 0.3, in_process  # the breaker it shares with the writes is open
    offloaded = _lease_end_seconds_after_failed_write(private_redis, offload=True)
    assert offloaded < 0.3, (
        f"end_lease tried the dead Redis for {offloaded:.2f}s: the parent's breaker never "
        "heard of the child's failed writes"
    )


def test_a_lost_writes_lease_is_ended_by_the_child(redis_url: str, raw: redis.Redis) -> None:
    """With Redis healthy, the child ends the lease: it is gone from Redis afterwards."""
    cache = TieredCache.from_config(settings(redis_url))
    try:
        assert cache.warm_writes(60) and cache.redis is not None
        assert cache.process_sink is not None
        lease = cache.redis.keys.lease_of(cache.redis.keys.head("img"))
        raw.set(lease, b"someone")
        assert cache.process_sink.end_lease("img") is True  # not None: the child did it
        assert raw.exists(lease) == 0
        assert writer_stat(cache, "process_deaths") == 0
    finally:
        cache.close()


@pytest.mark.parametrize("peeking", [False, True], ids=["arena", "handed over"])
def test_children_that_die_on_every_write_do_not_cost_every_write(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, peeking: bool
) -> None:
    """A writer process that answers ``ready`` but dies on each write (an environment the
    child cannot write from: a crashing extension, the OOM killer) is replaced once; after a
    second death with no write served between, starts back off and the write is made here,
    as later ones are: no write is lost, and not every write pays an interpreter + torch
    start-up."""

    children_patched(monkeypatch, "child._serve = child._serve_peek = lambda *a: os._exit(7)\n")
    if not peeking:
        no_peeking(monkeypatch)
    cache = TieredCache.from_config(settings(redis_url))
    items = {f"img{i}": embedding(32, 32, seed=i) for i in range(2)}
    try:
        for key, item in items.items():
            assert cache.warm_writes(60)  # a child is up (as between sparse writes)
            assert cache.put(key, item) and cache.flush(60)
        assert cache.put("img2", embedding(8, 8)) and cache.flush(60)  # backed off: here
        stats = cache.stats()["writer"]
    finally:
        cache.close()
    other = reader(redis_url)
    try:
        published = [key for key in items if other.get(key) is not None]
    finally:
        other.close()
    assert published == list(items), (
        f"published {published} of {list(items)}; {stats['process_starts']:.0f} starts, "
        f"{stats['process_deaths']:.0f} deaths, {stats['process_fallback_writes']:.0f} "
        "fallback writes"
    )
    assert stats["process_starts"] == 3  # two for the first write, one per warm_writes after
    assert stats["process_fallback_writes"] == 3
    assert stats["process_dispatched"] == (2 if peeking else 0)


def test_the_childs_imports_do_not_come_from_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str
) -> None:
    """``python -m`` would put the working directory first on the child's ``sys.path``
    (``vllm serve``, a console script, does not have it on the engine's): a ``redis.py``
    (``json.py``, ``socket.py``...) in the directory vLLM was started from would be imported
    *instead* in the child only. The child is started with ``-P``."""
    shadow = "raise ImportError('a redis.py of the working directory')\n"
    (tmp_path / "redis.py").write_text(shadow)
    monkeypatch.chdir(tmp_path)
    cache = TieredCache.from_config(settings(redis_url))
    try:
        started = cache.warm_writes(60)
        assert started, f"the writer process did not start: {cache.stats()['writer']}"
    finally:
        cache.close()


def test_the_writer_exits_when_its_parent_dies_even_if_the_parent_forked(redis_url: str) -> None:
    """A plain ``fork()`` of the engine (``multiprocessing``'s default start method on Linux,
    a forking server, user code) copies the parent's end of the child's socket: the child
    must still exit when the engine is killed while the fork lives on."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from ec_redis import TieredCache
        cache = TieredCache.from_config({settings(redis_url)!r})
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
        assert pid_alive(writer)
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 15
        while pid_alive(writer) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(writer), f"writer process {writer} outlived its parent (fork {fork})"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for pid in (fork, writer):  # the processes this test made, by pid
            if pid > 0 and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_config_the_cache_accepts_also_starts_a_writer_process(redis_url: str) -> None:
    """``CacheConfig`` is public and frozen, built by code as well as by ``from_dict``
    (demo/hooks.py does). A value the cache runs with but JSON cannot carry (a
    ``torch.device``, which ``_resolve_device`` takes) must still start a child."""
    config = CacheConfig(
        redis_url=redis_url, namespace="offload", device=torch.device("cpu"),  # type: ignore[arg-type]
        gpu_cache_bytes=0, cpu_cache_bytes=0, writer_process=True,
    )  # fmt: skip
    cache = TieredCache(config)
    try:
        item = embedding(8, 8)
        assert cache.put("works-in-process", item) and cache.flush(30)  # the cache runs
        assert cache.warm_writes(60), f"no writer process: {cache.stats()['writer']}"
    finally:
        cache.close()


def test_a_config_the_child_cannot_rebuild_fails_when_the_cache_is_built(redis_url: str) -> None:
    """A value ``from_dict`` refuses fails at once, naming the key, not at every start."""
    config = CacheConfig(redis_url=redis_url, namespace="not valid", writer_process=True)
    with pytest.raises(ConfigError, match="namespace"):
        TieredCache(config)


def test_a_child_running_other_ec_redis_code_than_its_parent_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str
) -> None:
    """The child imports ``ec_redis`` from disk when it starts, which can be long after the
    engine did (``pip install -U`` on a running server). Simulated with a copy of the package
    whose next release bumped the format version: such a child refuses to serve (it would
    write entries under keys this process's readers never look at), the start counts as
    failed, and the write is made here."""
    newer = tmp_path / "site"
    shutil.copytree(Path(ec_redis.__file__).parent, newer / "ec_redis")
    init = newer / "ec_redis" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"', '__version__ = "0.2.0"'))
    fmt = newer / "ec_redis" / "codec" / "format.py"
    fmt.write_text(fmt.read_text().replace("FORMAT_VERSION = 2", "FORMAT_VERSION = 3"))
    real_env = process_module.child_env

    def upgraded_env() -> dict[str, str]:
        env = real_env()
        env["PYTHONPATH"] = str(newer)  # what the interpreter would find after the upgrade
        return env

    monkeypatch.setattr(process_module, "child_env", upgraded_env)
    cache = TieredCache.from_config(settings(redis_url))
    item = embedding(16, 16, seed=9)
    try:
        started = cache.warm_writes(60)
        assert cache.put("img", item) and cache.flush(30)
        stats = cache.stats()["writer"]
    finally:
        cache.close()
    other = reader(redis_url)
    try:
        got = other.get("img")
    finally:
        other.close()
    assert got is not None and bit_exact(got, item), (
        f"writer process started={started}, stats {stats}: the write was counted but this "
        "code cannot find it"
    )
    assert not started and stats["process_start_failures"] == 1


def test_an_error_after_the_request_was_sent_never_lets_the_arena_be_refilled_under_the_child(
    monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """Any way out of a write other than the child's valid reply kills the child: here a
    ``MemoryError`` out of ``receive`` (its 1 MiB buffer is allocated right after the send).
    Were the child handed back to the pool, the next write would refill the arena while it
    is still on the first request, and it would store the *second* item's bytes under the
    *first* item's id, with a valid checksum."""

    children_patched(
        monkeypatch,
        "real = child.RedisTier.put\n"
        "def put(self, key, tensor):\n"
        "    time.sleep(2.0)  # descheduled before it reads the arena (a busy host)\n"
        "    return real(self, key, tensor)\n"
        "child.RedisTier.put = put\n",
    )
    cache = TieredCache.from_config(settings(redis_url))
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
    other = reader(redis_url)
    try:
        got = other.get("first")
    finally:
        other.close()
    assert got is None or bit_exact(got, first), (
        "Redis serves the second item's tensor under the first item's id"
        if got is not None and bit_exact(got, second)
        else "Redis serves a wrong tensor under the first item's id"
    )


def test_starts_back_off_after_a_failed_start_and_after_a_second_death() -> None:
    """One death (an OOM kill) costs one fresh start; a failed start, or a second death with
    no write served between, backs starts off, doubling; a served write forgives all."""
    now = [0.0]
    strikes = Strikes(Backoff(base_s=10.0, max_s=25.0), clock=lambda: now[0])
    assert strikes.died() == 0.0 and not strikes.backed_off()
    assert strikes.died() == 10.0 and strikes.backed_off()
    assert strikes.died() == 20.0
    assert strikes.start_failed() == 25.0  # at most max_s
    now[0] = 25.0
    assert not strikes.backed_off()
    strikes.served()
    assert strikes.died() == 0.0 and not strikes.backed_off()
    strikes.served()
    assert strikes.start_failed() == 10.0 and strikes.backed_off()


def test_the_writer_process_runs_under_sched_batch(writing: TieredCache) -> None:
    """Woken by a handed write, the child must not preempt the engine's thread (``sched.py``);
    the engine's own thread keeps its policy."""
    assert writing.process_sink is not None
    pids = writing.process_sink.pids()
    assert pids
    if os.sched_getscheduler(0) != os.SCHED_OTHER:
        pytest.skip("the test runs under another policy: the child keeps it")
    for pid in pids:
        assert os.sched_getscheduler(pid) == os.SCHED_BATCH, pid
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
