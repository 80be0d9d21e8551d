"""Security properties of the package itself: no code path that can execute stored data
(pickle, eval/exec, torch.load), and credentials that never reach a log line, an exception
message or a repr."""

from __future__ import annotations

import ast
import dataclasses
import logging
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ec_redis
from ec_redis import TieredCache
from ec_redis.config import CacheConfig
from ec_redis.embedded import EmbeddedRedis, Flavor, free_port
from ec_redis.errors import ConfigError, RedisSetupError
from tests.conftest import embedding
from tests.counters import count

SRC = Path(ec_redis.__file__).parent
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
UNSAFE_BUILTINS = {"eval", "exec"}
PASSWORD = "Pw-7f3e9c1a-do-not-log"  # distinctive: any occurrence anywhere is a leak
SALT = "salt-5b1d0e77-secret"
SENTINEL_PASSWORD = "SentinelPw-91ac44"


# -- no code path executes stored data -------------------------------------------------------


def unsafe_uses(source: str, filename: str = "<string>") -> list[str]:
    """Imports of pickle-like modules, eval/exec calls, torch.load (any spelling), and
    ``allow_pickle=True`` / ``weights_only=False`` arguments -- found in the syntax tree, so
    docstrings and comments that mention them do not count."""
    found: list[str] = []
    torch_names = {"torch"}
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNSAFE_MODULES:
                    found.append(f"{where} import {alias.name}")
                if alias.name == "torch":
                    torch_names.add(alias.asname or "torch")
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[0]
            if module in UNSAFE_MODULES:
                found.append(f"{where} from {node.module} import ...")
            if node.module == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where} from torch import load")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and (
                func.id in UNSAFE_BUILTINS
                or (func.id == "__import__" and _names_unsafe_module(node))
            ):
                found.append(f"{where} {func.id}(...)")
            if isinstance(func, ast.Attribute):
                if func.attr in UNSAFE_BUILTINS and _root_name(func) == "builtins":
                    found.append(f"{where} builtins.{func.attr}(...)")
                if func.attr == "load" and _root_name(func) in torch_names:
                    found.append(f"{where} torch.load(...)")
                if func.attr == "import_module" and _names_unsafe_module(node):
                    found.append(f"{where} import_module(<pickle-like>)")
            for kw in node.keywords:
                unsafe_value = kw.arg == "allow_pickle"  # allow_pickle=True, weights_only=False
                if (
                    kw.arg in ("allow_pickle", "weights_only")
                    and isinstance(kw.value, ast.Constant)
                    and kw.value.value is unsafe_value
                ):
                    found.append(f"{where} {kw.arg}={kw.value.value}")
    return found


def _root_name(node: ast.expr) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def _names_unsafe_module(call: ast.Call) -> bool:
    first = call.args[0] if call.args else None
    return (
        isinstance(first, ast.Constant)
        and isinstance(first.value, str)
        and first.value.split(".")[0] in UNSAFE_MODULES
    )


def test_the_scanner_finds_what_it_looks_for_and_ignores_docstrings() -> None:
    bad = (
        "import pickle\nimport torch as T\nfrom marshal import loads\nfrom torch import load\n"
        "eval('1')\nexec('x=1')\nT.load('f')\nimport numpy\nnumpy.load('f', allow_pickle=True)\n"
        "T.load('f', weights_only=False)\n__import__('pickle')\n"
        "import importlib\nimportlib.import_module('dill')\nimport builtins\nbuiltins.eval('1')\n"
    )
    assert len(unsafe_uses(bad)) == 12, unsafe_uses(bad)
    harmless = (
        '"""Never uses pickle, eval(, exec( or torch.load on stored data."""\n'
        "# pickle.loads(x) would be unsafe\n"
        "def f(x):\n    '''torch.load(x)'''\n    return x.evaluate()\n"
        "numpy_load = {'allow_pickle': False}\nimport torch\ntorch.save\n"
    )
    assert unsafe_uses(harmless) == []


def test_the_package_never_unpickles_evaluates_or_torch_loads() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20  # the whole package, not an empty glob
    found = [hit for f in files for hit in unsafe_uses(f.read_text(), str(f.relative_to(SRC)))]
    assert found == []


# -- credentials never logged ----------------------------------------------------------------


def config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "device": "cpu",
        "producer_id": "test",
        "compression": "none",
        "cpu_cache_bytes": 0,
        "redis_connect_timeout_s": 0.5,
        "redis_socket_timeout_s": 0.5,
        "breaker_failures": 2,
        "breaker_cooldown_s": 0.05,
        "breaker_max_cooldown_s": 0.1,
        "tenant_salt": SALT,
        "sentinel_password": SENTINEL_PASSWORD,
    }
    base.update(overrides)
    return base


SECRETS = (PASSWORD, SALT, SENTINEL_PASSWORD)


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{where} contains a secret: {text!r}"


def assert_no_secret_in_logs(caplog: pytest.LogCaptureFixture) -> None:
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    for record in caplog.records:
        text = formatter.format(record)  # message, args and any traceback
        assert_no_secret(text + repr(record.args), f"log record {record.name}")


def exception_text(exc: BaseException) -> str:
    """Everything an exception shows where it is printed or reported: str and repr of it and
    of every exception in its displayed chain (``__cause__``, and ``__context__`` unless
    ``raise ... from None`` suppressed it, as traceback and error reporters do), and the
    formatted traceback."""
    parts = [*traceback.format_exception(type(exc), exc, exc.__traceback__)]
    seen: BaseException | None = exc
    while seen is not None:
        parts += [str(seen), repr(seen)]
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return "\n".join(parts)


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)  # the root logger: ec_redis, redis-py, everything
    yield caplog


URL_FORMS = {
    "user-password": "redis://cache-user:{pw}@127.0.0.1:{port}/0",
    "password-only": "redis://:{pw}@127.0.0.1:{port}/0",
    "query-string": "redis://127.0.0.1:{port}/0?password={pw}",
}


@pytest.mark.redis
@pytest.mark.parametrize("form", sorted(URL_FORMS))
def test_credentials_are_not_logged_when_redis_is_unreachable(
    form: str, debug_logs: pytest.LogCaptureFixture
) -> None:
    url = URL_FORMS[form].format(pw=PASSWORD, port=free_port())  # nothing listens there
    cache = TieredCache.from_config(config(redis_url=url))  # an outage only warns
    try:
        tensor = embedding(rows=4, width=64, seed=1)
        for i in range(4):
            cache.put(f"k{i}", tensor)
            assert cache.get(f"missing{i}") is None
            cache.contains(f"k{i}")
            cache.delete(f"x{i}")
        cache.flush(5)
        stats = cache.stats()
        assert count(stats["redis"], "errors") > 0  # the failures really happened
        assert count(stats["writer"], "failed") > 0
        assert_no_secret(repr(stats), "stats()")
        assert_no_secret(repr(cache.config), "repr(config)")
        assert_no_secret(str(cache.config.describe()), "describe()")
        assert cache.redis is not None
        assert_no_secret(repr(cache.redis.client), "repr(redis client)")
    finally:
        cache.close()
    assert any("unreachable" in r.getMessage() for r in debug_logs.records)
    assert any("failed" in r.getMessage() for r in debug_logs.records)
    assert_no_secret_in_logs(debug_logs)


@pytest.fixture(scope="module")
def password_server(server_flavor: Flavor) -> Iterator[EmbeddedRedis]:
    """A server whose default user has another password than the client's."""
    args = ("--requirepass", "the-servers-own-password")
    server = EmbeddedRedis.start(server_flavor, extra_args=args)
    yield server
    server.stop()


@pytest.mark.redis
@pytest.mark.parametrize("form", sorted(URL_FORMS))
def test_a_rejected_password_is_not_in_the_error_or_the_logs(
    form: str, password_server: EmbeddedRedis, debug_logs: pytest.LogCaptureFixture
) -> None:
    url = URL_FORMS[form].format(pw=PASSWORD, port=password_server.port)
    with pytest.raises(RedisSetupError) as caught:
        TieredCache.from_config(config(redis_url=url))
    text = exception_text(caught.value)
    assert "redis_url" in str(caught.value)  # it says what to fix...
    assert_no_secret(text, "RedisSetupError")  # ...without repeating the secret
    assert "the-servers-own-password" not in text
    assert_no_secret_in_logs(debug_logs)


def test_config_repr_str_and_describe_mask_every_secret() -> None:
    cfg = CacheConfig.from_dict(
        {
            "redis_url": f"redis://u:{PASSWORD}@h:6379/0",
            "tenant_salt": SALT,
            "sentinel_password": SENTINEL_PASSWORD,
        }
    )
    # the dataclass-generated repr showed all three verbatim
    for text in (repr(cfg), str(cfg), f"{cfg}", f"{cfg!r}", str([cfg]), str(cfg.describe())):
        assert_no_secret(text, "config text")
    assert "redis://u:***@h:6379/0" in repr(cfg) and "namespace='ecr'" in repr(cfg)
    assert repr(cfg).startswith("CacheConfig(") and "tenant_salt='***'" in repr(cfg)
    assert cfg.describe()["sentinel_password"] == "***"
    assert cfg.redis_url is not None and PASSWORD in cfg.redis_url  # the value itself is intact
    assert cfg == dataclasses.replace(cfg)  # still an ordinary frozen dataclass
    plain = CacheConfig.from_dict({})
    assert plain.describe()["sentinel_password"] == "" and "sentinel_password=''" in repr(plain)


@pytest.mark.parametrize(
    "raw",
    [
        {"redis_url": f"redis://:{PASSWORD}@h:6379/0", "cpu_cache_bytes": "lots"},
        {"redis_url": f"redis+cluster://u:{PASSWORD}@h1:1,h2:notaport"},
        {"redis_url": f"redis://:{PASSWORD}@h:6379/0", "no_such_key": 1},
        {"sentinel_password": 1234567},  # a numeric password (YAML/JSON) is still secret
        {"tenant_salt": ["not", "a", "string"]},
    ],
)
def test_config_errors_never_repeat_a_secret(raw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as caught:
        CacheConfig.from_dict(raw)
    text = exception_text(caught.value)
    assert_no_secret(text, "ConfigError")
    assert "1234567" not in text and "'not'" not in text
