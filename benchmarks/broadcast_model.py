"""The relay broadcast model (``_broadcast_model.py``) against measured
ratios, and its predictions for 100 and 1,000 hosts (issue 47).

Measured: ``interleave.py`` JSONs of ``bench_broadcast.py`` runs of two
trees, labelled ``old`` (relays pass on a fixed 1 MiB chunk) and ``new``
(the chunk of ``chunk_nbytes_for``: the object's size over its readers);
each run's rate and size are read from its command. Plain
``bench_broadcast.py`` JSONs are runs of the code as it is, labelled
``now`` (the new chunk, and ``trees``: ``put(trees=True)``). For each tree, rate,
size, schedule and N the model's ratio (N receivers against one) is put
beside the median of the measured ones.

The model's inputs: the link's payload rate (TCP over Ethernet carries 1448
of every 1514 bytes: 0.956 of the line rate), the chunk each tree uses,
and one per-hop latency ``--hop-ms``, which is not measured directly: it is
fitted (least squares) on the ``--fit`` points only (by default the old
tree's chains: a 1 MiB chunk), and every other point is a prediction of
the model with that latency. A point within ``--tolerance`` (10%) of its
measured ratio passes.

Predictions: 100 and 1,000 hosts, 1 GiB and 10 GiB, 100 Gbit/s links,
for the chain with the old and the new chunk, the tree (fanout 2) and two
complementary binary trees (the new chunk), each with the per-hop latency
fitted here and with lower ones (a relay that is not a Python thread on a
busy 2-core VM). Writes ``benchmarks/results/broadcast_model.json`` and the
plot ``docs/broadcast-model.png`` (``--plot``).

Run: ``.venv/bin/python benchmarks/broadcast_model.py --measured
RUNS.json ... [--hop-ms 1.5]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _broadcast_model import Link, ratio  # noqa: E402
from _common import MIB, write_json  # noqa: E402
from bench_broadcast import parse_nbytes  # noqa: E402

from tensorferry.transports import chunk_nbytes_for, half_chunk_nbytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TCP_PAYLOAD = 1448 / 1514
FIXED_CHUNK_NBYTES = 1 << 20  # the old tree's relays
GIB = 1 << 30
TARGET_1000_VS_ONE = 1.2


def parse_rate(text: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for u, f in units.items():
        if text.endswith(u):
            return float(text[: -len(u)]) * f
    return float(text)


def chunk(rule: str, nbytes: int, readers: int, schedule: str = "chain") -> int:
    """The chunk a tree's relays use for ``readers`` (two trees: each half's)."""
    if rule == "old":
        return FIXED_CHUNK_NBYTES
    return half_chunk_nbytes(nbytes, readers) if schedule == "trees" else chunk_nbytes_for(nbytes, readers)


def measured_points(paths: list[Path]) -> list[dict]:
    """Every (tree, rate, size, schedule, N) of the runs: the medians over
    the runs of the measured N-vs-1 ratio, and their spread."""
    points: dict[tuple, list[float]] = {}
    for path in paths:
        doc = json.loads(path.read_text())
        if "runs" not in doc:  # one bench_broadcast run of this code ("now": the new chunk, and two trees)
            env = doc["env"]
            doc = {"runs": {"b": [doc]}, "labels": {"b": "now"}, "command": ["--rate", env["rate"], "--nbytes", str(env["nbytes"])]}
        cmd = doc["command"]
        rate = cmd[cmd.index("--rate") + 1]
        nbytes = parse_nbytes(cmd[cmd.index("--nbytes") + 1])
        for k, runs in doc["runs"].items():
            rule = doc["labels"][k]
            for run in runs:
                for name, v in run["ratios"].items():
                    parts = name.split()
                    if len(parts) == 5 and parts[2:] == ["vs", "1", "receiver"] and v is not None:
                        schedule, n = parts[0], int(parts[1][1:])
                        points.setdefault((rule, rate, nbytes, schedule, n), []).append(v)
    return [{"tree": r, "rate": rate, "nbytes": nb, "schedule": s, "receivers": n, "measured": statistics.median(v),
             "measured_all": v} for (r, rate, nb, s, n), v in sorted(points.items())]


def model_ratio(p: dict, hop_seconds: float) -> float:
    bits = parse_rate(p["rate"])
    link = Link(bits * TCP_PAYLOAD / 8, hop_seconds)
    n, nbytes = p["receivers"], p["nbytes"]
    return ratio(nbytes, n, p["schedule"], chunk(p["tree"], nbytes, n, p["schedule"]), link,
                 one_chunk_nbytes=chunk(p["tree"], nbytes, 1, p["schedule"]))


def fit_hop(points: list[dict], fit: list[dict]) -> float:
    """The per-hop latency (s) that makes the model's ratios closest to
    the measured ones of ``fit`` (least squares over a grid to 20 ms)."""
    grid = [k * 1e-4 for k in range(0, 201)]
    return min(grid, key=lambda h: sum((model_ratio(p, h) - p["measured"]) ** 2 for p in fit))


def predictions(hops_seconds: list[float]) -> list[dict]:
    """100 Gbit/s links: 1 GiB and 10 GiB to 1 to 1,000 receivers, every
    schedule, each per-hop latency."""
    return [_one(nbytes, n, hop, 100e9) for hop in hops_seconds for nbytes in (GIB, 10 * GIB) for n in (1, 4, 16, 100, 1000)]


def largest_hop(nbytes: int, receivers: int, name: str, limit: float, link_bits: float = 100e9) -> float:
    """The largest per-hop latency (s) at which ``name`` (a schedule of
    SCHEDULE_NAMES) stays within ``limit`` of one receiver (bisection; 0:
    not even without any)."""
    def r(hop: float) -> float:
        row = _one(nbytes, receivers, hop, link_bits)
        return row[name]

    lo, hi = 0.0, 0.05
    if r(lo) > limit:
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if r(mid) <= limit else (lo, mid)
    return lo


def _one(nbytes: int, n: int, hop: float, link_bits: float) -> dict:
    link = Link(link_bits * TCP_PAYLOAD / 8, hop)
    new, one = chunk_nbytes_for(nbytes, n), chunk_nbytes_for(nbytes, 1)
    return {
        "hop_seconds": hop, "nbytes": nbytes, "receivers": n, "rate_bits": link_bits, "new_chunk_nbytes": new,
        "chain, 1 MiB chunk (old)": ratio(nbytes, n, "chain", FIXED_CHUNK_NBYTES, link, one_chunk_nbytes=FIXED_CHUNK_NBYTES),
        "chain, chunk by size and readers (new)": ratio(nbytes, n, "chain", new, link, one_chunk_nbytes=one),
        "tree, fanout 2": ratio(nbytes, n, "tree", new, link, one_chunk_nbytes=one),
        "two complementary binary trees": ratio(nbytes, n, "trees", half_chunk_nbytes(nbytes, n), link, one_chunk_nbytes=one),
    }


SCHEDULE_NAMES = ("chain, 1 MiB chunk (old)", "chain, chunk by size and readers (new)", "tree, fanout 2", "two complementary binary trees")


def plot(points: list[dict], preds: list[dict], hop_fit: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13.5, 5.6))
    style = {("old", "chain"): ("tab:red", "o"), ("new", "chain"): ("tab:blue", "o"),
             ("old", "tree"): ("tab:orange", "s"), ("new", "tree"): ("tab:cyan", "s"), ("now", "chain"): ("tab:purple", "o"), ("now", "tree"): ("tab:olive", "s"),
             ("now", "trees"): ("tab:green", "D")}
    labels_done = set()
    for p in points:
        color, marker = style.get((p["tree"], p["schedule"]), ("gray", "x"))
        if p["cpu_bound"]:
            marker = "x"
        setting = f"{p['nbytes'] // MIB} MiB @ {p['rate']}"
        label = f"{p['schedule']}, {p['tree']} chunk" if p["tree"] != "now" else f"{p['schedule']}, this code (new chunk)"
        x = p["receivers"] * (1.04 if "1gbit" in p["rate"] else 0.96)
        left.plot([x], [p["measured"]], marker, color=color, ms=8, mfc="none" if "1gbit" in p["rate"] else color,
                  label=label if label not in labels_done else None)
        left.plot([x], [p["model"]], "_", color=color, ms=16, mew=2.5)
        left.annotate(setting, (x, p["measured"]), textcoords="offset points", xytext=(6, -3), fontsize=6.5)
        labels_done.add(label)
    left.set_xscale("log", base=2)
    left.set_xticks([1, 2, 4, 8, 16])
    left.set_xticklabels(["1", "2", "4", "8", "16"])
    left.set_xlabel("receivers (namespace hosts)")
    left.set_ylabel("time vs one receiver")
    left.set_title(f"measured (markers; hollow: 1 Gbit/s; x: CPU-bound, not checked) and the model (bars),\nper-hop latency fitted on the old chains: {hop_fit * 1e3:.1f} ms",
                   fontsize=9.5)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    colors = dict(zip(SCHEDULE_NAMES, ("tab:red", "tab:blue", "tab:orange", "tab:green")))
    hops = sorted({r["hop_seconds"] for r in preds})
    dashes = {h: ls for h, ls in zip(hops, ("-", "--", "-.", ":"))}
    for name in SCHEDULE_NAMES:
        for hop in hops:
            rows = [r for r in preds if r["hop_seconds"] == hop and r["nbytes"] == GIB]
            xs = [r["receivers"] for r in rows]
            right.plot(xs, [r[name] for r in rows], dashes[hop], color=colors[name], lw=2,
                       label=f"{name}" if hop == hops[0] else None)
    for hop in hops:
        right.plot([], [], dashes[hop], color="gray", label=f"per-hop latency {hop * 1e6:,.0f} µs")
    right.axhline(TARGET_1000_VS_ONE, color="black", lw=0.8)
    right.text(1.1, TARGET_1000_VS_ONE * 1.03, f"goal at 1,000 hosts: {TARGET_1000_VS_ONE}x", fontsize=8)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("receivers (hosts)")
    right.set_ylabel("time vs one receiver (log)")
    right.set_title("predicted: 1 GiB, 100 Gbit/s links", fontsize=9.5)
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", type=Path, nargs="+", required=True, help="interleave.py JSONs of bench_broadcast (labels old, new)")
    ap.add_argument("--fit", default="old:chain", help="TREE:SCHEDULE of the points the per-hop latency is fitted on")
    ap.add_argument("--hop-ms", type=float, default=None, help="use this per-hop latency instead of fitting one")
    ap.add_argument("--predict-hop-us", type=float, nargs="+", default=[100.0, 20.0],
                    help="per-hop latencies to predict with besides the fitted one (µs)")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--cpu-bound", nargs="*", default=[], metavar="RATE:N",
                    help="points shown but neither fitted on nor checked: runs whose limit was this machine's CPU, not the links")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "broadcast_model.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "broadcast-model.png")
    args = ap.parse_args()
    points = measured_points(args.measured)
    for p in points:
        p["cpu_bound"] = f"{p['rate']}:{p['receivers']}" in args.cpu_bound
    tree, schedule = args.fit.split(":")
    fit = [p for p in points if p["tree"] == tree and p["schedule"] == schedule and not p["cpu_bound"]]
    hop = args.hop_ms / 1e3 if args.hop_ms is not None else fit_hop(points, fit)
    for p in points:
        p["model"] = model_ratio(p, hop)
        p["error"] = p["model"] / p["measured"] - 1
        p["fitted_on"] = p in fit and args.hop_ms is None
        p["within_tolerance"] = abs(p["error"]) <= args.tolerance
    preds = predictions([hop, *(h / 1e6 for h in args.predict_hop_us)])
    print(f"per-hop latency {'fitted on ' + args.fit if args.hop_ms is None else 'given'}: {hop * 1e3:.2f} ms")
    print(f"{'tree':>4} {'rate':>8} {'MiB':>5} {'schedule':>8} {'N':>3} {'chunk KiB':>9} {'measured':>9} {'model':>7} {'error':>7}  runs")
    for p in points:
        c = chunk(p["tree"], p["nbytes"], p["receivers"], p["schedule"]) // 1024
        print(f"{p['tree']:>4} {p['rate']:>8} {p['nbytes'] // MIB:>5} {p['schedule']:>8} {p['receivers']:>3} {c:>9} "
              f"{p['measured']:>8.3f}x {p['model']:>6.3f}x {p['error']:>+6.1%}{' (fit)' if p['fitted_on'] else ' (CPU-bound)' if p['cpu_bound'] else ''}  "
              f"{', '.join(f'{v:.3f}' for v in p['measured_all'])}")
    checked = [p for p in points if not p["fitted_on"] and not p["cpu_bound"]]
    print(f"within {args.tolerance:.0%}: {sum(p['within_tolerance'] for p in checked)} of {len(checked)} points not fitted on; "
          f"worst {max((abs(p['error']) for p in checked), default=0):.1%}")
    print(f"\npredicted, 100 Gbit/s links (time vs one receiver):")
    print(f"{'hop µs':>7} {'GiB':>4} {'N':>5} {'chunk KiB':>9} " + " ".join(f"{n[:24]:>24}" for n in SCHEDULE_NAMES))
    for r in preds:
        if r["receivers"] >= 100:
            print(f"{r['hop_seconds'] * 1e6:>7,.0f} {r['nbytes'] // GIB:>4} {r['receivers']:>5} {r['new_chunk_nbytes'] // 1024:>9} "
                  + " ".join(f"{r[n]:>23.3f}x" for n in SCHEDULE_NAMES))
    breakeven = {name: {f"{nb // GIB} GiB": largest_hop(nb, 1000, name, TARGET_1000_VS_ONE) for nb in (GIB, 10 * GIB)}
                 for name in SCHEDULE_NAMES}
    print(f"\nthe largest per-hop latency at which 1,000 receivers stay within {TARGET_1000_VS_ONE}x of one (100 Gbit/s):")
    for name, by in breakeven.items():
        print(f"  {name:<40} " + ", ".join(f"{k}: {v * 1e6:,.0f} µs" for k, v in by.items()))
    write_json(args.out, {"largest_hop_seconds_1000_within_target": breakeven, "hop_seconds": hop, "fit": args.fit if args.hop_ms is None else None, "tolerance": args.tolerance,
                          "points": points, "predictions": preds, "measured": [str(p) for p in args.measured]})
    if args.plot:
        plot(points, preds, hop, args.plot)
        print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
