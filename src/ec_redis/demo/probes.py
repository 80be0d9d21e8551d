"""Encoder-pass probe: counts the images a LLaVA vision tower encodes, inside an engine's
worker — through ``LLM.apply_model`` (the functions are importable by module name, so this
also works when the worker is another process), or in a server through ``collective_rpc``
with ``EncoderPassProbe`` as vLLM's worker extension."""

from __future__ import annotations

from typing import Any

import torch
import xxhash

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


# Digests (xxh3-64, hex) of image embeddings as an engine's model saw them, in order: what
# its vision side produced (``embed_multimodal``) and what its language model was fed
# (``embed_input_ids``'s multimodal embeddings, wherever they came from: the vision tower,
# vLLM's encoder cache, or the connector).
_produced: list[str] = []
_fed: list[str] = []
_steps: list[int] = []  # tokens each forward step embedded (how vLLM split the work)


def record_embeddings(model: torch.nn.Module) -> None:
    """Digest every image embedding the model produces or is fed from now on."""
    vllm_model: Any = model  # vLLM's multimodal model interface
    if getattr(vllm_model, "_ec_redis_recorded", False):
        return
    produce, embed = vllm_model.embed_multimodal, vllm_model.embed_input_ids

    def embed_multimodal(**kwargs: object) -> Any:
        out = produce(**kwargs)
        _produced.extend(_digest(t) for t in _items(out))
        return out

    def embed_input_ids(*args: Any, **kwargs: Any) -> Any:
        mm = kwargs.get("multimodal_embeddings", args[1] if len(args) > 1 else None)
        _fed.extend(_digest(t) for t in _items(mm))
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        _steps.append(int(input_ids.shape[0]) if isinstance(input_ids, torch.Tensor) else -1)
        return embed(*args, **kwargs)

    vllm_model.embed_multimodal = embed_multimodal
    vllm_model.embed_input_ids = embed_input_ids
    vllm_model._ec_redis_recorded = True


def embeddings_seen(model: torch.nn.Module) -> tuple[list[str], list[str], list[int]]:
    """(produced, fed, steps): every digest, and every step's token count, recorded in this
    process since ``record_embeddings``."""
    return list(_produced), list(_fed), list(_steps)


def _items(embeddings: Any) -> list[torch.Tensor]:
    """One tensor per item: vLLM passes a list of them, or one tensor batching them."""
    if embeddings is None:
        return []
    return list(embeddings.unbind(0) if isinstance(embeddings, torch.Tensor) else embeddings)


def _digest(tensor: torch.Tensor) -> str:
    """xxh3-64 of a tensor's bytes with its dtype and shape (the same bytes seen as another
    shape are another embedding)."""
    flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    hasher = xxhash.xxh3_64(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    hasher.update(flat.numpy().data)
    return hasher.hexdigest()
