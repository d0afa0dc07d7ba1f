"""Writes tensorferry-dashboard.json, the Grafana dashboard of tensorferry's monitor.

The panels are data (title, unit, queries) so the dashboard, its test
(tests/monitor/test_monitor_dashboard.py checks every metric and label the
queries use against what a running ``tensorferry monitor`` serves) and the
rendering in docs/monitor.md read the same list. Plain JSON in Grafana's
dashboard schema (schemaVersion 39): import it, or provision it from a file
(docs/guides/monitoring.md shows both).

Run: python monitoring/grafana/build_dashboard.py   (rewrites the JSON next to it)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

OUT = Path(__file__).with_name("tensorferry-dashboard.json")
SEL = 'instance=~"$instance"'
NAMES = f'{SEL}, name=~"$name"'
RATE = "$__rate_interval"


class Query(NamedTuple):
    expr: str
    legend: str


class Panel(NamedTuple):
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str
    stacked: bool = False


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Processes", (
        Panel("RSS by name", "bytes", (
            Query(f"sum by (name) (tensorferry_process_resident_bytes{{{NAMES}}})", "{{name}}"),),
            "Resident memory of each name group: the resident kinds (anon, file, shmem) add up to RSS. "
            "A group's RSS counts pages its members share once per member.", stacked=True),
        Panel("RSS by kind", "bytes", (
            Query(f"sum by (kind) (tensorferry_process_resident_bytes{{{NAMES}}})", "{{kind}}"),),
            "anon includes pages shared copy-on-write (it is not USS); shmem is /dev/shm, memfd and "
            "tensorferry's own pools.", stacked=True),
        Panel("USS by name (exact)", "bytes", (
            Query(f"sum by (name) (tensorferry_process_uss_bytes{{{NAMES}}})", "{{name}}"),),
            "What exiting the processes would free, from pagemap walks; a group shows only when every "
            "member has exact figures."),
        Panel("PSS by name (exact)", "bytes", (
            Query(f"sum by (name) (tensorferry_process_pss_bytes{{{NAMES}}})", "{{name}}"),),
            "Shared pages divided among their sharers: sums across groups without double counting "
            "(needs root for /proc/kpagecount)."),
        Panel("Age of exact figures", "s", (
            Query(f"max by (name) (tensorferry_process_exact_age_seconds{{{NAMES}}})", "{{name}}"),
            Query(f"sum by (name) (tensorferry_processes{{{NAMES}}}) - "
                  f"sum by (name) (tensorferry_processes_with_exact{{{NAMES}}})", "{{name}} without"),),
            "How old USS/PSS are (the oldest member's), and members without any (the group then has no USS)."),
        Panel("CPU by name", "percentunit", (
            Query(f"sum by (name) (rate(tensorferry_process_cpu_seconds_total{{{NAMES}}}[{RATE}]))", "{{name}}"),),
            "Cores used, user and system together.", stacked=True),
    )),
    ("Cgroups and pools", (
        Panel("Cgroup memory against its limit", "bytes", (
            Query(f"tensorferry_cgroup_memory_usage_bytes{{{SEL}}}", "usage {{cgroup}}"),
            Query(f"tensorferry_cgroup_watched_uss_bytes{{{SEL}}}", "watched USS {{cgroup}}"),
            Query(f"tensorferry_cgroup_memory_limit_bytes{{{SEL}}} < +Inf", "limit {{cgroup}}"),),
            "Usage counts page cache and kernel memory; watched USS is what the watched processes alone "
            "hold (`tensorferry monitor -c`)."),
        Panel("Pools: used / capacity", "percentunit", (
            Query(f"tensorferry_pool_used_bytes{{{SEL}}} / (tensorferry_pool_capacity_bytes{{{SEL}}} > 0)",
                  "{{pool}} ({{role}})"),),
            "Senders' pools and receive caches of the processes that serve their pools; a receive cache may "
            "pass its cap while results are alive."),
        Panel("Pools: bytes moved", "Bps", (
            Query(f"sum by (pool, role) (rate(tensorferry_pool_moved_bytes_total{{{SEL}}}[{RATE}]))",
                  "{{pool}} ({{role}})"),),
            "Transfer throughput out of each pool."),
    )),
    ("The monitor itself", (
        Panel("Tick time against the interval", "s", (
            Query(f"rate(tensorferry_monitor_tick_seconds_sum{{{SEL}}}[{RATE}]) / "
                  f"rate(tensorferry_monitor_tick_seconds_count{{{SEL}}}[{RATE}])", "tick {{instance}}"),
            Query(f"tensorferry_monitor_interval_seconds{{{SEL}}}", "interval {{instance}}"),
            Query(f"time() - tensorferry_monitor_last_tick_timestamp_seconds{{{SEL}}}", "since last tick {{instance}}"),),
            "A tick samples every watched process and takes the exact walk steps the budget allows."),
        Panel("Exact walks' CPU against the budget", "percentunit", (
            Query(f"rate(tensorferry_monitor_exact_seconds_total{{{SEL}}}[{RATE}])", "walks {{instance}}"),
            Query(f"tensorferry_monitor_exact_budget_cores{{{SEL}}}", "budget {{instance}}"),
            Query(f"rate(tensorferry_monitor_cpu_seconds_total{{{SEL}}}[{RATE}])", "monitor CPU {{instance}}"),),
            "Walks are charged their steps' wall time (above their CPU on a busy machine); the budget is a "
            "token bucket: bursts above it are paid back."),
        Panel("Skipped and failed", "ops", (
            Query(f"sum by (reason) (rate(tensorferry_monitor_exact_skipped_total{{{SEL}}}[{RATE}]))",
                  "exact skipped: {{reason}}"),
            Query(f"sum by (reason) (rate(tensorferry_monitor_errors_total{{{SEL}}}[{RATE}]))", "not sampled: {{reason}}"),),
            "stall: only smaps_rollup readable and too slow; denied: another user's process; unstable: "
            "mappings kept changing during a walk."),
        Panel("Monitor RSS", "bytes", (
            Query(f"tensorferry_monitor_rss_bytes{{{SEL}}}", "{{instance}}"),),
            "The monitor's own memory."),
    )),
)

VARIABLES = (
    # Both kinds of endpoint: `tensorferry monitor`'s and each process's own
    # pool endpoint (which serves pool figures only, no monitor ones).
    ("instance", 'label_values({__name__=~"tensorferry_monitor_interval_seconds|tensorferry_pool_capacity_bytes"}, instance)'),
    ("name", 'label_values(tensorferry_processes{instance=~"$instance"}, name)'),
)


def queries() -> list[str]:
    """Every PromQL expression the dashboard runs (the panels' and the variables')."""
    return [q.expr for _, panels in ROWS for p in panels for q in p.queries] + [v for _, v in VARIABLES]


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "timeseries",
        "title": p.title,
        "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {
                "unit": p.unit,
                "custom": {"stacking": {"mode": "normal" if p.stacked else "none"}, "fillOpacity": 10 if p.stacked else 0},
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": q.expr, "legendFormat": q.legend,
             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
            for i, q in enumerate(p.queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, p in enumerate(row_panels):
            panels.append(_panel(p, pid, (i % 3) * 8, y + (i // 3) * 8))
            pid += 1
        y += 8 * ((len(row_panels) + 2) // 3)
    templating = [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"}]
    for name, query in VARIABLES:
        templating.append({
            "name": name, "type": "query", "label": name,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"text": "All", "value": "$__all"},
        })
    return {
        "uid": "tensorferry-monitor",
        "title": "tensorferry monitor",
        "description": "Process memory (RSS by kind, exact USS/PSS), cgroups, pools and the monitor's own cost, "
                       "from `tensorferry monitor` and processes serving their pools.",
        "tags": ["tensorferry", "memory"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "templating": {"list": templating},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    """The JSON text written to :data:`OUT`."""
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
