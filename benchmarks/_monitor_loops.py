"""bench_monitor's sections 3 and 5: an agent process's own cost watching
100 processes (CPU, RSS, scraped /metrics), and how long the agent's and
top's loops take against the times asked of them."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


from tensorferry.monitor import Agent, AgentConfig, Selection

from _monitor_targets import ROOT, Target

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
