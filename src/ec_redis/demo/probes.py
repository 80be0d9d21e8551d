"""Encoder-pass probe: counts the images a LLaVA vision tower encodes, run inside an engine's
worker through ``LLM.apply_model`` (importable by module name, so it also works when the
worker is another process)."""

from __future__ import annotations

from typing import Any

import torch

_images_encoded = [0]


def count_encoder_passes(model: torch.nn.Module) -> None:
    """Count every image the vision tower encodes from now on (a forward pre-hook)."""
    tower: Any = model.vision_tower
    if getattr(tower, "_ec_redis_counted", False):
        return

    def count(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        pixels = args[0] if args else kwargs.get("pixel_values")
        _images_encoded[0] += len(pixels) if pixels is not None else 1

    tower.register_forward_pre_hook(count, with_kwargs=True)
    tower._ec_redis_counted = True


def images_encoded(model: torch.nn.Module) -> int:
    """Images encoded in this process since ``count_encoder_passes`` was applied."""
    return _images_encoded[0]
