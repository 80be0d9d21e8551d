"""Redis URLs for every topology, parsed without touching the network.

========================================================  ===================================
``redis://[user:pass@]host:port[/db]``                    one server
``rediss://...``                                          one server over TLS
``unix://[user:pass@]/path/redis.sock[?db=N]``            one server on a Unix socket
``redis+cluster://[user:pass@]h1:p1,h2:p2[,...]``         Redis Cluster (any seed nodes)
``rediss+cluster://...``                                  Redis Cluster over TLS
``redis+sentinel://[user:pass@]s1:p1,s2:p2/service[/db]``  the master Sentinel names ``service``
``rediss+sentinel://...``                                 ... over TLS
========================================================  ===================================

The credentials in the URL are the data servers' (Redis ACL user and password); a Sentinel
that needs its own password takes it from the ``sentinel_password`` setting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

STANDALONE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SCHEMES = STANDALONE_SCHEMES + CLUSTER_SCHEMES + SENTINEL_SCHEMES
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(\d{1,5}))?$")


@dataclass(frozen=True)
class RedisTarget:
    """Where and how to connect; ``password`` is never part of ``str()`` of this object."""

    kind: str  # "standalone" | "cluster" | "sentinel"
    tls: bool
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        shown = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"RedisTarget({self.kind}, tls={self.tls}, nodes={shown}, service={self.service!r})"

    __str__ = __repr__


def parse_target(url: str) -> RedisTarget:
    """Parse a cluster or sentinel URL (standalone URLs go to redis-py's own ``from_url``).

    Raises ``ValueError`` saying what is wrong; messages never contain the password.
    """
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    tls = scheme.startswith("rediss")
    if scheme in STANDALONE_SCHEMES:
        return RedisTarget("standalone", tls)
    rest = url.split("://", 1)[1]
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        credentials, netloc = netloc.rsplit("@", 1)
        user, _, secret = credentials.partition(":")
        username, password = unquote(user) or None, unquote(secret) or None
    nodes = tuple(_host_port(part) for part in netloc.split(",") if part)
    if not nodes:
        raise ValueError("list at least one host:port")
    path = path.split("?", 1)[0]
    if scheme in CLUSTER_SCHEMES:
        if path.strip("/"):
            raise ValueError("a cluster URL has no path (Redis Cluster has only database 0)")
        return RedisTarget("cluster", tls, nodes, username=username, password=password)
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("a sentinel URL ends with /service_name or /service_name/db")
    db = int(parts[1]) if len(parts) == 2 else 0
    return RedisTarget("sentinel", tls, nodes, unquote(parts[0]), db, username, password)


def _host_port(text: str) -> tuple[str, int]:
    match = _HOST_PORT.match(text)
    if not match:
        raise ValueError(f"{text!r} is not host:port")
    host = match.group(1).strip("[]")
    port = int(match.group(2) or 6379)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range")
    return host, port


def mask_url(url: str | None) -> str | None:
    """Hide the password of a Redis URL of any topology: ``redis://user:***@host:6379/0``."""
    if not url or "://" not in url:
        return url
    # redis-py also takes the password from the query string (``?password=...``)
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    scheme, rest = url.split("://", 1)
    netloc, sep, tail = rest.partition("/")
    if "@" not in netloc:
        return url
    credentials, hosts = netloc.rsplit("@", 1)
    user, colon, _ = credentials.partition(":")
    shown = f"{user}:***" if colon else user
    return f"{scheme}://{shown}@{hosts}{sep}{tail}"


def validate(url: str) -> None:
    """Raise ``ValueError`` for a URL no topology accepts (used by the config parser)."""
    target = parse_target(url)
    if target.kind == "standalone" and not url.startswith("unix://"):
        host = urlsplit(url).hostname
        if not host:
            raise ValueError("the URL names no host")
