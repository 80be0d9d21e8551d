"""The shell commands the docs show (README.md and docs/*.md), for the tests that run them.

A *command* is each logical line of a fenced block tagged ``bash``, ``sh``, ``shell`` or
``console``: blank lines and lines starting with ``#`` are skipped, a comment after the
command (``#`` after a blank, outside quotes) is cut off, a line ending in ``\\`` goes on on
the next one, and so does a line that leaves a quote open (the newline stays in the text,
as in the shell); a leading ``$ `` is stripped. In a ``console`` block only lines starting
with ``$`` are commands, the rest is output.

A test that runs a doc command takes its text from ``doc_command("<its first words>")``;
``tests/test_docs.py`` checks that every command is taken by some test that way.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_TAGS = frozenset({"bash", "sh", "shell", "console"})
# The Redis URL the docs' commands use; a test swaps in the server it started.
DOC_REDIS_URL = "redis://localhost:6379/0"
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)")


@dataclass(frozen=True)
class DocCommand:
    path: str  # relative to the repository root, e.g. "docs/operating.md"
    line: int  # 1-based line of the command's first physical line
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class FencedBlock:
    path: str
    line: int  # 1-based line of the first line inside the fence
    tag: str  # the info string's first word, lower-cased ("" when untagged)
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def fenced_blocks(text: str, path: str = "<text>") -> list[FencedBlock]:
    """Every fenced code block of a Markdown text (an unclosed fence runs to the end)."""
    blocks: list[FencedBlock] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if opened is None:
            i += 1
            continue
        fence, tag = opened.group(1), opened.group(2).lower()
        start = i + 1
        i = start
        while i < len(lines):
            closing = lines[i].strip()
            if closing.startswith(fence[0] * len(fence)) and set(closing) == {fence[0]}:
                break
            i += 1
        blocks.append(FencedBlock(path, start + 1, tag, tuple(lines[start:i])))
        i += 1
    return blocks


def _scan(line: str, quote: str | None) -> tuple[str, str | None]:
    """``line`` without a trailing shell comment (a ``#`` after a blank, outside quotes),
    and the quote still open at its end; ``quote``: the one open at its start."""
    escaped = False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote is None and char in "'\"":
            quote = char
        elif char == quote:
            quote = None
        elif quote is None and char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), None
    return (line if quote else line.rstrip()), quote


def _continued(text: str) -> bool:
    """Whether ``text`` ends in a backslash that escapes the newline."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1


def block_commands(block: FencedBlock) -> list[DocCommand]:
    """The commands of one shell block (none for any other tag)."""
    if block.tag not in SHELL_TAGS:
        return []
    commands: list[DocCommand] = []
    text: str | None = None  # the logical line being built
    first, quote = 0, None
    for offset, raw in enumerate(block.lines):
        if text is None:
            line = raw.strip()
            if block.tag == "console":
                if not line.startswith("$"):
                    continue  # output
                line = line[1:].lstrip()
            elif line.startswith("$ "):
                line = line[2:].lstrip()
            if not line or line.startswith("#"):
                continue
            first = block.line + offset
            text, quote = _scan(line, None)
        elif quote is not None:  # inside a quote: the newline is part of the word
            kept, quote = _scan(raw, quote)
            text += "\n" + kept
        else:  # after a backslash
            kept, quote = _scan(raw.strip(), None)
            text += " " + kept
        if quote is not None:
            continue
        if _continued(text):
            text = text[:-1].rstrip()
            continue
        commands.append(DocCommand(block.path, first, text.rstrip()))
        text = None
    if text is not None:  # the block ended inside a continuation
        commands.append(DocCommand(block.path, first, text.rstrip()))
    return commands


def commands_in(text: str, path: str = "<text>") -> list[DocCommand]:
    """Every command of a Markdown text."""
    return [c for block in fenced_blocks(text, path) for c in block_commands(block)]


@functools.cache
def doc_commands(root: Path = ROOT) -> list[DocCommand]:
    """Every command in README.md and docs/*.md."""
    found: list[DocCommand] = []
    for path in doc_files(root):
        found += commands_in(path.read_text(), str(path.relative_to(root)))
    return found


def matching(prefix: str, commands: list[DocCommand]) -> list[DocCommand]:
    return [c for c in commands if c.text.startswith(prefix)]


def doc_command(prefix: str) -> str:
    """The text of the one doc command that starts with ``prefix``; fails the test when no
    command or several do."""
    found = matching(prefix, doc_commands())
    if len(found) != 1:
        listed = "".join(f"\n  {c.where}: {c.text}" for c in found)
        pytest.fail(
            f"{len(found)} doc commands start with {prefix!r}, not one{listed}", pytrace=False
        )
    return found[0].text


def pointed_at(command: str, redis_url: str) -> str:
    """``command`` with the docs' Redis URL replaced by ``redis_url`` (a test's own server)."""
    assert DOC_REDIS_URL in command, f"{command!r} does not use {DOC_REDIS_URL}"
    return command.replace(DOC_REDIS_URL, redis_url)
