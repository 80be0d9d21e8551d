"""Weights identity: a cheap content fingerprint of the checkpoint a model string names.

Keys hash the model identity; without this, a new fine-tune rolled into the same path (or a
hub branch that moved) would be served the old weights' encoder outputs. ``weights_fingerprint``
returns

- ``"files:<32 hex>"`` for a local directory or file: config.json, params.json and the
  processor configs that shape encoder inputs, hashed whole; sharded-weight indexes hashed
  whole; and for each weight file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``,
  ``*.gguf``, top level only, as vLLM loads them) its name, size, safetensors header and
  ``SAMPLE_BLOCKS`` blocks of ``SAMPLE_BLOCK_BYTES`` at fixed offsets spread over the file.
  A fine-tune changes bytes everywhere; a change that touches none of the samples, the
  header or the size goes unnoticed (pin ``model_fingerprint`` if you patch weights in place);
- ``"hf:<commit>"`` for a hub id: the commit its revision resolves to in the local HF cache
  (vLLM put config.json there before the connector starts), or the revision itself when it
  already is a 40-hex commit. Nothing is downloaded;
- ``""`` with one warning per model when neither works (remote or streamed weights, an
  unreadable checkpoint): keys then fall back to name and revision.

Per-file digests are memoised in-process by (path, size, mtime_ns, inode, device), so the
scheduler and worker halves in one process read the checkpoint once. Never raises.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import xxhash

from ec_redis.logutil import logger

SAMPLE_BLOCKS = 16
SAMPLE_BLOCK_BYTES = 64 * 1024
MAX_WHOLE_FILE_BYTES = 4 * 1024 * 1024  # configs and indexes: hashed whole up to this size
MAX_ST_HEADER_BYTES = 4 * 1024 * 1024  # a safetensors header is read up to this size
MEMO_ENTRIES = 4096  # a 200-shard checkpoint needs ~200; cleared when full
CONFIG_FILES = frozenset(
    {
        "config.json",
        "params.json",  # Mistral-format checkpoints
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
    }
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INDEX_SUFFIX = ".index.json"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_FileKey = tuple[str, int, int, int, int]

_lock = threading.Lock()
_memo: dict[_FileKey, str] = {}
_warned: set[str] = set()


def weights_fingerprint(
    model: str, revision: str | None = None, *, hub_cache_dirs: Sequence[str] = ()
) -> str:
    """The weights identity of ``model`` (a local path or a hub id), or ``""`` when unknown.

    ``hub_cache_dirs`` are searched for a hub id's refs before the default HF hub cache
    (e.g. vLLM's ``download_dir``).
    """
    try:
        if os.path.exists(model):
            return _local(model)
        return _hub(model, revision, hub_cache_dirs)
    except Exception as exc:  # an odd checkpoint must never stop the engine
        _warn_once(model, f"could not fingerprint its weights ({type(exc).__name__}: {exc})")
        return ""


def sample_offsets(size_bytes: int) -> list[int]:
    """Where the sampled blocks of a file of ``size_bytes`` start (empty: hashed whole)."""
    if size_bytes <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
        return []
    span = size_bytes - SAMPLE_BLOCK_BYTES
    return [span * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]


def clear_memo() -> None:
    """Forget every memoised digest and warning (tests, benchmarks)."""
    with _lock:
        _memo.clear()
        _warned.clear()


# -- local checkpoints ----------------------------------------------------------------------


def _local(model: str) -> str:
    path = Path(model)
    files = [path] if path.is_file() else _checkpoint_files(path)
    weights = [f for f in files if f.name.endswith(WEIGHT_SUFFIXES)]
    if not weights:
        _warn_once(model, f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {model}")
        return ""
    digest = xxhash.xxh3_128(b"ec_redis weights v1")
    for file in sorted(files, key=lambda f: f.name):
        digest.update(f"{file.name}\0{_file_digest(file)}\0".encode())
    return f"files:{digest.hexdigest()}"


def _checkpoint_files(directory: Path) -> list[Path]:
    out = []
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            wanted = name in CONFIG_FILES or name.endswith((INDEX_SUFFIX, *WEIGHT_SUFFIXES))
            if wanted and entry.is_file():  # follows symlinks (HF snapshots link to blobs)
                out.append(Path(entry.path))
    return out


def _file_digest(file: Path) -> str:
    info = os.stat(file)
    key: _FileKey = (
        os.path.realpath(file),
        info.st_size,
        info.st_mtime_ns,
        info.st_ino,
        info.st_dev,
    )
    with _lock:
        known = _memo.get(key)
    if known is not None:
        return known
    digest = _read_digest(file, info)
    with _lock:
        if len(_memo) >= MEMO_ENTRIES:
            _memo.clear()
        _memo[key] = digest
    return digest


def _read_digest(file: Path, info: os.stat_result) -> str:
    if not stat.S_ISREG(info.st_mode):
        raise OSError(f"{file} is not a regular file")
    size = info.st_size
    digest = xxhash.xxh3_128(size.to_bytes(8, "little"))
    with open(file, "rb") as f:
        fd = f.fileno()
        whole_limit = MAX_WHOLE_FILE_BYTES if file.suffix == ".json" else 0
        offsets = sample_offsets(size)
        if size <= whole_limit or not offsets:
            digest.update(_pread_exactly(fd, size, 0))
            return digest.hexdigest()
        if file.name.endswith(".safetensors"):
            digest.update(_safetensors_header(fd, size))
        for offset in offsets:
            digest.update(_pread_exactly(fd, SAMPLE_BLOCK_BYTES, offset))
    return digest.hexdigest()


def _safetensors_header(fd: int, size: int) -> bytes:
    """The 8-byte length and (up to ``MAX_ST_HEADER_BYTES`` of) the JSON header."""
    prefix = _pread_exactly(fd, 8, 0)
    length = int.from_bytes(prefix, "little")
    return prefix + _pread_exactly(fd, min(length, MAX_ST_HEADER_BYTES, size - 8), 8)


def _pread_exactly(fd: int, count: int, offset: int) -> bytes:
    parts, done = [], 0
    while done < count:
        part = os.pread(fd, count - done, offset + done)
        if not part:
            raise OSError(f"file shrank while being read (at byte {offset + done})")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


# -- hub ids --------------------------------------------------------------------------------


def _hub(repo_id: str, revision: str | None, cache_dirs: Iterable[str]) -> str:
    if revision and _COMMIT.fullmatch(revision):
        return f"hf:{revision}"
    commit = _cached_commit(repo_id, revision or "main", cache_dirs)
    if commit is None:
        _warn_once(
            repo_id,
            f"it is neither a local path nor a hub id whose revision {revision or 'main'!r} "
            "resolves in the local Hugging Face cache",
        )
        return ""
    return f"hf:{commit}"


def _cached_commit(repo_id: str, ref: str, cache_dirs: Iterable[str]) -> str | None:
    try:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:
        return None
    if not ref or any(part in ("", ".", "..") for part in ref.split("/")):
        return None
    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    for cache in (*cache_dirs, constants.HF_HUB_CACHE):
        try:
            text = (Path(cache) / folder / "refs" / ref).read_text().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if _COMMIT.fullmatch(text):
            return text
    return None


def _warn_once(model: str, why: str) -> None:
    with _lock:
        if model in _warned:
            return
        if len(_warned) >= MEMO_ENTRIES:
            _warned.clear()
        _warned.add(model)
    logger.warning(
        "ec_redis: no weights fingerprint for model %s: %s. Keys fall back to the model name "
        "and revision, so new weights under the same name would be served the old weights' "
        "encoder outputs; set model_fingerprint (e.g. %s) to a value that changes with them.",
        json.dumps(model),
        why,
        '{"model_fingerprint": "my-finetune-2026-11-30"}',
    )
