"""``ec-redis demo``: the README's first command — three real vLLM engines on an embedded
Redis — its report, and the quick ``--hooks-only`` walk."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ec_redis.demo import probes
from ec_redis.demo.report import build_report, render
from ec_redis.demo.tiny_model import DEMO_TOWER, build_tiny_llava
from tests.counters import count

# One real demo run takes about 70 s on a busy 2-core machine (its vision tower costs a few
# hundred ms per image); the bound is generous.
DEMO_TIMEOUT_S = 600


def ec_redis(*args: str, timeout_s: float = DEMO_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ec_redis.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One real demo run on the embedded Redis it starts itself: (JSON report, stderr)."""
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    out = ec_redis("demo", "--json", "--run-dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-4000:]
    report: dict[str, Any] = json.loads(out.stdout)
    return report, out.stderr


@pytest.mark.vllm
@pytest.mark.redis
@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_pd_answers_like_the_baseline_with_embeddings_from_redis(
    demo: tuple[dict[str, Any], str],
) -> None:
    report, stderr = demo
    assert report["mode"] == "engines"
    first, second, repeat = report["requests"]
    # PD's language model was fed, bit for bit, what the encoder engine computed and what the
    # baseline computed itself (digests taken inside each engine's model).
    for row in report["requests"]:
        check = row["embedding"]
        assert check["fed"] and check["same_as_baseline"] and check["from_encoder"], row
        pd_steps, baseline_steps = check["steps"]  # the gate holds a request whole: same split
        assert pd_steps == baseline_steps and len(pd_steps) >= 2, row
    assert [r["identical"] for r in report["requests"]] == [True, True, True]
    for row in (first, second):  # new images: the encoder saved them, PD loaded them
        assert row["encoder"] == {"encoder_passes": 1, "saved_items": 1}
        assert row["pd"]["tier"] == "redis" and row["pd"]["loaded_items"] == 1
        assert row["pd"]["encoder_passes"] == 0
        assert row["baseline"]["encoder_passes"] == 1  # the probe does count real passes
    assert second["uuid"] == "demo-image-b"
    # The repeat: PD's CPU tier had it from request 1 and vLLM still held it itself.
    assert repeat["image_seed"] == first["image_seed"]
    assert repeat["pd"]["tier"] == "cpu" and repeat["pd"]["encoder_passes"] == 0
    assert repeat["baseline"]["encoder_passes"] == 0  # vLLM's encoder cache holds 3 images
    assert count(report["pd_connector_totals"]["scheduler"], "local_fallbacks") == 0
    assert all(r["pd"]["ttft_s"] > 0 and r["baseline"]["ttft_s"] > 0 for r in report["requests"])
    # The demo's vision tower costs a few hundred ms per image on a CPU: loading a new image's
    # embedding from Redis reaches the first token sooner than running the tower.
    for row in (first, second):
        assert row["pd"]["ttft_s"] < row["baseline"]["ttft_s"], row
    assert Path(report["model"]).name == f"tiny-llava-s0{DEMO_TOWER.name_suffix}"
    assert "sized to cost" in report["model_sizing"] and report["model_sizing"] in stderr
    assert all(e["shutdown_errors"] == [] for e in report["engines"].values())
    # It said which Redis it used, showed engine progress and left vLLM's logs in files.
    assert "embedded" in stderr and "pd: engine ready" in stderr
    for name in ("encoder", "baseline", "pd"):
        log = Path(report["run_dir"]) / name / "engine.log"
        assert "LlavaForConditionalGeneration" in log.read_text()  # vLLM's own lines
    assert "bit-identical" in stderr


@pytest.mark.vllm
@pytest.mark.redis
def test_hooks_only_drives_the_connector_hooks_through_redis(redis_url: str) -> None:
    out = ec_redis("demo", "--hooks-only", "--redis-url", redis_url, "--json", timeout_s=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["mode"] == "connector" and len(report["items"]) == 2
    assert report["pd_counters"]["hits_redis"] == 2  # the PD side read both from Redis
    assert "PD took 2 of 2 items from Redis" in out.stderr
    assert "misses" not in out.stderr  # no unexplained counters


def fake_results() -> dict[str, dict[str, Any]]:
    """Engine results shaped like ``ec_redis.demo.engine``'s, for one request."""
    output = {"prompt_token_ids": [1, 4, 9], "prompt_logprobs": [None, -1.5, -0.25],
              "prompt_topk": [None, [[4, -1.5]], [[9, -0.25]]], "token_ids": [7, 7],
              "text": "ok", "ttft_s": 0.02, "wall_s": 0.03}  # fmt: skip
    counters = {
        "encoder": {"worker": {"saved_items": 1}},
        "baseline": {},
        "pd": {"scheduler": {"hits_redis": 1}, "worker": {"loaded_items": 1}},
    }
    passes = {"encoder": 1, "baseline": 1, "pd": 0}
    # The image embedding's digest: the encoder and the baseline each computed it, the
    # baseline's LM and PD's (from Redis) were fed it; the encoder-only engine has no LM.
    embeddings = {
        "encoder": {"produced": "e1", "fed": None, "steps": []},
        "baseline": {"produced": "e1", "fed": "e1", "steps": [3, 1]},
        "pd": {"produced": None, "fed": "e1", "steps": [3, 1]},
    }
    results = {}
    for name in ("encoder", "baseline", "pd"):
        request = {**copy.deepcopy(output), "encoder_passes": passes[name]}
        results[name] = {
            "requests": [{**request, "counters": counters[name], "embeddings": embeddings[name]}],
            "connector_totals": {},
            "engine_start_s": 1.0,
            "total_s": 2.0,
            "shutdown_errors": [],
        }
    return results


REQUEST = {"label": "image A", "image_seed": 0, "question": "?", "uuid": None}


def test_the_report_says_where_pd_got_each_embedding() -> None:
    report = build_report(fake_results(), [REQUEST])
    row = report["requests"][0]
    assert row["identical"] and report["all_identical"]
    assert row["pd"]["tier"] == "redis" and row["pd"]["served_by"] == "connector (redis tier)"
    text = "\n".join(render({**report, "wall_s": 1.0, "run_dir": "/tmp/x"}))
    assert (
        "PD ran its vision encoder 0 times for 1 image request: 1 embedding came from Redis" in text
    )
    assert "bit-identical" in text


def test_the_report_says_what_the_cache_saved_and_how_the_model_was_sized() -> None:
    results = fake_results()
    results["pd"]["requests"][0]["ttft_s"] = 0.05
    results["baseline"]["requests"][0]["ttft_s"] = 0.3
    report = build_report(results, [REQUEST])
    sizing = "vision tower: 12-layer CLIP, sized to cost ~250 ms per image"
    lines = render({**report, "wall_s": 1.0, "run_dir": "/tmp/x", "model_sizing": sizing})
    text = " ".join(" ".join(lines).split())  # the summary's wrapped lines, as one
    assert "Time to first token for the images PD took from Redis (request 1), median: PD " in text
    assert "50.0 ms with the cache, baseline 300.0 ms" in text and "250.0 ms saved" in text
    assert f"Model: {sizing}." in text
    results["pd"]["requests"][0]["ttft_s"] = 0.4  # slower: said so, not hidden
    lines = render({**build_report(results, [REQUEST]), "wall_s": 1.0, "run_dir": "/x"})
    text = " ".join(" ".join(lines).split())
    assert "PD was not faster this time" in text and "Model:" not in text


@pytest.mark.parametrize("field", ["prompt_logprobs", "prompt_topk", "token_ids"])
def test_the_report_flags_a_pd_output_that_differs_from_the_baseline(field: str) -> None:
    results = fake_results()
    pd_output = results["pd"]["requests"][0]
    if field == "token_ids":
        pd_output["token_ids"] = [7, 8]
    else:
        pd_output[field][2] = -0.5 if field == "prompt_logprobs" else [[9, -0.5]]
    report = build_report(results, [REQUEST])
    assert not report["requests"][0]["identical"] and report["all_identical"] is False
    text = "\n".join(render({**report, "wall_s": 1.0, "run_dir": "/tmp/x"}))
    assert "PROBLEM: PD's output differs from the baseline's for request(s) 1" in text


@pytest.mark.parametrize(
    ("encoder_made", "baseline_fed", "pd_fed", "pd_steps", "said"),
    [
        # PD's LM got the baseline's embedding: the outputs parted in the engines' arithmetic
        ("e1", "e1", "e1", [3, 1], "fed the baseline's image embedding bit for bit"),
        ("e1", "e1", "e1", [3, 1], "Both ran the same steps (tokens per step: [3, 1])"),
        ("e1", "e1", "e1", [1, 2, 1], "tokens per step: PD [1, 2, 1], baseline [3, 1]"),
        # PD got the encoder's embedding, which is not the one the baseline computed
        ("e1", "b1", "e1", [3, 1], "the two engines' vision towers did not compute the same"),
        # PD got bytes the encoder did not compute for this image: the cache's defect
        ("e1", "e1", "x9", [3, 1], "the cache delivered a wrong tensor"),
        # Nothing to compare with: said so, never blamed on anyone
        ("e1", "e1", None, [3, 1], "no image embedding was seen entering PD's or the baseline"),
        ("e1", None, "e1", [3, 1], "no image embedding was seen entering PD's or the baseline"),
        (None, "e1", "x9", [3, 1], "computed nothing for this image to compare them with"),
    ],
)
def test_the_report_says_where_a_differing_output_parted_from_the_baseline(
    encoder_made: str | None,
    baseline_fed: str | None,
    pd_fed: str | None,
    pd_steps: list[int],
    said: str,
) -> None:
    results = fake_results()
    results["pd"]["requests"][0]["token_ids"] = [7, 8]
    results["encoder"]["requests"][0]["embeddings"]["produced"] = encoder_made
    results["baseline"]["requests"][0]["embeddings"]["fed"] = baseline_fed
    results["pd"]["requests"][0]["embeddings"].update(fed=pd_fed, steps=pd_steps)
    report = build_report(results, [REQUEST])
    check = report["requests"][0]["embedding"]
    seen = pd_fed is not None and baseline_fed is not None
    assert check["same_as_baseline"] == (seen and pd_fed == baseline_fed)
    assert check["from_encoder"] == (pd_fed is not None and pd_fed == encoder_made)
    assert check["steps"] == [pd_steps, [3, 1]]
    text = " ".join(" ".join(render({**report, "wall_s": 1.0, "run_dir": "/x"})).split())
    assert "Request 1: " in text and said in text


def test_the_embedding_of_another_image_is_the_caches_defect() -> None:
    """PD fed image A's embedding (which the encoder did compute, for request 1) in request 2,
    for image B: a mix-up, never blamed on the vision towers. The repeat of A (request 3,
    not encoded again) is compared with what the encoder computed for A."""
    requests = [
        REQUEST,
        {**REQUEST, "label": "image B", "image_seed": 1},
        {**REQUEST, "label": "image A again"},
    ]
    results = fake_results()
    for name in results:
        one = results[name]["requests"][0]
        results[name]["requests"] = [copy.deepcopy(one) for _ in requests]
    encoder, baseline, pd = (results[n]["requests"] for n in ("encoder", "baseline", "pd"))
    encoder[1]["embeddings"]["produced"], baseline[1]["embeddings"]["fed"] = "b1", "b1"
    encoder[2]["embeddings"]["produced"] = None  # had it already
    pd[1]["embeddings"]["fed"] = "e1"  # A's bytes for B
    pd[1]["token_ids"] = [7, 8]
    report = build_report(results, requests)
    checks = [r["embedding"] for r in report["requests"]]
    assert [(c["same_as_baseline"], c["from_encoder"]) for c in checks] == [
        (True, True),
        (False, False),
        (True, True),
    ]
    text = " ".join(" ".join(render({**report, "wall_s": 1.0, "run_dir": "/x"})).split())
    assert "Request 2: PD's language model was fed other bytes than the encoder" in text
    assert "vision towers" not in text


class _FakeModel:
    """vLLM's two multimodal model methods, as the probe wraps them."""

    def __init__(self, item: torch.Tensor) -> None:
        self.item = item

    def embed_multimodal(self, **kwargs: object) -> list[torch.Tensor]:
        return [self.item.clone()]

    def embed_input_ids(
        self, input_ids: torch.Tensor, multimodal_embeddings: Any = None, **kwargs: Any
    ) -> torch.Tensor:
        return torch.zeros(len(input_ids))


@pytest.mark.parametrize("splits", [[576], [305, 271], [505, 71], [1, 574, 1]])
def test_the_probe_digests_an_embedding_fed_in_pieces_as_the_whole(splits: list[int]) -> None:
    """A prefill split inside an image feeds its embedding in slices: the digest of what was
    fed is the digest of what was produced, however it was cut; other bytes, or the same
    bytes as another dtype, digest differently."""
    item = torch.randn(576, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    model = _FakeModel(item)
    probes.record_embeddings(model)  # type: ignore[arg-type]
    probes.begin_request(model)  # type: ignore[arg-type]
    model.embed_multimodal()
    start = 0
    for rows in splits:
        piece = item[start : start + rows]
        model.embed_input_ids(torch.zeros(rows + 2, dtype=torch.long), [piece])
        start += rows
    seen = probes.request_seen(model)  # type: ignore[arg-type]
    assert seen["produced"] is not None and seen["fed"] == seen["produced"]
    assert seen["steps"] == [rows + 2 for rows in splits]
    for other in (item.clone().index_fill_(0, torch.tensor([575]), 0), item.view(torch.float16)):
        probes.begin_request(model)  # type: ignore[arg-type]
        model.embed_input_ids(torch.zeros(1, dtype=torch.long), [other])
        assert probes.request_seen(model)["fed"] not in (None, seen["produced"])  # type: ignore[arg-type]
    probes.begin_request(model)  # type: ignore[arg-type]
    assert probes.request_seen(model) == {"produced": None, "fed": None, "steps": []}  # type: ignore[arg-type]


def test_the_demo_kit_imports_without_vllm_transformers_or_pillow() -> None:
    code = (
        "import sys\n"
        "for name in ('vllm', 'transformers', 'tokenizers', 'PIL'):\n"
        "    sys.modules[name] = None\n"
        "import ec_redis.demo.tiny_model, ec_redis.demo.probes, ec_redis.demo.engine\n"
        "import ec_redis.demo.launcher, ec_redis.demo.flow, ec_redis.demo.report\n"
        "import ec_redis.demo.hooks\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.vllm  # transformers comes with vLLM
def test_the_tiny_model_takes_head_counts_for_tensor_parallel(tmp_path: Path) -> None:
    default = build_tiny_llava(tmp_path)
    stale = tmp_path / "tiny-llava-s0-h4kv2"
    stale.mkdir()
    (stale / "leftover").write_text("an interrupted build of long ago")
    wide = build_tiny_llava(tmp_path, num_attention_heads=4, num_key_value_heads=2)
    assert default.name == "tiny-llava-s0" and wide == stale
    assert not (wide / "leftover").exists()  # replaced whole, never built into
    shapes = {}
    for model in (default, wide):
        config = json.loads((model / "config.json").read_text())
        text, vision = config["text_config"], config["vision_config"]
        shapes[model.name] = (
            text["num_attention_heads"],
            text["num_key_value_heads"],
            vision["num_attention_heads"],
        )
    # The default shape is the one every e2e baseline is built from.
    assert shapes == {"tiny-llava-s0": (2, 1, 2), "tiny-llava-s0-h4kv2": (4, 2, 4)}
    assert build_tiny_llava(tmp_path) == default  # a finished build is reused
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llava-s0", "tiny-llava-s0-h4kv2"]
