"""Run one benchmark against two source trees alternately and put the
medians of its ratios side by side.

Each round runs the benchmark command once with ``PYTHONPATH`` at tree A's
``src`` and once at tree B's (A first in even rounds, B first in odd ones,
so drifting load weighs on both alike). The benchmark scripts themselves
are this checkout's: they use tensorferry's public API only, so the same
script measures either tree. Each run writes its JSON into a folder of its
own (``TENSORFERRY_BENCH_OUT``, honoured by ``_common.results_dir``); every
benchmark's JSON carries a flat ``"ratios"`` mapping (each ratio against the
peer or the limit measured in the same run). The table gives, per ratio,
the median over A's runs, over B's, and B / A.

Before the first round each tree is checked: its ``src`` must be the
``tensorferry`` that Python imports under that ``PYTHONPATH``.

Example (the old main against the new one, three rounds of the pool benchmark)::

    .venv/bin/python benchmarks/interleave.py --a /tmp/tf-old --b . --rounds 3 -- benchmarks/bench_pool.py

Writes ``benchmarks/results/interleave_<name>.json`` (``--out``): every run's
ratios, return code, wall time and load, and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import OUT_ENV, RESULTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tree_env(tree: Path, out: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(tree / "src"), UCX_NET_DEVICES="lo", GLOO_SOCKET_IFNAME="lo")
    env[OUT_ENV] = str(out)
    return env


def check_tree(tree: Path) -> str:
    """The folder ``tensorferry`` is imported from under this tree's
    PYTHONPATH; raises SystemExit if it is not the tree's own."""
    src = tree / "src" / "tensorferry"
    if not src.is_dir():
        raise SystemExit(f"interleave: {tree} has no src/tensorferry")
    env = tree_env(tree, Path(tempfile.gettempdir()))
    proc = subprocess.run([sys.executable, "-c", "import tensorferry; print(tensorferry.__file__)"],
                          capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    got = Path(proc.stdout.strip() or "?").resolve().parent
    if proc.returncode != 0 or got != src.resolve():
        raise SystemExit(f"interleave: with PYTHONPATH={tree / 'src'} Python imports tensorferry from {got} "
                         f"(rc {proc.returncode}: {proc.stderr.strip()[-300:]})")
    if not list(src.rglob("*.so")):  # the flat tree and the layered one (copy/, tensors/, plans/)
        print(f"interleave: note: {src} holds no compiled extension (*.so); build it there "
              "(python -c 'from setuptools import setup; setup()' build_ext --inplace) or copy the .so files",
              file=sys.stderr)
    return str(got)


def run_once(cmd: list[str], tree: Path, out: Path, timeout: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=tree_env(tree, out), cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, check=False)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = None, f"timed out after {timeout} s"
    ratios: dict[str, float | None] = {}
    files = sorted(out.glob("*.json"))
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except ValueError:
            continue
        for name, value in (doc.get("ratios") or {}).items():
            ratios[f"{f.stem} | {name}" if len(files) > 1 else name] = value
    return {"tree": str(tree), "rc": rc, "wall_seconds": time.monotonic() - t0, "loadavg_1min_start": load,
            "ratios": ratios, "files": [f.name for f in files], "tail": tail if rc != 0 else ""}


def medians(runs: list[dict]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for run in runs:
        for name, v in run["ratios"].items():
            if v is not None:
                values.setdefault(name, []).append(v)
    return {k: statistics.median(v) for k, v in values.items()}


def table(a: dict[str, float], b: dict[str, float], label_a: str, label_b: str) -> str:
    names = sorted(set(a) | set(b))
    width = max([len(n) for n in names] + [5])
    lines = [f"{'ratio':<{width}}  {label_a:>10}  {label_b:>10}  {'B/A':>6}"]
    for n in names:
        va, vb = a.get(n), b.get(n)
        ba = f"{vb / va:6.2f}" if va and vb is not None else "     -"
        fa = f"{va:10.3f}" if va is not None else f"{'-':>10}"
        fb = f"{vb:10.3f}" if vb is not None else f"{'-':>10}"
        lines.append(f"{n:<{width}}  {fa}  {fb}  {ba}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="tree A (a checkout; its src/ goes on PYTHONPATH)")
    ap.add_argument("--b", type=Path, required=True, help="tree B")
    ap.add_argument("--label-a", default="A")
    ap.add_argument("--label-b", default="B")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (each runs A and B once)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    ap.add_argument("--out", type=Path, default=None, help="the JSON to write (default results/interleave_<bench>.json)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark (a .py runs with this Python)")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    if not cmd:
        ap.error("give the benchmark command after --")
    if cmd[0].endswith(".py"):
        cmd = [sys.executable, *cmd]
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    imported = {k: check_tree(t) for k, t in trees.items()}
    bench = Path(next((c for c in cmd if c.endswith(".py")), "bench")).stem
    out = args.out or RESULTS / f"interleave_{bench}.json"
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="tf-interleave-") as tmp:
        for r in range(args.rounds):
            for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
                run = run_once(cmd, trees[k], Path(tmp) / f"{r}-{k}", args.timeout)
                runs[k].append(run)
                print(f"round {r + 1}/{args.rounds} {k} ({trees[k]}): rc {run['rc']}, {run['wall_seconds']:.0f} s, "
                      f"{len(run['ratios'])} ratios, load {run['loadavg_1min_start']:.1f}", flush=True)
                if run["rc"] != 0:
                    print(run["tail"], file=sys.stderr)
    med_a, med_b = medians(runs["A"]), medians(runs["B"])
    print(f"\n{' '.join(cmd[1:] if cmd[0] == sys.executable else cmd)}: medians of {args.rounds} interleaved runs each; "
          f"A = {args.label_a} ({trees['A']}), B = {args.label_b} ({trees['B']}); every ratio is against the peer or "
          "the limit of its own run (read its direction from its name)")
    print(table(med_a, med_b, args.label_a, args.label_b))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": cmd, "trees": {k: str(v) for k, v in trees.items()}, "imported": imported,
                               "labels": {"A": args.label_a, "B": args.label_b}, "rounds": args.rounds, "runs": runs,
                               "medians": {"A": med_a, "B": med_b},
                               "b_over_a": {n: med_b[n] / med_a[n] for n in med_a if n in med_b and med_a[n]}},
                              indent=1))
    print(f"wrote {out}")
    return 0 if all(run["rc"] == 0 for rs in runs.values() for run in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
