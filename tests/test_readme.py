"""The README documents every configuration key and every exported metric (the operator's
reference)."""

from __future__ import annotations

from pathlib import Path

from ec_redis.config import CacheConfig, ConnectorOptions


def test_every_config_key_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for key in CacheConfig.keys() + ConnectorOptions.keys():
        assert f"| `{key}` |" in readme, f"README lacks a row for {key}"


def test_every_exported_metric_is_documented_in_the_readme() -> None:
    import ast

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    tree = ast.parse((root / "src" / "ec_redis" / "connector" / "stats.py").read_text())
    names: dict[str, list[str]] = {}
    for node in ast.walk(tree):  # read, not imported: importing stats.py needs vLLM
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id in ("COUNTERS", "GAUGES")
            and isinstance(node.value, ast.Dict)
        ):
            names[node.target.id] = [ast.literal_eval(k) for k in node.value.keys if k]
    assert names.get("COUNTERS") and names.get("GAUGES"), "stats.py lost its metric tables"
    for name in names["COUNTERS"]:
        assert f"_{name}_total" in readme, f"README's metrics table lacks {name}"
    for name in names["GAUGES"]:
        assert f"_{name}`" in readme or f"_{name}," in readme, f"README lacks gauge {name}"
