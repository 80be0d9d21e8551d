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


class _Stream:
    """xxh3-64 of a sequence of tensors' bytes, in order: the same embedding bytes give the
    same digest however vLLM sliced them (a prefill split inside an image feeds it in
    pieces), and another dtype's bytes give another (the first tensor's dtype is hashed)."""

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_64()
        self.nbytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        flat = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        if self.nbytes == 0:
            self._hasher.update(str(tensor.dtype).encode())
        self._hasher.update(flat.numpy().data)
        self.nbytes += flat.numel()

    def digest(self) -> str | None:
        return self._hasher.hexdigest() if self.nbytes else None


# Per request (``begin_request`` starts one): the image embeddings the engine's vision side
# produced (``embed_multimodal``) and those its language model was fed (``embed_input_ids``:
# from the vision tower, vLLM's encoder cache or the connector alike), and the tokens each
# forward step embedded (how vLLM split the work).
_seen = {"produced": _Stream(), "fed": _Stream()}
_steps: list[int] = []


def record_embeddings(model: torch.nn.Module) -> None:
    """Follow every image embedding the model produces or is fed from now on."""
    vllm_model: Any = model  # vLLM's multimodal model interface
    if getattr(vllm_model, "_ec_redis_recorded", False):
        return
    produce, embed = vllm_model.embed_multimodal, vllm_model.embed_input_ids

    def embed_multimodal(**kwargs: object) -> Any:
        out = produce(**kwargs)
        for item in _items(out):
            _seen["produced"].add(item)
        return out

    def embed_input_ids(*args: Any, **kwargs: Any) -> Any:
        mm = kwargs.get("multimodal_embeddings", args[1] if len(args) > 1 else None)
        for item in _items(mm):
            _seen["fed"].add(item)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        _steps.append(int(input_ids.shape[0]) if isinstance(input_ids, torch.Tensor) else -1)
        return embed(*args, **kwargs)

    vllm_model.embed_multimodal = embed_multimodal
    vllm_model.embed_input_ids = embed_input_ids
    vllm_model._ec_redis_recorded = True


def begin_request(model: torch.nn.Module) -> None:
    """Start following a new request (the engine answers one at a time)."""
    _seen["produced"], _seen["fed"] = _Stream(), _Stream()
    _steps.clear()


def request_seen(model: torch.nn.Module) -> dict[str, Any]:
    """Since ``begin_request``: the digest of every image embedding byte produced and fed
    (``None``: none), and the tokens each step embedded."""
    return {
        "produced": _seen["produced"].digest(),
        "fed": _seen["fed"].digest(),
        "steps": list(_steps),
    }


def _items(embeddings: Any) -> list[torch.Tensor]:
    """One tensor per item: vLLM passes a list of them, or one tensor batching them."""
    if embeddings is None:
        return []
    return list(embeddings.unbind(0) if isinstance(embeddings, torch.Tensor) else embeddings)
