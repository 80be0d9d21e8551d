"""House rules a reviewer would otherwise have to catch by eye (see STYLE.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ec_redis"
_FROM_UNITTEST_IMPORT_MOCK = re.compile(r"from\s+unittest\s+import\s[^\n]*\bmock\b")


def uses_unittest_mock(text: str) -> bool:
    return "unittest.mock" in text or _FROM_UNITTEST_IMPORT_MOCK.search(text) is not None


def test_product_code_never_uses_unittest_mock() -> None:
    """A demo or a benchmark builds real objects (a real VllmConfig, a real engine)."""
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50  # the walk really reads the package
    offenders = [str(p.relative_to(SRC)) for p in files if uses_unittest_mock(p.read_text())]
    assert offenders == []


def test_the_mock_rule_recognises_every_spelling() -> None:
    for text in (
        "import unittest.mock",
        "from unittest import mock",
        "from unittest import TestCase, mock",
        "from unittest.mock import Mock",
        "    from unittest.mock import MagicMock, patch",
        "import unittest\nconfig = unittest.mock.Mock()",
    ):
        assert uses_unittest_mock(text), text
    assert not uses_unittest_mock("from unittest import TestCase\nmock_free = True")


# -- benchmarks live in bench/, and only the CLI reaches them -------------------------------

BENCH = "ec_redis.bench"
MAY_IMPORT_BENCH = ("bench", "cli")  # packages under ec_redis/ whose modules may import bench


def bench_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports in ``source`` (the module named ``module``; ``is_package``: an
    ``__init__.py``) that reach ``ec_redis.bench``, absolute or relative."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: list[str] = []
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        if any(name == BENCH or name.startswith(BENCH + ".") for name in names):
            found.append(f"{module}:{node.lineno}")
    return found


def test_only_benchmarks_and_the_cli_import_bench() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the walk really reads the package
    offenders: dict[str, list[str]] = {}
    for path in files:
        relative = path.relative_to(SRC)
        if relative.parts[1] in MAY_IMPORT_BENCH:
            continue
        names = relative.with_suffix("").parts
        is_package = names[-1] == "__init__"
        module = ".".join(names[:-1] if is_package else names)
        found = bench_imports(path.read_text(), module, is_package)
        if found:
            offenders[relative.as_posix()] = found
    assert offenders == {}  # no product module imports a benchmark, with no exceptions


def test_connector_holds_no_benchmark() -> None:
    modules = sorted(p.name for p in (PACKAGE / "connector").rglob("*.py"))
    assert "connector.py" in modules  # the walk really reads the connector
    assert [name for name in modules if "bench" in name] == []


def test_the_bench_import_rule_recognises_every_spelling() -> None:
    for source, module in (
        ("import ec_redis.bench", "ec_redis.cache"),
        ("import ec_redis.bench.timing as timing", "ec_redis.cache"),
        ("from ec_redis.bench.workload import Item", "ec_redis.connector.scheduler"),
        ("from ec_redis.bench import timing", "ec_redis.cache"),
        ("from ec_redis import cache, bench", "ec_redis.demo.hooks"),
        ("from .bench import timing", "ec_redis.cache"),
        ("from . import bench", "ec_redis.writer"),
        ("from ..bench.workload import Item", "ec_redis.connector.scheduler"),
        ("from .. import bench", "ec_redis.tiers.cpu"),
        ("from ...bench import timing", "ec_redis.tiers.redis.x"),
        ("def f():\n    from ec_redis.bench.connector_hooks import run", "ec_redis.demo.hooks"),
    ):
        assert bench_imports(source, module), (source, module)
    assert bench_imports("from .bench import timing", "ec_redis.connector", is_package=True) == []
    assert bench_imports("from ..bench import timing", "ec_redis.connector", is_package=True)
    for source, module in (
        ("import ec_redis.benchmarks", "ec_redis.cache"),
        ("from ec_redis.connector import bench", "ec_redis.cache"),
        ("from .bench import timing", "ec_redis.connector.scheduler"),  # ec_redis.connector.bench
        ("from ec_redis import cache  # ec_redis.bench", "ec_redis.demo.hooks"),
        ('"""from ec_redis.bench import timing"""', "ec_redis.cache"),
    ):
        assert bench_imports(source, module) == [], (source, module)
