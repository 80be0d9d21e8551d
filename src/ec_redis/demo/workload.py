"""Synthetic encoder outputs: Qwen2.5-VL-shaped items with activation-like statistics, for
the demo's ``--hooks-only`` walk and the benchmarks (``bench/workload.py`` adds their sizes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

WIDTH = 3584  # Qwen2.5-VL-7B hidden size: 7,168 bytes per token in bf16


@dataclass(frozen=True)
class Item:
    label: str
    rows: int
    width: int = WIDTH

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * 2


QUICK_ITEMS = (Item("448px image", 256), Item("1344px image", 2304))


def activation_like(rows: int, width: int = WIDTH, seed: int = 0) -> torch.Tensor:
    """bf16 values shaped like a vision tower's output: per-channel scales spanning orders of
    magnitude, heavy-tailed outliers, no exact repeats. Synthetic; see docs/benchmarks.md."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(width, generator=gen) * 1.2)
    values = torch.randn(rows, width, generator=gen) * scale
    outliers = torch.rand(rows, width, generator=gen) < 0.001
    values = torch.where(outliers, values * 40, values)
    return values.to(torch.bfloat16)
