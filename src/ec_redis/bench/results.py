"""Benchmark result records: rows of "ours vs baseline", codec rows, the whole report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ec_redis.bench.timing import Timing
from ec_redis.bench.workload import Item


@dataclass
class Row:
    """One operation on one item size: our median vs the baseline's median."""

    item: str
    shape: str
    mib: float
    op: str
    ms: float
    gbps: float
    baseline: str = ""
    baseline_ms: float | None = None
    ratio: float | None = None  # our throughput / baseline throughput


@dataclass
class CodecRow:
    item: str
    codec: str
    ratio: float
    encode_ms: float
    decode_ms: float


@dataclass
class Report:
    server: str  # what was measured, in full (binary, version, topology, URL)
    machine: str
    name: str = ""  # a short name for tables and plots, e.g. "valkey-server 9.1.2, cluster"
    rows: list[Row] = field(default_factory=list)
    codecs: list[CodecRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_row(
    item: Item, op: str, ours: Timing, baseline: str = "", base: Timing | None = None
) -> Row:
    return Row(
        item=item.label,
        shape=f"{item.rows}x{item.width}",
        mib=item.nbytes / 2**20,
        op=op,
        ms=ours.median_s * 1e3,
        gbps=ours.gbps(item.nbytes),
        baseline=baseline,
        baseline_ms=base.median_s * 1e3 if base else None,
        ratio=base.median_s / ours.median_s if base else None,
    )
