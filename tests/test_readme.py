"""The README documents every configuration key (the operator's reference)."""

from __future__ import annotations

from pathlib import Path

from ec_redis.config import CacheConfig, ConnectorOptions


def test_every_config_key_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for key in CacheConfig.keys() + ConnectorOptions.keys():
        assert f"| `{key}` |" in readme, f"README lacks a row for {key}"
