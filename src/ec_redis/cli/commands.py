"""The ``ec-redis`` subcommands: each takes the parsed arguments and returns an exit code."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ec_redis.config import CacheConfig
from ec_redis.errors import ConfigError, ECRedisError
from ec_redis.units import format_bytes, parse_bytes


class Unreachable(ECRedisError):
    """Redis did not answer."""


def _config(args: argparse.Namespace, url: str | None = None) -> CacheConfig:
    raw: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ECRedisError(f"--set expects KEY=VALUE, got {item!r} (e.g. --set ttl_s=3600)")
        raw[key.strip()] = value
    if url or getattr(args, "redis_url", None):
        raw["redis_url"] = url or args.redis_url
    return CacheConfig.from_dict(raw)


def _client(config: CacheConfig) -> Any:
    from ec_redis.redis_conn import check_connection, make_client

    client = make_client(config)
    outage = check_connection(client)  # RedisSetupError for credentials/TLS
    if outage is not None:
        client.close()
        raise Unreachable(f"cannot reach Redis at {config.describe()['redis_url']} ({outage})")
    return client


@contextlib.contextmanager
def _redis(args: argparse.Namespace) -> Iterator[tuple[CacheConfig, Any]]:
    config = _config(args)
    client = _client(config)
    try:
        yield config, client
    finally:
        client.close()


@contextlib.contextmanager
def _embedded_url(args: argparse.Namespace) -> Iterator[str]:
    """The given --redis-url, or an embedded server for the command's lifetime."""
    if args.redis_url:
        yield args.redis_url
        return
    from ec_redis.embedded import EmbeddedRedis

    with EmbeddedRedis.start() as server:
        _err(f"ec-redis: using {server.kind}")
        yield server.url


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _say(message: str) -> None:
    print(message, flush=True)


def _print(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else text)


# -- commands ------------------------------------------------------------------------------


def demo(args: argparse.Namespace) -> int:
    _config(args)  # validates --set
    say = _err if args.json else _say
    hooks_only = args.hooks_only
    if not hooks_only and not _has_vllm():
        _err("ec-redis: vLLM is not installed, so no engine can run: showing --hooks-only")
        hooks_only = True
    with _embedded_url(args) as url:
        if hooks_only:
            from ec_redis.demo import hooks

            _vllm_logs_to_stderr("ERROR")  # the walk's lines, not vLLM's config warnings
            report = hooks.run(url, say)
        else:
            from ec_redis.demo.launcher import EngineFailed

            try:
                report = _demo_engines(url, args.run_dir, say)
            except EngineFailed as exc:
                _err(f"ec-redis demo: {exc}")
                return 1
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    return 1 if report.get("all_identical") is False else 0  # 1: a problem was found


def _vllm_logs_to_stderr(level: str | None = None) -> None:
    """Keep stdout for our tables and JSON when vLLM runs in this process (it logs to stdout);
    set before vLLM is first imported. Explicit VLLM_LOGGING_* settings win."""
    import logging
    import os

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if level is not None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", level)
        logging.getLogger("torch._library.triton").setLevel(level)  # "Triton not available"


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _demo_engines(url: str, run_dir: str | None, say: Any) -> dict[str, Any]:
    import tempfile
    from pathlib import Path

    from ec_redis.demo import flow

    if run_dir is None:
        path = Path(tempfile.mkdtemp(prefix="ec-redis-demo-"))
    else:
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        if any(path.iterdir()):
            raise ECRedisError(f"--run-dir {path} is not empty (give a new or empty folder)")
    return flow.run(url, path, say)


def doctor(args: argparse.Namespace) -> int:
    from ec_redis.cli import doctor as checks

    findings = checks.run(_config(args))
    lines = []
    for f in findings:
        fix = f"\n        fix: {f.fix}" if f.fix and f.level != checks.OK else ""
        lines.append(f"{f.level:>4}  {f.check:<10} {f.detail}{fix}")
    _print(args, [f.as_dict() for f in findings], "\n".join(lines))
    return 1 if any(f.level == checks.FAIL for f in findings) else 0


def stats(args: argparse.Namespace) -> int:
    from ec_redis.cli import inventory

    with _redis(args) as (_, client):
        match = inventory.pattern(args.namespace, args.fingerprint)
        keys = list(inventory.scan_heads(client, match, args.max_keys, _progress("scanned")))
        groups = inventory.totals(inventory.read_entries(client, keys))
    data: dict[str, Any] = {"groups": [g.as_dict() for g in groups]}
    lines = [
        "namespace  fingerprint                       entries     stored      raw  saved  model"
    ]
    for g in data["groups"]:
        lines.append(
            f"{g['namespace']:<10} {g['fingerprint']} {g['entries']:>7} "
            f"{format_bytes(g['stored_bytes']):>10} {format_bytes(g['raw_bytes']):>10} "
            f"{max(g['compression_savings'], 0.0):>5.1%}  {g['model']}"
        )
    if not groups:
        lines.append("(no ec_redis entries)")
    if args.metrics_url:
        data["live"] = _live_counters(args.metrics_url)
        lines += ["", "live counters:"] + [f"  {k} {v}" for k, v in data["live"].items()]
    _print(args, data, "\n".join(lines))
    return 0


def ls(args: argparse.Namespace) -> int:
    from ec_redis.cli import inventory

    with _redis(args) as (_, client):
        match = inventory.pattern(args.namespace, args.fingerprint)
        keys = []
        for key in inventory.scan_heads(client, match, args.max_keys):
            keys.append(key)
            if len(keys) >= args.limit:
                break
        entries = [e.as_dict() for e in inventory.read_entries(client, keys)]
    lines = [
        f"{e['item'][:40]:<40} {e['dtype']!s:<5} {e['shape']!s:<14} "
        f"{format_bytes(e['stored_bytes']):>10} {e['codec']!s:<5} ttl={e['ttl_s']} {e['key']}"
        + (f"  PROBLEM: {e['problem']}" if e["problem"] else "")
        for e in entries
    ]
    _print(args, entries, "\n".join(lines) or "(no ec_redis entries)")
    return 0


def inspect(args: argparse.Namespace) -> int:
    from ec_redis.cli import inventory

    if inventory.parse_head_key(args.key) is None:
        raise ECRedisError(
            f"{args.key!r} is not an ec_redis head key; list them with 'ec-redis ls'"
        )
    with _redis(args) as (_, client):
        if not client.exists(args.key):
            raise ECRedisError(f"no such key: {args.key}")
        entry = inventory.read_entries(client, [args.key])[0]
        data = entry.as_dict()
        data["checksum"] = (
            inventory.verify(client, entry) if args.verify else "not verified (--verify)"
        )
    text = "\n".join(f"{k:>13}: {v}" for k, v in data.items())
    _print(args, data, text)
    return 1 if args.verify and data["checksum"] != "ok" else 0


def purge(args: argparse.Namespace) -> int:
    from ec_redis.cli import inventory

    if not args.namespace:
        raise ECRedisError("purge needs --namespace (and optionally --fingerprint)")
    with _redis(args) as (_, client):
        match = inventory.pattern(args.namespace, args.fingerprint)
        heads = sum(1 for _ in inventory.scan_heads(client, match, args.max_keys))
        if not args.yes:
            if not sys.stdin.isatty():
                raise ECRedisError(f"{heads} entries match {match!r}; re-run with --yes to delete")
            answer = input(f"delete {heads} entries (and their chunks) matching {match!r}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                _print(args, {"deleted_keys": 0}, "nothing deleted")
                return 0
        removed = inventory.purge(client, match, args.max_keys, _progress("deleted"))
    _print(
        args,
        {"entries": heads, "deleted_keys": removed},
        f"deleted {removed} keys ({heads} entries)",
    )
    return 0


def bench(args: argparse.Namespace) -> int:
    from ec_redis.bench.report import render
    from ec_redis.bench.runner import run
    from ec_redis.bench.targets import targets

    if args.loop:
        return _bench_loop(args)
    if args.rounds is not None:
        raise ECRedisError("bench --rounds is for --loop (the other measurements take --repeat)")
    _reachable(args)
    chunk_bytes = parse_bytes(args.chunk_bytes)
    repeat = 3 if args.quick and args.repeat == 5 else args.repeat
    reports = []
    chosen = targets(args.redis_url, args.topology, args.server, _err, args.io_threads)
    for url, label, name in chosen:
        reports.append(
            run(
                url,
                label,
                name=name,
                quick=args.quick,
                repeat=repeat,
                chunk_bytes=chunk_bytes,
                codecs=not args.no_codecs,
            )
        )
    hooks = _bench_hooks(args, args.quick, 10 if args.quick else 20) if args.compare else None
    if args.plot:
        from ec_redis.bench.plot import plot

        plot(reports, args.plot)
        _err(f"ec-redis: wrote {args.plot}")
    if args.json:
        data: dict[str, Any] = {"reports": [r.as_dict() for r in reports]}
        if hooks is not None:
            data["connector"] = [dataclasses.asdict(r) for r in hooks]
        print(json.dumps(data, indent=2))
        return 0
    print("\n\n".join(render(r) for r in reports))
    if len(reports) > 1:
        from ec_redis.bench.report import render_comparison

        print("\n" + render_comparison(reports))
    if hooks is not None:
        from ec_redis.bench.connector_hooks import render as render_hooks

        print("\n" + render_hooks(hooks))
    return 0


def _reachable(args: argparse.Namespace) -> None:
    """The configuration checked and, with --redis-url, the server answering: an unreachable
    or refusing one is exit 3 with its reason, not a traceback mid-benchmark."""
    config = _config(args)
    if args.redis_url:
        _client(config).close()


def _bench_loop(args: argparse.Namespace) -> int:
    from ec_redis.bench import read_loop
    from ec_redis.bench.targets import targets

    if args.topology != "standalone":
        raise ECRedisError("bench --loop measures one server: leave --topology out")
    unused = [flag for flag, given in (("--plot", args.plot), ("--compare", args.compare),
              ("--repeat (--loop takes --rounds)", args.repeat != 5)) if given]  # fmt: skip
    if unused:
        raise ECRedisError(f"bench --loop does not take {', '.join(unused)}")
    if args.redis_url and (why := read_loop.supported(args.redis_url)):
        raise ECRedisError(f"bench --loop measures {why}; got {args.redis_url}")
    _reachable(args)
    chunk_bytes = parse_bytes(args.chunk_bytes)
    rounds = args.rounds or 300
    rows: list[Any] = []
    for url, _, name in targets(args.redis_url, "standalone", args.server, _err, args.io_threads):
        items = read_loop.LOOP_ITEMS[:2] if args.quick else read_loop.LOOP_ITEMS
        rows += read_loop.run(url, name, rounds, items, _err, chunk_bytes)
    if args.json:
        print(json.dumps({"loop": [dataclasses.asdict(r) for r in rows]}, indent=2))
    else:
        print(read_loop.render(rows))
    return 0


def bench_connector(args: argparse.Namespace) -> int:
    if args.scheduler:
        return _bench_scheduler(args)
    if args.visibility:
        return _bench_visibility(args)
    if args.single_flight:
        return _bench_single_flight(args)
    if args.encoder_step:
        return _bench_encoder_step(args)
    rows = _bench_hooks(args, args.quick, args.runs)
    from ec_redis.bench.connector_hooks import render  # imported by _bench_hooks already

    return _print_rows(args, rows, render)


def _print_rows(args: argparse.Namespace, rows: list[Any], render: Callable[[Any], str]) -> int:
    """A benchmark's rows as JSON (``--json``) or its table."""
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print(render(rows))
    return 0


def _bench_visibility(args: argparse.Namespace) -> int:
    from ec_redis.demo.workload import QUICK_ITEMS

    _vllm_logs_to_stderr()
    try:
        from ec_redis.bench import visibility
    except ImportError as exc:
        raise ECRedisError(f"the connector benchmark needs vLLM installed ({exc})") from None
    with _embedded_url(args) as url:
        rows = visibility.run(url, QUICK_ITEMS, args.runs, _err)
    return _print_rows(args, rows, visibility.render)


def _bench_encoder_step(args: argparse.Namespace) -> int:
    _vllm_logs_to_stderr()
    try:
        from ec_redis.bench import encoder_step
    except ImportError as exc:
        raise ECRedisError(f"the connector benchmark needs vLLM installed ({exc})") from None
    with _embedded_url(args) as url:
        rows = encoder_step.run(url, args.mib, args.steps, _err, args.items)
    return _print_rows(args, rows, encoder_step.render)


def _bench_single_flight(args: argparse.Namespace) -> int:
    from ec_redis.demo.workload import QUICK_ITEMS

    if args.instances < 2 or args.encode_ms < 0:
        raise ConfigError("--single-flight needs --instances >= 2 and --encode-ms >= 0")
    _vllm_logs_to_stderr()
    try:
        from ec_redis.bench import single_flight as single_flight_bench
    except ImportError as exc:
        raise ECRedisError(f"the connector benchmark needs vLLM installed ({exc})") from None
    with _embedded_url(args) as url:
        rows = single_flight_bench.run(
            url, QUICK_ITEMS, args.runs, args.encode_ms, _err, instances=args.instances
        )
    return _print_rows(args, rows, single_flight_bench.render)


def _bench_scheduler(args: argparse.Namespace) -> int:
    _vllm_logs_to_stderr()
    try:
        from ec_redis.bench import scheduler_cost
    except ImportError as exc:
        raise ECRedisError(f"the connector benchmark needs vLLM installed ({exc})") from None
    rows = scheduler_cost.run(args.steps, _err)
    return _print_rows(args, rows, scheduler_cost.render)


def fingerprint(args: argparse.Namespace) -> int:
    from ec_redis.fingerprint import weights_fingerprint

    _config(args)
    weights = weights_fingerprint(args.model, args.revision)
    data = {"model": args.model, "revision": args.revision, "weights": weights}
    _print(args, data, weights or "(none: see the warning; pin one with model_fingerprint)")
    return 0 if weights else 1


def bench_fingerprint(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ec_redis.bench import fingerprint as timing

    _config(args)
    with contextlib.ExitStack() as stack:
        if args.checkpoint:
            checkpoint = Path(args.checkpoint)
        else:
            size = parse_bytes(args.size)
            _err(f"ec-redis: writing a sparse {format_bytes(size)} checkpoint ...")
            checkpoint = stack.enter_context(
                timing.generated(size, args.shards, args.dir, args.keep)
            )
        report = timing.run(checkpoint, args.repeat, args.drop_caches)
    _print(args, report.as_dict(), timing.render(report))
    return 0


def _bench_hooks(args: argparse.Namespace, quick: bool, runs: int) -> list[Any]:
    from ec_redis.bench.workload import ITEMS
    from ec_redis.demo.workload import QUICK_ITEMS

    _vllm_logs_to_stderr()
    try:
        from ec_redis.bench import connector_hooks as hooks
    except ImportError as exc:
        raise ECRedisError(f"the connector benchmark needs vLLM installed ({exc})") from None
    with _embedded_url(args) as url:
        rows: list[Any] = hooks.run(url, QUICK_ITEMS if quick else ITEMS, runs, _err)
        return rows


def _progress(verb: str) -> Any:
    return lambda n: _err(f"ec-redis: {verb} {n} keys ...")


def _live_counters(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:ec_redis_") and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name.endswith(("_bucket", "_created")):
                continue
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals
