"""Parsing of human sizes ("8GiB", "512MB", 4096) into byte counts."""

from __future__ import annotations

import re
from decimal import Decimal

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: object) -> int:
    """Return a byte count for an int or a string such as ``"8GiB"``, ``"512MB"``, ``"0"``.

    Raises ``ValueError`` for anything else (booleans, negatives, unknown units).
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got the boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match:
            number, unit = match.groups()
            factor = _UNITS.get(unit.lower())
            if factor is not None:
                return int(Decimal(number) * factor)  # exact: float(2.01) * 1000 < 2010
    raise ValueError(f"expected a byte size such as 4194304 or '4MiB', got {value!r}")


def format_bytes(num_bytes: float) -> str:
    """Format a byte count with a binary unit, e.g. ``16.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} GiB"  # pragma: no cover - loop always returns
