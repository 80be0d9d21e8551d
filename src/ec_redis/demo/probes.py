"""Encoder-pass probe: counts the images a LLaVA vision tower encodes, inside an engine's
worker — through ``LLM.apply_model`` (the functions are importable by module name, so this
also works when the worker is another process), or in a server through ``collective_rpc``
with ``EncoderPassProbe`` as vLLM's worker extension."""

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


class EncoderPassProbe:
    """The probe as a vLLM worker extension, for servers: start one with
    ``--worker-extension-cls ec_redis.demo.probes.EncoderPassProbe`` (and, to reach it over
    HTTP, ``VLLM_SERVER_DEV_MODE=1``), then ``POST /collective_rpc`` with
    ``{"method": "ec_redis_count_encoder_passes"}`` once and ``{"method":
    "ec_redis_images_encoded"}`` whenever: one count per rank. vLLM mixes this class into
    its worker class, which provides ``get_model``."""

    def ec_redis_count_encoder_passes(self) -> None:
        worker: Any = self  # vLLM's worker, which this class is mixed into
        count_encoder_passes(worker.get_model())

    def ec_redis_images_encoded(self) -> int:
        return _images_encoded[0]
