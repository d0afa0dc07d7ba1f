"""A process's name for labels and tables: from its command line, bounded.

The kernel's name (``comm``) is cut at 15 characters (``run_ray_tests.s``)
and is the interpreter's for every script (``python3``), so by default a
process is named from its command line: the script or module an interpreter
runs (``train.py``, ``vllm.entrypoints.api_server``), Ray's title of a
worker (``ray::Trainer``), else the program's base name. Arguments never
enter a name (they would make label values unbounded), and a name is cut at
``max_chars``.
"""

from __future__ import annotations

__all__ = ["NameSource", "process_name"]

import os
import re
from typing import Literal

from ._types import ProcessMemory

NameSource = Literal["cmdline", "comm"]
"""``cmdline``: from the command line (default); ``comm``: the kernel's 15-character name."""

# Programs that run a script named by their first argument that is not an option.
_INTERPRETER = re.compile(r"^(python|pypy|bash|sh|dash|zsh|ksh|node|perl|ruby|Rscript|julia)[\d.]*$")
# Interpreter options that take a value (``python -W ignore x.py``, ``bash -o pipefail x.sh``).
_OPTIONS_WITH_VALUE = frozenset(("-W", "-X", "-Q", "-o", "-O", "--require", "-r", "-I", "-e"))


def _ray_group(title: str) -> str:
    # ``ray::Actor.method arg`` -> ``ray::Actor``: methods and task arguments
    # would make the names unbounded.
    return title.split(" ", 1)[0].split(".", 1)[0]


def _script(args: tuple[str, ...]) -> str | None:
    """The script or ``-m`` module an interpreter runs, or None (``-c``, an interactive shell)."""
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1]
        if arg in ("-c", "--command", "-"):
            return None
        if arg in _OPTIONS_WITH_VALUE:
            skip = True
            continue
        if arg.startswith("-"):
            continue
        if arg.startswith(("/dev/fd/", "/proc/")):
            return None  # a script piped in: its fd number names nothing
        return os.path.basename(arg) or None
    return None


# (argv, comm, source, max_chars) -> name: the name is a function of these
# alone, and a node's processes keep their command lines tick after tick
# (grouping 1,000 processes from the cache costs ~0.3 ms a tick, not ~4 ms).
_NAMES: dict[tuple[tuple[str, ...], str, str, int], str] = {}
# A node's distinct command lines are far fewer; past this many the cache starts over.
_MAX_CACHED_NAMES = 16384


def process_name(sample: ProcessMemory, names: NameSource = "cmdline", max_chars: int = 48) -> str:
    """The name a process is labelled and grouped by.

    Args:
        sample: the process.
        names: ``cmdline`` (from the command line) or ``comm`` (the kernel's name).
        max_chars: names are cut to this many characters.

    Returns:
        ``ray::Actor`` for a Ray worker titled ``ray::Actor.method`` (with
        either source: Ray retitles its workers), else with ``cmdline`` the
        script or module an interpreter runs, a title a process gave itself
        (one argument with spaces, as ``postgres: checkpointer``) or the
        program's base name; ``comm`` where the command line is empty (kernel
        threads, zombies) or unreadable.
    """
    key = (sample.cmdline, sample.name, names, max_chars)
    name = _NAMES.get(key)
    if name is None:
        if len(_NAMES) >= _MAX_CACHED_NAMES:
            _NAMES.clear()
        name = _NAMES[key] = _name(sample.cmdline, sample.name, names, max_chars)
    return name


def _name(argv: tuple[str, ...], comm: str, names: NameSource, max_chars: int) -> str:
    if argv and argv[0].startswith("ray::"):
        return _ray_group(argv[0])[:max_chars]
    if names == "comm" or not argv:
        return comm[:max_chars]
    first = argv[0]
    if len(argv) == 1 and " " in first:
        # A title set with setproctitle: its words are the name ("nginx: worker process").
        return first[:max_chars]
    program = os.path.basename(first.split(" ", 1)[0]) or comm
    if _INTERPRETER.match(program):
        script = _script(argv[1:])
        if script:
            return script[:max_chars]
    return program[:max_chars]
