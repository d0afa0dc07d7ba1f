"""The benchmark harness: the steps every benchmark repeats, written once.

A benchmark is a script that measures, reports and writes one JSON; what it
measures is its own, the run around it is here:

* options and sizes: ``transfer_parser`` (the transfer benchmarks' options),
  ``sizes`` (1 GiB, or 64 MiB with ``--quick``, and the transports);
* worker processes: ``run_in_pair`` starts the sender and receiver workers
  (``_pair.Workers``), measures the limits before and after the benchmark's
  own measurements (pooled: the machine is shared) and records the end of
  the run; ``run_cases`` opens each transport in the pair, runs its cases
  and keeps going past a failed one;
* rounds and medians: ``interleaved``, ``med`` (``_common``) and
  ``limit_medians``;
* the report: ``table`` and ``verified_cell`` for the rows, ``verified_target``
  for the check every benchmark makes after timing, ``print_limits`` and
  ``print_targets``; ``report`` prints the limits, the benchmark's tables and
  the targets, ``finish`` also writes the JSON with its flat ``"ratios"``
  (what ``interleave.py`` tabulates; ``_common.write_result``);
* ``namespace_hosts``: ``tests/_hosts.py``, for the benchmarks between hosts;
* ``private``: a tensorferry-internal helper a benchmark needs (test data,
  a flatten), looked up where the tree being measured keeps it.

Below it: ``_common`` (what is measured alike everywhere: peak RSS, the copy
and socket limits, the environment record, writing JSON) and ``_pair`` (the
two worker processes and the jobs they run). Public API only otherwise: ``interleave.py`` runs a benchmark against two
trees, one of which may have moved its private modules.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from _common import GIB, MIB, available_transports, log, med, results_dir, write_result
from _pair import Workers, limits_again, measure_limits

__all__ = [
    "PACKING", "QUICK_NBYTES", "QUICK_REPEATS", "SYNTHETIC", "TENSORS", "TENSOR_META", "env_end", "finish",
    "limit_medians", "namespace_hosts", "out_path", "print_limits", "print_targets", "private", "report",
    "run_cases", "run_in_pair", "sizes", "table", "transfer_parser", "verified_cell", "verified_target",
]

# A quick run: big enough that a copy is not all overhead, small enough to
# finish in seconds on a shared 2-core machine.
QUICK_NBYTES = 64 * MIB
QUICK_REPEATS = 2
# Where a tree keeps the private helpers the benchmarks use: the layered
# tree's module first, the flat tree's after (interleave.py runs old and new).
SYNTHETIC = ("tensorferry.cli._synthetic", "tensorferry._synthetic")
TENSORS = ("tensorferry.tensors", "tensorferry._tensors")
TENSOR_META = ("tensorferry.tensors._meta", "tensorferry._tensor_meta")
PACKING = ("tensorferry.wire.packing", "tensorferry.packing")


def private(modules: tuple[str, ...], name: str | None = None) -> Any:
    """The first of ``modules`` that imports (``SYNTHETIC``, ``TENSORS``,
    ...), or its attribute ``name``: a private tensorferry helper, wherever
    the tree under test keeps it. Raises ImportError naming every place
    looked in (a tree that has none of them)."""
    missed = []
    for module in modules:
        try:
            found = importlib.import_module(module)
            return found if name is None else getattr(found, name)
        except (ImportError, AttributeError) as exc:
            missed.append(f"{module}: {exc}")
    raise ImportError(f"no {name or 'module'} of {modules[0]} in this tensorferry tree ({'; '.join(missed)})")


# -- options and sizes ---------------------------------------------------------------


def transfer_parser(doc: str) -> argparse.ArgumentParser:
    """A transfer benchmark's parser (its description: ``doc``'s first
    paragraph) with the options every one takes (bench_transfer.py's)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each worker")
    ap.add_argument("--transports", nargs="*", default=None, help="default: tensorferry.transports.available()")
    ap.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB, 2 repeats (smoke run)")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed sections (slows them)")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    return ap


def sizes(args: argparse.Namespace) -> tuple[int, int, list[str]]:
    """(bytes sent, timed repeats, transports) of a transfer benchmark: 1 GiB
    and ``--repeats``, or with ``--quick`` QUICK_NBYTES and QUICK_REPEATS;
    ``--transports``, else every one this machine runs."""
    transports = args.transports if args.transports is not None else available_transports()
    return (QUICK_NBYTES, QUICK_REPEATS, transports) if args.quick else (GIB, args.repeats, transports)


# -- worker processes ----------------------------------------------------------------


def env_end(env: dict, started: float, **extra: Any) -> dict:
    """The environment record with the run's end: load then, wall seconds."""
    return {**env, "loadavg_1min_end": round(os.getloadavg()[0], 2), "wall_seconds": time.monotonic() - started,
            **extra}


def run_in_pair(modules: list[str], doc: dict, env: dict, nbytes: int, threads: int,
                measure: Callable[[Workers], None], *, limits: tuple[str, ...] = (), limit_repeats: int = 3) -> dict:
    """Start the sender and receiver workers (running the jobs of
    ``modules``), measure ``limits`` into ``doc["limits"]``, run
    ``measure``, measure the limits again (pooled with the first), stop the
    workers, and set ``doc["env"]`` (``env`` and the run's end). Returns
    the workers' start-up records."""
    started = time.monotonic()
    w = Workers(nbytes, threads, modules)
    try:
        if limits:
            measure_limits(w, doc["limits"], limits, limit_repeats)
        measure(w)
        if limits:
            limits_again(w, doc["limits"], limit_repeats)
    finally:
        w.close()
    doc["env"] = env_end(env, started)
    return w.info


def run_cases(w: Workers, doc: dict, transports: list[str], cases: Callable[[str], Iterable[tuple[str, dict]]],
              record: Callable[[str, dict, dict, dict], None], *, open_job: dict | None = None,
              opened: Callable[[str], None] | None = None, failed: Callable[[dict, Exception], None] | None = None,
              timeout: float = 600.0) -> None:
    """For each transport: open it in both workers (``open_job``: more of
    the ``tf_open`` job), call ``opened``, run each of its ``cases`` (name,
    job) and hand both sides' results to ``record``, then close it. A case
    that fails goes to ``doc["errors"]`` (and to ``failed``), the workers
    reopen the transport and the next case runs."""
    for transport in transports:
        try:
            w.run({"job": "tf_open", "transport": transport, **(open_job or {})})
        except Exception as exc:  # noqa: BLE001 - a transport that cannot open is reported, the others run
            doc["errors"].append(f"{transport}: open: {exc}")
            continue
        if opened is not None:
            opened(transport)
        for name, spec in cases(transport):
            try:
                s, r = w.run(spec, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - a failed case is reported, the next one runs
                doc["errors"].append(f"{name}: {exc}")
                log(f"{name}: FAILED {exc}")
                if failed is not None:
                    failed(spec, exc)
                w.reopen(transport)
                continue
            record(name, spec, s, r)
        w.run({"job": "tf_close"})


def namespace_hosts(benchmark: str | None = None) -> tuple[Any, str | None]:
    """``tests/_hosts.py`` (hosts as network namespaces on a bridge, links
    shaped by ``tc``) and why this machine cannot make them (None: it can;
    with ``benchmark``, the reason is also said on stderr in its name)."""
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import _hosts

    reason = _hosts.available()
    if reason is not None and benchmark is not None:
        print(f"{benchmark}: cannot make namespace hosts here: {reason}", file=sys.stderr)
    return _hosts, reason


# -- the report ----------------------------------------------------------------------


def limit_medians(limits: dict, keys: Iterable[str] | None = None) -> dict[str, float]:
    """Each measured limit's median seconds (only ``keys`` when given)."""
    return {k: med(v["seconds"]) for k, v in limits.items()
            if v and v.get("seconds") and (keys is None or k in keys)}


def verified_target(doc: dict, what: str, bad: list[str]) -> None:
    """The target every benchmark checks after timing: ``what`` verified
    bit-exact; ``bad`` names the cases that were not."""
    doc.setdefault("targets", []).append({"target": what, "required": "all", "measured": None, "unit": "",
                                          "met": not bad, "note": "; ".join(bad) or "all equal"})


def print_limits(con: Any, limits: dict, nbytes_of: Callable[[str], int], title: str) -> None:
    from rich.table import Table

    t = Table(title=title)
    for col in ("limit", "median ms", "GB/s", "runs", "verified", "via"):
        t.add_column(col, justify="left" if col in ("limit", "via") else "right")
    for k, v in limits.items():
        if v and v.get("seconds"):
            s = med(v["seconds"])
            t.add_row(k, f"{s * 1e3:,.1f}", f"{nbytes_of(k) / s / 1e9:.2f}", str(len(v["seconds"])),
                      str(v.get("verified")), v.get("via", ""))
            many = v.get("seconds_10000_descs")
            if many:
                t.add_row(f"{k}, 10k descriptors (context)", f"{med(many) * 1e3:,.1f}",
                          f"{nbytes_of(k) / med(many) / 1e9:.2f}", str(len(many)), "", f"{med(many) / s:.2f}x 1 descriptor")
    if t.rows:
        con.print(t)


def print_targets(con: Any, targets: list[dict], title: str = "targets",
                  unit_of: Callable[[dict], str] | None = None) -> None:
    """The targets table: each target, what it requires, what was measured
    (in ``unit_of(target)``; default its ``"unit"``, else ``x``) and whether it was met."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("target", "required", "measured", "met", "note"):
        t.add_column(col)
    for tg in targets:
        unit = unit_of(tg) if unit_of is not None else tg.get("unit", "x")
        m = "-" if tg["measured"] is None else f"{tg['measured']:.2f}{unit}"
        met = "[yellow]n/a[/]" if tg["met"] is None else ("[green]yes[/]" if tg["met"] else "[red]no[/]")
        if tg["met"] is None and tg["required"] == "report" and tg["measured"] is not None:
            met = "[cyan]reported[/]"
        t.add_row(tg["target"], tg["required"], m, met, tg["note"])
    con.print(t)


def verified_cell(row: dict) -> str:
    return "yes" if row["verified"] else f"[red]NO {row['problem']}[/]"


def table(title: str, cols: Iterable[str], rows: Iterable[Iterable[str]], left: tuple[str, ...] = ()) -> Any:
    """A rich table: ``cols`` right-aligned but the first and ``left``."""
    from rich.table import Table

    t = Table(title=title)
    for i, col in enumerate(cols):
        t.add_column(col, justify="left" if i == 0 or col in left else "right")
    for row in rows:
        t.add_row(*row)
    return t


def report(doc: dict, nbytes: int, tables: Iterable[Callable[[Any, dict], None]], con: Any = None, *,
           limits_title: str = "limits (start and end pooled)") -> None:
    """Print the limits (if any), each of ``tables(console, doc)``, the
    targets and the errors."""
    if con is None:
        from rich.console import Console

        con = Console(width=220)
    if doc.get("limits"):
        print_limits(con, doc["limits"], lambda k: nbytes, limits_title)
    for print_table in tables:
        print_table(con, doc)
    print_targets(con, doc.get("targets", []))
    for e in doc.get("errors", []):
        con.print(f"[red]error:[/] {e}")


def finish(doc: dict, ratios: dict[str, float | None], path: Path, nbytes: int,
           tables: Iterable[Callable[[Any, dict], None]]) -> Path:
    """``report`` the run, then write ``doc`` with its ``ratios`` to ``path``."""
    report(doc, nbytes, tables)
    return write_result(path, doc, ratios)


def out_path(args: argparse.Namespace, name: str) -> Path:
    """Where benchmark ``name``'s JSON goes: ``--out``, else results_dir()."""
    return results_dir(getattr(args, "out", None)) / f"{name}.json"
