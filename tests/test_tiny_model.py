"""``ec_redis.demo.tiny_model``: the built model's file modes and its vision tower sizes (the
tests' tiny default, the demo's heavier one)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ec_redis.demo.tiny_model import (
    DEMO_TOWER,
    NUM_IMAGE_TOKENS,
    TINY_TOWER,
    VisionTower,
    build_tiny_llava,
    make_image,
)


def modes(model: Path) -> dict[str, int]:
    """Every entry of the model directory (itself included) and its permission bits."""
    entries = [model, *model.rglob("*")]
    return {str(e.relative_to(model.parent)): stat.S_IMODE(e.stat().st_mode) for e in entries}


@pytest.mark.vllm  # transformers comes with vLLM
def test_every_file_of_the_built_model_is_readable_by_other_users(tmp_path: Path) -> None:
    old_umask = os.umask(0o077)  # a strict umask must not hide the model either
    try:
        model = build_tiny_llava(tmp_path)
    finally:
        os.umask(old_umask)
    found = modes(model)
    assert f"{model.name}/model.safetensors" in found  # safetensors writes it 0600 itself
    expected = {name: 0o755 if (tmp_path / name).is_dir() else 0o644 for name in found}
    assert {k: oct(v) for k, v in found.items()} == {k: oct(v) for k, v in expected.items()}


@pytest.mark.vllm
def test_the_default_tower_is_the_tests_tiny_one(tmp_path: Path) -> None:
    model = build_tiny_llava(tmp_path)
    config = json.loads((model / "config.json").read_text())
    vision = config["vision_config"]
    assert model.name == "tiny-llava-s0"  # the name every e2e test builds and reuses
    assert (vision["num_hidden_layers"], vision["hidden_size"], vision["image_size"]) == (2, 64, 56)
    assert vision["intermediate_size"] == 128 and vision["num_attention_heads"] == 2
    assert config["image_seq_length"] == NUM_IMAGE_TOKENS == 16
    assert config["text_config"]["max_position_embeddings"] == 512
    assert make_image(0).size == (56, 56)


@pytest.mark.vllm
def test_another_tower_gets_its_own_directory_and_image_size(tmp_path: Path) -> None:
    tower = VisionTower(layers=3, width=128, image_size=112)  # small: a quick build
    default = build_tiny_llava(tmp_path)
    model = build_tiny_llava(tmp_path, vision_tower=tower)
    assert model.name == "tiny-llava-s0-v3x128p112" and model != default
    config = json.loads((model / "config.json").read_text())
    vision = config["vision_config"]
    assert (vision["num_hidden_layers"], vision["hidden_size"], vision["image_size"]) == (
        3,
        128,
        112,
    )
    assert vision["intermediate_size"] == 512
    assert vision["num_attention_heads"] == 4  # 2 heads per 64 of width, as in the default
    assert config["image_seq_length"] == tower.num_image_tokens == 64
    processor = json.loads((model / "processor_config.json").read_text())
    image_processor = processor["image_processor"]
    assert image_processor["crop_size"] == {"height": 112, "width": 112}
    assert image_processor["size"] == {"shortest_edge": 112}
    assert make_image(5, tower.image_size).size == (112, 112)
    assert make_image(5, 56).tobytes() == make_image(5).tobytes()  # same default images
    assert build_tiny_llava(tmp_path, vision_tower=tower) == model  # reused once built
    assert all(mode in (0o644, 0o755) for mode in modes(model).values())


def test_the_demo_tower_has_llava_15_image_shape_and_room_in_the_demo_engines() -> None:
    from ec_redis.demo import flow

    assert flow.VISION_TOWER == DEMO_TOWER != TINY_TOWER
    assert (DEMO_TOWER.image_size, DEMO_TOWER.num_image_tokens) == (336, 576)
    assert DEMO_TOWER.name_suffix == "-v12x768p336" and TINY_TOWER.name_suffix == ""
    spec = flow._spec(Path("/m"), None)
    assert spec["image_size"] == 336
    # room for the whole request: 576 image tokens, the question and the answer
    assert spec["llm_kwargs"]["max_model_len"] >= DEMO_TOWER.num_image_tokens + 64
    # vLLM's own encoder cache (max_num_batched_tokens) holds every image of the demo (the
    # warm-up's and the requests'), so the repeat is served from it
    images = {r.image_seed for r in (*flow.REQUESTS, flow.WARMUP)}
    budget = spec["llm_kwargs"]["max_num_batched_tokens"]
    assert budget >= DEMO_TOWER.num_image_tokens * len(images)
    assert DEMO_TOWER.describe() in flow.MODEL_SIZING and "ms per image" in flow.MODEL_SIZING
