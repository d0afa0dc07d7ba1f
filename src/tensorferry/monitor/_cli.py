"""The ``monitor`` and ``top`` subcommands; cli.py calls :func:`add_subcommands`."""

from __future__ import annotations

__all__ = ["add_subcommands"]

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, get_args

import msgspec

from ..errors import ConfigurationError, MonitorError, NoSuchProcess
from ._agent import Agent, AgentConfig, Selection, Snapshot
from ._config import DEFAULT_PORT
from ._names import NameSource
from ._once import DEFAULT_WAIT_SECONDS, exact_snapshot, missing_lines, one_shot_config
from ._types import ProcessMemory, SortKey

_EXIT_OK, _EXIT_FAILURE, _EXIT_USAGE = 0, 1, 2
# top --once into a pipe or file: rich would fit the table to 80 columns and
# cut values ("5.…"); a table never needs more than this.
_PIPE_WIDTH = 1000
# 65535: the largest TCP port; 0 lets the OS pick a free one.
_MAX_PORT = 65535
# ProcfsBackend holds at most 4,096 processes' 2 files each open, within a
# quarter of the soft limit: 4 x 2 x 4096.
_HELD_OPEN_FILES = 4 * 2 * 4096


class _Options(NamedTuple):
    """The command line, checked and converted: what the verbs run with."""

    selection: Selection
    config: AgentConfig
    duration_seconds: float | None
    port: int
    sort_by: SortKey
    limit: int | None
    exact_wait_seconds: float = DEFAULT_WAIT_SECONDS
    """top --once/--json: how long to wait for exact figures (0: one tick)."""


def _bad(option: str, text: str, need: str) -> ConfigurationError:
    return ConfigurationError(f"{option} {text!r}: {need}")


def _number(option: str, text: str, need: str, ok: Callable[[float], bool], *, percent: bool = False) -> float:
    try:
        value = float(text[:-1]) / 100 if percent and text.endswith("%") else float(text)
    except ValueError:
        raise _bad(option, text, need) from None
    if not ok(value):  # NaN fails every comparison
        raise _bad(option, text, need)
    return value


def _int(option: str, text: str, need: str, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _bad(option, text, need) from None
    if value < minimum or (maximum is not None and value > maximum):
        raise _bad(option, text, need)
    return value


def _options(args: argparse.Namespace) -> _Options:
    """Check every option before anything is built; a bad value names the option, the value and what works.

    Raises:
        ConfigurationError: a usage error (the CLI prints one line and exits 2).
    """
    pids = tuple(_int("--pid/-p", p, "must be a process id (a positive int)", 1) for p in args.pid)
    tree = None if args.tree is None else _int("--tree/-t", args.tree, "must be a process id (a positive int)", 1)
    positive = lambda v: 0 < v < math.inf  # noqa: E731
    seconds = "must be a number of seconds > 0"
    interval = _number("--interval/-i", args.interval, seconds + " (default 1)", positive)
    budget = _number("--budget/-b", args.budget, "must be a fraction of one core in (0, 1], as 0.001 or 0.1%",
                     lambda v: 0 < v <= 1, percent=True)
    max_stall = _number("--max-stall", args.max_stall, seconds + " (default 0.02)", positive)
    duration = None if args.duration is None else _number("--duration/-d", args.duration, seconds, positive)
    port = 0
    if getattr(args, "port", None) is not None:
        port = _int("--port/-P", args.port, f"must be a port in 0..{_MAX_PORT} (0: a free one)", 0, _MAX_PORT)
    sort_by, limit = "rss", None
    if getattr(args, "sort", None) is not None:
        if args.sort not in get_args(SortKey):
            raise _bad("--sort/-s", args.sort, f"must be one of {', '.join(get_args(SortKey))}")
        sort_by = args.sort
    if getattr(args, "limit", None) is not None:
        limit = _int("--limit/-n", args.limit, "must be a number of rows >= 1", 1)
    exact_wait = DEFAULT_WAIT_SECONDS
    if getattr(args, "exact_wait", None) is not None:
        exact_wait = _number("--exact-wait", args.exact_wait, "must be a number of seconds >= 0", lambda v: 0 <= v < math.inf)
    if args.names not in get_args(NameSource):
        raise _bad("--names", args.names, "must be cmdline (the script, module or program) or comm (the kernel's name)")
    max_name_chars = _int("--max-name-chars", args.max_name_chars, "must be a number of characters >= 1", 1)
    selection = Selection(
        pids=pids,
        pattern=args.pattern,
        tree_root_pid=tree,
        all_processes=args.all or not (pids or args.pattern or tree),
    )
    config = AgentConfig(
        interval_seconds=interval,
        exact=not args.no_exact,
        cpu_budget_fraction=budget,
        max_stall_seconds=max_stall,
        force_exact=args.force_exact,
        cgroups=args.cgroup,
        count_fds=not args.no_fds,
        names=args.names,  # type: ignore[arg-type]  # checked above
        max_name_chars=max_name_chars,
    )
    return _Options(selection, config, duration, port, sort_by, limit, exact_wait)


def _add_common(p: argparse.ArgumentParser) -> None:
    # Values are taken as text and checked by _options (the verbs' `check`):
    # a bad one is then one line `ConfigurationError: ...` and exit 2, as
    # every usage error of the CLI.
    sel = p.add_argument_group("selection (the union; all processes when none is given)")
    sel.add_argument("--pid", "-p", action="append", default=[], metavar="PID", help="a process (repeatable)")
    sel.add_argument("--pattern", "-k", metavar="REGEX", help="processes whose command line matches")
    sel.add_argument("--tree", "-t", metavar="PID", help="a process and all its descendants")
    sel.add_argument("--all", "-a", action="store_true", help="every process")
    smp = p.add_argument_group("sampling")
    smp.add_argument("--interval", "-i", default="1", metavar="SECONDS", help="time between ticks (default 1)")
    smp.add_argument("--budget", "-b", default="0.001", metavar="FRACTION", help="CPU for exact USS/PSS reads: 0.001 or 0.1%% of a core (default)")
    smp.add_argument("--max-stall", default="0.02", metavar="SECONDS", help="longest one step of an exact walk may take: sizes the pagemap slice; smaps_rollup (where pagemap is absent) is not read above it (default 0.02)")
    smp.add_argument("--force-exact", action="store_true", help="read smaps_rollup even above --max-stall (still within --budget)")
    smp.add_argument("--no-exact", action="store_true", help="cheap figures only: no pagemap or smaps_rollup walks at all")
    smp.add_argument("--cgroup", "-c", action="store_true", help="also report the processes' memory cgroups (v1/v2)")
    smp.add_argument("--no-fds", action="store_true", help="do not count open fds")
    smp.add_argument("--duration", "-d", metavar="SECONDS", help="stop after this long (default: until interrupted)")
    smp.add_argument("--names", default="cmdline", metavar="SOURCE", help="process names (the name label, NAME): cmdline (the script, module or program; default) or comm (the kernel's 15-character name)")
    smp.add_argument("--max-name-chars", default="48", metavar="N", help="cut names to N characters (default 48)")
    smp.add_argument("--proc-root", default=None, help=argparse.SUPPRESS)


def _check(args: argparse.Namespace) -> None:
    # cli.main calls this before the verb: a ConfigurationError is a usage error there.
    _options(args)


def add_subcommands(subparsers: Any) -> None:
    """Add ``monitor`` and ``top`` to an argparse subparsers object."""
    mon = subparsers.add_parser(
        "monitor",
        help="serve process memory figures for Prometheus (or write JSON lines)",
        description="Watch processes' memory at a bounded cost to them; serve /metrics or write JSON lines.",
    )
    _add_common(mon)
    out = mon.add_argument_group("output")
    out.add_argument("--port", "-P", default=str(DEFAULT_PORT), help=f"serve /metrics and /healthz on this port (0: a free one; default {DEFAULT_PORT})")
    out.add_argument("--host", "-H", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    out.add_argument("--json", "-j", action="store_true", help="write one JSON object per tick to stdout instead of serving")
    out.add_argument("--per-process", action="store_true", help="label metrics (and pools) by pid too (unbounded over time) instead of by name group only")
    mon.set_defaults(func=_run_monitor, check=_check)

    top = subparsers.add_parser(
        "top",
        help="a live table of processes sorted by memory (q quits)",
        description="A live table of processes sorted by memory, with the age of exact figures; q quits.",
    )
    _add_common(top)
    top.add_argument("--sort", "-s", default="rss", metavar="COLUMN", help=f"sort column: {', '.join(get_args(SortKey))} (default rss)")
    top.add_argument("--limit", "-n", default=None, help="rows to show (default: fit the screen)")
    top.add_argument("--once", "-o", action="store_true", help="print the table of one tick and exit (no screen redraw, no keys)")
    top.add_argument("--json", "-j", action="store_true", help="print one JSON object (as monitor -j writes per tick) and exit")
    top.add_argument("--exact-wait", "-w", default=None, metavar="SECONDS",
                     help=f"--once/--json: wait up to this long for every process's USS/PSS, not paced by --budget; "
                          f"what is still missing is listed with why (default {DEFAULT_WAIT_SECONDS:g}; 0: one tick)")
    top.set_defaults(func=_run_top, check=_check)


def _error(exc: BaseException) -> None:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)


def _raise_open_file_limit() -> None:
    """Raise this process's soft open-file limit toward the hard one.

    The backend holds two /proc files open per watched process, within a
    quarter of the soft limit; past that it opens, reads and closes them
    every tick (three syscalls for one). A soft limit of 1024 (many
    distributions' default) holds 128 processes; the monitor is a process
    of its own, so it takes what the hard limit allows, up to what 4,096
    held processes need.
    """
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = _HELD_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, _HELD_OPEN_FILES)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, OSError, ValueError):
        pass  # not on this platform, or not allowed: the backend copes with what it has


def _agent(args: argparse.Namespace, opts: _Options) -> Agent:
    from ._sample import default_backend

    _raise_open_file_limit()
    backend = default_backend(args.proc_root, count_fds=opts.config.count_fds)
    # Named processes must exist at start; later exits are counted, not fatal.
    named = [("--pid/-p", p) for p in opts.selection.pids]
    if opts.selection.tree_root_pid:
        named.append(("--tree/-t", opts.selection.tree_root_pid))
    for option, pid in named:
        try:
            backend.cheap(pid)
        except NoSuchProcess as exc:
            if type(exc) is not NoSuchProcess:
                raise  # a zombie: its own message says so
            # Not "exited between listing and reading": nothing was listed.
            raise NoSuchProcess(pid, msg=(
                f"{option} {pid}: no process has this id (it never existed, or it exited before the "
                "monitor started); check it with `ps -p {pid}`, or select by command line with -k REGEX"
            ).replace("{pid}", str(pid))) from None
    return Agent(opts.selection, opts.config, backend=backend)


def _start(args: argparse.Namespace, *, one_shot: bool = False) -> tuple[_Options, Agent] | int:
    """The checked options and the agent, or the exit status of why not."""
    try:
        opts = _options(args)
    except ConfigurationError as exc:
        _error(exc)
        return _EXIT_USAGE
    if one_shot:
        opts = opts._replace(config=one_shot_config(opts.config, opts.exact_wait_seconds))
    try:
        return opts, _agent(args, opts)
    except MonitorError as exc:
        _error(exc)
        return _EXIT_FAILURE


# One process of ``monitor -j``: ProcessMemory's fields in their order, then
# its group. A msgspec struct encodes ~10x faster than json.dumps of a dict
# (1,000 processes: ~1 ms a tick instead of ~9 ms); cmdline (a tuple) is an array.
_ProcessJson = msgspec.defstruct("_ProcessJson", [*ProcessMemory._fields, ("group", str)])


def _snapshot_json(snap: Snapshot, exact_missing: dict[int, str] | None = None) -> str:
    name_of, row = snap.name_of, _ProcessJson
    return msgspec.json.encode(
        {
            "timestamp": snap.timestamp,
            "processes": [row(*s, name_of(s)) for s in snap.samples],
            "groups": [g._asdict() for g in snap.groups],
            "cgroups": [c._asdict() for c in snap.cgroups],
            "errors": snap.errors,
            "monitor": snap.stats._asdict(),
            # top --json: processes without USS/PSS after the wait, and why.
            **({} if exact_missing is None else {"exact_missing": [{"pid": p, "reason": r} for p, r in exact_missing.items()]}),
        }
    ).decode()


def _run_monitor(args: argparse.Namespace) -> int:
    started = _start(args)
    if isinstance(started, int):
        return started
    opts, agent = started
    server = None
    try:
        if args.json:
            def emit(snap: Snapshot) -> None:
                sys.stdout.write(_snapshot_json(snap) + "\n")
                sys.stdout.flush()

            agent.run(duration_seconds=opts.duration_seconds, on_snapshot=emit)
            return _EXIT_OK
        from ._server import serve_prometheus

        agent.tick()  # the first scrape already has figures
        server = serve_prometheus(
            agent, host=args.host, port=opts.port, labels="process" if args.per_process else "group"
        )
        print(f"serving {server.url} and {server.health_url}", file=sys.stderr, flush=True)
        agent.run(duration_seconds=opts.duration_seconds)
        return _EXIT_OK
    except ConfigurationError as exc:
        # --host/--port that cannot be bound: the options' fault, not the run's.
        _error(exc)
        return _EXIT_USAGE
    except KeyboardInterrupt:
        return _EXIT_OK
    except BrokenPipeError:
        return _EXIT_OK
    except (OSError, MonitorError) as exc:
        _error(exc)
        return _EXIT_FAILURE
    finally:
        agent.stop()
        if server is not None:
            server.close()


def _run_top(args: argparse.Namespace) -> int:
    started = _start(args, one_shot=args.once or args.json)
    if isinstance(started, int):
        return started
    opts, agent = started
    try:
        if args.once or args.json:
            snap, missing = exact_snapshot(agent, opts.exact_wait_seconds)
            if args.json:
                sys.stdout.write(_snapshot_json(snap, exact_missing=missing) + "\n")
                return _EXIT_OK
            from rich.console import Console

            from ._top import build_table

            # Not a terminal (a pipe, a file): no width to fit, so whole values.
            console = Console() if sys.stdout.isatty() else Console(width=_PIPE_WIDTH)
            console.print(build_table(snap, sort_by=opts.sort_by, limit=opts.limit, live=False))
            for line in missing_lines(missing):
                console.print(line, highlight=False, markup=False)
            return _EXIT_OK
        from ._top import run_top

        run_top(agent, sort_by=opts.sort_by, limit=opts.limit, duration_seconds=opts.duration_seconds)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        pass
    finally:
        agent.stop()
    return _EXIT_OK
