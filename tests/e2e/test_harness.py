"""The e2e harness itself: equal runs are bit-identical, producer -> consumer works, models differ.

Uses vLLM's built-in ECExampleConnector (files on disk), so a failure here is the
harness's, not ec_redis's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e.harness import image_request, requires_vllm, run_engine, run_engines

pytestmark = requires_vllm

# Same text, different images: the prompts tokenize identically, so any logprob difference
# after the image comes from the image. Image 0 is keyed by its content hash; image 1 by a
# client uuid, which vLLM uses verbatim as its mm_hash (so the test can find its file).
IMAGE1_UUID = "harness-image-1"
REQUESTS = [image_request(image_seed=0), image_request(image_seed=1, uuid=IMAGE1_UUID)]
# Round 2 sends image 0 again, alone, to the same engine, through the chat template (which
# renders the same raw LLaVA prompt).
ROUNDS = [REQUESTS, [{"question": "What is shown in this image?", "image_seed": 0}]]


def spec(model: Path, ec_transfer_config: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "model": str(model),
        "ec_transfer_config": ec_transfer_config,
        "sampling": {"max_tokens": 4, "prompt_logprobs": 2},
        "rounds": ROUNDS,
    }


def example_connector(role: str, storage: Path) -> dict[str, Any]:
    return {
        "ec_connector": "ECExampleConnector",
        "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": str(storage)},
    }


@pytest.fixture(scope="module")
def ec_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ECExampleConnector's shared folder."""
    return tmp_path_factory.mktemp("ec_store")


@pytest.fixture(scope="module")
def runs(
    tiny_model: Path,
    other_tiny_model: Path,
    ec_store: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, dict[str, Any]]:
    """The independent engine runs, two at a time."""
    results = run_engines(
        {
            "baseline": spec(tiny_model),
            "baseline_again": spec(tiny_model),
            "other_model": spec(other_tiny_model),
            "producer": spec(tiny_model, example_connector("ec_producer", ec_store)),
        },
        tmp_path_factory.mktemp("runs"),
    )
    for name, result in results.items():
        assert result["shutdown_errors"] == [], name
        print(f"{name}: {result['timings_s']}")
    return results


def first_round(result: dict[str, Any]) -> list[dict[str, Any]]:
    rounds: list[list[dict[str, Any]]] = result["rounds"]
    return rounds[0]


def test_equal_runs_are_bit_identical(runs: dict[str, dict[str, Any]]) -> None:
    base, again = runs["baseline"], runs["baseline_again"]
    assert base["rounds"] == again["rounds"]
    img0, img1 = first_round(base)
    assert len(img0["token_ids"]) == 4
    assert img0["prompt_logprobs"][0] is None
    assert all(isinstance(lp, float) for lp in img0["prompt_logprobs"][1:])
    # The image reaches the LM: same tokens, different image, different logprobs.
    assert img0["prompt_token_ids"] == img1["prompt_token_ids"]
    assert img0["prompt_logprobs"] != img1["prompt_logprobs"]
    # A second round in the same engine, through the chat template, repeats the first.
    assert base["rounds"][1][0]["prompt_token_ids"] == img0["prompt_token_ids"]
    assert base["rounds"][1][0]["prompt_logprobs"] == img0["prompt_logprobs"]
    assert base["rounds"][1][0]["token_ids"] == img0["token_ids"]


def test_different_models_give_different_logprobs(runs: dict[str, dict[str, Any]]) -> None:
    base, other = first_round(runs["baseline"])[0], first_round(runs["other_model"])[0]
    assert base["prompt_token_ids"] == other["prompt_token_ids"]
    assert base["prompt_logprobs"] != other["prompt_logprobs"]


def test_example_connector_producer_to_consumer(
    runs: dict[str, dict[str, Any]], tiny_model: Path, ec_store: Path, tmp_path: Path
) -> None:
    saved = sorted(ec_store.glob("*/encoder_cache.safetensors"))
    assert len(saved) == 2, "the producer saves one encoder output per distinct image"
    # Spoil image 1's stored output: a consumer that really loads from the store must now
    # differ from the baseline on image 1 while matching it bit for bit on image 0.
    _spoil(ec_store / IMAGE1_UUID / "encoder_cache.safetensors")

    consumer = run_engine(
        spec(tiny_model, example_connector("ec_consumer", ec_store)), tmp_path, name="consumer"
    )
    print(f"consumer: {consumer['timings_s']}")
    assert consumer["shutdown_errors"] == []
    base_img0, base_img1 = first_round(runs["baseline"])
    img0, img1 = first_round(consumer)
    assert img0["prompt_logprobs"] == base_img0["prompt_logprobs"]
    assert img0["prompt_topk"] == base_img0["prompt_topk"]
    assert img0["token_ids"] == base_img0["token_ids"]
    assert consumer["rounds"][1][0]["prompt_logprobs"] == base_img0["prompt_logprobs"]
    assert img1["prompt_logprobs"] != base_img1["prompt_logprobs"]


def _spoil(path: Path) -> None:
    """Overwrite a stored encoder output with noise of the same shape and dtype."""
    tensor = load_file(path)["ec_cache"]
    noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(0))
    save_file({"ec_cache": noise.to(tensor.dtype)}, path)
