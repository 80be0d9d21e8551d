"""The writer process's setup message: what it rebuilds the parent's Redis tier from, and the
fingerprint of the code it must run.

The message is checked when the cache is built, by rebuilding the configuration from it
exactly as the child will: a ``CacheConfig`` made by code (not by ``from_dict``) may hold
values JSON cannot carry (a ``torch.device`` for ``device``: sent as its text) or values
``from_dict`` refuses. Those fail there, naming the key, instead of failing every start.

The fingerprint digests this process's ``ec_redis`` sources. A child imports them from disk
when it starts, possibly long after the parent did (``pip install -U`` on a running server,
another checkout first on the path): a child whose code differs refuses to serve, and the
parent writes on its own threads instead (counted as failed starts).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import ec_redis
from ec_redis.config import CacheConfig
from ec_redis.errors import ConfigError
from ec_redis.keys import ModelIdentity

_JSON_SCALARS = (str, int, float, bool, type(None))


@functools.cache
def fingerprint() -> str:
    """``version:digest`` of this process's ``ec_redis`` package: every ``.py`` file under
    it, by relative path and content (computed once per process, at its first use)."""
    root = Path(ec_redis.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return f"{ec_redis.__version__}:{digest.hexdigest()[:24]}"


def setup_message(config: CacheConfig, identity: ModelIdentity, producer_id: str) -> dict[str, Any]:
    """The setup message for a writer process of a cache built from ``config``; raises
    ``ConfigError`` when the child could not rebuild the same configuration from it."""
    message = {
        "config": _fields(config),
        "identity": _fields(identity),
        "producer_id": producer_id,
        "code": fingerprint(),
    }
    try:
        rebuilt, rebuilt_identity = read(json.loads(json.dumps(message)))
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"ec_redis: writer_process is on, but the writer process cannot rebuild this "
            f"configuration ({exc}); build the CacheConfig with CacheConfig.from_dict, or set "
            "writer_process: false"
        ) from None
    differ = [
        f.name
        for f in dataclasses.fields(config)
        if f.name != "producer_id"
        and _plain(getattr(rebuilt, f.name)) != _plain(getattr(config, f.name))
    ]
    if differ or rebuilt_identity != identity:
        raise ConfigError(
            f"ec_redis: writer_process is on, but the writer process would rebuild "
            f"{differ or 'the model identity'} differently from what this cache runs with; "
            "build the CacheConfig with CacheConfig.from_dict, or set writer_process: false"
        )
    return message


def read(message: dict[str, Any]) -> tuple[CacheConfig, ModelIdentity]:
    """The configuration and model identity a setup message carries (the child's side)."""
    config = dataclasses.replace(
        CacheConfig.from_dict(message["config"]), producer_id=str(message["producer_id"])
    )
    return config, ModelIdentity(**message["identity"])


def _fields(value: CacheConfig | ModelIdentity) -> dict[str, object]:
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}


def _plain(value: object) -> object:
    """``value`` as JSON carries it: scalars as they are, anything else (a ``torch.device``)
    as its text, which the child parses like a configuration file's."""
    return value if isinstance(value, _JSON_SCALARS) else str(value)
