"""Staged bytes travel to worker processes as host-local files: metadata stays small, a
promised item's file lives until its step ran, and every file is removed in the end."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_redis.connector import owners
from ec_redis.connector import transport as module
from ec_redis.connector.metadata import ECRedisMetadata, ECRedisWorkerMetadata
from ec_redis.connector.spares import is_spare
from ec_redis.connector.staging import Found
from ec_redis.connector.transport import FileTransport, InlineTransport, read_staged
from tests.conftest import bit_exact, embedding

pytestmark = pytest.mark.vllm
MiB = 1 << 20


def found(rows: int, width: int = 128, seed: int = 0) -> Found:
    tensor = embedding(rows, width, seed)
    return Found(tensor.dtype, tuple(tensor.shape), tensor)


def files(directory: Path) -> list[Path]:
    """Staged item files (not the owner locks of the transports that made them, nor their
    spare files)."""
    return sorted(
        p
        for p in directory.glob(f"{module.FILE_PREFIX}*")
        if p.suffix != owners.LOCK_SUFFIX and not is_spare(p.name)
    )


def test_a_staged_file_holds_the_bytes_and_any_rank_reads_them(tmp_path: Path) -> None:
    transport = FileTransport(str(tmp_path))
    original = found(64, seed=1)
    staged = transport.stage(original)
    assert staged.tensor is None and staged.path is not None and staged.loadable
    assert staged.nbytes == original.nbytes
    load = transport.load("img", staged, step=0)
    assert load.tensor is None and load.shape == (64, 128) and load.dtype == "bfloat16"
    # Another process (a TP rank) reads it by name.
    code = (
        "import pickle, sys, torch; from ec_redis.connector.transport import read_staged; "
        "t = read_staged(pickle.loads(sys.stdin.buffer.read())); "
        "sys.stdout.buffer.write(t.view(torch.uint8).numpy().tobytes())"
    )
    rank = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(load), capture_output=True, check=True
    )
    assert rank.stdout == original.tensor.view(torch.uint8).numpy().tobytes()  # type: ignore[union-attr]
    assert bit_exact(read_staged(load), original.tensor)  # type: ignore[arg-type]


def test_a_file_lives_until_its_entry_and_every_load_in_transit_let_go(tmp_path: Path) -> None:
    transport = FileTransport(str(tmp_path))
    staged = transport.stage(found(16))
    transport.load("img", staged, step=3)
    transport.load("img", staged, step=4)  # a second request loads it in a later step
    transport.discard(staged)  # the staging entry died (its last request loaded it)
    assert len(files(tmp_path)) == 1  # two loads still in transit
    transport.step_done(3)
    assert len(files(tmp_path)) == 1
    transport.step_done(4)
    assert files(tmp_path) == [] and transport.live_files() == 0


def test_loads_whose_step_never_reports_back_expire(tmp_path: Path) -> None:
    now = [0.0]
    transport = FileTransport(str(tmp_path), in_transit_ttl_s=60, clock=lambda: now[0])
    staged = transport.stage(found(16))
    transport.load("img", staged, step=0)
    transport.discard(staged)
    now[0] = 59.0
    transport.sweep()
    assert len(files(tmp_path)) == 1
    now[0] = 61.0
    transport.sweep()
    assert files(tmp_path) == []


def test_a_full_tmpfs_falls_back_to_inline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transport = FileTransport(str(tmp_path))
    monkeypatch.setattr(module, "_has_room", lambda directory, nbytes: False)
    original = found(16)
    assert transport.stage(original) is original
    monkeypatch.setattr(module, "_has_room", lambda directory, nbytes: True)

    def full(path: str, tensor: torch.Tensor) -> None:
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "_write_file", full)
    assert transport.stage(original) is original  # slower, never wrong
    assert files(tmp_path) == []  # the partial file is gone
    assert transport.counters.snapshot()["stage_inline_fallbacks"] == 2


def test_only_files_whose_owner_is_gone_are_removed_at_start(tmp_path: Path) -> None:
    """Ownership is a held lock, not a pid: a live owner in another process (whose pid may
    mean nothing here, e.g. another container sharing /dev/shm) keeps its files; a dead
    owner's files go even when its pid was reused by a live process (here: ours)."""
    code = (
        "import sys, time; from pathlib import Path; from ec_redis.connector.owners import Owner\n"
        "owner = Owner(Path(sys.argv[1]), sys.argv[2]); print(owner.stem, flush=True)\n"
        "time.sleep(120)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path), module.FILE_PREFIX],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        live = tmp_path / f"{holder.stdout.readline().strip()}-0"
        dead_stem = f"{module.FILE_PREFIX}{os.getpid()}-0badf00d"  # a live pid, a free lock
        (tmp_path / f"{dead_stem}{owners.LOCK_SUFFIX}").write_bytes(b"")
        dead = tmp_path / f"{dead_stem}-0"
        lockless = tmp_path / f"{module.FILE_PREFIX}1-0000abcd-0"
        for path in (live, dead, lockless):
            path.write_bytes(b"x")
        transport = FileTransport(str(tmp_path))
        assert files(tmp_path) == [live]
        assert not (tmp_path / f"{dead_stem}{owners.LOCK_SUFFIX}").exists()
        transport.close()  # its own lock goes with it
        locks = sorted(p.name for p in tmp_path.glob(f"*{owners.LOCK_SUFFIX}"))
        assert locks == [f"{live.name[:-2]}{owners.LOCK_SUFFIX}"]
    finally:
        holder.kill()
        holder.wait()
    FileTransport(str(tmp_path)).close()  # the holder is dead now: its file goes too
    assert files(tmp_path) == [] and not list(tmp_path.iterdir())


def test_step_metadata_stays_under_4_kib_for_16_and_150_mib_items(tmp_path: Path) -> None:
    transport = FileTransport(str(tmp_path))
    loads = [
        transport.load(name, transport.stage(found(rows, 3584)), step=0)
        for name, rows in (("image", 16 * MiB // 7168), ("video", 150 * MiB // 7168))
    ]
    meta = ECRedisMetadata(loads=loads, step=0)
    assert len(pickle.dumps(meta)) <= 4096
    inline = InlineTransport()
    inline_meta = ECRedisMetadata(loads=[inline.load("image", found(2340, 3584), step=0)])
    assert len(pickle.dumps(inline_meta)) > 16 * 10**6  # what it would have cost inline
    transport.close()
    assert files(tmp_path) == []


def test_worker_metadata_acknowledges_the_latest_step_over_ranks() -> None:
    merged = ECRedisWorkerMetadata(1, 7).aggregate(ECRedisWorkerMetadata(2, 7))
    assert isinstance(merged, ECRedisWorkerMetadata)
    assert (merged.pending_writes, merged.loaded_step) == (3, 7)


@pytest.mark.redis
def test_the_connector_loads_through_files_and_leaves_none_behind(
    make_connector: Any, tmp_path: Path
) -> None:
    from tests.connector.conftest import request
    from tests.connector.test_connector_unit import publish, wait_ready

    tensors = {"a": embedding(16, 128, seed=1), "b": embedding(600, 128, seed=2)}
    publish(make_connector, tensors)
    extra = {"stage_transport": "file", "stage_dir": str(tmp_path)}
    scheduler = make_connector("ec_consumer", extra=extra)
    worker = make_connector("ec_consumer", "worker", extra=extra)
    req = request("r1", ("a", 16), ("b", 600))
    assert wait_ready(scheduler, req)
    assert len(files(tmp_path)) == 2  # staged in files, not in memory
    for index in (0, 1):
        assert scheduler.has_cache_item(req.mm_features[index].identifier)
        scheduler.update_state_after_alloc(req, index)
    meta = scheduler.build_connector_meta(None)
    assert all(load.tensor is None for load in meta.loads)
    assert len(pickle.dumps(meta)) < 4096
    worker.bind_connector_metadata(meta)
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(encoder_cache)
    from vllm.v1.outputs import ECConnectorOutput

    output = ECConnectorOutput(ec_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    for name, tensor in tensors.items():
        assert bit_exact(encoder_cache[name], tensor)
    assert len(files(tmp_path)) == 2  # in transit until the step's output comes back
    scheduler.update_connector_output(output)
    scheduler.request_finished(req)
    assert files(tmp_path) == []
    assert scheduler.live_state()["staged_bytes"] == 0


def test_a_stats_channel_of_a_dead_publisher_is_swept_and_a_live_ones_is_kept(
    tmp_path: Path,
) -> None:
    from ec_redis.connector import channel

    key = channel.channel_key("engine-a", 0)
    live = channel.Publisher(str(tmp_path), key, lambda: {"counters": {"saved_items": 1}})
    live.publish()
    dead_stem = f"{channel.CHANNEL_PREFIX}{key}-{os.getpid()}-0badf00d"
    (tmp_path / f"{dead_stem}{owners.LOCK_SUFFIX}").write_bytes(b"")
    for suffix in (".json", ".tmp"):  # a publisher killed mid-write leaves its .tmp too
        (tmp_path / f"{dead_stem}{suffix}").write_text("{}")
    channel.Reader(str(tmp_path), key)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, f"{live.name[: -len('.json')]}{owners.LOCK_SUFFIX}"]
    )
    live.close()
    assert list(tmp_path.iterdir()) == []


def test_engine_ids_that_differ_anywhere_get_different_channels() -> None:
    from ec_redis.connector.channel import channel_key

    long_id = "x" * 100
    assert channel_key("a.b", 0) != channel_key("a_b", 0)
    assert channel_key(long_id + "1", 0) != channel_key(long_id + "2", 0)
    assert channel_key("a", 0) != channel_key("a", 1)
