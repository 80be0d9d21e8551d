"""Weights fingerprint: same checkpoint, same value; any sampled change, another value and key."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ec_redis import fingerprint
from ec_redis.cli.main import main as cli_main
from ec_redis.config import CacheConfig
from ec_redis.errors import ConfigError
from ec_redis.fingerprint import SAMPLE_BLOCK_BYTES, sample_offsets, weights_fingerprint
from ec_redis.keys import KeyBuilder, ModelIdentity

SHARD_BYTES = 3 * 1024 * 1024 + 4321  # above the sampling threshold, not block-aligned
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def fresh_memo() -> Iterator[None]:
    fingerprint.clear_memo()
    yield
    fingerprint.clear_memo()


def write_shard(path: Path, size: int, seed: int, header_pad: int = 0) -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    header += b" " * header_pad
    body = bytes((seed * 7 + i * 13) % 251 for i in range(4096))
    with path.open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        while f.tell() < size:
            f.write(body[: size - f.tell()])


def checkpoint(root: Path, seed: int = 0, shards: int = 2) -> Path:
    """A small sharded safetensors checkpoint with configs and an index."""
    root.mkdir(parents=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    for i, name in enumerate(names):
        write_shard(root / name, SHARD_BYTES, seed * 100 + i)
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": names[0]}}))
    (root / "config.json").write_text(json.dumps({"hidden_size": 128}))
    (root / "preprocessor_config.json").write_text(json.dumps({"size": 56}))
    (root / "README.md").write_text("not part of the identity")
    return root


def fingerprint_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """This module's warnings only (other tests' background threads may log meanwhile)."""
    return [r.getMessage() for r in caplog.records if "no weights fingerprint" in r.getMessage()]


def recompute(path: Path) -> str:
    """The fingerprint a fresh process would compute (empty memo)."""
    fingerprint.clear_memo()
    return weights_fingerprint(str(path))


def patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0x01]))


SHARD = "model-00001-of-00002.safetensors"
Mutation = Callable[[Path], object]
MUTATIONS: dict[str, Mutation] = {
    "byte in the first sampled block": lambda d: flip(d / SHARD, 20_000),
    "byte in a middle sampled block": lambda d: flip(d / SHARD, sample_offsets(SHARD_BYTES)[7]),
    "last byte of the file": lambda d: flip(d / SHARD, SHARD_BYTES - 1),
    "shard size": lambda d: os.truncate(d / SHARD, SHARD_BYTES - 1),
    "config.json": lambda d: (d / "config.json").write_text(json.dumps({"hidden_size": 129})),
    "preprocessor config": lambda d: (d / "preprocessor_config.json").write_text('{"size": 57}'),
    "index": lambda d: (d / "model.safetensors.index.json").write_text("{}"),
    "a shard renamed": lambda d: (d / SHARD).rename(d / "model-x.safetensors"),
    "a weight file added": lambda d: write_shard(d / "extra.bin", 1000, 3),
    "a processor config added": lambda d: (d / "processor_config.json").write_text("{}"),
}


def test_same_weights_give_the_same_value_wherever_they_are(tmp_path: Path) -> None:
    first = weights_fingerprint(str(checkpoint(tmp_path / "a")))
    assert first.startswith("files:") and len(first) == len("files:") + 32
    assert recompute(tmp_path / "a") == first
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # another path, other inodes and mtimes
    assert recompute(tmp_path / "b") == first
    (tmp_path / "a" / "README.md").write_text("edited")  # not an identity file
    (tmp_path / "a" / "tokenizer.json").write_text("{}")
    assert recompute(tmp_path / "a") == first


def test_other_weights_give_another_value(tmp_path: Path) -> None:
    assert recompute(checkpoint(tmp_path / "s0", 0)) != recompute(checkpoint(tmp_path / "s1", 1))


@pytest.mark.parametrize("change", list(MUTATIONS), ids=list(MUTATIONS))
def test_any_identity_change_gives_another_value(tmp_path: Path, change: str) -> None:
    directory = checkpoint(tmp_path / "ckpt")
    before = recompute(directory)
    MUTATIONS[change](directory)
    assert recompute(directory) != before


@pytest.mark.parametrize(("name", "read"), [("big.safetensors", True), ("big.bin", False)])
def test_the_whole_safetensors_header_is_read(tmp_path: Path, name: str, read: bool) -> None:
    # A header larger than the first sampled block: a byte of it past that block still counts
    # (for safetensors files only; other formats have no such header).
    write_shard(tmp_path / name, SHARD_BYTES, 0, header_pad=100_000)
    offset = SAMPLE_BLOCK_BYTES + 20_000
    assert offset < sample_offsets(SHARD_BYTES)[1]
    before = recompute(tmp_path)
    patch_bytes(tmp_path / name, offset, b"x")  # a space of the header's padding
    assert (recompute(tmp_path) != before) is read


def test_sample_offsets_spread_over_the_whole_file() -> None:
    offsets = sample_offsets(SHARD_BYTES)
    assert len(offsets) == fingerprint.SAMPLE_BLOCKS
    assert offsets[0] == 0 and offsets[-1] == SHARD_BYTES - SAMPLE_BLOCK_BYTES
    assert offsets == sorted(set(offsets))
    assert sample_offsets(fingerprint.SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES) == []  # read whole


def test_a_byte_between_the_samples_is_not_read(tmp_path: Path) -> None:
    # The documented limit of sampling (and proof the reads are bounded): a byte no sample,
    # header or size covers does not change the value.
    directory = checkpoint(tmp_path / "ckpt")
    before = recompute(directory)
    gap = sample_offsets(SHARD_BYTES)[3] + SAMPLE_BLOCK_BYTES + 10
    assert gap < sample_offsets(SHARD_BYTES)[4]
    flip(directory / SHARD, gap)
    assert recompute(directory) == before


def test_small_weight_files_are_hashed_whole(tmp_path: Path) -> None:
    write_shard(tmp_path / "tiny.safetensors", 200_000, 0)
    before = weights_fingerprint(str(tmp_path))
    flip(tmp_path / "tiny.safetensors", 123_457)
    assert recompute(tmp_path) != before


class OpenCounter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        monkeypatch.setattr(fingerprint, "open", self, raising=False)

    def __call__(self, file: Any, *args: Any, **kwargs: Any) -> Any:
        self.paths.append(os.path.basename(file))
        return open(file, *args, **kwargs)


def test_a_memo_hit_reads_nothing_and_a_changed_file_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = checkpoint(tmp_path / "ckpt")
    opens = OpenCounter(monkeypatch)
    first = weights_fingerprint(str(directory))
    assert sorted(opens.paths) == sorted(
        [SHARD, "model-00002-of-00002.safetensors", "model.safetensors.index.json",
         "config.json", "preprocessor_config.json"]
    )  # fmt: skip
    opens.paths.clear()
    assert weights_fingerprint(str(directory)) == first  # e.g. the worker half, same process
    assert opens.paths == []
    flip(directory / SHARD, 0)
    os.utime(directory / SHARD, ns=(1, 1))  # a new mtime, whatever the clock's granularity
    assert weights_fingerprint(str(directory)) != first
    assert opens.paths == [SHARD]


def test_a_single_weight_file_is_a_checkpoint(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    write_shard(gguf, SHARD_BYTES, 0)
    before = weights_fingerprint(str(gguf))
    assert before.startswith("files:")
    flip(gguf, sample_offsets(SHARD_BYTES)[5] + 1)
    assert recompute(gguf) != before


def test_no_weight_files_falls_back_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text("{}")  # e.g. weights streamed from object storage
    with caplog.at_level(logging.WARNING, logger="ec_redis"):
        assert weights_fingerprint(str(tmp_path)) == ""
        assert weights_fingerprint(str(tmp_path)) == ""
    (warning,) = fingerprint_warnings(caplog)
    assert "model_fingerprint" in warning and "no weight files" in warning


def test_an_unreadable_checkpoint_falls_back_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    directory = checkpoint(tmp_path / "ckpt")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fingerprint, "open", refuse, raising=False)
    with caplog.at_level(logging.WARNING, logger="ec_redis"):
        assert weights_fingerprint(str(directory)) == ""
    (warning,) = fingerprint_warnings(caplog)
    assert "PermissionError" in warning and "model_fingerprint" in warning


# -- hub ids --------------------------------------------------------------------------------


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face hub cache holding refs of org/model, and no network at all."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    refs = cache / "models--org--model" / "refs"
    (refs / "refs" / "pr").mkdir(parents=True)
    (refs / "main").write_text(COMMIT)
    (refs / "v2").write_text("f" * 40 + "\n")
    (refs / "refs" / "pr" / "1").write_text("e" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the fingerprint must not touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return cache


def test_a_hub_id_resolves_to_its_cached_commit(hub_cache: Path) -> None:
    assert weights_fingerprint("org/model") == f"hf:{COMMIT}"
    assert weights_fingerprint("org/model", "main") == f"hf:{COMMIT}"
    assert weights_fingerprint("org/model", "v2") == "hf:" + "f" * 40
    assert weights_fingerprint("org/model", "refs/pr/1") == "hf:" + "e" * 40


def test_a_commit_revision_is_used_as_is(hub_cache: Path) -> None:
    assert weights_fingerprint("org/never-downloaded", "a" * 40) == "hf:" + "a" * 40


def test_extra_cache_dirs_are_searched_first(hub_cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "download_dir"
    (other / "models--org--model" / "refs").mkdir(parents=True)
    (other / "models--org--model" / "refs" / "main").write_text("b" * 40)
    assert weights_fingerprint("org/model", hub_cache_dirs=[str(other)]) == "hf:" + "b" * 40


@pytest.mark.parametrize(
    ("model", "revision"),
    [("org/other", None), ("org/model", "v3"), ("org/model", "../../../etc/x"), ("s3://b/m", None)],
)
def test_an_unresolvable_hub_id_falls_back_with_one_warning(
    hub_cache: Path, caplog: pytest.LogCaptureFixture, model: str, revision: str | None
) -> None:
    with caplog.at_level(logging.WARNING, logger="ec_redis"):
        assert weights_fingerprint(model, revision) == ""
        assert weights_fingerprint(model, revision) == ""
    (warning,) = fingerprint_warnings(caplog)
    assert "model_fingerprint" in warning and model in warning


def test_a_corrupt_ref_is_not_a_commit(hub_cache: Path) -> None:
    (hub_cache / "models--org--model" / "refs" / "main").write_text("not a commit")
    assert weights_fingerprint("org/model") == ""


# -- keys and configuration -----------------------------------------------------------------


def test_keys_of_two_checkpoints_under_one_name_differ(tmp_path: Path) -> None:
    identities = [
        ModelIdentity("/models/current", "", "bfloat16", 128, recompute(checkpoint(tmp_path / s)))
        for s in ("a", "b")
    ]
    assert identities[0].weights == identities[1].weights  # same bytes: same key
    flip(tmp_path / "b" / SHARD, 5)
    identities[1] = ModelIdentity("/models/current", "", "bfloat16", 128, recompute(tmp_path / "b"))
    heads = [KeyBuilder("ecr", identity).head("img-1") for identity in identities]
    assert heads[0] != heads[1]


def test_model_fingerprint_is_validated_naming_the_key() -> None:
    assert CacheConfig.from_dict({"model_fingerprint": "hf:" + "a" * 40}).model_fingerprint
    assert CacheConfig.from_dict({"model_fingerprint": ""}).model_fingerprint == ""
    for bad in ("two words", "x" * 129, "a/b", 7, "new\nline"):
        with pytest.raises(ConfigError, match=r"'model_fingerprint'.*example"):
            CacheConfig.from_dict({"model_fingerprint": bad})


def test_a_cache_built_from_config_carries_the_pinned_fingerprint() -> None:
    import fakeredis

    from ec_redis import TieredCache

    config = CacheConfig(model_name="m", model_fingerprint="rollout-7")
    with TieredCache(config, redis_client=fakeredis.FakeRedis()) as cache:
        assert cache.identity == ModelIdentity("m", weights="rollout-7")
        assert cache.redis is not None
        assert cache.redis.options.model == "m@rollout-7"  # blob headers: 'ec-redis stats'


# -- the connector's model_identity (needs vLLM for its config types) ----------------------


def identity_for(model: str, revision: str | None = None, **extra: Any) -> ModelIdentity:
    from ec_redis.connector.connector import model_identity
    from tests.connector.conftest import vllm_config

    config = vllm_config("ec_consumer", {}, model=model)
    config.model_config.revision = revision
    return model_identity(config, CacheConfig.from_dict(extra))


@pytest.mark.vllm
def test_model_identity_fingerprints_the_checkpoint_vllm_loads(tmp_path: Path) -> None:
    directory = checkpoint(tmp_path / "current")
    identity = identity_for(str(directory))
    assert identity.weights == weights_fingerprint(str(directory))
    assert identity.weights.startswith("files:")


@pytest.mark.vllm
def test_model_fingerprint_wins_and_reads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    directory = checkpoint(tmp_path / "current")
    opens = OpenCounter(monkeypatch)
    assert identity_for(str(directory), model_fingerprint="rollout-7").weights == "rollout-7"
    with caplog.at_level(logging.WARNING, logger="ec_redis"):
        assert identity_for("s3://bucket/model", model_fingerprint="pin").weights == "pin"
    assert opens.paths == [] and fingerprint_warnings(caplog) == []


@pytest.mark.vllm
def test_model_identity_resolves_a_hub_id(hub_cache: Path) -> None:
    assert identity_for("org/model", "v2").weights == "hf:" + "f" * 40


# -- the command line -----------------------------------------------------------------------


def test_cli_fingerprint_prints_the_value_or_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = checkpoint(tmp_path / "ckpt")
    assert cli_main(["fingerprint", str(directory)]) == 0
    assert capsys.readouterr().out.strip() == weights_fingerprint(str(directory))
    assert cli_main(["fingerprint", str(tmp_path / "missing"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["weights"] == ""


def test_cli_bench_fingerprint_times_a_generated_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "gen"
    argv = ["bench-fingerprint", "--size", "8MiB", "--shards", "2", "--repeat", "2"]
    assert cli_main([*argv, "--dir", str(target), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == 5 and report["total_bytes"] >= 8 * 1024**2
    assert report["fingerprint"].startswith("files:")
    assert len(report["cold"]["samples_s"]) == 2
    assert not target.exists()  # removed without --keep
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert cli_main([*argv, "--dir", str(tmp_path / "full")]) == 2  # never writes into it
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
