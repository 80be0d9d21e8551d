"""Fixtures for the real-vLLM end-to-end tests: tiny models built once per session (seed 0,
``tiny_model``, lives in tests/conftest.py: the connector tests drive vLLM's scheduler with it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import tiny_llava


@pytest.fixture(scope="session")
def other_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with different random weights (seed 1)."""
    return tiny_llava(tmp_path_factory, seed=1)
