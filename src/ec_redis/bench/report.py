"""Formats a benchmark report as aligned text tables (Markdown-compatible)."""

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
