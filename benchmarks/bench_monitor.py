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

Run: .venv/bin/python benchmarks/bench_monitor.py [--quick] [--exact-only] [--exact-rounds N] [--loops]
Writes benchmarks/results/bench_monitor.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tensorferry.monitor import Agent, AgentConfig, Selection  # noqa: E402
from tensorferry.monitor import _pagemap, _pagemap_reads  # noqa: E402
from tensorferry.monitor._pagemap import slice_nbytes_for_stall  # noqa: E402
from tensorferry.monitor._procfs import ProcfsBackend  # noqa: E402

TARGET = ROOT / "tests" / "monitor" / "fixtures" / "target.py"
RESULTS = ROOT / "benchmarks" / "results" / "bench_monitor.json"

RAY_BEFORE = ["pid", "create_time", "cpu_percent", "cpu_times", "cmdline", "memory_info", "memory_full_info", "num_fds"]
RAY_AFTER = ["pid", "create_time", "cpu_percent", "cpu_times", "cmdline", "memory_info", "num_fds"]


class Target:
    """A benchmark target; ends by closing its stdin, then by its pid."""

    def __init__(self, label: str, *args: str) -> None:
        self.label = label
        self.proc = subprocess.Popen(
            [sys.executable, str(TARGET), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"target {label} failed to start")
        self.facts = json.loads(line)
        self.pid = self.proc.pid

    def churn(self, seconds: float) -> dict[str, float]:
        self.proc.stdin.write(f"churn {seconds}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)


def per_call(fn, *, min_calls: int, max_seconds: float) -> float:
    """Median seconds per call of ``fn`` (each call timed alone)."""
    times: list[float] = []
    deadline = time.perf_counter() + max_seconds
    while len(times) < min_calls or (time.perf_counter() < deadline and len(times) < 20 * min_calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= min_calls and time.perf_counter() > deadline:
            break
    return statistics.median(times)


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


def pin_apart(victim: Target) -> tuple[set[int], int | None]:
    """The victim on the last CPU, this process (and the monitor threads it
    starts) on the others, so a row measures lock stalls, not the monitor
    taking the victim's core. Returns this process's affinity to restore and
    the victim's CPU (None on one CPU: nothing pinned)."""
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        return mine, None
    cpu = max(mine)
    os.sched_setaffinity(victim.pid, {cpu})
    os.sched_setaffinity(0, mine - {cpu})
    return mine, cpu


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


UNPACED = "pagemap slices, no pauses"
"""The ablation row: the same walks with the pauses between lock bursts turned
off (preads of 256 MiB back to back, as before they were added)."""
CONTROL = "pagemap slices, another process"
"""The control row: the same pagemap walks of another process of the same size
while the victim loops. It takes the monitor's CPU as the real row does and
none of the victim's lock, so what it adds over no monitor is scheduling."""


@contextlib.contextmanager
def unpaced():
    """Walks without pauses between lock bursts, for the ablation row only."""
    saved = _pagemap.LOCK_BURST_SECONDS, _pagemap_reads._PREAD_CALL_PAGES
    _pagemap.LOCK_BURST_SECONDS, _pagemap_reads._PREAD_CALL_PAGES = math.inf, _pagemap_reads._PREAD_PAGES
    try:
        yield
    finally:
        _pagemap.LOCK_BURST_SECONDS, _pagemap_reads._PREAD_CALL_PAGES = saved


def exact_unpaced(backend: ProcfsBackend, pid: int):
    with unpaced():
        return backend.exact(pid)


def exact_figures(victim: Target, victim_mib: int, seconds: float, sim_seconds: int, rounds: int) -> dict[str, object]:
    """Section 4: pagemap slices against smaps_rollup and memory_full_info,
    ``rounds`` rounds of every row (the medians are what the table reports)."""
    backend = ProcfsBackend(count_fds=False)
    rss = backend.cheap(victim.pid).rss_bytes
    gib = rss / 2**30
    # Monitor CPU per exact figure (this process's CPU time, median of 3).
    cpu: dict[str, float] = {}
    p = psutil.Process(victim.pid)
    methods = {
        "pagemap slices": lambda: backend.exact(victim.pid),
        UNPACED: lambda: exact_unpaced(backend, victim.pid),
        "smaps_rollup": lambda: backend.exact_rollup(victim.pid),
        "psutil memory_full_info": p.memory_full_info,
    }
    figures = {}
    for name, fn in methods.items():
        runs = []
        for _ in range(3):
            c0 = time.process_time()
            out = fn()
            runs.append(time.process_time() - c0)
        cpu[name] = statistics.median(runs)
        figures[name] = getattr(out, "uss_bytes", getattr(out, "uss", None))
    pm = backend.exact(victim.pid)
    # One walk as exact() makes it, for its slices, its PAGEMAP_SCAN calls
    # (the longest call is the longest the walk held the victim's lock at
    # once) and its pauses between lock bursts.
    stall = AgentConfig().max_stall_seconds
    walk = backend.start_walk(victim.pid, slice_nbytes=slice_nbytes_for_stall(stall), step_limit_seconds=stall)
    walk_wall = time.perf_counter()
    while walk is not None and not walk.step():
        pass
    walk_wall = time.perf_counter() - walk_wall
    other = Target("control", "big", str(victim_mib))
    methods[CONTROL] = lambda: backend.exact(other.pid)
    per_round: list[dict[str, dict[str, object]]] = []
    restore, victim_cpu = pin_apart(victim)
    try:
        for round_no in range(rounds):
            rows: dict[str, dict[str, object]] = {}
            for load in ("churn", "alloc"):
                def run(label: str, fn) -> None:
                    stop = threading.Event()
                    count = [0]

                    def loop() -> None:
                        while not stop.is_set():
                            t0 = time.perf_counter()
                            fn()
                            count[0] += 1
                            stop.wait(max(0.0, 1.0 - (time.perf_counter() - t0)))

                    th = threading.Thread(target=loop, daemon=True) if fn is not None else None
                    if th is not None:
                        th.start()
                    try:
                        victim.proc.stdin.write(f"{load} {seconds}\n")
                        victim.proc.stdin.flush()
                        r = json.loads(victim.proc.stdout.readline())
                    finally:
                        stop.set()
                        if th is not None:
                            th.join(30)
                    r["figures"] = count[0]
                    rows[f"{load}: {label}"] = r
                    print(f"  exact round {round_no + 1}/{rounds}: {load}: {label} "
                          f"(worst {r['worst_seconds'] * 1e3:.2f} ms, load {os.getloadavg()[0]:.2f})",
                          file=sys.stderr, flush=True)

                run("no monitor", None)
                for name, fn in methods.items():
                    run(name, fn)
            per_round.append(rows)
    finally:
        os.sched_setaffinity(0, restore)
        other.close()
    # How often the default budget gives this process a figure: 1 Hz ticks
    # on a simulated clock (no sleeping), each step's real cost charged.
    clock = [0.0]
    agent = Agent(Selection(pids=(victim.pid,)), AgentConfig(), backend=backend, clock=lambda: clock[0])
    finished: list[float] = []
    last = None
    for second in range(sim_seconds):
        clock[0] = float(second)
        s = agent.tick().samples[0]
        if s.uss_source == "pagemap" and s.exact_age_seconds == 0.0 and last != second:
            finished.append(float(second))
            last = second
    st = agent.stats()
    return {
        "rss_bytes": rss,
        "victim_cpu": victim_cpu,
        "rounds": rounds,
        "cpu_seconds_per_figure": cpu,
        "cpu_seconds_per_figure_per_gib": {k: v / gib for k, v in cpu.items()},
        "uss_bytes": figures,
        "pagemap_steps": pm.steps if pm else None,
        "pagemap_max_step_seconds": pm.max_step_seconds if pm else None,
        "pagemap_slice_mib": [pages * os.sysconf("SC_PAGE_SIZE") / 2**20 for pages in walk.slice_history]
        if walk else None,
        "pagemap_scan_calls": walk.scan_calls if walk else None,
        "pagemap_max_scan_seconds": walk.max_scan_seconds if walk else None,
        "pagemap_walk_wall_seconds": walk_wall,
        "pagemap_walk_cost_seconds": walk.cost_seconds if walk else None,
        "pagemap_lock_gaps": walk.gaps if walk else None,
        "pagemap_lock_gap_seconds": walk.gap_seconds if walk else None,
        "interference_rounds": per_round,
        "interference": summarize_rounds(per_round),
        "agent_simulated_seconds": sim_seconds,
        "agent_figures": len(finished),
        "agent_figure_times": finished,
        "agent_seconds_per_figure": (sim_seconds / len(finished)) if finished else None,
        "agent_steps": st.exact_steps,
        "agent_exact_seconds": st.exact_seconds,
        "agent_stall_skips": st.exact_skipped_stall,
    }


def summarize_rounds(per_round: list[dict[str, dict[str, object]]]) -> dict[str, dict[str, object]]:
    """Per row: the median over rounds of each figure, and of the round's
    worst call divided by the same round's worst with no monitor."""
    out: dict[str, dict[str, object]] = {}
    for name in per_round[0]:
        base = name.split(":")[0] + ": no monitor"
        rs = [rows[name] for rows in per_round]
        row: dict[str, object] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("figures", "p50_seconds", "p999_seconds", "worst_seconds", "slow_iterations",
                      "blocked_seconds", "runqueue_seconds", "iterations")
        }
        row["worst_seconds_per_round"] = [r["worst_seconds"] for r in rs]
        row["worst_over_no_monitor"] = statistics.median(
            rows[name]["worst_seconds"] / rows[base]["worst_seconds"] for rows in per_round)
        out[name] = row
    return out


def exact_targets(ex: dict[str, object]) -> dict[str, object]:
    """Issue 17's speed figures from section 4, with the ratios it asks for."""
    rows = ex["interference"]
    rest = rows["churn: no monitor"]["worst_seconds"]
    limit = max(2e-3, 3 * rest)
    out: dict[str, object] = {"mmap_loop_worst_at_rest_ms": rest * 1e3, "target_ms": limit * 1e3}
    for name in ("pagemap slices", UNPACED, CONTROL, "smaps_rollup", "psutil memory_full_info"):
        for load in ("churn", "alloc"):
            r = rows[f"{load}: {name}"]
            out[f"{load}: {name}: worst_ms"] = r["worst_seconds"] * 1e3
            out[f"{load}: {name}: worst_over_rest"] = r["worst_over_no_monitor"]
    for load in ("churn", "alloc"):
        rest_l = rows[f"{load}: no monitor"]["worst_seconds"]
        worst = rows[f"{load}: pagemap slices"]["worst_seconds"]
        out[f"{load}: pagemap_target_met"] = worst <= max(2e-3, 3 * rest_l)
    cpu = ex["cpu_seconds_per_figure_per_gib"]
    out["cpu_ms_per_gib_pagemap"] = cpu["pagemap slices"] * 1e3
    out["cpu_ms_per_gib_smaps_rollup"] = cpu["smaps_rollup"] * 1e3
    out["cpu_pagemap_over_smaps_rollup"] = cpu["pagemap slices"] / cpu["smaps_rollup"]
    out["default_budget_seconds_per_figure"] = ex["agent_seconds_per_figure"]
    return out


def print_exact(ex: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(width=220)
    t = Table(title=f"exact figures of a {ex['rss_bytes'] / 2**30:.1f} GiB process (4 KiB pages), monitor at 1 Hz, "
                    f"median of {ex['rounds']} rounds")
    for h in ("victim loop", "monitor", "figures", "p50 µs", "p99.9 µs", "worst ms", "worst ms per round",
              "worst / no monitor", "iterations > 5 ms", "victim blocked ms", "victim waiting for a CPU ms"):
        t.add_column(h, justify="right")
    for name, r in ex["interference"].items():
        t.add_row(*name.split(": "), f"{r['figures']:.0f}", f"{r['p50_seconds'] * 1e6:.0f}",
                  f"{r['p999_seconds'] * 1e6:.0f}", f"{r['worst_seconds'] * 1e3:.2f}",
                  " / ".join(f"{w * 1e3:.1f}" for w in r["worst_seconds_per_round"]),
                  f"{r['worst_over_no_monitor']:.2f}x", f"{r['slow_iterations']:.0f}",
                  f"{r['blocked_seconds'] * 1e3:.1f}", f"{r['runqueue_seconds'] * 1e3:.1f}")
    c.print(t)
    t = Table(title="monitor CPU per exact figure")
    for h in ("source", "CPU ms", "CPU ms per GiB resident", "vs smaps_rollup"):
        t.add_column(h, justify="right")
    ref = ex["cpu_seconds_per_figure"]["smaps_rollup"]
    for k, v in ex["cpu_seconds_per_figure"].items():
        t.add_row(k, f"{v * 1e3:.1f}", f"{ex['cpu_seconds_per_figure_per_gib'][k] * 1e3:.1f}", f"{v / ref:.2f}x")
    c.print(t)
    c.print(f"default budget (0.1% of a core, 1 Hz): {ex['agent_figures']} pagemap figures in "
            f"{ex['agent_simulated_seconds']} simulated s (one per {ex['agent_seconds_per_figure'] or 0:.0f} s), "
            f"{ex['agent_steps']} steps, {ex['agent_exact_seconds'] * 1e3:.0f} ms walking; "
            f"a pagemap figure took {ex['pagemap_steps']} steps, the longest {ex['pagemap_max_step_seconds'] * 1e3:.1f} ms; "
            f"slices (MiB): {', '.join(f'{m:.0f}' for m in ex['pagemap_slice_mib'] or [])}; "
            f"{ex['pagemap_scan_calls']} PAGEMAP_SCAN calls, the longest {ex['pagemap_max_scan_seconds'] * 1e3:.2f} ms; "
            f"one walk {ex['pagemap_walk_wall_seconds'] * 1e3:.1f} ms of wall time, "
            f"{ex['pagemap_walk_cost_seconds'] * 1e3:.1f} ms charged, "
            f"{ex['pagemap_lock_gaps']} pauses between lock bursts ({ex['pagemap_lock_gap_seconds'] * 1e3:.1f} ms)")
    tg = exact_targets(ex)
    rows = ex["interference"]
    names = ("pagemap slices", UNPACED, CONTROL, "smaps_rollup", "psutil memory_full_info")
    for load, label in (("churn", "mmap loop"), ("alloc", "tensor loop")):
        rest = rows[f"{load}: no monitor"]["worst_seconds"]
        c.print(f"issue 17, {label}, worst victim call (medians): at rest {rest * 1e3:.2f} ms; "
                + ", ".join(f"{n} {tg[f'{load}: {n}: worst_ms']:.2f} ms ({tg[f'{load}: {n}: worst_over_rest']:.2f}x)"
                            for n in names)
                + f"; target for pagemap slices {max(2e-3, 3 * rest) * 1e3:.2f} ms: "
                + ("met" if tg[f"{load}: pagemap_target_met"] else "missed")
                + f"; victim blocked {rows[f'{load}: pagemap slices']['blocked_seconds'] * 1e3:.1f} ms with pagemap "
                + f"slices, {rows[f'{load}: no monitor']['blocked_seconds'] * 1e3:.1f} ms at rest")
    c.print(f"issue 17, CPU per exact figure per GiB: pagemap {tg['cpu_ms_per_gib_pagemap']:.1f} ms, smaps_rollup "
            f"{tg['cpu_ms_per_gib_smaps_rollup']:.1f} ms ({tg['cpu_pagemap_over_smaps_rollup']:.2f}x); default budget: "
            f"one figure per {tg['default_budget_seconds_per_figure'] or 0:.0f} s")


AGENT_CODE = r"""
import json, sys, time, resource
sys.path.insert(0, sys.argv[4])
from tensorferry.monitor import Agent, AgentConfig, Selection, serve_prometheus
root, seconds, status_age = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
WARM_SECONDS = 5.0
agent = Agent(Selection(tree_root_pid=root), AgentConfig(interval_seconds=1.0, status_max_age_seconds=status_age))
server = serve_prometheus(agent, host="127.0.0.1", port=0)
# Warm-up, not measured: the first exact read of everyone and the initial
# full bucket (max_stall_seconds of walks at once) are spent here, so what
# follows is the steady rate an hour of running costs.
agent.run(duration_seconds=WARM_SECONDS)
print(json.dumps({"port": server.port}), flush=True)
warm = agent.stats()
cpu0 = time.process_time()
agent.run(duration_seconds=seconds)
cpu = time.process_time() - cpu0
st = agent.stats()
snap = agent.latest
server.close()
print(json.dumps({
    "processes": len(snap.samples), "seconds": seconds, "cpu_seconds": cpu,
    "status_max_age_seconds": status_age,
    "ticks": st.ticks - warm.ticks,
    "cheap_sample_seconds": st.sample_seconds - warm.sample_seconds,
    "samples": st.samples - warm.samples,
    "exact_seconds": st.exact_seconds - warm.exact_seconds, "exact_reads": st.exact_reads - warm.exact_reads,
    "rss_bytes": st.rss_bytes, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
"""

SCRAPE_SECONDS = 15.0  # a common Prometheus scrape interval; the scrapes count in the agent's CPU


def agent_self_cost(seconds: float, status_max_age_seconds: float) -> dict[str, float]:
    import urllib.request

    tree = Target("tree", "tree", "99")  # 1 parent + 99 children = 100 processes
    scrapes = 0
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", AGENT_CODE, str(tree.pid), str(seconds), str(status_max_age_seconds),
             str(ROOT / "src")],
            stdout=subprocess.PIPE, text=True,
        )
        port = json.loads(proc.stdout.readline())["port"]
        deadline = time.monotonic() + seconds - 1.0
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                resp.read()
            scrapes += 1
            time.sleep(min(SCRAPE_SECONDS, max(0.0, deadline - time.monotonic())))
        out, _ = proc.communicate(timeout=seconds + 90)
        if proc.returncode != 0:
            raise RuntimeError(f"agent process failed (rc {proc.returncode})")
    finally:
        tree.close()
    r = json.loads(out)
    r["scrapes"] = scrapes
    r["cpu_seconds_per_hour"] = r["cpu_seconds"] / r["seconds"] * 3600
    r["core_fraction"] = r["cpu_seconds"] / r["seconds"]
    r["cheap_us_per_process"] = r["cheap_sample_seconds"] / max(1, r["samples"]) * 1e6
    return r


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


def loop_timing(rounds: int) -> dict[str, float]:
    """Section 5: the agent's and top's loops against their asked-for times (medians)."""
    import io

    from rich.console import Console

    from tensorferry.monitor._top import KeyReader, run_top

    run_ratio, run_ticks, tick_ratio, quit_ratio = [], [], [], []
    for _ in range(rounds):
        agent = Agent(Selection(pids=(os.getpid(),)), AgentConfig(interval_seconds=0.1, jitter_fraction=0.0))
        snaps: list[object] = []
        t0 = time.perf_counter()
        agent.run(duration_seconds=0.45, on_snapshot=snaps.append)
        run_ratio.append((time.perf_counter() - t0) / 0.45)
        run_ticks.append(len(snaps))
        agent.stop()
        every = Agent(Selection(all_processes=True), AgentConfig(interval_seconds=1.0))
        every.tick()  # the first tick opens every file and walks; time a later one
        t0 = time.perf_counter()
        every.tick()
        tick_ratio.append((time.perf_counter() - t0) / every.config.interval_seconds)
        every.stop()
        r, w = os.pipe()
        quitting = Agent(Selection(pids=(os.getpid(),)), AgentConfig(interval_seconds=5.0))
        with os.fdopen(r, "rb") as stream:
            t0 = time.perf_counter()
            os.write(w, b"q")
            run_top(quitting, console=Console(file=io.StringIO()), keys=KeyReader(stream))
            quit_ratio.append((time.perf_counter() - t0) / 5.0)
        os.close(w)
        quitting.stop()
    return {
        "rounds": rounds,
        "run_0_45s_wall_over_asked_median": statistics.median(run_ratio),
        "run_0_45s_ticks_median": statistics.median(run_ticks),
        "tick_all_processes_over_interval_median": statistics.median(tick_ratio),
        "top_quit_on_q_over_interval_median": statistics.median(quit_ratio),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller targets, shorter phases (a smoke run)")
    ap.add_argument("--exact-only", action="store_true", help="only section 4 (exact figures of a 4 GiB process)")
    ap.add_argument("--exact-rounds", type=int, default=3, metavar="N",
                    help="rounds of every section-4 row; the table gives medians (default 3)")
    ap.add_argument("--loops", action="store_true", help="only section 5 (the agent's and top's loops)")
    args = ap.parse_args()
    if args.exact_rounds < 1:
        ap.error(f"--exact-rounds {args.exact_rounds}: must be at least 1")
    if args.loops:
        loops = loop_timing(3 if args.quick else 9)
        for key, value in loops.items():
            print(f"{key:<45} {value:.3f}")
        out = RESULTS.with_name("bench_monitor_loops.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"kernel": os.uname().release, "loops": loops,
                                   "load_average": os.getloadavg()}, indent=2))
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
        out = RESULTS.with_name("bench_monitor_exact.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"kernel": os.uname().release, "exact": ex, "targets": exact_targets(ex),
                                   "load_average_at_start": load_start, "load_average_at_end": os.getloadavg()},
                                  indent=2))
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
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(
        {"quick": args.quick, "kernel": os.uname().release, "cpus": os.cpu_count(),
         "sample_costs": costs, "interference": interf, "agent_self_cost": self_cost, "exact": exact,
         "summary": summary},
        indent=2,
    ))
    print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
