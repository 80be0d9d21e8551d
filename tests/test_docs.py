"""The docs: docs/configuration.md documents every configuration key and docs/metrics.md every
exported metric (the operator's reference); every shell command in README.md and docs/*.md is
run by a test; every link between them resolves."""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest

from ec_redis.config import CacheConfig, ConnectorOptions, parse_extra_config
from tests.doc_commands import (
    ROOT,
    DocCommand,
    commands_in,
    doc_command,
    doc_commands,
    doc_files,
    fenced_blocks,
    matching,
)

DOCS = ROOT / "docs"
# Not scanned for doc_command("...") calls: the helper itself, and this file's samples.
NOT_RUNNERS = {ROOT / "tests" / "doc_commands.py", Path(__file__).resolve()}


def test_every_config_key_is_documented() -> None:
    page = (DOCS / "configuration.md").read_text()
    for key in CacheConfig.keys() + ConnectorOptions.keys():
        assert f"| `{key}` |" in page, f"docs/configuration.md lacks a row for {key}"


def test_every_exported_metric_is_documented() -> None:
    page = (DOCS / "metrics.md").read_text()
    tree = ast.parse((ROOT / "src" / "ec_redis" / "connector" / "stats.py").read_text())
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
        assert f"_{name}_total" in page, f"docs/metrics.md's table lacks {name}"
    for name in names["GAUGES"]:
        assert f"_{name}`" in page or f"_{name}," in page, f"docs/metrics.md lacks gauge {name}"


# -- every command in the docs is one that a test runs --------------------------------------


def selectors() -> list[tuple[str, str]]:
    """(file:line, prefix) of every ``doc_command("<literal>")`` call in the tests."""
    found: list[tuple[str, str]] = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.resolve() in NOT_RUNNERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            arg = node.args[0]
            if (
                name == "doc_command"
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
            ):
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", arg.value))
    return found


def test_every_command_in_the_docs_is_run_by_a_test() -> None:
    commands = doc_commands()
    assert any(c.text == "bash scripts/test.sh" for c in commands)  # the parser found them
    prefixes = [prefix for _, prefix in selectors()]
    unrun = [c for c in commands if not any(c.text.startswith(p) for p in prefixes)]
    assert not unrun, "doc commands no test takes with doc_command(...):\n" + "\n".join(
        f"  {c.where}: {c.text}" for c in unrun
    )


def test_every_doc_command_a_test_asks_for_is_in_the_docs_once() -> None:
    commands = doc_commands()
    wrong = [
        f"  {where}: doc_command({prefix!r}) matches {len(matching(prefix, commands))}"
        for where, prefix in selectors()
        if len(matching(prefix, commands)) != 1
    ]
    assert not wrong, "doc_command calls that match no command, or several:\n" + "\n".join(wrong)


SAMPLE = """\
# Title

```bash
# a comment line
bash scripts/run.sh   # a trailing comment
  $ ec-redis doctor --redis-url redis://localhost:6379/0

vllm serve m --port 1 \\
  --ec-transfer-config '{"a": "#not a comment",
  "b": 2}'  # done
echo "a \\"quoted\\" #hash"
```

```console
$ ec-redis stats --json
{"groups": []}
```

```text
not a command
```

```python
print("nor this")
```

  ```sh
  last \\
```
"""


def test_the_parser_reads_commands_as_the_shell_would() -> None:
    got = commands_in(SAMPLE, "sample.md")
    assert [(c.line, c.text) for c in got] == [
        (5, "bash scripts/run.sh"),
        (6, "ec-redis doctor --redis-url redis://localhost:6379/0"),
        (8, 'vllm serve m --port 1 --ec-transfer-config \'{"a": "#not a comment",\n  "b": 2}\''),
        (11, 'echo "a \\"quoted\\" #hash"'),
        (15, "ec-redis stats --json"),
        (28, "last"),
    ]
    assert got[0] == DocCommand("sample.md", 5, "bash scripts/run.sh")
    assert got[0].where == "sample.md:5"
    assert [b.tag for b in fenced_blocks(SAMPLE)] == ["bash", "console", "text", "python", "sh"]


def test_doc_command_fails_unless_exactly_one_command_starts_so() -> None:
    assert doc_command("bash scripts/test") == "bash scripts/test.sh"
    for prefix, many in (("no such command", 0), ("ec-redis ", 2)):  # doctor and stats
        assert len(matching(prefix, doc_commands())) == many
        with pytest.raises(pytest.fail.Exception, match=f"{many} doc commands start with"):
            doc_command(prefix)


# -- the vLLM examples, which need a GPU model and are shown as text -------------------------

# Stands in for `vllm`: prints each argument NUL-terminated, then a separator.
FAKE_VLLM = "vllm() { printf '%s\\0' \"$@\"; printf '\\1\\0'; }\nMODEL=some/model\n"


def test_the_vllm_examples_give_a_valid_connector_config() -> None:
    blocks = [
        b
        for b in fenced_blocks((ROOT / "README.md").read_text(), "README.md")
        if "vllm serve" in b.text
    ]
    assert len(blocks) == 2 and all(b.tag == "text" for b in blocks)
    roles: list[str] = []
    for block in blocks:  # run as the shell would, with vllm replaced by FAKE_VLLM
        out = subprocess.run(
            ["bash", "-c", FAKE_VLLM + block.text], capture_output=True, check=True
        ).stdout
        for call in out.decode().split("\1\0")[:-1]:
            argv = call.split("\0")[:-1]
            assert argv[0] == "serve" and "--ec-transfer-config" in argv, argv
            config = json.loads(argv[argv.index("--ec-transfer-config") + 1])
            assert config["ec_connector"] == "ECRedisConnector"
            assert config["ec_connector_module_path"] == "ec_redis.connector"
            cache, _ = parse_extra_config(config["ec_connector_extra_config"])
            assert cache.redis_url
            roles.append(config["ec_role"])
    assert roles == ["ec_both", "ec_producer", "ec_consumer"]


# -- links -----------------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`+[^`]*`+")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every line of a Markdown text outside its fenced blocks."""
    inside: set[int] = set()
    for block in fenced_blocks(text):
        inside.update(range(block.line - 1, block.line + len(block.lines) + 1))
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if n not in inside]


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown text."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_the_anchor_rule_is_githubs() -> None:
    page = "# ec_redis — a cache\n## The encoder → PD race\n## Connector settings (`x_y`)\n"
    page += "## Tenants' settings\n## Scheduler cost per step (issue #8)\n## Twice\n## Twice\n"
    page += "```\n# not a heading\n```\n"
    assert anchors(page) == {
        "ec_redis--a-cache",
        "the-encoder--pd-race",
        "connector-settings-x_y",
        "tenants-settings",
        "scheduler-cost-per-step-issue-8",
        "twice",
        "twice-1",
    }


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link outside code (link texts may wrap)."""
    prose_only = dict(prose_lines(text))
    lines = [prose_only.get(n, "") for n in range(1, len(text.splitlines()) + 1)]
    prose = _CODE_SPAN.sub(lambda span: "\n" * span.group().count("\n"), "\n".join(lines))
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in _LINK.finditer(prose)]


def test_links_are_found_where_they_wrap_and_not_in_code() -> None:
    text = "see [a\nlink](x.md#y) and `[not](this.md)`\n```\n[nor](that.md)\n```\n[b](z.md)\n"
    assert links(text) == [(1, "x.md#y"), (6, "z.md")]


def test_every_link_between_the_docs_resolves() -> None:
    broken: list[str] = []
    for path in doc_files():
        for number, target in links(path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    pages = [p for p in sorted(DOCS.glob("*.md")) if not p.name.endswith(".draft.md")]
    assert len(pages) >= 6
    missing = [p.name for p in pages if f"(docs/{p.name})" not in readme]
    assert not missing, f"the README's Documentation list lacks {missing}"
