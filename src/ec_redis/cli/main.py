"""``ec-redis``: the operator's command line (parser and dispatch; commands live beside it).

Exit codes: 0 ok; 1 a problem was found (doctor FAIL, corrupt entry); 2 bad usage or
configuration; 3 Redis unreachable or refusing this client.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ec_redis.cli import commands
from ec_redis.errors import ConfigError, ECRedisError, RedisSetupError

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_REDIS = 0, 1, 2, 3

EPILOG = """examples:
  ec-redis demo                                   # embedded Redis, encoder -> PD engines
  ec-redis doctor --redis-url redis://cache:6379/0
  ec-redis stats  --redis-url redis+cluster://h1:7000,h2:7001 --json
  ec-redis ls     --redis-url redis://cache:6379/0 --namespace ecr --limit 20
  ec-redis inspect 'ecr:v2:{3f2a....e1.0c1d...}' --redis-url redis://cache:6379/0 --verify
  ec-redis purge  --redis-url redis://cache:6379/0 --namespace ecr --yes
  ec-redis bench  --quick --compare --plot docs/throughput.png
  ec-redis fingerprint /models/current            # the weights part of the model identity
  ec-redis bench  --server both --topology both   # redis-server and valkey-server
Any configuration key can be given as --set KEY=VALUE (e.g. --set tls_ca_file=/ca.crt).
exit codes: 0 ok, 1 problem found, 2 bad usage/config, 3 Redis unreachable or refusing us
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ec-redis",
        description="Tools for ec_redis, the Redis-backed encoder cache for vLLM.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, redis: str = "required") -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if redis == "required":
            p.add_argument("--redis-url", required=True, help="the Redis to look at (any topology)")
        elif redis == "embedded":
            p.add_argument("--redis-url", help="Redis to use (default: an embedded server)")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a configuration key (repeatable), e.g. tls_ca_file=/ca.crt",
        )
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    demo = command(
        "demo",
        "real vLLM engines on a tiny local model: encoder -> Redis -> prefill/decode, "
        "checked against a baseline engine",
        "embedded",
    )
    demo.add_argument(
        "--hooks-only",
        action="store_true",
        help="no engines: drive the connector hooks in vLLM's order (the cache alone without "
        "vLLM); seconds instead of minutes",
    )
    demo.add_argument(
        "--run-dir", help="keep the model and the engines' logs here (default: a new temp dir)"
    )
    command("doctor", "check connectivity, TLS, auth, version, topology, memory policy")
    stats = command("stats", "entries, bytes and compression per namespace/model")
    stats.add_argument("--metrics-url", help="also show live vllm:ec_redis_* counters from here")
    ls = command("ls", "list entries (headers only)")
    inspect = command("inspect", "show one entry's header, size, TTL (and verify it)")
    inspect.add_argument("key", help="a head key as printed by 'ec-redis ls'")
    inspect.add_argument("--verify", action="store_true", help="read every part, check it")
    purge = command("purge", "delete entries (UNLINK in batches), after a confirmation")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    for p in (stats, ls, purge):
        p.add_argument("--namespace", help="only this namespace (default: all)")
        p.add_argument("--fingerprint", help="only this model fingerprint (from 'ec-redis stats')")
        p.add_argument("--max-keys", type=int, default=1_000_000, help="stop SCAN after this many")
    ls.add_argument("--limit", type=int, default=100, help="list at most this many (default 100)")
    bench = command(
        "bench", "put/get per tier vs raw redis-py SET/GET of the same bytes", "embedded"
    )
    bench.add_argument("--quick", action="store_true", help="two item sizes, fewer runs")
    bench.add_argument("--repeat", type=int, default=5, help="runs per measurement (default 5)")
    bench.add_argument("--chunk-bytes", default="4MiB", help="Redis tier chunk size")
    bench.add_argument("--no-codecs", action="store_true", help="skip the codec comparison")
    bench.add_argument(
        "--topology",
        choices=("standalone", "cluster", "both"),
        default="standalone",
        help="embedded topology (without --redis-url)",
    )
    bench.add_argument(
        "--server",
        choices=("redis", "valkey", "both"),
        help="embedded server binary (without --redis-url; default: every one installed, "
        "redis-server and valkey-server side by side)",
    )
    bench.add_argument(
        "--compare",
        action="store_true",
        help="also drive the connector hooks next to vLLM's ECExampleConnector",
    )
    bench.add_argument(
        "--io-threads",
        type=int,
        default=0,
        metavar="N",
        help="also measure each embedded valkey-server started with --io-threads N (N > 1)",
    )
    bench.add_argument("--plot", metavar="PNG", help="write a throughput-vs-size plot")
    bench.add_argument(
        "--loop",
        action="store_true",
        help="instead: each read of one item back to back (raw socket GET, GETRANGE, GET + "
        "checksum; tier get; redis-py GET), 1.8 to 64 MiB (--quick: 1.8 and 4), one server "
        "over TCP",
    )
    bench.add_argument("--rounds", type=_at_least_one, help="--loop: rounds per item (default 300)")
    hooks = command(
        "bench-connector", "the connector hooks next to vLLM's ECExampleConnector", "embedded"
    )
    hooks.add_argument("--runs", type=int, default=20, help="items per size (default 20)")
    hooks.add_argument("--quick", action="store_true", help="two item sizes")
    hooks.add_argument(
        "--scheduler",
        action="store_true",
        help="instead: what the scheduler hooks add to one step with 1/64/256 requests waiting",
    )
    hooks.add_argument(
        "--visibility",
        action="store_true",
        help="instead: save_caches -> has_cache_item latency, poll only vs push, next to a raw "
        "SET+GET of the same bytes (1.8 and 16 MiB items)",
    )
    hooks.add_argument(
        "--single-flight",
        action="store_true",
        help="instead: N ec_both instances get the same new item at once, single_flight on "
        "vs off in one run: encodes, Redis commands, hold time and time to embedding per item "
        "(1.8 and 16 MiB items)",
    )
    hooks.add_argument(
        "--encoder-step",
        action="store_true",
        help="instead: what every connector hook adds to an encoder step saving a new item, "
        "its worker in a process of its own behind vLLM's broadcast queue, write thread + "
        "save wait vs writer process, quiet and with one core busy; PD's time to see the item "
        "next to a raw SET+GET",
    )
    hooks.add_argument("--mib", type=float, default=16.0, help="--encoder-step: item MiB (16)")
    hooks.add_argument(
        "--items", type=_at_least_one, default=1, help="--encoder-step: items saved per step (1)"
    )
    hooks.add_argument(
        "--steps", type=int, default=200, help="--scheduler / --encoder-step: steps per case"
    )
    hooks.add_argument(
        "--instances", type=int, default=3, help="--single-flight: instances (default 3)"
    )
    hooks.add_argument(
        "--encode-ms",
        type=float,
        default=100.0,
        help="--single-flight: what one encode costs (a sleep; default 100)",
    )
    fp = command("fingerprint", "the weights fingerprint a model path or hub id gets", "none")
    fp.add_argument("model", help="a checkpoint folder or file, or a hub id (as given to vLLM)")
    fp.add_argument("--revision", help="the hub revision (default: main)")
    fp_bench = command(
        "bench-fingerprint", "start-up cost of the weights fingerprint, cold and memoised", "none"
    )
    fp_bench.add_argument("--size", default="16GiB", help="generated checkpoint size (16GiB)")
    fp_bench.add_argument("--shards", type=int, default=4, help="safetensors files (default 4)")
    fp_bench.add_argument("--dir", help="generate into this new or empty folder (default: tmp)")
    fp_bench.add_argument("--keep", action="store_true", help="keep the generated checkpoint")
    fp_bench.add_argument("--checkpoint", help="time this existing checkpoint instead")
    fp_bench.add_argument("--repeat", type=int, default=5, help="runs per case (default 5)")
    fp_bench.add_argument(
        "--drop-caches",
        action="store_true",
        help="also drop the whole host's page cache before each cold run (root only)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = getattr(commands, args.command.replace("-", "_"))
    try:
        code: int = handler(args)
        return code
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except RedisSetupError as exc:
        return _fail(str(exc), EXIT_REDIS)
    except commands.Unreachable as exc:
        return _fail(f"{exc}; check the URL, the network and that Redis is running", EXIT_REDIS)
    except ECRedisError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        return 130


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, not {value}")
    return value


def _fail(message: str, code: int) -> int:
    print(f"ec-redis: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
