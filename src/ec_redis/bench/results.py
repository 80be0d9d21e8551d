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
class SocketRow:
    """One item's Redis-tier get next to the socket-level reads of the same bytes (median ms):
    one value, the tier's pieces pipelined (``bench/raw_socket.py``), and redis-py's GET."""

    item: str
    mib: float
    get_ms: float  # each read's tensor dropped before the next read (its memory reused)
    kept_ms: float  # every read's tensor kept: each lands in memory never used before
    one_ms: float
    pieces_ms: float
    pieces: int  # how many keys the pipelined read fetched
    redis_py_ms: float
    # The reading thread's CPU time (``time.thread_time``: neither the server's work nor
    # waiting counts), median: what the client itself costs per read.
    get_cpu_ms: float
    one_cpu_ms: float
    pieces_cpu_ms: float

    @property
    def raw_ms(self) -> float:
        """The faster of the two socket reads."""
        return min(self.one_ms, self.pieces_ms)

    @property
    def raw_cpu_ms(self) -> float:
        """The CPU time of the faster of the two socket reads (the one ``raw_ms`` is)."""
        return self.one_cpu_ms if self.one_ms <= self.pieces_ms else self.pieces_cpu_ms

    @property
    def ratio(self) -> float:
        """The tier's throughput / the faster socket read's (1: as fast as the socket)."""
        return self.raw_ms / self.get_ms

    @property
    def kept_ratio(self) -> float:
        return self.raw_ms / self.kept_ms

    @property
    def redis_py_ratio(self) -> float:
        return self.redis_py_ms / self.get_ms


@dataclass
class Report:
    server: str  # what was measured, in full (binary, version, topology, URL)
    machine: str
    name: str = ""  # a short name for tables and plots, e.g. "valkey-server 9.1.2, cluster"
    rows: list[Row] = field(default_factory=list)
    codecs: list[CodecRow] = field(default_factory=list)
    sockets: list[SocketRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for row, data in zip(self.sockets, out["sockets"], strict=True):
            data.update(raw_ms=row.raw_ms, raw_cpu_ms=row.raw_cpu_ms, ratio=row.ratio,
                        kept_ratio=row.kept_ratio, redis_py_ratio=row.redis_py_ratio)  # fmt: skip
        return out


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
