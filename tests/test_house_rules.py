"""House rules a reviewer would otherwise have to catch by eye (see STYLE.md)."""

from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
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
