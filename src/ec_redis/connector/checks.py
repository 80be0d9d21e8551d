"""What a cached item must look like before vLLM may use it: dtype, rank, width, rows.

Dtype and width belong to the model and are checked once per fetched entry; rows belong to
the request (a client uuid reused for other content expects other rows) and are checked
each time the scheduler is asked about the item for a particular request.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ec_redis.connector.staging import Found


class TensorCheck:
    def __init__(
        self, dtype: torch.dtype, width_for: Callable[[str], int | None], default_width: int
    ) -> None:
        self.dtype = dtype
        self._width_for = width_for
        self._default_width = default_width
        self._itemsize = torch.empty((), dtype=dtype).element_size()

    def width(self, modality: str) -> int:
        """The encoder output width: measured per modality on producers, else the model's."""
        return self._width_for(modality) or self._default_width

    def problem(self, modality: str, found: Found) -> str | None:
        """Why an entry can never be used by this model, or None."""
        if len(found.shape) != 2:
            return f"rank {len(found.shape)}, expected 2"
        if found.dtype != self.dtype:
            return f"dtype {found.dtype}, expected {self.dtype}"
        width = self._width_for(modality)
        if width is not None and found.shape[1] != width:
            return f"width {found.shape[1]}, expected {width}"
        return None

    def reserve(self, modality: str, rows: int) -> int:
        """Bytes a fetch of ``rows`` embeddings is expected to stage."""
        return max(1, rows * self.width(modality) * self._itemsize)
