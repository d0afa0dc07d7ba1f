"""bench_monitor's section 6 (``--scale``): the monitor's own cost at node
scale. 100, 1,000 and 3,000 idle processes (``sleep`` children of one
parent, started here and ended by pid), watched by real ``tensorferry
monitor`` processes at a 1 s tick with ``--pattern``, ``--tree`` and
``--all`` selection, fds counted, serving ``/metrics``. All the monitors of
a size run at once on one fleet, so every row sees the same load, and are
measured over the same window after a warm-up (command lines are read
again at 10, 30 and 70 s; exact figures fill in), scraped every
SCRAPE_EVERY_SECONDS inside it as a Prometheus would. Per row: CPU (its
live threads' run time in their schedstat, plus what ended scrape threads
left in its stat) per tick and per process, RSS, a tick's wall time (from
its start to the snapshot a scrape renders), and scrapes of ``/metrics``
(group labels; one ``--per-process`` row per size, whose exposition is
parsed and whose per-process series are checked to sum to the group's).
With ``--compare SRC`` every row also runs the monitor from another tree's
``src`` (the code before a change), beside this one's.
"""
from __future__ import annotations

import gzip
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from _monitor_targets import ROOT

# The fleet's parent: N `sleep` children whose argv[0] is the tag (so the
# pattern matches them and nothing else), their pids on one line, then it
# waits for stdin to close.
FLEET_CODE = r"""
import os, sys
n, tag = int(sys.argv[1]), sys.argv[2]
pids = [os.posix_spawn("/bin/sleep", [tag, "infinity"], os.environ) for _ in range(n)]
print(" ".join(map(str, pids)), flush=True)
sys.stdin.read()
"""

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
WARM_SECONDS = 6.0  # start-up: every process's first sample, first exact walks, the first full listing
# Scrapes inside the measured window, as a Prometheus would make them (its
# common scrape_interval): what a scrape costs the monitor is counted.
SCRAPE_EVERY_SECONDS = 15.0


class Fleet:
    """N idle processes under one parent; ended by pid (children, then the parent)."""

    def __init__(self, n: int, tag: str) -> None:
        self.tag = tag
        self.proc = subprocess.Popen([sys.executable, "-c", FLEET_CODE, str(n), tag],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fleet of {n} failed to start (rc {self.proc.poll()})")
        self.pids = [int(p) for p in line.split()]
        self.root = self.proc.pid

    def close(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.stdin.close()  # the parent reaps nothing: it exits, and init reaps the children
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _stop(mon: subprocess.Popen) -> None:
    """End a monitor as Ctrl-C does; by its pid if it does not go."""
    mon.send_signal(signal.SIGINT)
    try:
        mon.wait(20)
    except subprocess.TimeoutExpired:
        mon.kill()
        mon.wait(10)


def _cpu_seconds(pid: int) -> float:
    """CPU time of ``pid``: its live threads' from their schedstat (ns; stat's
    utime + stime count 10 ms ticks, too coarse for 100 processes' 0.1%),
    plus what threads that ended (a scrape's) left in the process's stat,
    in ticks: the process's total less its live threads' totals."""
    total_ns, live_ticks = 0, 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile: counted below, in the process's stat
        total_ns += ns
        live_ticks += int(fields[11]) + int(fields[12])
    user, system = _user_system_seconds(pid)
    ended = max(0.0, user + system - live_ticks / _CLOCK_TICKS)
    return total_ns / 1e9 + ended


def _user_system_seconds(pid: int) -> tuple[float, float]:
    """utime and stime of ``pid`` (10 ms ticks): where its CPU went, Python or the kernel's /proc reads."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    return int(fields[11]) / _CLOCK_TICKS, int(fields[12]) / _CLOCK_TICKS


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# What Prometheus 3 sends with a scrape: OpenMetrics first, gzip.
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
              "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
              "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "Accept-Encoding": "gzip",
}


def _scrape(url: str) -> tuple[float, str]:
    """One scrape as Prometheus makes it: seconds until the whole body is in, and the body."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers=PROMETHEUS_HEADERS), timeout=30) as resp:
        raw = resp.read()
        gzipped = resp.headers.get("Content-Encoding") == "gzip"
    seconds = time.perf_counter() - t0
    return seconds, (gzip.decompress(raw) if gzipped else raw).decode()


def _metric(body: str, name: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _selection(mode: str, fleet: Fleet) -> list[str]:
    return {"pattern": ["-k", f"^{fleet.tag} "], "tree": ["-t", str(fleet.root)], "all": ["-a"]}[mode]


class _Watch:
    """One ``tensorferry monitor`` process from ``src`` serving /metrics,
    watching ``fleet`` by ``mode``: started at once, measured between
    :meth:`begin` and :meth:`end`, ended by :meth:`close`."""

    def __init__(self, fleet: Fleet, mode: str, src: Path, *, per_process: bool = False) -> None:
        self.fleet, self.mode, self.src, self.per_process = fleet, mode, src, per_process
        env = dict(os.environ, PYTHONPATH=str(src))
        cmd = [sys.executable, "-m", "tensorferry", "monitor", *_selection(mode, fleet), "-i", "1", "-P", "0"]
        if per_process:
            cmd.append("--per-process")
        self.mon = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        line = ""
        for _ in range(20):  # "serving http://127.0.0.1:PORT/metrics and ...", after any warnings
            line = self.mon.stderr.readline()
            if not line or line.startswith("serving"):
                break
        if not line.startswith("serving"):
            self.close()
            raise RuntimeError(f"monitor did not start: {line!r}")
        self.url = line.split()[1]
        self.scrapes_in_window = 0

    def begin(self) -> None:
        _, body = _scrape(self.url)
        self.ticks0 = _metric(body, "tensorferry_monitor_tick_seconds_count")
        self.tick_s0 = _metric(body, "tensorferry_monitor_tick_seconds_sum")
        self.cpu0, self.t0, self.us0 = _cpu_seconds(self.mon.pid), time.monotonic(), _user_system_seconds(self.mon.pid)

    def scrape(self) -> None:
        _scrape(self.url)
        self.scrapes_in_window += 1

    def end(self, warm: float) -> dict[str, object]:
        cpu1, t1, us1 = _cpu_seconds(self.mon.pid), time.monotonic(), _user_system_seconds(self.mon.pid)
        rss = _rss_bytes(self.mon.pid)
        scrapes = [_scrape(self.url) for _ in range(5)]
        body = scrapes[-1][1]
        ticks = _metric(body, "tensorferry_monitor_tick_seconds_count") - self.ticks0
        tick_s = _metric(body, "tensorferry_monitor_tick_seconds_sum") - self.tick_s0
        watched = sum(float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines() if ln.startswith("tensorferry_processes{"))
        cpu, span = cpu1 - self.cpu0, t1 - self.t0
        row: dict[str, object] = {
            "mode": self.mode, "src": str(self.src), "per_process": self.per_process, "fleet": len(self.fleet.pids),
            "warm_seconds": warm, "scrapes_in_window": self.scrapes_in_window,
            "watched": watched, "seconds": span, "cpu_seconds": cpu,
            "core_percent": cpu / span * 100, "ticks": ticks,
            "user_percent": (us1[0] - self.us0[0]) / span * 100, "system_percent": (us1[1] - self.us0[1]) / span * 100,
            "cpu_ms_per_tick": cpu / max(ticks, 1) * 1e3,
            "cpu_us_per_process_tick": cpu / max(ticks, 1) / max(watched, 1) * 1e6,
            "tick_wall_ms": tick_s / max(ticks, 1) * 1e3, "rss_mib": rss / 2**20,
            "scrape_ms": statistics.median(t for t, _ in scrapes) * 1e3, "scrape_bytes": len(body),
            "load_1min": os.getloadavg()[0],
        }
        if self.per_process:
            row.update(check_exposition(body))
        return row

    def close(self) -> None:
        _stop(self.mon)


def watch_together(watches: list[_Watch], seconds: float, warm: float) -> list[dict[str, object]]:
    """Warm up, then measure every watch over the same ``seconds``, each
    scraped every SCRAPE_EVERY_SECONDS (staggered): all see the same load."""
    time.sleep(warm)
    for w in watches:
        w.begin()
    t0 = time.monotonic()
    due = [t0 + SCRAPE_EVERY_SECONDS * (i + 1) / len(watches) for i in range(len(watches))]
    while True:
        i = min(range(len(watches)), key=due.__getitem__)
        if due[i] > t0 + seconds - 0.5:
            break
        time.sleep(max(0.0, due[i] - time.monotonic()))
        watches[i].scrape()
        due[i] += SCRAPE_EVERY_SECONDS
    time.sleep(max(0.0, t0 + seconds - time.monotonic()))
    return [w.end(warm) for w in watches]


def check_exposition(body: str) -> dict[str, object]:
    """Parse a ``--per-process`` scrape (prometheus_client's OpenMetrics parser) and
    check that each name's per-process resident series sum to what the
    group figures would be: every series has a name, a pid and a kind, and
    no pid appears twice in one family."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    series = 0
    by_name: dict[tuple[str, str], float] = {}
    pids_seen: set[tuple[str, str]] = set()
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            series += 1
            if s.name == "tensorferry_process_resident_bytes":
                key = (s.labels["pid"], s.labels["kind"])
                if key in pids_seen:
                    raise AssertionError(f"pid {key} twice in one scrape")
                pids_seen.add(key)
                by_name[(s.labels["name"], s.labels["kind"])] = by_name.get((s.labels["name"], s.labels["kind"]), 0.0) + s.value
    return {"exposition_series": series, "exposition_valid": True,
            "resident_sum_bytes": sum(by_name.values()), "resident_series": len(pids_seen)}


def scale(sizes: tuple[int, ...], modes: tuple[str, ...], seconds: float, compare: Path | None,
          warm: float = WARM_SECONDS) -> dict[str, object]:
    """Every (size, mode) row, with this tree's src and ``compare``'s: for each
    size, all its monitors at once on one fleet, over one window."""
    here = ROOT / "src"
    srcs = [here] if compare is None else [compare, here]
    rows: list[dict[str, object]] = []
    load_start = os.getloadavg()
    for n in sizes:
        fleet = Fleet(n, f"tfscale{os.getpid()}x{n}")
        watches: list[_Watch] = []
        try:
            for mode in modes:
                for src in srcs:
                    watches.append(_Watch(fleet, mode, src))
            watches.append(_Watch(fleet, "pattern", here, per_process=True))
            for row in watch_together(watches, seconds, warm):
                rows.append(row)
                _log(row)
        finally:
            for w in watches:
                w.close()
            fleet.close()
    return {"rows": rows, "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
            "cpus": os.cpu_count(), "kernel": os.uname().release, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "warm_seconds": warm, "seconds": seconds, "scrape_every_seconds": SCRAPE_EVERY_SECONDS}


def _log(r: dict[str, object]) -> None:
    print(f"  {r['fleet']:>5} {r['mode']:<8}{' per-process' if r['per_process'] else ''} "
          f"{'new' if str(r['src']).startswith(str(ROOT)) else 'old'}: {r['core_percent']:.2f}% "
          f"(user {r['user_percent']:.2f}%, kernel {r['system_percent']:.2f}%) "
          f"({r['cpu_us_per_process_tick']:.1f} µs/process/tick, {r['watched']:.0f} watched, "
          f"load {r['load_1min']:.1f})", file=sys.stderr, flush=True)


def print_scale(doc: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="monitor at node scale: 1 s ticks, fds counted, serving /metrics (CPU of the monitor process)")
    for h in ("idle procs", "selection", "code", "watched", "% of a core", "user %", "kernel %", "ms CPU / tick",
              "µs / process / tick",
              "tick wall ms", "RSS MiB", "scrape ms", "load"):
        t.add_column(h, justify="right")
    for r in doc["rows"]:
        code = "new" if str(r["src"]).startswith(str(ROOT)) else "old"
        t.add_row(str(r["fleet"]), r["mode"] + (" --per-process" if r["per_process"] else ""), code,
                  f"{r['watched']:.0f}", f"{r['core_percent']:.2f}", f"{r['user_percent']:.2f}",
                  f"{r['system_percent']:.2f}", f"{r['cpu_ms_per_tick']:.2f}",
                  f"{r['cpu_us_per_process_tick']:.2f}", f"{r['tick_wall_ms']:.1f}", f"{r['rss_mib']:.1f}",
                  f"{r['scrape_ms']:.1f}", f"{r['load_1min']:.1f}")
    Console(width=200).print(t)


def plot_scale(doc: dict[str, object], path: Path) -> None:
    """CPU of one core against watched processes, one line per selection and code."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    lines: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in doc["rows"]:
        if r["per_process"]:
            continue
        code = "new" if str(r["src"]).startswith(str(ROOT)) else "before"
        lines.setdefault((r["mode"], code), []).append((r["watched"], r["core_percent"]))
    style = {"pattern": "o", "tree": "s", "all": "^"}
    for (mode, code), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=style.get(mode, "o"),
                ls="-" if code == "new" else "--", color="tab:blue" if code == "new" else "tab:gray",
                label=f"{code}: --{mode}")
    ax.axhline(1.0, color="tab:red", lw=1, ls=":", label="1% of one core")
    ax.set_xlabel("watched processes (idle)")
    ax.set_ylabel("monitor CPU, % of one core (1 s ticks)")
    ax.set_title(f"tensorferry monitor at node scale, {doc['date']}, load "
                 f"{doc['load_average_at_start'][0]:.1f}-{doc['load_average_at_end'][0]:.1f} on {doc['cpus']} CPUs",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def json_rows(fleet_n: int, srcs: list[Path], seconds: float, warm: float = WARM_SECONDS) -> list[dict[str, object]]:
    """``monitor -k ... --json`` (one JSON object per tick to a pipe), the
    issue's own measurement: one monitor per src, at once, on one fleet."""
    fleet = Fleet(fleet_n, f"tfjson{os.getpid()}x{fleet_n}")
    mons: list[subprocess.Popen] = []
    try:
        for src in srcs:
            env = dict(os.environ, PYTHONPATH=str(src))
            mons.append(subprocess.Popen([sys.executable, "-m", "tensorferry", "monitor", "-k", f"^{fleet.tag} ", "-i", "1", "-j"],
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        lines = [[0, ""] for _ in mons]
        counting = threading.Event()

        def drain(i: int) -> None:  # a full pipe would block the monitor
            for line in mons[i].stdout:
                if counting.is_set():
                    lines[i][0] += 1
                lines[i][1] = line

        readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(mons))]
        for r in readers:
            r.start()
        time.sleep(warm)
        cpu0, t0 = [_cpu_seconds(m.pid) for m in mons], time.monotonic()
        counting.set()
        time.sleep(seconds)
        cpu1, t1 = [_cpu_seconds(m.pid) for m in mons], time.monotonic()
        counting.clear()
        out = []
        for i, src in enumerate(srcs):
            watched = len(json.loads(lines[i][1])["processes"])
            cpu = cpu1[i] - cpu0[i]
            out.append({"mode": "pattern --json", "src": str(src), "fleet": fleet_n, "watched": watched, "warm_seconds": warm,
                        "core_percent": cpu / (t1 - t0) * 100, "ticks": lines[i][0],
                        "cpu_us_per_process_tick": cpu / max(lines[i][0], 1) / max(watched, 1) * 1e6,
                        "load_1min": os.getloadavg()[0]})
        return out
    finally:
        for m in mons:
            _stop(m)
        fleet.close()
