"""Draws a preview of the Grafana dashboard with matplotlib, from a real run.

Not a Grafana screenshot: a real ``tensorferry monitor`` watches a few
processes (one grows, one holds steady memory, one owns a Sender's pool and
serves it), a real Prometheus server (Debian's ``prometheus`` package, on
127.0.0.1) scrapes both endpoints every 2 s with the rules of
``prometheus/tensorferry-rules.yml`` loaded, and each panel of
``grafana/build_dashboard.py`` is drawn from Prometheus' ``query_range`` of the
panel's own queries (``$instance``/``$name`` as ``.*``, ``$__rate_interval``
as 30 s). It also prints the rules' health as Prometheus evaluated them.

Run: python monitoring/render_preview.py [--seconds 150] [--out docs/monitor-dashboard-preview.png]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARK = "tf-preview"

GROW = """
import sys, time
held = []
for i in range(10**6):
    held.append(bytearray(b"x" * (2 << 20)))
    if len(held) > 120:
        del held[:60]
    time.sleep(0.5)
"""
STEADY = """
import time
block = bytearray(b"y" * (96 << 20))
time.sleep(10**6)
"""
POOL = """
import sys, time, torch, tensorferry
from tensorferry.monitor import register_pool_source, serve_prometheus
torch.set_num_threads(1)
with tensorferry.Sender("shm", capacity_nbytes=64 << 20) as sender, tensorferry.Receiver("shm") as receiver:
    register_pool_source("weights", sender.stats, role="sender")
    server = serve_prometheus(None, port=int(sys.argv[2]))
    held = []
    for i in range(10**6):
        held.append(sender.put(torch.ones((i % 6 + 1) << 18), readers=None))
        receiver.get(held[-1])
        if len(held) > 8:
            sender.discard(held.pop(0))
        time.sleep(1.0)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read().decode())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=150.0, help="how long Prometheus scrapes (default 150)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "monitor-dashboard-preview.png"))
    args = ap.parse_args()
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        sys.exit("prometheus is not installed (Debian: apt-get install prometheus)")
    spec = importlib.util.spec_from_file_location("build_dashboard", HERE / "grafana" / "build_dashboard.py")
    builder = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(builder)  # type: ignore[union-attr]

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    mon_port, pool_port, prom_port = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen] = []
    # Not named after MARK: Prometheus' own command line holds this path.
    work = Path(tempfile.mkdtemp(prefix="tfprev-"))
    try:
        # Scripts in files, so each process is named after its script.
        for name, script in (("grows", GROW), ("steady", STEADY), ("pool", POOL)):
            (work / f"{MARK}-{name}.py").write_text(script)
        for name in ("grows", "steady"):
            procs.append(subprocess.Popen([sys.executable, str(work / f"{MARK}-{name}.py")], env=env))
        procs.append(subprocess.Popen([sys.executable, str(work / f"{MARK}-pool.py"), MARK, str(pool_port)], env=env))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tensorferry", "monitor", "-k", MARK, "-c", "-b", "0.05", "-i", "1",
             "-P", str(mon_port)], env=env, stdin=subprocess.DEVNULL))
        shutil.copy(HERE / "prometheus" / "tensorferry-rules.yml", work / "rules.yml")
        (work / "prometheus.yml").write_text(
            "global: {scrape_interval: 2s, evaluation_interval: 2s}\n"
            "rule_files: [rules.yml]\n"
            "scrape_configs:\n"
            f"  - job_name: tensorferry\n    static_configs: [{{targets: ['127.0.0.1:{mon_port}', '127.0.0.1:{pool_port}']}}]\n"
        )
        procs.append(subprocess.Popen(
            [prometheus, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        start = time.time()
        time.sleep(args.seconds)
        end = time.time()
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        targets = get(f"{api}/targets")["data"]["activeTargets"]
        print("targets:", [(t["scrapeUrl"], t["health"]) for t in targets])
        for group in get(f"{api}/rules")["data"]["groups"]:
            for rule in group["rules"]:
                print(f"rule {rule['name']}: health {rule['health']}"
                      + (f", state {rule['state']}" if "state" in rule else "")
                      + (f", error {rule['lastError']}" if rule.get("lastError") else ""))
        draw(builder, api, start, end, Path(args.out))
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def draw(builder, api: str, start: float, end: float, out: Path) -> None:  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for _, row in builder.ROWS for p in row]
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(16, 3.2 * rows), squeeze=False)
    scale = {"bytes": (2**20, "MiB"), "Bps": (2**20, "MiB/s"), "s": (1, "s"), "percentunit": (0.01, "%"),
             "ops": (1, "/s")}
    for ax, panel in zip(axes.flat, panels):
        div, unit = scale.get(panel.unit, (1, panel.unit))
        for q in panel.queries:
            expr = (q.expr.replace('=~"$instance"', '=~".*"').replace('=~"$name"', '=~".*"')
                    .replace("$__rate_interval", "30s"))
            params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 2})
            for series in get(f"{api}/query_range?{params}")["data"]["result"]:
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) / div for _, v in series["values"]]
                legend = q.legend
                for k, v in series["metric"].items():
                    legend = legend.replace("{{" + k + "}}", v)
                ax.plot(xs, ys, label=legend[:40], linewidth=1.2)
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("tensorferry monitor dashboard: panels drawn with matplotlib from Prometheus query_range of the "
                 "dashboard's queries, scraping a real monitor (not a Grafana screenshot); x: seconds", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
