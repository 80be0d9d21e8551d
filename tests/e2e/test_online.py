"""The online shape: a baseline, an encoder and a PD OpenAI server, with a real Redis between.

Emulates vLLM's EPD proxy (``disagg_epd_proxy.py``): each chat request goes to the encoder
server (an ``ec_producer``, which only encodes and answers with no tokens), then to the PD
server (an ``ec_consumer``). PD's generated tokens and prompt logprobs must equal those of a
server without any EC connector, bit for bit, and PD's metrics must show that it took the
image embeddings from Redis instead of encoding them.

These servers run single-process engines (``SINGLE_PROCESS_ENV``: the worker shares the
engine core's process), a supported layout; ``test_online_default_layout.py`` runs vLLM's
default one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
import requests

from ec_redis.demo.tiny_model import image_data_url, make_image
from ec_redis.embedded import EmbeddedRedis
from tests.e2e.harness import (
    SINGLE_PROCESS_ENV,
    ApiServer,
    requires_vllm,
    stop_servers,
    wait_healthy,
)

pytestmark = [*requires_vllm, pytest.mark.redis]

EC_CONNECTOR = {
    "ec_connector": "ECRedisConnector",
    "ec_connector_module_path": "ec_redis.connector",
}
REQUEST_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def online_servers(
    redis_server: EmbeddedRedis, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ApiServer]]:
    """The three servers, started together once for this module's tests (in file order) and
    always stopped (process groups killed)."""
    tmp_path = tmp_path_factory.mktemp("online")
    extra = {"redis_url": redis_server.url}
    configs: dict[str, dict[str, Any] | None] = {
        "baseline": None,
        "encoder": {**EC_CONNECTOR, "ec_role": "ec_producer", "ec_connector_extra_config": extra},
        # A generous wait: on two busy cores the encoder's Redis write may land late.
        "pd": {
            **EC_CONNECTOR,
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": {**extra, "consumer_wait_s": 10},
        },
    }
    started: list[ApiServer] = []
    try:
        # All three at once: start-up is mostly single-threaded imports, and three at a time
        # on two cores is no slower in total than two and then one.
        for name, config in configs.items():
            started.append(
                ApiServer(
                    name, tiny_model, tmp_path, ec_transfer_config=config, env=SINGLE_PROCESS_ENV
                )
            )
        ready = wait_healthy(started, timeout_s=180)
        print(f"servers healthy after (s): {ready}")
        yield {server.name: server for server in started}
    finally:
        stop_servers(started)


def chat_request(model: Path, image_seed: int) -> dict[str, Any]:
    return {
        "model": str(model),
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image_url",
                        "image_url": {"url": image_data_url(make_image(image_seed))},
                    },
                    {"type": "text", "text": "What is shown in this image?"},
                ],
            }
        ],
        "temperature": 0,
        "max_tokens": 4,
        "seed": 0,
        "logprobs": True,
        "prompt_logprobs": 1,  # a vLLM extension of chat completions
        "return_token_ids": True,  # another: prompt_token_ids and the choice's token_ids
    }


def post_chat(server: ApiServer, body: dict[str, Any]) -> dict[str, Any]:
    response = requests.post(
        f"{server.url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S
    )
    assert response.status_code == 200, (
        f"{server.name}: HTTP {response.status_code}: {response.text[:2000]}\n{server.log_tail()}"
    )
    result: dict[str, Any] = response.json()
    return result


def comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """What must match between PD and the baseline (ids and timestamps never do)."""
    choice = answer["choices"][0]
    return {
        "prompt_token_ids": answer["prompt_token_ids"],
        "prompt_logprobs": answer["prompt_logprobs"],
        "token_ids": choice["token_ids"],
        "text": choice["message"]["content"],
        "logprobs": choice["logprobs"],
        "finish_reason": choice["finish_reason"],
        "usage": answer["usage"],
    }


def metric_total(server: ApiServer, name: str, **labels: str) -> float:
    """The sum over the label sets of ``name`` on the server's /metrics that carry every
    given label. A missing series fails rather than reading 0: every one the connector
    exports is there from the start."""
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    values = [
        float(m.group(2))
        for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
        if all(f'{key}="{value}"' in (m.group(1) or "") for key, value in labels.items())
    ]
    assert values, f"no series {name}{labels or ''} on {server.url}/metrics"
    return sum(values)


def wait_for(check: Any, timeout_s: float = 10) -> Any:
    """Poll ``check()`` until it returns a truthy value or the deadline passes; return it."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_encoder_then_pd_matches_baseline(
    online_servers: dict[str, ApiServer], redis_url: str, tiny_model: Path
) -> None:
    baseline, encoder, pd = (online_servers[n] for n in ("baseline", "encoder", "pd"))
    store = redis.Redis.from_url(redis_url)
    try:
        baselines = []
        for n, image_seed in enumerate((0, 1), start=1):
            body = chat_request(tiny_model, image_seed)
            # The proxy's order: the encoder answers once the image is encoded (no tokens;
            # its Redis write may still be in flight), then PD gets the same request at once.
            encoded = post_chat(encoder, body)
            assert encoded["usage"]["completion_tokens"] == 0, encoded
            disaggregated = comparable(post_chat(pd, body))
            expected = comparable(post_chat(baseline, body))
            baselines.append(expected)

            assert len(expected["token_ids"]) == 4
            assert expected["prompt_logprobs"][0] is None
            assert len(expected["prompt_logprobs"]) == len(expected["prompt_token_ids"])
            assert disaggregated == expected, f"image {image_seed}: PD differs from baseline"

            # One Redis entry per distinct image, written by the encoder (PD, a pure
            # consumer, never writes).
            assert wait_for(lambda n=n: store.dbsize() >= n) and store.dbsize() == n
            # vLLM 0.32's V1 runner drops worker-side connector stats; the connector's
            # scheduler half reports the worker half of its own process instead, and keeps a
            # producer-only engine stepping until its Redis writes drained.
            saved = wait_for(
                lambda n=n: metric_total(encoder, "vllm:ec_redis_saved_items_total") >= n
            )
            assert saved, f"encoder reports no save for image {image_seed}\n{encoder.log_tail()}"
            assert metric_total(encoder, "vllm:ec_redis_saved_items_total") == n
            assert wait_for(lambda: metric_total(encoder, "vllm:ec_redis_write_queue_depth") == 0)

            # PD took every image from Redis and encoded none itself. These counters come
            # from the connector's scheduler half, which vLLM polls every step.
            hits = wait_for(lambda n=n: metric_total(pd, "vllm:ec_redis_hits_redis_total") >= n)
            assert hits, f"PD has no Redis hit for image {image_seed}\n{pd.log_tail()}"
            assert metric_total(pd, "vllm:ec_redis_hits_redis_total") == n
            assert metric_total(pd, "vllm:ec_redis_local_fallbacks_total") == 0
            assert metric_total(pd, "vllm:ec_redis_rejected_items_total") == 0

        # The check is not vacuous: the two images really change the model's view.
        assert baselines[0]["prompt_token_ids"] == baselines[1]["prompt_token_ids"]
        assert baselines[0]["prompt_logprobs"] != baselines[1]["prompt_logprobs"]
        # Both writes landed and were reported (the engine kept stepping until they drained).
        # Here both connector halves share one process and one cache;
        # test_online_default_layout.py checks the same counters across processes.
        written = metric_total(encoder, "vllm:ec_redis_redis_written_bytes_total")
        assert written >= 2 * 16 * 128 * 2  # two 16x128 bf16 embeddings, plus headers
    finally:
        store.close()


def test_a_request_aborted_while_it_waits_leaves_pd_healthy(
    online_servers: dict[str, ApiServer], redis_url: str, tiny_model: Path
) -> None:
    """A client gives up on PD while PD waits for an image no encoder will ever publish:
    vLLM aborts the request mid-wait; PD keeps serving, correctly, and holds nothing."""
    baseline, encoder, pd = (online_servers[n] for n in ("baseline", "encoder", "pd"))
    fallbacks_before = metric_total(pd, "vllm:ec_redis_local_fallbacks_total")
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        abandoned = pool.submit(
            requests.post,
            f"{pd.url}/v1/chat/completions",
            json=chat_request(tiny_model, 5),
            timeout=4,  # PD would wait up to 10 s for the image
        )
        held = wait_for(lambda: metric_total(pd, "vllm:num_requests_waiting") == 1, timeout_s=3)
        assert held, f"PD never held the request\n{pd.log_tail()}"
        with pytest.raises(requests.exceptions.ReadTimeout):
            abandoned.result()
    # vLLM aborts the request when the client goes: it leaves PD's queue long before the
    # 10 s wait would have ended (and is never encoded or served).
    gone = wait_for(lambda: metric_total(pd, "vllm:num_requests_waiting") == 0, timeout_s=5)
    assert gone and time.monotonic() - started < 8, f"not aborted mid-wait\n{pd.log_tail()}"
    time.sleep(10)  # past the wait: an un-aborted request would now be encoded locally
    assert metric_total(pd, "vllm:ec_redis_local_fallbacks_total") == fallbacks_before
    assert requests.get(f"{pd.url}/health", timeout=10).status_code == 200

    hits_before = metric_total(pd, "vllm:ec_redis_hits_redis_total")
    body = chat_request(tiny_model, 6)
    post_chat(encoder, body)
    assert comparable(post_chat(pd, body)) == comparable(post_chat(baseline, body))
    assert wait_for(lambda: metric_total(pd, "vllm:ec_redis_hits_redis_total") > hits_before)
    # Nothing of the aborted request (or the served one) is still staged or reserved.
    assert wait_for(lambda: metric_total(pd, "vllm:ec_redis_staged_bytes") == 0)
    assert metric_total(pd, "vllm:ec_redis_reserved_bytes") == 0
