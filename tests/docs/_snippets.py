"""Reading the docs' code blocks as the snippet tests run them.

Every fenced ``python`` block of README.md and docs/**/*.md is a snippet. An
HTML comment on the line just above a block says how it runs (Markdown
renders nothing of it)::

    <!-- snippet: run -->                     alone, in a fresh process (the default, no comment needed)
    <!-- snippet: continue -->                appended to the page's previous snippet (one program)
    <!-- snippet: process group=NAME -->      with every block of the group, each its own process, at once
    <!-- snippet: not-run reason="..." -->    not run here; the test lists it with the reason

Each program is written to a file in an empty folder and run there with
this interpreter (so ``if __name__ == "__main__"`` and multiprocessing's
spawn work as they do for a user's script), on loopback.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^\n`]*)$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")
KINDS = ("run", "continue", "process", "not-run")


class Block(NamedTuple):
    """One fenced python block: where it is, its code and its marker."""

    page: str  # relative to the repository
    line: int  # the opening fence's line, from 1
    code: str
    kind: str
    options: dict[str, str]


class Program(NamedTuple):
    """What one test runs: one or more processes started together."""

    id: str
    page: str
    line: int
    sources: tuple[str, ...]  # one per process
    reason: str  # why it is not run ("" where it is)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The python blocks of one page, with their markers (checked)."""
    page = str(path.relative_to(REPO))
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence)
                    and set(lines[j].strip()) == {fence[0]}), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a code block that is never closed")
        language = info.split()[0] if info else ""
        if language in ("python", "py"):
            marker = MARKER.match(lines[i - 1]) if i else None
            kind, options = _parse(marker.group("body"), f"{page}:{i + 1}") if marker else ("run", {})
            code = "\n".join(line[len(m.group("indent")):] for line in lines[i + 1:end]) + "\n"
            out.append(Block(page, i + 1, code, kind, options))
        elif i and MARKER.match(lines[i - 1]):
            raise ValueError(f"{page}:{i + 1}: a snippet marker above a {language or 'plain'} block (only python runs)")
        i = end + 1
    return out


def _parse(body: str, where: str) -> tuple[str, dict[str, str]]:
    words = shlex.split(body)
    if not words or words[0] not in KINDS:
        raise ValueError(f"{where}: snippet marker {body!r}: the first word must be one of {', '.join(KINDS)}")
    options = dict(w.split("=", 1) for w in words[1:] if "=" in w)
    if len(options) != len(words) - 1:
        raise ValueError(f"{where}: snippet marker {body!r}: options are key=value")
    needed = {"process": {"group"}, "not-run": {"reason"}}.get(words[0], set())
    if needed - set(options) or (words[0] == "not-run" and not options["reason"].strip()):
        raise ValueError(f"{where}: snippet marker {body!r} needs {', '.join(sorted(needed))}")
    return words[0], options


def programs(page_blocks: list[Block]) -> list[Program]:
    """A page's blocks as the programs the test runs, in page order."""
    out: list[Program] = []
    groups: dict[str, int] = {}
    last: int | None = None  # index in out of the program a `continue` extends
    for b in page_blocks:
        if b.kind == "continue":
            if last is None or out[last].reason or len(out[last].sources) != 1:
                raise ValueError(f"{b.page}:{b.line}: `continue` needs a run snippet above it on the page")
            p = out[last]
            out[last] = p._replace(sources=(p.sources[0] + b.code,))
            continue
        if b.kind == "process":
            name = b.options["group"]
            if name in groups:
                p = out[groups[name]]
                out[groups[name]] = p._replace(sources=p.sources + (b.code,))
            else:
                groups[name] = len(out)
                out.append(Program(f"{b.page}:{b.line}[{name}]", b.page, b.line, (b.code,), ""))
            last = None
            continue
        reason = b.options.get("reason", "") if b.kind == "not-run" else ""
        out.append(Program(f"{b.page}:{b.line}", b.page, b.line, (b.code,), reason))
        last = None if reason else len(out) - 1
    for name, k in groups.items():
        if len(out[k].sources) < 2:
            raise ValueError(f"{out[k].id}: process group {name!r} has one block; a group is two processes or more")
    return out


def all_programs() -> list[Program]:
    return [p for path in pages() for p in programs(blocks(path))]
