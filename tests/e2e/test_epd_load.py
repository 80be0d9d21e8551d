"""EPD under load, in vLLM's default layout: an encoder (``ec_producer``) and a PD server
(``ec_consumer``), each with its worker in its own process, behind ``python -m
ec_redis.proxy``, loaded by vLLM's own benchmark client (``random-mm``: 40 requests of two new
images each, 8 in flight), with a real Redis between them.

1. Every item the encoder published reaches PD: no local encode on PD, one Redis hit per
   image, not one lookup that found nothing (before the fix, up to 16 of 80 images per run waited
   out ``consumer_wait_s``, with thousands of waits: the encoder's background write trailed
   its answer by up to 10 s; docs/benchmarks.md).
2. Every ec_redis counter on both servers' ``/metrics`` equals what happened, counted once:
   saves and bytes against the images sent, bytes written against Redis's own account of
   the stored values, histogram counts against the operations they time, gauges back to 0.
3. The Grafana dashboard on a real Prometheus scraping both servers: every expression returns
   data, and the hit-rate panel shows the hits and local encodes that happened.

The servers (about 2 minutes to start on two busy cores) and the load run are shared by the
tests of this module.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from ec_redis.embedded import EmbeddedRedis, free_port
from tests.conftest import emptied
from tests.e2e.harness import (
    DEFAULT_LAYOUT_ENV,
    ApiServer,
    CommandServer,
    requires_vllm,
    stop_servers,
    wait_healthy,
)
from tests.e2e.load import Load, Metrics, run_benchmark
from tests.e2e.prometheus import (
    INSTALL_HINT,
    PROMETHEUS,
    REQUIRED,
    Prometheus,
    dashboard_targets,
    finite,
    grafana_expr,
)
from tests.e2e.prometheus import scrape_config as prometheus_config

# Servers, a 40-request load and Prometheus: minutes, not the default 300 s per test.
pytestmark = [*requires_vllm, pytest.mark.redis, pytest.mark.timeout(1200)]

EC_CONNECTOR = {
    "ec_connector": "ECRedisConnector",
    "ec_connector_module_path": "ec_redis.connector",
}
IMAGES = 2  # per request; the servers allow two (the harness's default is one)
LOAD = Load(num_prompts=40, images=IMAGES, concurrency=8, seed=1000)
ROWS, WIDTH, BF16_BYTES = 16, 128, 2  # one tiny-LLaVA image embedding
ITEM_BYTES = ROWS * WIDTH * BF16_BYTES
METRICS_SETTLE_S = 30  # generous bound on a counter reaching /metrics after the response


@dataclass
class Epd:
    encoder: ApiServer
    pd: ApiServer
    proxy: CommandServer
    model: Path
    redis_server: EmbeddedRedis
    work: Path


@pytest.fixture(scope="module")
def epd(
    redis_server: EmbeddedRedis, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Epd]:
    """Encoder and PD (vLLM's default layout, two images per prompt) and the proxy."""
    work = tmp_path_factory.mktemp("epd_load")
    # consumer_wait_s: the default 5 s. EC_REDIS_EPD_EXTRA (JSON) adds keys, for the
    # before/after runs of docs/benchmarks.md (e.g. the old write path).
    extra = {
        "redis_url": redis_server.url,
        **json.loads(os.environ.get("EC_REDIS_EPD_EXTRA", "{}")),
    }
    limit = ("--limit-mm-per-prompt", json.dumps({"image": IMAGES}))
    started: list[ApiServer] = []

    def server(name: str, role: str) -> ApiServer:
        ec = {**EC_CONNECTOR, "ec_role": role, "ec_connector_extra_config": extra}
        started.append(
            ApiServer(name, tiny_model, work, ec, extra_args=limit, env=DEFAULT_LAYOUT_ENV)
        )
        return started[-1]

    try:
        encoder = server("encoder", "ec_producer")
        pd = server("pd", "ec_consumer")
        ready = wait_healthy(started, timeout_s=400)
        port = free_port()
        proxy_cmd = [
            sys.executable, "-m", "ec_redis.proxy",
            "--encoder-url", encoder.url, "--pd-url", pd.url, "--port", str(port),
        ]  # fmt: skip
        proxy = CommandServer("proxy", proxy_cmd, port, work)
        started.append(proxy)
        wait_healthy([proxy], timeout_s=60)
        print(f"servers healthy after (s): {ready}")
        yield Epd(encoder, pd, proxy, tiny_model, redis_server, work)
    finally:
        stop_servers(started)


def settled(server: ApiServer, before: Metrics, name: str, expected: float) -> Metrics:
    """Scrape until ``name`` moved by ``expected`` since ``before`` (or the bound passed);
    then once more a second later, so a late second report would show as a surplus."""
    deadline = time.monotonic() + METRICS_SETTLE_S
    while True:
        now = Metrics.scrape(server.url)
        if now.ec(name) - before.ec(name) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.0)
    return Metrics.scrape(server.url)


@dataclass
class LoadRun:
    result: dict[str, Any]  # vLLM's benchmark client's result JSON
    encoder: dict[str, float]  # ec_redis series: change during the run
    pd: dict[str, float]
    encoder_after: Metrics
    pd_after: Metrics
    stored_keys: int  # Redis's own account, after the run
    stored_bytes: int
    set_calls: int
    publish_calls: int


@pytest.fixture(scope="module")
def load_run(epd: Epd) -> LoadRun:
    """One load of new images through the proxy, on an emptied Redis."""
    client = redis.Redis.from_url(emptied(epd.redis_server))
    try:
        client.config_resetstat()
        encoder_before, pd_before = Metrics.scrape(epd.encoder.url), Metrics.scrape(epd.pd.url)
        started = time.monotonic()
        result = run_benchmark(epd.proxy.url, epd.model, LOAD, epd.work / "bench")
        images = LOAD.num_images
        encoder_after = settled(epd.encoder, encoder_before, "saved_items_total", images)
        pd_after = settled(epd.pd, pd_before, "loaded_items_total", images)
        keys = list(client.scan_iter(count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        stored_bytes = sum(pipe.execute())
        stats = client.info("commandstats")
        print(
            f"load: {result['completed']} completed, {result['failed']} failed in "
            f"{time.monotonic() - started:.1f} s; TTFT p50 {result['p50_ttft_ms']:.0f} ms, "
            f"p99 {result['p99_ttft_ms']:.0f} ms"
        )
        return LoadRun(
            result=result,
            encoder=encoder_after.minus(encoder_before),
            pd=pd_after.minus(pd_before),
            encoder_after=encoder_after,
            pd_after=pd_after,
            stored_keys=len(keys),
            stored_bytes=stored_bytes,
            set_calls=int(stats.get("cmdstat_set", {}).get("calls", 0)),
            publish_calls=int(stats.get("cmdstat_publish", {}).get("calls", 0)),
        )
    finally:
        client.close()


def ec(deltas: dict[str, float], name: str) -> float:
    """The change of ``vllm:ec_redis_<name>``; a series missing from /metrics fails."""
    series = f"vllm:ec_redis_{name}"
    assert series in deltas, f"{series} is not on /metrics (there: {sorted(deltas)})"
    return deltas[series]


def test_every_item_the_encoder_published_reaches_pd_under_load(load_run: LoadRun) -> None:
    images = LOAD.num_images
    result, pd, encoder = load_run.result, load_run.pd, load_run.encoder
    shown = "saved_items save_wait_timeouts hits_redis misses local_fallbacks loaded_items waits"
    seen = {  # (encoder, PD), for the failure messages
        name: (ec(encoder, f"{name}_total"), ec(pd, f"{name}_total")) for name in shown.split()
    }
    print(f"counters (encoder, PD): {seen}")  # with -s: the figures of docs/benchmarks.md
    assert result["completed"] == LOAD.num_prompts and result["failed"] == 0, result["errors"]
    assert load_run.stored_keys == images, seen  # every image published ...
    assert ec(pd, "local_fallbacks_total") == 0, seen  # ... and PD encoded none itself
    assert ec(pd, "hits_redis_total") == images, seen
    assert ec(pd, "loaded_items_total") == images, seen
    assert ec(encoder, "save_wait_timeouts_total") == 0, seen  # each write beat the answer
    # No polling for items that were not there: every lookup PD made found its item (each
    # look that finds nothing is a miss, so an item lost or late shows here, however fast
    # or slow the machine). Not a bound on ``waits``: those count steps spent waiting for a
    # lookup in flight, which a busy machine (the CI's background image build) multiplies.
    assert ec(pd, "misses_total") == 0, seen


def test_every_counter_on_metrics_tells_what_happened_exactly_once(load_run: LoadRun) -> None:
    """Worker-side counters (saves, loads, bytes, queue, latencies) come from worker processes
    through the scheduler half: each must equal what happened, neither lost nor doubled."""
    images, requests_sent = LOAD.num_images, LOAD.num_prompts
    encoder, pd = load_run.encoder, load_run.pd
    # Encoder: what it saved, and what reached Redis by Redis's own account.
    assert ec(encoder, "saved_items_total") == images
    assert ec(encoder, "saved_bytes_total") == images * ITEM_BYTES
    assert load_run.stored_keys == images  # one self-describing entry per image, no lease left
    # Each written once, and claimed once (single flight: the claim script's SET of the
    # lease, which the write then deletes).
    assert load_run.set_calls == 2 * images
    assert ec(encoder, "lease_claims_total") == images
    assert load_run.publish_calls == images  # and announced once
    assert ec(encoder, "redis_written_bytes_total") == load_run.stored_bytes
    assert load_run.encoder_after.ec("write_queue_depth") == 0
    assert ec(encoder, "save_seconds_count") == images  # one observation per save
    assert ec(encoder, "item_mb_count") == images
    assert ec(encoder, "item_mb_sum") == pytest.approx(images * ITEM_BYTES / 1e6)
    assert ec(encoder, "fetch_seconds_count") == requests_sent  # one head check per request
    for name in ("write_drops_total", "redis_write_errors_total", "redis_errors_total"):
        assert ec(encoder, name) == 0, name
    # The writes ran on the encoder's writer thread (writer_process is off by default).
    names = ("process_starts", "process_deaths", "fallback_writes", "handed_over_writes")
    writer = {n: load_run.encoder_after.ec(f"writer_{n}_total") for n in names}
    print(f"encoder writer: {writer}")
    if os.environ.get("EC_REDIS_EPD_EXTRA") is None:
        assert writer == {
            "process_starts": 0, "process_deaths": 0, "fallback_writes": 0,
            "handed_over_writes": 0,
        }  # fmt: skip
    assert ec(encoder, "skipped_encodes_total") == 0  # the images were new
    # PD: what it loaded, from where, and how long the loads took.
    assert ec(pd, "hits_redis_total") == images
    assert ec(pd, "hits_cpu_total") == ec(pd, "hits_gpu_total") == 0
    assert ec(pd, "loaded_items_total") == images
    assert ec(pd, "loaded_bytes_total") == images * ITEM_BYTES
    assert ec(pd, "item_mb_count") == images
    # One load_seconds observation per step that loaded something: at most one per image,
    # at least one per step's worth (up to max_num_seqs=4 requests of two images).
    assert math.ceil(images / 8) <= ec(pd, "load_seconds_count") <= images
    # One batched lookup per request, plus one per look again at a missing item.
    assert requests_sent <= ec(pd, "fetch_seconds_count") <= requests_sent + ec(pd, "misses_total")
    assert ec(pd, "local_fallbacks_total") == 0
    for name in ("rejected_items_total", "bad_blobs_total", "internal_errors_total"):
        assert ec(pd, name) == 0 and ec(encoder, name) == 0, name
    assert load_run.pd_after.ec("staged_bytes") == load_run.pd_after.ec("reserved_bytes") == 0


# -- the dashboard on a real Prometheus ------------------------------------------------------

requires_prometheus = pytest.mark.skipif(
    PROMETHEUS is None and not REQUIRED, reason=f"needs the prometheus binary ({INSTALL_HINT})"
)
SCRAPE_S = 1


@requires_prometheus
def test_every_dashboard_query_returns_data_on_a_real_prometheus(epd: Epd, tmp_path: Path) -> None:
    """Prometheus scrapes both servers every second while images go through the proxy (Redis
    hits on PD) and straight to PD (never published: PD waits, then encodes them)."""
    assert PROMETHEUS is not None, f"EC_REDIS_REQUIRE_PROMETHEUS=1 but no binary ({INSTALL_HINT})"
    targets = {"encoder": epd.encoder.url, "pd": epd.pd.url}
    config = prometheus_config(
        {role: url.removeprefix("http://") for role, url in targets.items()}, "epd", SCRAPE_S
    )
    prometheus = Prometheus(config, tmp_path / "prometheus")
    try:
        prometheus.wait_ready()
        deadline = time.monotonic() + 60
        while len(finite(prometheus.query('up{job="vllm"} == 1', time.time()))) < 2:
            assert time.monotonic() < deadline, f"targets not up\n{prometheus.server.log_tail()}"
            time.sleep(0.5)
        time.sleep(3 * SCRAPE_S)  # samples from before the traffic
        start = time.time()
        pd_before = Metrics.scrape(epd.pd.url)
        hits = Load(num_prompts=8, images=IMAGES, concurrency=4, seed=2000)
        misses = Load(num_prompts=2, images=1, concurrency=2, seed=3000)
        done = run_benchmark(epd.proxy.url, epd.model, hits, tmp_path / "hits")
        assert done["failed"] == 0
        done = run_benchmark(epd.pd.url, epd.model, misses, tmp_path / "misses")
        assert done["failed"] == 0
        pd_after = settled(epd.pd, pd_before, "loaded_items_total", hits.num_images)
        served = pd_after.ec("hits_redis_total") - pd_before.ec("hits_redis_total")
        encoded = pd_after.ec("local_fallbacks_total") - pd_before.ec("local_fallbacks_total")
        assert (served, encoded) == (hits.num_images, misses.num_images)
        time.sleep(3 * SCRAPE_S)  # Prometheus has the final values
        end = time.time()
        range_s = math.ceil(end - start) + 3 * SCRAPE_S

        empty = []
        for title, panel, target in dashboard_targets():
            expr = grafana_expr(target["expr"], range_s, SCRAPE_S)
            if target.get("instant"):
                result = prometheus.query(expr, end)
            else:
                result = prometheus.query_range(expr, start - 3 * SCRAPE_S, end, SCRAPE_S)
            if not finite(result):
                empty.append(f"{title} / {target['legendFormat']}: {expr}")
            if panel["id"] == 3:  # "Hit rate over the time range", per role
                rates = {s["metric"].get("role"): finite([s])[-1] for s in result}
                assert set(rates) == {"pd"}, rates  # the encoder needs nothing: no value
                assert rates["pd"] == pytest.approx(served / (served + encoded), abs=0.01)
            if panel["id"] == 2 and target["legendFormat"].startswith("redis"):
                share = finite(result)
                assert share and max(share) == pytest.approx(1.0) and min(share) >= 0, share
        assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    finally:
        prometheus.stop()
