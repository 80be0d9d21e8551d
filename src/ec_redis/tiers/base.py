"""The tier protocol: get/put/contains/delete by item id, with a looping ``get_many``."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class Tier:
    """A byte store of tensors by item id. A miss is ``None``; exceptions mean a bug."""

    name: str = "tier"

    def get(self, key: str) -> torch.Tensor | None:
        raise NotImplementedError

    def put(self, key: str, tensor: torch.Tensor) -> bool:
        """Store ``tensor``; return False when the tier declined it (too big, disabled, down)."""
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def get_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor | None]:
        """Look up several ids; tiers that can batch (Redis pipelines) override this."""
        return {key: self.get(key) for key in keys}

    def contains_many(self, keys: Iterable[str]) -> dict[str, bool]:
        return {key: self.contains(key) for key in keys}

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Release resources; the default has none."""


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor's elements occupy (not its possibly larger storage)."""
    return tensor.numel() * tensor.element_size()
