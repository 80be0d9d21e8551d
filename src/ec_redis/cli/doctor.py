"""``ec-redis doctor``: is this Redis fit to be the cache's cold tier? Each finding says how to
fix it; any FAIL makes the exit code non-zero."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

from ec_redis.codec.format import HEADER_SIZE
from ec_redis.config import CacheConfig
from ec_redis.errors import RedisSetupError
from ec_redis.redis_url import mask_url, parse_target

OK, WARN, FAIL = "ok", "warn", "FAIL"
GOOD_POLICIES = ("allkeys-lru", "allkeys-lfu")


@dataclass
class Finding:
    level: str
    check: str
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"level": self.level, "check": self.check, "detail": self.detail, "fix": self.fix}


def run(config: CacheConfig) -> list[Finding]:
    from ec_redis.redis_conn import check_connection, make_client

    assert config.redis_url is not None
    target = parse_target(config.redis_url)
    findings = [Finding(OK, "url", f"{mask_url(config.redis_url)} ({target.kind})")]
    client = make_client(config)
    try:
        try:
            outage = check_connection(client)
        except RedisSetupError as exc:
            return [*findings, Finding(FAIL, "connect", str(exc).split(";")[0], _fix(exc))]
        if outage is not None:
            return [
                *findings,
                Finding(
                    FAIL, "connect", outage, "check host, port and firewall; is redis-server up?"
                ),
            ]
        detail = "TLS handshake and PING ok" if target.tls else "PING ok"
        findings.append(Finding(OK, "connect", detail))
        findings += _server(client, target.kind)
        findings += _memory(client, config)
        findings.append(_probe(client, config))
    finally:
        client.close()
    return findings


def _server(client: Any, kind: str) -> list[Finding]:
    info = _first(client.info("server"))
    version = str(info.get("redis_version", "?"))
    major = int(version.split(".")[0]) if version[:1].isdigit() else 0
    level = OK if major >= 6 else FAIL
    # Valkey reports the Redis version it is compatible with (7.2.4) as redis_version
    server = f"Redis {version}"
    if "valkey_version" in info:
        server = f"Valkey {info['valkey_version']} (redis_version {version})"
    out = [
        Finding(
            level,
            "version",
            server,
            "" if level == OK else "ec_redis needs Redis >= 6.2 or Valkey (GETEX, UNLINK)",
        )
    ]
    if kind == "cluster":
        state = client.cluster_info()
        state = _first(state) if "cluster_state" not in state else state
        masters = len(client.get_primaries())
        good = state.get("cluster_state") == "ok"
        out.append(
            Finding(
                OK if good else FAIL,
                "topology",
                f"cluster_state={state.get('cluster_state')}, {masters} masters",
                "" if good else "repair the cluster (redis-cli --cluster check)",
            )
        )
    else:
        replication = _first(client.info("replication"))
        out.append(Finding(OK, "topology", f"{kind}, role={replication.get('role', '?')}"))
    return out


def _memory(client: Any, config: CacheConfig) -> list[Finding]:
    try:
        got = _first(client.config_get("maxmemory*"))
        bulk = _first(client.config_get("proto-max-bulk-len"))
    except Exception as exc:  # CONFIG is often denied to application users: say so
        return [
            Finding(
                WARN,
                "memory",
                f"cannot read CONFIG ({exc})",
                "run doctor as an admin user to check maxmemory and the policy",
            )
        ]
    out = []
    maxmemory = int(got.get("maxmemory", 0))
    policy = str(got.get("maxmemory-policy", "?"))
    if maxmemory == 0:
        out.append(
            Finding(
                WARN,
                "maxmemory",
                "0 (unlimited): Redis grows until the host runs out of memory",
                "set maxmemory, e.g. CONFIG SET maxmemory 32gb",
            )
        )
    else:
        out.append(Finding(OK, "maxmemory", f"{maxmemory / 2**30:.1f} GiB"))
    if policy in GOOD_POLICIES:
        out.append(Finding(OK, "eviction", policy))
    elif policy.startswith("volatile") and config.ttl_s > 0:
        out.append(Finding(OK, "eviction", f"{policy} (entries carry a TTL: ttl_s={config.ttl_s})"))
    else:
        why = (
            "a full Redis refuses every write"
            if policy == "noeviction"
            else "entries without a TTL are never evicted"
        )
        out.append(
            Finding(
                WARN,
                "eviction",
                f"{policy}: {why}",
                "CONFIG SET maxmemory-policy allkeys-lru (one eviction authority)",
            )
        )
    limit = int(bulk.get("proto-max-bulk-len", 512 << 20))
    if limit < config.chunk_bytes:
        out.append(
            Finding(
                FAIL,
                "value size",
                f"proto-max-bulk-len {limit} < chunk_bytes {config.chunk_bytes}",
                "raise proto-max-bulk-len or lower chunk_bytes",
            )
        )
    return out


def _probe(client: Any, config: CacheConfig) -> Finding:
    """SET, GET, then delete through the entry scripts' compare-and-delete: what the cache
    does (entries are switched and deleted by Lua scripts, EVALSHA/EVAL)."""
    from ec_redis.tiers.scripts import DELETE, DELETED

    key = f"{config.namespace}:doctor:{{{uuid.uuid4().hex}}}"
    value = os.urandom(1024)
    try:
        client.set(key, value, px=60_000)
        back = client.get(key)
        deleted = int(DELETE.run(client, [key], [value[:HEADER_SIZE]])[0]) == DELETED
    except Exception as exc:
        return Finding(
            FAIL,
            "probe",
            f"write/read/script delete of {key} failed: {exc}",
            f"give the user rights on ~{config.namespace}:* incl. +evalsha +eval "
            "(Lua scripting must be enabled)",
        )
    if back != value or not deleted:
        return Finding(
            FAIL, "probe", "read back different bytes", "check for a proxy rewriting values"
        )
    return Finding(OK, "probe", f"write/read/script delete under {config.namespace}:* ok")


def _first(reply: Any) -> dict[str, Any]:
    """A cluster client answers per node ({node: reply}); take the first node's."""
    if isinstance(reply, dict) and reply and all(isinstance(v, dict) for v in reply.values()):
        return dict(next(iter(reply.values())))
    return dict(reply)


def _fix(exc: RedisSetupError) -> str:
    text = str(exc)
    return text.split(";", 1)[1].strip() if ";" in text else ""
