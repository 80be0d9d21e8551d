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
    lines += ["", "ratio = our throughput / baseline throughput (>1: faster than the baseline)"]
    lines += report.notes
    return "\n".join(lines)


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
    return "\n".join(lines)
