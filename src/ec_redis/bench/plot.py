"""A PNG of throughput vs item size for ``ec-redis bench --plot`` (needs matplotlib:
``pip install 'ec_redis[plot]'``)."""

from __future__ import annotations

from ec_redis.bench.results import Report
from ec_redis.errors import ECRedisError

SERIES = (
    ("redis get (GET+verify)", "ec_redis get"),
    ("redis put (encode+SET)", "ec_redis put"),
)


def plot(reports: list[Report], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ECRedisError("--plot needs matplotlib: pip install 'ec_redis[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for report in reports:
        where = report.name or report.server
        for op, label in SERIES:
            rows = [r for r in report.rows if r.op == op]
            ours = [r.gbps for r in rows]
            raw = [r.gbps / r.ratio if r.ratio else float("nan") for r in rows]  # ratio = ours/raw
            sizes = [r.mib for r in rows]
            ax.plot(sizes, ours, marker="o", label=f"{label} ({where})")
            baseline = rows[0].baseline if rows else ""
            ax.plot(sizes, raw, marker="x", linestyle="--", label=f"redis-py {baseline} ({where})")
    ax.set_xscale("log")
    sizes_all = sorted({r.mib for report in reports for r in report.rows})
    ax.set_xticks(sizes_all, [f"{size:.1f}" for size in sizes_all])
    ax.minorticks_off()
    ax.set_xlabel("item size (MiB, bf16 embeddings)")
    ax.set_ylabel("throughput (GB/s)")
    ax.set_title("ec_redis Redis tier vs raw redis-py, same server, same bytes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
