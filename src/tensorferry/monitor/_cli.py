"""The ``monitor`` and ``top`` subcommands; cli.py calls :func:`add_subcommands`."""

from __future__ import annotations

__all__ = ["add_subcommands"]

import argparse
import json
import sys
from typing import Any

from tensorferry.errors import MonitorError

from ._agent import Agent, AgentConfig, Selection, Snapshot

_EXIT_OK, _EXIT_FAILURE, _EXIT_USAGE = 0, 1, 2


def _budget(text: str) -> float:
    """``0.001`` or ``0.1%``: a fraction of one core."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be a fraction of a core (0.001) or a percentage (0.1%), got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"budget must be in (0, 1] of a core, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    sel = p.add_argument_group("selection (the union; all processes when none is given)")
    sel.add_argument("--pid", "-p", type=int, action="append", default=[], metavar="PID", help="a process (repeatable)")
    sel.add_argument("--pattern", "-k", metavar="REGEX", help="processes whose command line matches")
    sel.add_argument("--tree", "-t", type=int, metavar="PID", help="a process and all its descendants")
    sel.add_argument("--all", "-a", action="store_true", help="every process")
    smp = p.add_argument_group("sampling")
    smp.add_argument("--interval", "-i", type=_positive_float, default=1.0, metavar="SECONDS", help="time between ticks (default 1)")
    smp.add_argument("--budget", "-b", type=_budget, default=0.001, metavar="FRACTION", help="CPU for exact USS/PSS reads: 0.001 or 0.1%% of a core (default)")
    smp.add_argument("--max-stall", type=_positive_float, default=0.02, metavar="SECONDS", help="longest one step of an exact walk may take: sizes the pagemap slice; smaps_rollup (where pagemap is absent) is not read above it (default 0.02)")
    smp.add_argument("--force-exact", action="store_true", help="read smaps_rollup even above --max-stall (still within --budget)")
    smp.add_argument("--no-exact", action="store_true", help="cheap figures only: no pagemap or smaps_rollup walks at all")
    smp.add_argument("--cgroup", "-c", action="store_true", help="also report the processes' memory cgroups (v1/v2)")
    smp.add_argument("--no-fds", action="store_true", help="do not count open fds")
    smp.add_argument("--duration", "-d", type=_positive_float, metavar="SECONDS", help="stop after this long (default: until interrupted)")
    smp.add_argument("--proc-root", default=None, help=argparse.SUPPRESS)


def add_subcommands(subparsers: Any) -> None:
    """Add ``monitor`` and ``top`` to an argparse subparsers object."""
    mon = subparsers.add_parser(
        "monitor",
        help="serve process memory figures for Prometheus (or write JSON lines)",
        description="Watch processes' memory at a bounded cost to them; serve /metrics or write JSON lines.",
    )
    _add_common(mon)
    out = mon.add_argument_group("output")
    out.add_argument("--port", "-P", type=int, default=9464, help="serve /metrics on this port (0: a free one; default 9464)")
    out.add_argument("--host", "-H", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    out.add_argument("--json", "-j", action="store_true", help="write one JSON object per tick to stdout instead of serving")
    out.add_argument("--per-process", action="store_true", help="label metrics by pid (unbounded over time) instead of by name group")
    mon.set_defaults(func=_run_monitor)

    top = subparsers.add_parser(
        "top",
        help="a live table of processes sorted by memory (q quits)",
        description="A live table of processes sorted by memory, with the age of exact figures; q quits.",
    )
    _add_common(top)
    top.add_argument("--sort", "-s", choices=["rss", "uss", "pss", "anon", "shmem", "swap", "cpu"], default="rss", help="sort column (default rss)")
    top.add_argument("--limit", "-n", type=int, default=None, help="rows to show (default: fit the screen)")
    top.set_defaults(func=_run_top)


def _error(exc: BaseException) -> None:
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)


def _agent(args: argparse.Namespace) -> Agent:
    selection = Selection(
        pids=tuple(args.pid),
        pattern=args.pattern,
        tree_root_pid=args.tree,
        all_processes=args.all or not (args.pid or args.pattern or args.tree),
    )
    config = AgentConfig(
        interval_seconds=args.interval,
        exact=not args.no_exact,
        cpu_budget_fraction=args.budget,
        max_stall_seconds=args.max_stall,
        force_exact=args.force_exact,
        cgroups=args.cgroup,
        count_fds=not args.no_fds,
    )
    from ._sample import default_backend

    backend = default_backend(args.proc_root, count_fds=config.count_fds)
    # Named processes must exist at start; later exits are counted, not fatal.
    for pid in [*args.pid, *([args.tree] if args.tree else [])]:
        backend.cheap(pid)
    return Agent(selection, config, backend=backend)


def _snapshot_json(snap: Snapshot) -> str:
    def proc(s: Any) -> dict[str, Any]:
        d = s._asdict()
        d["cmdline"] = list(s.cmdline)
        return d

    return json.dumps(
        {
            "timestamp": snap.timestamp,
            "processes": [proc(s) for s in snap.samples],
            "groups": [g._asdict() for g in snap.groups],
            "cgroups": [c._asdict() for c in snap.cgroups],
            "errors": snap.errors,
            "monitor": snap.stats._asdict(),
        },
        separators=(",", ":"),
    )


def _run_monitor(args: argparse.Namespace) -> int:
    try:
        agent = _agent(args)
    except ValueError as exc:
        _error(exc)
        return _EXIT_USAGE
    except MonitorError as exc:
        _error(exc)
        return _EXIT_FAILURE
    server = None
    try:
        if args.json:
            def emit(snap: Snapshot) -> None:
                sys.stdout.write(_snapshot_json(snap) + "\n")
                sys.stdout.flush()

            agent.run(duration_seconds=args.duration, on_snapshot=emit)
            return _EXIT_OK
        from ._prometheus import serve_prometheus

        agent.tick()  # the first scrape already has figures
        server = serve_prometheus(
            agent, host=args.host, port=args.port, labels="process" if args.per_process else "group"
        )
        print(f"serving {server.url}", file=sys.stderr, flush=True)
        agent.run(duration_seconds=args.duration)
        return _EXIT_OK
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
    try:
        agent = _agent(args)
    except ValueError as exc:
        _error(exc)
        return _EXIT_USAGE
    except MonitorError as exc:
        _error(exc)
        return _EXIT_FAILURE
    from ._top import run_top

    try:
        run_top(agent, sort_by=args.sort, limit=args.limit, duration_seconds=args.duration)
    except KeyboardInterrupt:
        pass
    return _EXIT_OK
