"""What watching a process costs it: tensorferry's monitor against psutil and
Ray dashboard's attribute sets, on the same target processes, in one run.

Measures (see docs/monitor.md for the reading):
  1. cost per sample on targets: small, 1k/10k/50k mappings, 1 and 4 GiB of
     4 KiB pages, torch imported; for tensorferry's one-shot cheap sample
     (sample(): files opened and closed, with and without the fd count), the
     agent's per-process path (files held open; status read every call, and
     status carried over while stat shows RSS unchanged), its exact read,
     psutil memory_info() (interleaved with the cheap methods in several
     rounds: the noise reference),
     memory_full_info(), and Ray's as_dict attribute sets before and after
     it dropped memory_full_info;
  2. interference: the 4 GiB target maps, touches and unmaps 256 KiB in a loop
     and records its iteration latencies with no monitor, with tensorferry's
     Agent at 1 Hz (default budget), and with a memory_full_info loop at 1 Hz;
     the target is pinned to one CPU and the monitors to the other(s), and
     iterations over 5 ms are counted and summed (each walk that catches the
     loop is one of them);
  3. agent self-cost: CPU seconds per hour and RSS of an agent process
     watching 100 processes at 1 Hz (serving /metrics on 127.0.0.1, scraped
     every 15 s), with the default status carry-over and with status read
     every tick (the cost when every target's RSS moves every tick).

  4. exact figures of a 4 GiB process (4 KiB pages): the worst call of a
     victim while a monitor takes exact figures at 1 Hz (pagemap slices,
     smaps_rollup, psutil memory_full_info), for a victim mapping and
     unmapping 256 KiB and one allocating 8 MiB tensors in a loop; the
     monitor's CPU per exact figure per GiB resident; how often the agent's
     default budget gives it a figure (ticks at 1 Hz on a simulated clock,
     each walk step's real cost charged). A control row walks another
     process of the same size while the victim loops: the monitor's CPU
     without the victim's lock, so what it adds is scheduling. Each row also
     gives where the victim's time went (its schedstat): blocked (the lock)
     and waiting for a CPU (scheduling). Every row runs in several rounds;
     the table gives medians.

  5. the loops (``--loops``, alone): how long ``Agent.run(duration_seconds=0.45)``
     at 0.1 s ticks takes over what was asked, how many ticks it makes of the
     4-5 possible, how long one tick of every process on the machine takes
     against its interval, and how long ``top`` takes to quit on ``q`` against
     its 5 s interval. The tests check only that these loops end; their
     timing is measured here (medians over rounds, ratios to the interval).

  6. node scale (``--scale``, alone): a ``tensorferry monitor`` process
     watching 100, 1,000 and 3,000 idle processes at 1 s ticks with
     ``--pattern``, ``--tree`` and ``--all``, fds counted, serving /metrics:
     its CPU per tick and per process, RSS, tick wall time and scrape time;
     a ``--per-process`` row per size whose scrape is parsed and summed, and
     the issue's own ``monitor -k ... --json`` row at 1,000. Every monitor
     of a size runs at once on one fleet, is measured over the same window
     (``--scale-seconds``, 60 s) after ``--scale-warm`` (90 s: command lines
     and exact figures settle) and is scraped every 15 s inside it.
     ``--compare SRC`` runs every row also from another tree's ``src`` (the
     code before a change), side by side. ``--plot PATH`` draws CPU against
     watched processes.

Sections 1, 2 and the tables are here; ``_monitor_targets.py`` holds the
target processes, ``_monitor_exact.py`` section 4, ``_monitor_loops.py``
sections 3 and 5, ``_monitor_scale.py`` section 6.

Run: .venv/bin/python benchmarks/bench_monitor.py [--quick] [--exact-only] [--exact-rounds N] [--loops]
     [--scale [--scale-sizes 100,1000,3000] [--scale-seconds S] [--scale-warm S] [--compare SRC] [--plot PATH]]
Writes benchmarks/results/bench_monitor.json (bench_monitor_scale.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tensorferry.monitor import Agent, AgentConfig, Selection  # noqa: E402
from tensorferry.monitor._procfs import ProcfsBackend  # noqa: E402

from _common import results_dir, write_json  # noqa: E402
from _monitor_exact import exact_figures, exact_targets, print_exact  # noqa: E402
from _monitor_loops import agent_self_cost, loop_timing  # noqa: E402
from _monitor_scale import json_rows, plot_scale, print_scale, scale  # noqa: E402
from _monitor_targets import Target, per_call, pin_apart  # noqa: E402

# $TENSORFERRY_BENCH_OUT (interleave.py) or benchmarks/results.
RESULTS = results_dir() / "bench_monitor.json"

RAY_BEFORE = ["pid", "create_time", "cpu_percent", "cpu_times", "cmdline", "memory_info", "memory_full_info", "num_fds"]
RAY_AFTER = ["pid", "create_time", "cpu_percent", "cpu_times", "cmdline", "memory_info", "num_fds"]


CHEAP_METHODS = ("tf_cheap_s", "tf_cheap_nofds_s", "tf_agent_read_s", "tf_agent_carry_s", "psutil_memory_info_s")


def sample_costs(targets: list[Target], quick: bool) -> list[dict[str, object]]:
    rows = []
    with_fds = ProcfsBackend(count_fds=True)
    no_fds = ProcfsBackend(count_fds=False)
    # The agent's path: stat/status held open and pread; fds not counted (the
    # agent counts them every 10th tick). "read": status read every call (a
    # target whose RSS moves every tick); "carry": status skipped while stat
    # shows RSS and VmSize unchanged (an idle target, the best case).
    held = ProcfsBackend(count_fds=False)
    rounds = 3 if quick else 7
    cheap_n = 100 if quick else 400  # calls per method per round
    for t in targets:
        p = psutil.Process(t.pid)
        p.cpu_percent()
        budget = 0.5 if quick else 1.5  # seconds of walking per expensive method
        row: dict[str, object] = {"target": t.label, "pid": t.pid}
        s = with_fds.cheap(t.pid)
        row["rss_bytes"] = s.rss_bytes
        row["page_table_bytes"] = s.page_table_bytes
        with open(f"/proc/{t.pid}/maps", "rb") as f:
            row["mappings"] = f.read().count(b"\n")
        fns = {
            "tf_cheap_s": lambda: with_fds.cheap(t.pid),
            "tf_cheap_nofds_s": lambda: no_fds.cheap(t.pid),
            "tf_agent_read_s": lambda: held.cheap_reusing(t.pid, count_fds=False, max_status_age_seconds=0),
            "tf_agent_carry_s": lambda: held.cheap_reusing(t.pid, count_fds=False),
            "psutil_memory_info_s": p.memory_info,
        }
        # Interleaved rounds, memory_info in each as the noise reference: a
        # burst of load from other work on the machine hits every method alike.
        per_round: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                per_round[k].append(per_call(fn, min_calls=cheap_n, max_seconds=0.2))
        for k, v in per_round.items():
            row[k] = statistics.median(v)
            row[k.replace("_s", "_round_medians_s")] = v
        carried = held.cheap_reusing(t.pid, count_fds=False)
        row["tf_agent_carry_status_age_s"] = carried.status_age_seconds
        row["ray_after_s"] = per_call(lambda: p.as_dict(attrs=RAY_AFTER), min_calls=cheap_n, max_seconds=1)
        row["tf_exact_s"] = per_call(lambda: no_fds.exact(t.pid), min_calls=3, max_seconds=budget)
        row["psutil_memory_full_info_s"] = per_call(p.memory_full_info, min_calls=3, max_seconds=budget)
        row["ray_before_s"] = per_call(lambda: p.as_dict(attrs=RAY_BEFORE), min_calls=3, max_seconds=budget)
        row["full_info_over_tf_cheap"] = row["psutil_memory_full_info_s"] / row["tf_cheap_s"]
        row["full_info_over_tf_agent_read"] = row["psutil_memory_full_info_s"] / row["tf_agent_read_s"]
        est_agent = Agent(Selection(pids=(t.pid,)), backend=no_fds)
        row["agent_walk_estimate_s"] = est_agent.estimate_walk_seconds(s)
        row["agent_would_walk"] = row["agent_walk_estimate_s"] <= AgentConfig().max_stall_seconds
        rows.append(row)
        print(f"  sampled {t.label}", file=sys.stderr, flush=True)
    held.close()
    return rows


def interference(victim: Target, seconds: float) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    restore, victim_cpu = pin_apart(victim)
    try:
        out.update(_interference_rows(victim, seconds))
    finally:
        os.sched_setaffinity(0, restore)
    for row in out.values():
        row["victim_cpu"] = victim_cpu
    return out


def _interference_rows(victim: Target, seconds: float) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    out["no monitor"] = victim.churn(seconds)
    print("  churn: no monitor", file=sys.stderr, flush=True)

    # The agent watches the victim, as the memory_full_info loop below does;
    # walking other targets here would measure CPU contention on 2 cores, not stalls.
    agent = Agent(Selection(pids=(victim.pid,)), AgentConfig(interval_seconds=1.0))
    agent.start()
    try:
        out["tensorferry Agent 1 Hz"] = victim.churn(seconds)
    finally:
        agent.stop()
    st = agent.stats()
    out["tensorferry Agent 1 Hz"]["agent_exact_reads"] = st.exact_reads
    out["tensorferry Agent 1 Hz"]["agent_exact_seconds"] = st.exact_seconds
    out["tensorferry Agent 1 Hz"]["agent_stall_skips"] = st.exact_skipped_stall
    print("  churn: agent", file=sys.stderr, flush=True)

    stop = threading.Event()
    walks: list[float] = []

    def full_info_loop() -> None:
        p = psutil.Process(victim.pid)
        while not stop.is_set():
            t0 = time.perf_counter()
            p.memory_full_info()
            walks.append(time.perf_counter() - t0)
            stop.wait(max(0.0, 1.0 - (time.perf_counter() - t0)))

    th = threading.Thread(target=full_info_loop, daemon=True)
    th.start()
    try:
        out["psutil memory_full_info 1 Hz"] = victim.churn(seconds)
    finally:
        stop.set()
        th.join(10)
    out["psutil memory_full_info 1 Hz"]["walks"] = len(walks)
    out["psutil memory_full_info 1 Hz"]["median_walk_seconds"] = statistics.median(walks) if walks else 0.0
    out["psutil memory_full_info 1 Hz"]["walk_seconds"] = sum(walks)
    print("  churn: memory_full_info", file=sys.stderr, flush=True)
    # The noise floor: the same run again with nothing watching.
    out["no monitor (again)"] = victim.churn(seconds)
    return out


def print_tables(costs, interf, self_cost) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(width=200)
    t = Table(title="cost per sample (median of interleaved round medians, µs)")
    for h in ("target", "RSS", "maps", "tf cheap", "tf cheap -fds", "tf agent (status read)",
              "tf agent (status carried)", "psutil mem_info", "Ray after",
              "tf exact", "psutil full_info", "Ray before", "full_info / tf cheap",
              "full_info / tf agent", "agent walks?"):
        t.add_column(h, justify="right")
    for r in costs:
        t.add_row(
            r["target"], f"{r['rss_bytes'] / 2**20:.0f}M", str(r["mappings"]),
            *(f"{r[k] * 1e6:.1f}" for k in ("tf_cheap_s", "tf_cheap_nofds_s", "tf_agent_read_s",
                                            "tf_agent_carry_s", "psutil_memory_info_s",
                                            "ray_after_s", "tf_exact_s", "psutil_memory_full_info_s",
                                            "ray_before_s")),
            f"{r['full_info_over_tf_cheap']:.0f}x", f"{r['full_info_over_tf_agent_read']:.0f}x",
            "yes" if r["agent_would_walk"] else f"no (est {r['agent_walk_estimate_s'] * 1e3:.0f} ms)",
        )
    c.print(t)
    base = max(interf["no monitor"], interf["no monitor (again)"], key=lambda r: r["worst_seconds"])
    t = Table(title="interference: 4 GiB target mapping/touching/unmapping 256 KiB in a loop")
    for h in ("monitor", "iterations", "p50 µs", "p99 µs", "p99.9 µs", "worst µs", "worst / worse no-monitor run",
              "iterations > 5 ms", "time in them ms"):
        t.add_column(h, justify="right")
    for name, r in interf.items():
        t.add_row(name, str(r["iterations"]), f"{r['p50_seconds'] * 1e6:.0f}", f"{r['p99_seconds'] * 1e6:.0f}",
                  f"{r['p999_seconds'] * 1e6:.0f}", f"{r['worst_seconds'] * 1e6:.0f}",
                  f"{r['worst_seconds'] / base['worst_seconds']:.2f}x", str(r["slow_iterations"]),
                  f"{r['slow_seconds'] * 1e3:.1f}")
    c.print(t)
    for label, s in self_cost.items():
        c.print(
            f"agent self-cost ({label}), {s['processes']} processes at 1 Hz for {s['seconds']:.0f} s, "
            f"{s['scrapes']} scrapes: {s['cpu_seconds_per_hour']:.1f} CPU s/hour "
            f"({s['core_fraction'] * 100:.3f}% of a core; cheap sample {s['cheap_us_per_process']:.1f} µs/process, "
            f"exact {s['exact_seconds'] * 1e3:.1f} ms in {s['exact_reads']} reads); "
            f"RSS {s['rss_bytes'] / 2**20:.1f} MiB (peak {s['peak_rss_bytes'] / 2**20:.1f} MiB)"
        )


def run_scale(args: argparse.Namespace) -> int:
    sizes = tuple(int(n) for n in args.scale_sizes.split(","))
    modes = tuple(args.scale_modes.split(","))
    if not set(modes) <= {"pattern", "tree", "all"} or min(sizes) < 1:
        raise SystemExit(f"--scale-sizes {args.scale_sizes} / --scale-modes {args.scale_modes}: sizes >= 1, "
                         "modes among pattern, tree, all")
    doc = scale(sizes, modes, args.scale_seconds, args.compare, args.scale_warm)
    json_sizes = [n for n in sizes if n == 1000] or [max(sizes)]
    srcs = [ROOT / "src"] if args.compare is None else [args.compare, ROOT / "src"]
    doc["json_rows"] = [r for n in json_sizes for r in json_rows(n, srcs, args.scale_seconds, args.scale_warm)]
    doc["load_average_at_end"] = os.getloadavg()
    print_scale(doc)
    for r in doc["json_rows"]:
        print(f"monitor -k ... --json, {r['watched']} processes, {'new' if str(r['src']).startswith(str(ROOT)) else 'old'}: "
              f"{r['core_percent']:.2f}% of a core ({r['cpu_us_per_process_tick']:.2f} µs/process/tick, load {r['load_1min']:.1f})")
    out = write_json(RESULTS.with_name("bench_monitor_scale.json"), doc, indent=2)
    print(f"wrote {out}", file=sys.stderr)
    if args.plot is not None:
        plot_scale(doc, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller targets, shorter phases (a smoke run)")
    ap.add_argument("--exact-only", action="store_true", help="only section 4 (exact figures of a 4 GiB process)")
    ap.add_argument("--exact-rounds", type=int, default=3, metavar="N",
                    help="rounds of every section-4 row; the table gives medians (default 3)")
    ap.add_argument("--loops", action="store_true", help="only section 5 (the agent's and top's loops)")
    ap.add_argument("--scale", action="store_true", help="only section 6 (the monitor at node scale)")
    ap.add_argument("--scale-sizes", default="100,1000,3000", metavar="N,N,...", help="idle processes per row")
    ap.add_argument("--scale-modes", default="pattern,tree,all", metavar="MODE,...", help="selections per size")
    ap.add_argument("--scale-seconds", type=float, default=60.0, metavar="S",
                    help="measured window per size (every row of a size at once)")
    ap.add_argument("--scale-warm", type=float, default=90.0, metavar="S",
                    help="seconds before the window: command lines are read again at 10, 30 and 70 s, then every 40 s")
    ap.add_argument("--compare", type=Path, metavar="SRC", help="also run every scale row from this src tree")
    ap.add_argument("--plot", type=Path, metavar="PATH", help="section 6: plot CPU against watched processes")
    args = ap.parse_args()
    if args.scale:
        return run_scale(args)
    if args.exact_rounds < 1:
        ap.error(f"--exact-rounds {args.exact_rounds}: must be at least 1")
    if args.loops:
        loops = loop_timing(3 if args.quick else 9)
        for key, value in loops.items():
            print(f"{key:<45} {value:.3f}")
        out = write_json(RESULTS.with_name("bench_monitor_loops.json"),
                         {"kernel": os.uname().release, "loops": loops, "load_average": os.getloadavg()}, indent=2)
        print(f"wrote {out}", file=sys.stderr)
        return 0
    if args.exact_only:
        mib = 1024 if args.quick else 4096
        load_start = os.getloadavg()
        victim = Target("4G RSS", "big", str(mib))
        try:
            ex = exact_figures(victim, mib, 3.0 if args.quick else 8.0, 300 if args.quick else 900, args.exact_rounds)
        finally:
            victim.close()
        print_exact(ex)
        print(f"load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f} "
              f"(1 min; {os.cpu_count()} CPUs)")
        out = write_json(RESULTS.with_name("bench_monitor_exact.json"),
                         {"kernel": os.uname().release, "exact": ex, "targets": exact_targets(ex),
                          "load_average_at_start": load_start, "load_average_at_end": os.getloadavg()}, indent=2)
        print(f"wrote {out}", file=sys.stderr)
        return 0
    big = (256, 1024) if args.quick else (1024, 4096)
    churn_seconds = 3.0 if args.quick else 10.0
    self_seconds = 5.0 if args.quick else 30.0
    t_start = time.monotonic()
    targets: list[Target] = []
    try:
        print("starting targets", file=sys.stderr, flush=True)
        targets.append(Target("small", "sleep"))
        for n in (1000, 10000, 50000):
            targets.append(Target(f"{n // 1000}k maps", "maps", str(n)))
        targets.append(Target(f"{big[0] // 1024 or big[0]}{'G' if big[0] >= 1024 else 'M'} RSS", "big", str(big[0])))
        targets.append(Target(f"{big[1] // 1024}G RSS", "big", str(big[1])))
        targets.append(Target("torch", "torch"))
        costs = sample_costs(targets, args.quick)
        victim = targets[5]
        interf = interference(victim, churn_seconds)
        exact = exact_figures(victim, big[1], churn_seconds, 900, args.exact_rounds)
    finally:
        for t in targets:
            t.close()
    self_cost = {
        "default: status carried while RSS stands still": agent_self_cost(self_seconds, 10.0),
        "status read every tick (every target's RSS moving)": agent_self_cost(self_seconds, 0.0),
    }
    default_cost, worst_cost = self_cost.values()
    cheap_max = max(r["tf_cheap_s"] for r in costs)
    agent_read_max = max(r["tf_agent_read_s"] for r in costs)
    at50k = next(r for r in costs if r["target"] == "50k maps")
    base = max(interf["no monitor"]["worst_seconds"], interf["no monitor (again)"]["worst_seconds"])
    summary = {
        "cheap_sample_max_us": cheap_max * 1e6,
        "cheap_sample_target_30us_met": cheap_max <= 30e-6,
        "agent_cheap_read_max_us": agent_read_max * 1e6,
        "psutil_memory_info_median_us": statistics.median(r["psutil_memory_info_s"] for r in costs) * 1e6,
        "full_info_over_cheap_at_50k_maps": at50k["full_info_over_tf_cheap"],
        "ratio_target_500x_met": at50k["full_info_over_tf_cheap"] >= 500,
        "full_info_over_agent_read_at_50k_maps": at50k["full_info_over_tf_agent_read"],
        "agent_worst_over_no_monitor": interf["tensorferry Agent 1 Hz"]["worst_seconds"] / base,
        "full_info_worst_over_no_monitor": interf["psutil memory_full_info 1 Hz"]["worst_seconds"] / base,
        # Stalls over 5 ms, per row: the walks show here even when one
        # scheduling hiccup sets the worst iteration of a no-monitor run.
        "slow_iterations": {k: r["slow_iterations"] for k, r in interf.items()},
        "slow_milliseconds": {k: r["slow_seconds"] * 1e3 for k, r in interf.items()},
        "victim_cpu": interf["no monitor"]["victim_cpu"],
        "agent_worst_within_2x_met": interf["tensorferry Agent 1 Hz"]["worst_seconds"] <= 2 * base,
        "agent_core_percent": default_cost["core_fraction"] * 100,
        "agent_core_percent_status_every_tick": worst_cost["core_fraction"] * 100,
        "agent_cpu_target_0.5pct_met": max(default_cost["core_fraction"], worst_cost["core_fraction"]) < 0.005,
        "agent_rss_mib": max(default_cost["rss_bytes"], worst_cost["rss_bytes"]) / 2**20,
        "agent_rss_target_80mib_met": max(default_cost["rss_bytes"], worst_cost["rss_bytes"]) < 80 * 2**20,
        "exact": exact_targets(exact),
        "load_average_at_end": os.getloadavg(),
        "wall_seconds": time.monotonic() - t_start,
    }
    print_tables(costs, interf, self_cost)
    print_exact(exact)
    print(json.dumps(summary, indent=2))
    write_json(RESULTS, {"quick": args.quick, "kernel": os.uname().release, "cpus": os.cpu_count(),
                         "sample_costs": costs, "interference": interf, "agent_self_cost": self_cost, "exact": exact,
                         "summary": summary}, indent=2)
    print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
