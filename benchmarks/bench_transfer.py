"""Transfer benchmark: 1 GiB of float32 between two processes, every
transport, against the limits and the peers, measured in one run.

The entry point of the transfer benchmarks, run in one pair of worker
processes (``_pair.py``) so that every ratio is against a limit of the same
run; each part also runs alone:

* ``bench_transports.py``: tensorferry put→held, every transport and
  receive mode (1, 10k, 100k tensors), the ticket's size and speed, against
  memcpy, raw loopback TCP and raw NIXL;
* ``bench_peers.py``: a ``torch.multiprocessing`` queue and
  ``torch.save``/socket/``torch.load``, against memcpy;
* ``bench_stream.py``: a fresh put of an object four times the free pool
  (streamed in pieces), against memcpy;
* ``bench_plans.py``: ``Sender.plan``/``Receiver.plan`` syncs, against the
  sender's memcpy (``--plans`` runs it alone, ``--no-plans`` leaves it out).

torch runs with ONE intra-op thread in every process by default
(``--threads``): on this shared 2-core machine a parallel copy stalls
whenever the other core is busy, and the memcpy limit is measured with the
same setting as the copies it bounds.

Run: ``.venv/bin/python benchmarks/bench_transfer.py`` (``--quick`` for a
64 MiB smoke run; ``--profile`` writes cProfile of the timed sections to
``benchmarks/results/bench_transfer_profile.txt``; ``--only shm:pool:100k
...`` runs a subset, and with ``--plans`` names groups as ``tcp:wire``;
``--replot JSON`` redraws the tables and plots). Writes
``benchmarks/results/bench_transfer.json`` and ``.png``
(``bench_transfer_plans.json`` for ``--plans``; the plans plot in
``..._plans.png``).
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"  # NIXL/UCX on loopback, here and in every child

import json
import sys
import time
from pathlib import Path
from typing import Any

import bench_peers
import bench_plans
import bench_stream
import bench_transports
from _common import MIB, copy_threads, environment, log, results_dir, write_result
from _harness import QUICK_REPEATS, report, run_in_pair, sizes, transfer_parser
from _pair import Workers, measure_raw_nixl

MODULES = ["bench_transports", "bench_peers", "bench_stream", "bench_plans"]


def print_all(doc: dict) -> None:
    from rich.console import Console

    env = doc["env"]
    nbytes = env["nbytes"]
    con = Console(width=220)
    con.print(f"[bold]tensorferry transfer benchmark[/] — {env['date']} — {env['machine']} — {nbytes / MIB:,.0f} MiB "
              f"float32; medians of {env['repeats']} after 1 warm-up; torch threads {env['torch_threads']}; "
              f"load {env['loadavg_1min']} (start), {env.get('loadavg_1min_end')} (end)")
    tables = [bench_transports.print_table] if doc.get("rows") else []
    tables += [bench_peers.print_table, bench_stream.print_table] + ([bench_plans.print_table] if doc.get("plans") else [])
    report(doc, nbytes, tables, con, limits_title="limits (same run: start and end pooled)")


def plot_all(doc: dict, path: Path) -> None:
    from _plots import plot_plans, plot_transports

    if doc.get("rows"):
        plot_transports(doc, doc["env"]["nbytes"], path.with_suffix(".png"))
    if doc.get("plans", {}).get("rows"):
        plot_plans(doc, path.with_name(path.stem + "_plans.png"))


def write_profiles(doc: dict, path: Path) -> None:
    with path.open("w") as f:
        for c in doc["cases"]:
            if "error" in c:
                continue
            for side, text in (("SENDER put()", c["sender"].get("profile_sender")),
                               ("RECEIVER get() (main thread only)", c["receiver"].get("profile_receiver"))):
                f.write(f"\n===== {c['transport']} {c['mode']} {c['count']}: {side}, {c['repeats']} timed runs =====\n")
                f.write(text or "(none)\n")
        for c in doc.get("plans", {}).get("cases", []):
            if "error" in c or not c["sender"].get("profile_sender"):
                continue  # a group's profile is kept with its first variant
            for side, text in (("SENDER plan+put", c["sender"]["profile_sender"]),
                               ("RECEIVER plan+get (main thread only)", c["receiver"].get("profile_receiver"))):
                f.write(f"\n===== plans group {c['transport']}:{c['group']}: {side}, {c['repeats']} rounds =====\n")
                f.write(text or "(none)\n")


def main() -> int:
    ap = transfer_parser(__doc__)
    ap.add_argument("--peer-repeats", type=int, default=3, help="timed repeats per peer case")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-stream", action="store_true", help="leave the streamed-put part out")
    ap.add_argument("--plans", action="store_true", help="run only the plans part (bench_plans.py)")
    ap.add_argument("--no-plans", action="store_true", help="leave the plans part out of a full run")
    ap.add_argument("--only", nargs="*", default=None, metavar="TRANSPORT:MODE:TENSORS",
                    help="run only these tensorferry cases (e.g. shm:pool:100k tcp:into:1), no peers")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON", help="only redraw the tables and plots")
    args = ap.parse_args()
    if args.replot is not None:
        doc = json.loads(args.replot.read_text())
        print_all(doc)
        plot_all(doc, args.replot)
        return 0
    if args.plans:
        return bench_plans.main(sys.argv[1:], name="bench_transfer_plans" + ("_quick" if args.quick else ""))

    nbytes, repeats, transports = sizes(args)
    peer_repeats = QUICK_REPEATS if args.quick else args.peer_repeats
    started = time.monotonic()
    env = environment(nbytes=nbytes, repeats=repeats, peer_repeats=peer_repeats, torch_threads=args.threads,
                      copy_threads=copy_threads(), transports=transports)
    log(f"transports {transports}; {nbytes / MIB:.0f} MiB; repeats {repeats} (peers {peer_repeats}); "
        f"torch threads {args.threads}; load {env['loadavg_1min']}")
    doc: dict[str, Any] = {"limits": {}, "cases": [], "peers": [], "stream": [], "errors": [], "targets": []}

    def measure(w: Workers) -> None:
        if "nixl" in transports:
            measure_raw_nixl(doc["limits"], nbytes, max(3, repeats), doc["errors"])
        bench_transports.measure(w, doc, transports, repeats, args.only, args.profile)
        if not (args.no_peers or args.only):
            bench_peers.measure(w, doc, peer_repeats)
        if not (args.no_stream or args.only):
            bench_stream.measure(w, doc, nbytes, transports, repeats)
        if not (args.no_plans or args.only):
            bench_plans.measure(w, doc, transports, repeats, None, args.profile)

    info = run_in_pair(MODULES, doc, env, nbytes, args.threads, measure, limits=bench_transports.LIMITS,
                       limit_repeats=max(3, repeats))
    doc["env"]["peak_reset_works"] = {k: v["peak_reset_works"] for k, v in info.items()}
    ratios = bench_transports.summarize(doc, nbytes)
    for part in (bench_peers, bench_stream, bench_plans):
        ratios.update(part.summarize(doc, nbytes))
    suffix = "_quick" if args.quick else "_profile" if args.profile else "_subset" if args.only else ""
    path = write_result(results_dir(args.out) / f"bench_transfer{suffix}.json", doc, ratios)
    print_all(doc)
    if args.profile:
        write_profiles(doc, path.with_name("bench_transfer_profile.txt"))
    plot_all(doc, path)
    log(f"done in {time.monotonic() - started:.0f} s; wrote {path} and .png")
    return 0 if not doc["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
