"""``ec-redis``: command-line entry point (subcommands parse their own options)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ec_redis.errors import ECRedisError
from ec_redis.units import parse_bytes

EPILOG = """examples:
  ec-redis bench                         # embedded redis-server on a free port
  ec-redis bench --quick --json          # two sizes, machine-readable
  ec-redis bench --redis-url redis://cache-host:6379/0
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ec-redis",
        description="Tools for ec_redis, the Redis-backed encoder cache for vLLM.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser(
        "bench",
        help="measure put/get per tier against raw redis-py SET/GET of the same bytes",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--redis-url", help="Redis to measure (default: an embedded server)")
    bench.add_argument("--json", action="store_true", help="print JSON instead of tables")
    bench.add_argument("--quick", action="store_true", help="two item sizes, fewer runs")
    bench.add_argument("--repeat", type=int, default=5, help="runs per measurement (default 5)")
    bench.add_argument("--chunk-bytes", default="4MiB", help="Redis tier chunk size")
    bench.add_argument("--no-codecs", action="store_true", help="skip the codec comparison")
    hooks = sub.add_parser(
        "bench-connector",
        help="drive the vLLM connector hooks, side by side with vLLM's ECExampleConnector",
    )
    hooks.add_argument("--redis-url", help="Redis to use (default: an embedded server)")
    hooks.add_argument("--runs", type=int, default=20, help="items per size (default 20)")
    hooks.add_argument("--quick", action="store_true", help="two item sizes")
    hooks.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench":
            return _bench(args)
        if args.command == "bench-connector":
            return _bench_connector(args)
    except ECRedisError as exc:
        print(f"ec-redis: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2  # pragma: no cover - argparse requires a command


def _bench(args: argparse.Namespace) -> int:
    from ec_redis.bench.report import render
    from ec_redis.bench.runner import run
    from ec_redis.embedded import EmbeddedRedis

    chunk_bytes = parse_bytes(args.chunk_bytes)
    repeat = 3 if args.quick and args.repeat == 5 else args.repeat
    if args.redis_url:
        report = run(args.redis_url, f"{args.redis_url} (given)", quick=args.quick,
                     repeat=repeat, chunk_bytes=chunk_bytes, codecs=not args.no_codecs)  # fmt: skip
    else:
        with EmbeddedRedis.start() as server:
            print(f"ec-redis: using {server.kind}", file=sys.stderr)
            report = run(server.url, server.kind, quick=args.quick, repeat=repeat,
                         chunk_bytes=chunk_bytes, codecs=not args.no_codecs)  # fmt: skip
    print(json.dumps(report.as_dict(), indent=2) if args.json else render(report))
    return 0


def _bench_connector(args: argparse.Namespace) -> int:
    import contextlib
    import dataclasses

    from ec_redis.bench.workload import ITEMS, QUICK_ITEMS
    from ec_redis.embedded import EmbeddedRedis

    try:
        from ec_redis.connector import bench
    except ImportError as exc:
        print(f"ec-redis: bench-connector needs vLLM installed ({exc})", file=sys.stderr)
        return 2
    items = QUICK_ITEMS if args.quick else ITEMS
    with contextlib.ExitStack() as stack:
        url = args.redis_url
        if not url:
            server = stack.enter_context(EmbeddedRedis.start())
            print(f"ec-redis: using {server.kind}", file=sys.stderr)
            url = server.url
        rows = bench.run(url, items, args.runs, lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print(bench.render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
