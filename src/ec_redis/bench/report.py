"""Formats benchmark reports as aligned text tables (Markdown-compatible): one report in
full, or several side by side."""

from __future__ import annotations

from ec_redis.bench.results import Report


def render(report: Report) -> str:
    lines = [
        f"server:  {report.server}",
        f"machine: {report.machine}",
        "",
        "| item | shape | MiB | operation | ms (median) | GB/s | baseline | baseline ms | ratio |",
        "|---|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in report.rows:
        base_ms = f"{r.baseline_ms:.2f}" if r.baseline_ms is not None else ""
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
        lines.append(
            f"| {r.item} | {r.shape} | {r.mib:.1f} | {r.op} | {r.ms:.3f} | {r.gbps:.2f} "
            f"| {r.baseline} | {base_ms} | {ratio} |"
        )
    if report.codecs:
        lines += [
            "",
            "| item | codec | size ratio | encode ms | decode ms |",
            "|---|---|---:|---:|---:|",
        ]
        for c in report.codecs:
            lines.append(
                f"| {c.item} | {c.codec} | {c.ratio:.3f} | {c.encode_ms:.2f} | {c.decode_ms:.2f} |"
            )
    if report.sockets:
        lines += ["", *render_sockets(report)]
    lines += ["", "ratio = our throughput / baseline throughput (>1: faster than the baseline)"]
    lines += report.notes
    return "\n".join(lines)


def render_sockets(report: Report) -> list[str]:
    """The Redis tier's get next to socket-level reads of the same bytes (MB/s: 10^6 B/s)."""
    lines = [
        "| item | size (MiB) | tier get MB/s | raw socket, one value MB/s | raw socket, pieces "
        "pipelined MB/s | tier / faster raw | raw redis-py GET MB/s | tier / redis-py "
        "| tier get, tensors kept MB/s | kept / faster raw | client CPU ms, tier / faster raw |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report.sockets:
        mb = s.mib * 2**20 / 1e3  # MB per second from ms
        lines.append(
            f"| {s.item} | {s.mib:.1f} | {mb / s.get_ms:.0f} | {mb / s.one_ms:.0f} "
            f"| {mb / s.pieces_ms:.0f} ({s.pieces}) | {s.ratio:.2f}x "
            f"| {mb / s.redis_py_ms:.0f} | {s.redis_py_ratio:.2f}x "
            f"| {mb / s.kept_ms:.0f} | {s.kept_ratio:.2f}x "
            f"| {s.get_cpu_ms:.2f} / {s.raw_cpu_ms:.2f} |"
        )
    lines += [
        "",
        "MB/s = 10^6 bytes/s at the median; raw socket: a minimal RESP client recv_into a "
        "pre-faulted buffer (bench/raw_socket.py), one key or the tier's pieces (count) "
        "pipelined; tier get: each read's tensor dropped before the next (its memory "
        "recycled); tensors kept: every read lands in memory never used before; client CPU: "
        "the reading thread's CPU time (median), which waiting and the server's work do not "
        "count",
    ]
    return lines


# The rows that depend on the server; the local tiers' rows do not.
SERVER_OPS = ("redis put (encode+SET)", "redis get (GET+verify)")


def render_comparison(reports: list[Report]) -> str:
    """The server-dependent rows of several reports side by side: median ms of each, with
    its ratio to raw redis-py on the same server in brackets."""
    cells: list[dict[tuple[str, str], str]] = []
    for report in reports:
        cells.append({
            (r.item, r.op): f"{r.ms:.2f} ({r.ratio:.2f}x)" if r.ratio else f"{r.ms:.2f}"
            for r in report.rows if r.op in SERVER_OPS
        })  # fmt: skip
    first = reports[0].rows if reports else []
    keys = [(r.item, r.op, r.mib) for r in first if r.op in SERVER_OPS]
    header = " | ".join(r.name or r.server for r in reports)
    lines = [
        f"| item | MiB | operation | {header} |",
        "|---|---:|---|" + "---:|" * len(reports),
    ]
    for item, op, mib in keys:
        row = " | ".join(c.get((item, op), "") for c in cells)
        lines.append(f"| {item} | {mib:.1f} | {op} | {row} |")
    lines += ["", "ms (median); (ratio) = our throughput / raw redis-py's on the same server"]
    with_sockets = [r for r in reports if r.sockets]
    if with_sockets:
        header = " | ".join(r.name or r.server for r in with_sockets)
        lines += [
            "",
            f"| item | size (MiB) | {header} |",
            "|---|---:|" + "---:|" * len(with_sockets),
        ]
        by_server = [{s.item: s for s in r.sockets} for r in with_sockets]
        for s in with_sockets[0].sockets:
            row = " | ".join(
                f"{s.mib * 2**20 / 1e3 / m[s.item].get_ms:.0f} ({m[s.item].ratio:.2f}x)"
                if s.item in m else ""
                for m in by_server
            )  # fmt: skip
            lines.append(f"| {s.item} | {s.mib:.1f} | {row} |")
        lines += ["", "tier get MB/s (median); (ratio) = its throughput / the faster raw-socket "
                  "read's (one value or the pieces pipelined) on the same server"]  # fmt: skip
    return "\n".join(lines)
