"""Start-up cost of the weights fingerprint: a generated checkpoint, timed cold and memoised.

The generated checkpoint looks like a real sharded one (config.json, a preprocessor config,
a safetensors index, ``shards`` safetensors files with real headers) but is sparse: only the
bytes the fingerprint reads (each header and the sampled blocks) hold data, written to disk
and then evicted from the page cache, so a cold run reads them from the device; the rest are
holes. The same timings can be taken on a real checkpoint (``checkpoint=``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ec_redis import fingerprint
from ec_redis.bench.timing import Timing, measure
from ec_redis.errors import ECRedisError

TENSORS_PER_SHARD = 100
MIN_SHARD_BYTES = 1024**2
_DROP_CACHES = "/proc/sys/vm/drop_caches"


@dataclass(frozen=True)
class FingerprintReport:
    """Timings of one checkpoint: cold, page cache warm (another process), memoised."""

    checkpoint: str
    files: int
    total_bytes: int
    fingerprint: str
    eviction: str
    cold: Timing
    warm: Timing
    memoised: Timing

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("cold", "warm", "memoised"):
            timing: Timing = getattr(self, name)
            out[name] = {"median_s": timing.median_s, "samples_s": list(timing.samples)}
        return out


@contextlib.contextmanager
def generated(
    total_bytes: int, shards: int, directory: str | None = None, keep: bool = False
) -> Iterator[Path]:
    """A generated checkpoint in ``directory`` (which must be new or empty; default: a temp
    folder), removed afterwards unless ``keep``."""
    if shards < 1 or total_bytes < shards * MIN_SHARD_BYTES:
        raise ECRedisError(
            f"need at least one shard of at least {MIN_SHARD_BYTES // 1024**2} MiB "
            f"(got {shards} shards in {total_bytes} bytes); e.g. --size 16GiB --shards 4"
        )
    if directory is None:
        path = Path(tempfile.mkdtemp(prefix="ec-redis-fingerprint-"))
    else:
        path = Path(directory)
        if path.exists() and any(path.iterdir()):
            raise ECRedisError(f"--dir {directory} is not empty; give a new or empty folder")
    try:
        make_checkpoint(path, total_bytes, shards)
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def make_checkpoint(directory: Path, total_bytes: int, shards: int, seed: int = 0) -> list[Path]:
    """Write a sparse ``shards``-file checkpoint of ``total_bytes`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    shard_bytes = total_bytes // shards
    weight_map: dict[str, str] = {}
    files = []
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        header = _safetensors_header(shard_bytes, index)
        weight_map.update({tensor: name for tensor in header if tensor != "__metadata__"})
        files.append(_write_sparse(directory / name, shard_bytes, header, rng))
    index_doc = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    configs = {
        "model.safetensors.index.json": index_doc,
        "config.json": {"architectures": ["LlavaForConditionalGeneration"], "seed": seed},
        "preprocessor_config.json": {"image_processor_type": "CLIPImageProcessor"},
    }
    for name, doc in configs.items():
        (directory / name).write_text(json.dumps(doc, indent=2))
        files.append(directory / name)
    return files


def run(checkpoint: Path, repeat: int = 5, drop_caches: bool = False) -> FingerprintReport:
    """Time ``fingerprint.weights_fingerprint(checkpoint)``: cold (page cache evicted, empty
    memo), warm (empty memo: a second process on the host) and memoised (this process)."""
    files = _files(checkpoint)
    eviction = "posix_fadvise(DONTNEED) per file"
    if drop_caches:
        eviction += " + " + _drop_caches()

    def cold_setup() -> None:
        _evict(files, drop_caches)
        fingerprint.clear_memo()

    model = str(checkpoint)
    cold = measure(lambda: fingerprint.weights_fingerprint(model), repeat, cold_setup)
    warm = measure(lambda: fingerprint.weights_fingerprint(model), repeat, fingerprint.clear_memo)
    memoised = measure(lambda: fingerprint.weights_fingerprint(model), repeat)
    return FingerprintReport(
        checkpoint=model,
        files=len(files),
        total_bytes=sum(f.stat().st_size for f in files),
        fingerprint=fingerprint.weights_fingerprint(model),
        eviction=eviction,
        cold=cold,
        warm=warm,
        memoised=memoised,
    )


def render(report: FingerprintReport) -> str:
    gib = report.total_bytes / 1024**3
    lines = [
        f"checkpoint {report.checkpoint}: {report.files} files, {gib:.1f} GiB",
        f"fingerprint {report.fingerprint or '(none)'}",
        f"cold = page cache evicted by {report.eviction}",
        "case                               median ms   max ms",
    ]
    for label, timing in (
        ("cold (first process after a copy)", report.cold),
        ("warm page cache, empty memo", report.warm),
        ("memoised (same process)", report.memoised),
    ):
        worst = max(timing.samples)
        lines.append(f"{label:<34} {timing.median_s * 1e3:>9.2f} {worst * 1e3:>8.2f}")
    return "\n".join(lines)


def _safetensors_header(shard_bytes: int, shard: int) -> dict[str, Any]:
    """A header whose tensors fill the shard, like a real one (bf16, one row each)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    per_tensor = (shard_bytes - 64 * 1024) // TENSORS_PER_SHARD // 2 * 2
    for i in range(TENSORS_PER_SHARD):
        start = i * per_tensor
        header[f"model.layers.{shard}.block.{i}.weight"] = {
            "dtype": "BF16",
            "shape": [per_tensor // 2],
            "data_offsets": [start, start + per_tensor],
        }
    return header


def _write_sparse(path: Path, size: int, header: dict[str, Any], rng: random.Random) -> Path:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.truncate(size)  # holes everywhere ...
        for offset in fingerprint.sample_offsets(size):  # ... but real data where it is read
            f.seek(offset)
            f.write(rng.randbytes(fingerprint.SAMPLE_BLOCK_BYTES))
        f.seek(0)  # the header last: the first sampled block starts at byte 0
        f.write(len(text).to_bytes(8, "little") + text)
        f.flush()
        os.fsync(f.fileno())
    return path


def _files(checkpoint: Path) -> list[Path]:
    if checkpoint.is_file():
        return [checkpoint]
    return sorted(p for p in checkpoint.iterdir() if p.is_file())


def _evict(files: Iterable[Path], drop_caches: bool) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if drop_caches:
        _drop_caches()


def _drop_caches() -> str:
    """Drop the whole host's page cache (root only); says whether it worked."""
    try:
        os.sync()
        with open(_DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError as exc:
        return f"drop_caches refused ({exc.strerror})"
    return "echo 3 > /proc/sys/vm/drop_caches"
