"""Reading counters in tests: one never counted reads 0, a name the product never counts fails.

Counters are sparse (``stats.Counters`` reports a name once it first counts; a stats delta
carries only what changed), so ``stats.get("errors", 0) == 0`` also passes for a counter that
was renamed or misspelt — a test that cannot fail. ``count`` accepts a missing name only when
the package counts it somewhere (``.inc("name")`` under ``src/ec_redis``, or a series the
connector exports); anything else is a test bug and fails naming what there is.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src" / "ec_redis"
_INC = re.compile(r"""\.inc\(\s*(f?)["']([^"']+)["']""")


@functools.cache
def _counted() -> re.Pattern[str]:
    """Every counter name the package counts: literal ``.inc`` names, f-string ones as
    patterns (``f"write_{outcome}"``), and the connector's exported series."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        for is_f, name in _INC.findall(path.read_text()):
            names.add(
                re.sub(r"\\\{[^}]*\\\}", "[a-z0-9_]+", re.escape(name)) if is_f else re.escape(name)
            )
    tree = ast.parse((SRC / "connector" / "stats.py").read_text())
    for node in ast.walk(tree):  # COUNTERS / GAUGES: read, not imported (that needs vLLM)
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id in ("COUNTERS", "GAUGES")
            and isinstance(node.value, ast.Dict)
        ):
            keys = node.value.keys
            names.update(re.escape(k.value) for k in keys if isinstance(k, ast.Constant))
    assert names, f"no counters found under {SRC}"
    return re.compile("|".join(sorted(names)))


def is_counted(name: str) -> bool:
    """Whether the package counts a counter called ``name`` anywhere."""
    return _counted().fullmatch(name) is not None


def count(stats: Mapping[str, Any], name: str) -> float:
    """``stats[name]``; 0 when it is missing only because nothing was counted yet."""
    if name in stats:
        return float(stats[name])
    assert is_counted(name), (
        f"no counter {name!r} is ever counted under src/ec_redis (renamed? misspelt?); "
        f"this snapshot has {sorted(stats)}"
    )
    return 0.0
