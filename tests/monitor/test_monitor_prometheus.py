"""The Prometheus endpoint, started on 127.0.0.1, scraped over real HTTP, parsed."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request

import pytest
from monitor_helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from tensorferry.errors import ConfigurationError
from tensorferry.monitor import (
    Agent,
    AgentConfig,
    Selection,
    register_pool_source,
    serve_prometheus,
    unregister_pool_source,
)

MIB = 1 << 20


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, metric: str, /, **labels: str) -> float:
    hits = [s.value for s in samples if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (metric, labels, samples)
    return hits[0]


def test_group_metrics_match_the_snapshot(start_target) -> None:
    t = start_target("big", "48")
    # A budget of a whole core: both walks finish within the first tick.
    agent = Agent(Selection(pids=(t.pid, os.getpid())), AgentConfig(interval_seconds=0.2, cpu_budget_fraction=1.0))
    snap = agent.tick()
    with serve_prometheus(agent, host="127.0.0.1", port=0) as server:
        assert server.host == "127.0.0.1" and server.port > 0
        m = scrape(server.url)
    res = m["tensorferry_process_resident_bytes"]
    for g in snap.groups:
        parts = {k: value(res, "tensorferry_process_resident_bytes", name=g.name, kind=k)
                 for k in ("anon", "file", "shmem")}
        # The kinds partition RSS: their sum is the group's RSS, to the byte.
        assert sum(parts.values()) == g.rss_bytes == g.anon_bytes + g.file_bytes + g.shmem_bytes
        assert parts["anon"] == g.anon_bytes
        assert value(m["tensorferry_process_uss_bytes"], "tensorferry_process_uss_bytes", name=g.name) == g.uss_bytes
        assert value(m["tensorferry_process_swap_bytes"], "tensorferry_process_swap_bytes", name=g.name) == g.swap_bytes
        assert value(m["tensorferry_processes"], "tensorferry_processes", name=g.name) == g.count
        assert value(m["tensorferry_processes_with_exact"], "tensorferry_processes_with_exact",
                     name=g.name) == g.exact_count == g.count
    assert {s.labels["kind"] for s in res} == {"anon", "file", "shmem"}
    # USS and PSS are families of their own, never a kind of resident memory.
    assert not any("kind" in s.labels for s in m["tensorferry_process_uss_bytes"])
    # Names come from the command line: the target runs a fixture script.
    target_name = snap.name_of(next(x for x in snap.samples if x.pid == t.pid))
    assert target_name == "target.py"
    assert sum(value(res, "tensorferry_process_resident_bytes", name=target_name, kind=k)
               for k in ("anon", "file", "shmem")) >= 48 * MIB
    cpu = m["tensorferry_process_cpu_seconds"]
    assert {s.name for s in cpu} == {"tensorferry_process_cpu_seconds_total"}
    assert value(m["tensorferry_monitor_sample_seconds"], "tensorferry_monitor_sample_seconds_count") == 2
    assert value(m["tensorferry_monitor_sample_seconds"], "tensorferry_monitor_sample_seconds_sum") > 0
    assert value(m["tensorferry_monitor_exact_reads"], "tensorferry_monitor_exact_reads_total") == 2
    assert value(m["tensorferry_monitor_exact_seconds"], "tensorferry_monitor_exact_seconds_total") > 0
    assert value(m["tensorferry_monitor_rss_bytes"], "tensorferry_monitor_rss_bytes") > MIB
    assert value(m["tensorferry_monitor_tick_seconds"], "tensorferry_monitor_tick_seconds_count") == 1
    assert value(m["tensorferry_monitor_tick_seconds"], "tensorferry_monitor_tick_seconds_sum") == \
        value(m["tensorferry_monitor_last_tick_seconds"], "tensorferry_monitor_last_tick_seconds") > 0
    assert value(m["tensorferry_monitor_interval_seconds"], "tensorferry_monitor_interval_seconds") == 0.2
    assert value(m["tensorferry_monitor_exact_budget_cores"], "tensorferry_monitor_exact_budget_cores") == 1.0
    assert value(m["tensorferry_monitor_errors"], "tensorferry_monitor_errors_total", reason="vanished") == 0
    assert {s.labels["reason"] for s in m["tensorferry_monitor_exact_skipped"]} == {"stall", "denied", "unstable"}
    assert "tensorferry_monitor_cpu_seconds" in m
    # Without cgroups asked for, no cgroup families.
    assert not any(name.startswith("tensorferry_cgroup_") for name in m)


def test_help_texts_say_where_figures_come_from(start_target) -> None:
    """The HELP lines name the sources the code reads (issue 28: they said smaps_rollup)."""
    agent = Agent(Selection(pids=(os.getpid(),)), AgentConfig(cpu_budget_fraction=1.0))
    agent.tick()
    with serve_prometheus(agent, port=0) as server:
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            text = resp.read().decode()
    helps = {line.split(" ", 3)[2]: line.split(" ", 3)[3] for line in text.splitlines() if line.startswith("# HELP ")}
    assert "pagemap" in helps["tensorferry_process_uss_bytes"] and "smaps_rollup" in helps["tensorferry_process_uss_bytes"]
    assert "kpagecount" in helps["tensorferry_process_pss_bytes"]
    assert "add up to RSS" in helps["tensorferry_process_resident_bytes"]
    assert "not USS" in helps["tensorferry_process_resident_bytes"]
    assert "pagemap" in helps["tensorferry_monitor_exact_seconds_total"]


def test_per_process_labels_and_scrapes_follow_the_running_agent(start_target) -> None:
    t = start_target("sleep")
    agent = Agent(Selection(pids=(t.pid,)), AgentConfig(interval_seconds=0.05, jitter_fraction=0.0))
    started = time.monotonic()
    (before,) = agent.tick().samples
    with serve_prometheus(agent, port=0, labels="process") as server:
        first = scrape(server.url)
        agent.start()
        try:
            wait_until(lambda: agent.stats().ticks >= 4, what="three ticks of the background thread")
        finally:
            agent.stop()
        second = scrape(server.url)
    (after,) = agent.latest.samples
    assert agent.latest.stats.ticks >= 4
    # Each scrape shows the snapshot that was latest when it ran, to the byte
    # and the second.
    assert value(first["tensorferry_process_resident_bytes"], "tensorferry_process_resident_bytes",
                 pid=str(t.pid), name="target.py", kind="anon") == before.anon_bytes
    assert value(second["tensorferry_process_uss_bytes"], "tensorferry_process_uss_bytes",
                 pid=str(t.pid)) == after.uss_bytes
    assert value(second["tensorferry_monitor_tick_seconds"], "tensorferry_monitor_tick_seconds_count") == \
        agent.latest.stats.ticks
    # The count stays by name with per-process labels (it disappeared before issue 28).
    assert value(second["tensorferry_processes"], "tensorferry_processes", name="target.py") == 1
    # Exact figures were read at the first tick (a small process, within the
    # budget); the scrape gives their age as the last snapshot has it, which
    # cannot exceed the time the agent has been running.
    assert before.uss_source == after.uss_source == "pagemap" and after.exact_age_seconds is not None
    age = value(second["tensorferry_process_exact_age_seconds"], "tensorferry_process_exact_age_seconds",
                pid=str(t.pid))
    assert age == after.exact_age_seconds < time.monotonic() - started


def test_pool_sources_through_the_same_collector() -> None:
    figures = {"capacity_nbytes": 1 << 30, "used_nbytes": 3 << 20, "largest_free_nbytes": 900 << 20,
               "transfers": 7, "bytes_moved": 21 << 20}
    register_pool_source("weights", lambda: figures, role="sender")
    register_pool_source("broken", lambda: {"capacity_nbytes": 1})
    # A name that carries this process's pid (as the receive cache registers):
    # the pid leaves the pool label, so a restarted process has the same series.
    register_pool_source(f"receive-cache:{os.getpid()}:1", lambda: figures)
    try:
        with pytest.warns(RuntimeWarning, match="pool source 'broken' failed"):
            with serve_prometheus(None, port=0) as server:
                m = scrape(server.url)
                again = scrape(server.url)
            with serve_prometheus(None, port=0, labels="process") as server:
                per_pid = scrape(server.url)
    finally:
        unregister_pool_source("weights")
        unregister_pool_source("broken")
        unregister_pool_source(f"receive-cache:{os.getpid()}:1")
    w = {"pool": "weights", "role": "sender"}
    assert value(m["tensorferry_pool_capacity_bytes"], "tensorferry_pool_capacity_bytes", **w) == 1 << 30
    assert value(m["tensorferry_pool_used_bytes"], "tensorferry_pool_used_bytes", **w) == 3 << 20
    assert value(m["tensorferry_pool_largest_free_bytes"], "tensorferry_pool_largest_free_bytes", **w) == 900 << 20
    assert value(m["tensorferry_pool_transfers"], "tensorferry_pool_transfers_total", **w) == 7
    assert value(m["tensorferry_pool_moved_bytes"], "tensorferry_pool_moved_bytes_total", **w) == 21 << 20
    assert value(again["tensorferry_pool_sources_failing"], "tensorferry_pool_sources_failing") == 1
    assert all(s.labels.get("pool") != "broken" for s in m["tensorferry_pool_capacity_bytes"])
    labels = [s.labels for s in m["tensorferry_pool_capacity_bytes"]]
    assert {"pool": "receive-cache:1", "role": "receive-cache"} in labels
    assert all(str(os.getpid()) not in v for lab in labels for v in lab.values())
    # The pid as a label of its own, where asked for.
    assert value(per_pid["tensorferry_pool_capacity_bytes"], "tensorferry_pool_capacity_bytes",
                 pool="receive-cache:1", pid=str(os.getpid())) == 1 << 30
    # No agent: no process metrics, only pools; /healthz says so.
    assert "tensorferry_process_resident_bytes" not in m


def test_register_pool_source_validates() -> None:
    with pytest.raises(ConfigurationError, match=r"register_pool_source\(name=''\)"):
        register_pool_source("", dict)
    with pytest.raises(ConfigurationError, match=r"register_pool_source\(source=42\) for 'p'"):
        register_pool_source("p", 42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"register_pool_source\(role=''\) for 'p'"):
        register_pool_source("p", dict, role="")
    with pytest.raises(ConfigurationError, match=r"labels='pid'.*'group'.*'process'"):
        serve_prometheus(None, port=0, labels="pid")  # type: ignore[arg-type]


@pytest.mark.parametrize("port", [-1, 70000, "21464", True])
def test_serve_prometheus_port_out_of_range(port) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigurationError, match=rf"serve_prometheus\(port={port!r}\)"):
        serve_prometheus(None, port=port)


def test_serve_prometheus_port_in_use() -> None:
    with serve_prometheus(None, port=0) as server:
        with pytest.raises(ConfigurationError, match=f"port={server.port}.*cannot bind") as info:
            serve_prometheus(None, port=server.port)
    assert isinstance(info.value.__cause__, OSError)


def test_healthz_is_short_and_turns_503_when_ticks_stop() -> None:
    agent = Agent(Selection(pids=(os.getpid(),)), AgentConfig(interval_seconds=0.05, exact=False))
    with serve_prometheus(agent, port=0) as server:
        with pytest.raises(urllib.error.HTTPError) as early:
            urllib.request.urlopen(server.health_url, timeout=10)
        assert early.value.code == 503 and early.value.read().decode() == "starting: no tick yet\n"
        agent.tick()
        with urllib.request.urlopen(server.health_url, timeout=10) as resp:
            line = resp.read().decode()
        assert resp.status == 200 and line.startswith("ok: last tick") and line.count("\n") == 1
        # No tick since: past STALE_INTERVALS intervals (plus a second) the probe fails.
        from tensorferry.monitor._server import STALE_INTERVALS, health

        limit = STALE_INTERVALS * 0.05 + 1.0
        assert health(agent, now=agent.latest.timestamp + limit - 0.01)[0]
        ok, said = health(agent, now=agent.latest.timestamp + 10.0)
        assert not ok and said == "stale: last tick 10.0s ago, interval 0.05s, 1 processes"

