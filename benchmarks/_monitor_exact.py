"""bench_monitor's section 4: exact figures of a large process (pagemap
slices, smaps_rollup, psutil memory_full_info) taken at 1 Hz while a victim
loops, the victim's worst call and where its time went, and how often the
agent's default budget gives a figure."""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import threading
import time

import psutil

from tensorferry.monitor import Agent, AgentConfig, Selection
from tensorferry.monitor import _pagemap, _pagemap_reads
from tensorferry.monitor._pagemap import slice_nbytes_for_stall
from tensorferry.monitor._procfs import ProcfsBackend

from _monitor_targets import Target, pin_apart

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
