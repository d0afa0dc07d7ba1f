"""The Prometheus endpoint, started on 127.0.0.1, scraped over real HTTP, parsed."""

from __future__ import annotations

import os
import time
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
    mem = m["tensorferry_process_memory_bytes"]
    for g in snap.groups:
        assert value(mem, "tensorferry_process_memory_bytes", name=g.name, kind="rss") == g.rss_bytes
        assert value(mem, "tensorferry_process_memory_bytes", name=g.name, kind="anon") == g.anon_bytes
        assert value(mem, "tensorferry_process_memory_bytes", name=g.name, kind="uss") == g.uss_bytes
        assert value(m["tensorferry_process_count"], "tensorferry_process_count", name=g.name) == g.count
    kinds = {s.labels["kind"] for s in mem}
    assert kinds == {"rss", "anon", "file", "shmem", "swap", "uss", "pss"}
    target_name = next(x.name for x in snap.samples if x.pid == t.pid)
    assert value(mem, "tensorferry_process_memory_bytes", name=target_name, kind="rss") >= 48 * MIB
    cpu = m["tensorferry_process_cpu_seconds"]
    assert {s.name for s in cpu} == {"tensorferry_process_cpu_seconds_total"}
    assert value(m["tensorferry_monitor_sample_seconds"], "tensorferry_monitor_sample_seconds_count") == 2
    assert value(m["tensorferry_monitor_sample_seconds"], "tensorferry_monitor_sample_seconds_sum") > 0
    assert value(m["tensorferry_monitor_exact_seconds"], "tensorferry_monitor_exact_seconds_count") == 2
    assert value(m["tensorferry_monitor_rss_bytes"], "tensorferry_monitor_rss_bytes") > MIB
    assert value(m["tensorferry_monitor_ticks"], "tensorferry_monitor_ticks_total") == 1
    assert value(m["tensorferry_monitor_errors"], "tensorferry_monitor_errors_total", reason="vanished") == 0
    assert "tensorferry_monitor_cpu_seconds" in m


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
    assert value(first["tensorferry_process_memory_bytes"], "tensorferry_process_memory_bytes",
                 pid=str(t.pid), kind="rss") == before.rss_bytes
    assert value(second["tensorferry_process_memory_bytes"], "tensorferry_process_memory_bytes",
                 pid=str(t.pid), kind="uss") == after.uss_bytes
    assert value(second["tensorferry_monitor_ticks"], "tensorferry_monitor_ticks_total") == agent.latest.stats.ticks
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
    register_pool_source("weights", lambda: figures)
    register_pool_source("broken", lambda: {"capacity_nbytes": 1})
    try:
        with pytest.warns(RuntimeWarning, match="pool source 'broken' failed"):
            with serve_prometheus(None, port=0) as server:
                m = scrape(server.url)
                again = scrape(server.url)
    finally:
        unregister_pool_source("weights")
        unregister_pool_source("broken")
    assert value(m["tensorferry_pool_capacity_bytes"], "tensorferry_pool_capacity_bytes", pool="weights") == 1 << 30
    assert value(m["tensorferry_pool_used_bytes"], "tensorferry_pool_used_bytes", pool="weights") == 3 << 20
    assert value(m["tensorferry_pool_largest_free_bytes"], "tensorferry_pool_largest_free_bytes",
                 pool="weights") == 900 << 20
    assert value(m["tensorferry_pool_transfers"], "tensorferry_pool_transfers_total", pool="weights") == 7
    assert value(m["tensorferry_pool_moved_bytes"], "tensorferry_pool_moved_bytes_total", pool="weights") == 21 << 20
    assert value(again["tensorferry_pool_source_failures"], "tensorferry_pool_source_failures") == 1
    assert all(s.labels.get("pool") != "broken" for s in m["tensorferry_pool_capacity_bytes"])
    # No agent: no process metrics, only pools.
    assert "tensorferry_process_memory_bytes" not in m


def test_register_pool_source_validates() -> None:
    with pytest.raises(ConfigurationError, match=r"register_pool_source\(name=''\)"):
        register_pool_source("", dict)
    with pytest.raises(ConfigurationError, match=r"register_pool_source\(source=42\) for 'p'"):
        register_pool_source("p", 42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"labels='pid'.*'group'.*'process'"):
        serve_prometheus(None, port=0, labels="pid")  # type: ignore[arg-type]


@pytest.mark.parametrize("port", [-1, 70000, "9464", True])
def test_serve_prometheus_port_out_of_range(port) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigurationError, match=rf"serve_prometheus\(port={port!r}\)"):
        serve_prometheus(None, port=port)


def test_serve_prometheus_port_in_use() -> None:
    with serve_prometheus(None, port=0) as server:
        with pytest.raises(ConfigurationError, match=f"port={server.port}.*cannot bind") as info:
            serve_prometheus(None, port=server.port)
    assert isinstance(info.value.__cause__, OSError)
