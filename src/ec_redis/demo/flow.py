"""``ec-redis demo``: three real vLLM engines on a tiny local model, an encoder and a
prefill/decode instance sharing encoder outputs through Redis, checked against a baseline.

The model is random-weight LLaVA-1.5 with a tiny LM but a vision tower of real cost
(``tiny_model.DEMO_TOWER``: 576 image tokens per 336 px image, a few hundred ms per image on
2 CPU cores), so PD, which loads each new image's embedding instead of running the tower,
reaches its first token sooner than the baseline, which runs the tower itself.

The engines — ``encoder`` (``ec_producer``), ``baseline`` (no connector) and ``pd``
(``ec_consumer``) — start side by side, each in its own process (vLLM's worker-side EC
connector is a process-wide singleton), then answer the same image requests one at a time,
taking turns so that only one engine works at any moment: the encoder answers everything
first (it saves every encoder output to Redis and flushes on exit), then the baseline and
PD alternate, request by request, so a busy machine slows both alike. Each engine answers
one warm-up image request first, so the times shown are those of a warm engine.
"""

from __future__ import annotations

import secrets
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ec_redis.demo import launcher
from ec_redis.demo.report import build_report, render
from ec_redis.demo.tiny_model import DEMO_TOWER, DEMO_TOWER_COST, build_tiny_llava
from ec_redis.redis_url import mask_url

Say = Callable[[str], None]
ENGINES_TIMEOUT_S = 1800  # start-up of three engines on a slow, shared 2-core machine


@dataclass(frozen=True)
class DemoRequest:
    label: str
    image_seed: int
    question: str
    uuid: str | None = None  # a client's multimodal uuid: vLLM then uses it as the mm_hash


REQUESTS = (
    DemoRequest("image A", 0, "What is shown in this image?"),
    DemoRequest("image B (uuid)", 1, "What is shown in this image?", "demo-image-b"),
    DemoRequest("image A again", 0, "Describe the image in one word."),  # another question
)
WARMUP = DemoRequest("warm-up", 99, "What is shown in this image?")
MAX_TOKENS = 4
VISION_TOWER = DEMO_TOWER
# How the model was sized, in one line (said at the start and under the table).
MODEL_SIZING = (
    f"vision tower: {VISION_TOWER.describe()}, sized to cost {DEMO_TOWER_COST}, so the cache "
    "has something to save (LM: 2-layer Llama, 128 wide)"
)
# Over engine.DEFAULT_LLM_KWARGS (sized for the tests' 16-token images): room for 576 image
# tokens, the question and the answer; and, since vLLM sizes its own encoder cache by
# max_num_batched_tokens, room there for three images, so that a repeat is still served from
# it, as with the tests' model.
LLM_KWARGS = {"max_model_len": 1024, "max_num_batched_tokens": 2048}


def run(redis_url: str, run_dir: Path, say: Say) -> dict[str, Any]:
    """Run the demo against ``redis_url``, keeping models and logs under ``run_dir``;
    returns the report (see ``report.build_report``) after printing it through ``say``."""
    started = time.monotonic()
    namespace = f"demo-{secrets.token_hex(4)}"  # a fresh run never finds an older run's entries
    say(
        textwrap.fill(
            "ec-redis demo: an encoder engine saves image embeddings to Redis, a "
            "prefill/decode (PD) engine loads them instead of running its vision encoder, "
            "and a baseline engine without the connector shows what the answers must be.",
            width=100,
        )
    )
    say(f"  Redis: {mask_url(redis_url)} (namespace {namespace})")
    say(f"  files: {run_dir} (the model; each engine's vLLM log in <engine>/engine.log)")
    say(f"{launcher.stamp(started)}building a random-weight LLaVA-1.5 model (no download) ...")
    say(f"  model: {MODEL_SIZING}")
    model = build_tiny_llava(run_dir / "model", vision_tower=VISION_TOWER)
    size_mb = sum(f.stat().st_size for f in model.iterdir()) / 1e6
    say(f"{launcher.stamp(started)}model ready: {model} ({size_mb:.1f} MB)")

    extra = {"redis_url": redis_url, "namespace": namespace, "ttl_s": 3600}
    specs = {
        "encoder": _spec(model, _connector("ec_producer", extra)),
        "baseline": _spec(model, None),
        "pd": _spec(model, _connector("ec_consumer", extra)),
    }
    say(
        f"{launcher.stamp(started)}starting 3 vLLM engines side by side, 30-60 s on 2 cores: "
        "encoder (ec_producer), baseline (no connector), pd (ec_consumer)"
    )
    engines = [launcher.start(name, spec, run_dir) for name, spec in specs.items()]
    with launcher.Runner(engines, say, started, ENGINES_TIMEOUT_S) as runner:
        runner.wait_ready()
        results = {"encoder": runner.finish("encoder")}  # all saved and flushed to Redis
        for step in range(len(REQUESTS) + 1):  # 0: the warm-up
            runner.turn("baseline", step)
            runner.turn("pd", step)
        results.update(baseline=runner.finish("baseline"), pd=runner.finish("pd"))
    report = build_report(results, [asdict(r) for r in REQUESTS])
    report.update(
        redis_url=mask_url(redis_url),
        namespace=namespace,
        run_dir=str(run_dir),
        model=str(model),
        model_sizing=MODEL_SIZING,
        wall_s=time.monotonic() - started,
    )
    say("")
    for line in render(report):
        say(line)
    return report


def _spec(model: Path, ec_transfer_config: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "model": str(model),
        "ec_transfer_config": ec_transfer_config,
        "warmup": asdict(WARMUP),
        "requests": [asdict(r) for r in REQUESTS],
        "max_tokens": MAX_TOKENS,
        "image_size": VISION_TOWER.image_size,
        "llm_kwargs": LLM_KWARGS,
    }


def _connector(role: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "ec_connector": "ECRedisConnector",
        "ec_connector_module_path": "ec_redis.connector",
        "ec_role": role,
        "ec_connector_extra_config": extra,
    }
