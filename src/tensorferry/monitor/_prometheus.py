"""Prometheus export: a custom collector over the agent's latest snapshot.

The collector reads what the agent already sampled; a scrape never triggers
a page-table walk. Metrics are in base units (bytes, seconds). Per-process
labels (``pid``) are opt-in: pids churn, so the default labels are the
bounded group names.
"""

from __future__ import annotations

__all__ = ["MonitorCollector", "PrometheusServer", "serve_prometheus"]

import threading
from collections.abc import Iterator
from typing import Literal

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

from tensorferry.errors import ConfigurationError

from ._agent import Agent
from ._checks import check_int
from ._pools import collect_pool_figures

_KINDS = ("rss", "anon", "file", "shmem", "swap", "uss", "pss")


class MonitorCollector:
    """Exposes an agent's latest snapshot and the registered pool sources.

    Args:
        agent: whose snapshots to expose; None exposes only pool figures (a
            worker process exporting its own pools).
        labels: ``group`` (bounded: one series per name group) or ``process``
            (one per pid; for a handful of long-lived processes).
    """

    def __init__(self, agent: Agent | None = None, *, labels: Literal["group", "process"] = "group") -> None:
        if labels not in ("group", "process"):
            raise ConfigurationError(
                f"MonitorCollector(labels={labels!r}): must be 'group' (one series per name group, "
                "bounded) or 'process' (one per pid)"
            )
        self.agent = agent
        self.labels = labels

    def describe(self) -> list[Metric]:
        # Empty: the registry must not call collect() (and read pools) at registration.
        return []

    def collect(self) -> Iterator[Metric]:
        """Build the metric families (called by prometheus_client per scrape)."""
        yield from self._pools()
        snap = self.agent.latest if self.agent is not None else None
        if snap is None:
            return
        per_process = self.labels == "process"
        names = ["name", "pid", "kind"] if per_process else ["name", "kind"]
        mem = GaugeMetricFamily(
            "tensorferry_process_memory_bytes",
            "Process memory by kind: rss = anon + file + shmem resident; anon is RSS - shared "
            "(not USS); uss/pss only where exact figures were read (smaps_rollup)",
            labels=names,
        )
        cpu = CounterMetricFamily(
            "tensorferry_process_cpu_seconds",
            "CPU time of the processes since they started, by mode",
            labels=names[:-1] + ["mode"],
        )
        age = GaugeMetricFamily(
            "tensorferry_process_exact_age_seconds",
            "Age of the uss/pss figures (oldest among a group's members)",
            labels=names[:-1],
        )
        threads = GaugeMetricFamily("tensorferry_process_threads", "Threads", labels=names[:-1])
        if per_process:
            for s in snap.samples:
                base = [s.name, str(s.pid)]
                for kind, value in zip(
                    _KINDS,
                    (s.rss_bytes, s.anon_bytes, s.file_bytes, s.shmem_bytes, s.swap_bytes, s.uss_bytes, s.pss_bytes),
                ):
                    if value is not None:
                        mem.add_metric(base + [kind], value)
                cpu.add_metric(base + ["user"], s.cpu_user_seconds)
                cpu.add_metric(base + ["system"], s.cpu_system_seconds)
                if s.exact_age_seconds is not None:
                    age.add_metric(base, s.exact_age_seconds)
                threads.add_metric(base, s.num_threads)
        else:
            count = GaugeMetricFamily("tensorferry_process_count", "Processes in the group", labels=["name"])
            for g in snap.groups:
                for kind, value in zip(
                    _KINDS,
                    (g.rss_bytes, g.anon_bytes, g.file_bytes, g.shmem_bytes, g.swap_bytes, g.uss_bytes, g.pss_bytes),
                ):
                    if value is not None:
                        mem.add_metric([g.name, kind], value)
                cpu.add_metric([g.name, "user"], g.cpu_user_seconds)
                cpu.add_metric([g.name, "system"], g.cpu_system_seconds)
                if g.max_exact_age_seconds is not None:
                    age.add_metric([g.name], g.max_exact_age_seconds)
                threads.add_metric([g.name], g.num_threads)
                count.add_metric([g.name], g.count)
            yield count
        yield from (mem, cpu, age, threads)
        if snap.cgroups:
            cg = GaugeMetricFamily(
                "tensorferry_cgroup_memory_bytes",
                "Memory cgroup figures by kind (usage includes page cache and kernel memory)",
                labels=["cgroup", "kind"],
            )
            for c in snap.cgroups:
                for kind, value in (
                    ("usage", c.usage_bytes), ("limit", c.limit_bytes), ("anon", c.anon_bytes),
                    ("file", c.file_bytes), ("shmem", c.shmem_bytes), ("swap", c.swap_bytes),
                ):
                    if value is not None:
                        cg.add_metric([c.path, kind], value)
            yield cg
        yield from self._self_cost(snap)

    def _self_cost(self, snap) -> Iterator[Metric]:  # type: ignore[no-untyped-def]
        st = snap.stats
        sample = SummaryMetricFamily(
            "tensorferry_monitor_sample_seconds", "Wall time of the agent's cheap samples (statm/status/stat)"
        )
        sample.add_metric([], count_value=st.samples, sum_value=st.sample_seconds)
        exact = SummaryMetricFamily(
            "tensorferry_monitor_exact_seconds",
            "Wall time of smaps_rollup reads; each stalled its target's mmap about as long",
        )
        exact.add_metric([], count_value=st.exact_reads, sum_value=st.exact_seconds)
        skipped = CounterMetricFamily(
            "tensorferry_monitor_exact_skipped", "Exact reads not done, by reason", labels=["reason"]
        )
        skipped.add_metric(["stall"], st.exact_skipped_stall)
        skipped.add_metric(["denied"], st.exact_denied)
        errors = CounterMetricFamily(
            "tensorferry_monitor_errors", "Selected processes that could not be sampled", labels=["reason"]
        )
        for reason, n in sorted(st.errors.items()):
            errors.add_metric([reason], n)
        ticks = CounterMetricFamily("tensorferry_monitor_ticks", "Agent ticks")
        ticks.add_metric([], st.ticks)
        cpu = CounterMetricFamily("tensorferry_monitor_cpu_seconds", "CPU time of the monitor process")
        cpu.add_metric([], st.cpu_seconds)
        rss = GaugeMetricFamily("tensorferry_monitor_rss_bytes", "RSS of the monitor process")
        rss.add_metric([], st.rss_bytes)
        last = GaugeMetricFamily("tensorferry_monitor_last_tick_timestamp_seconds", "When the last tick ran")
        last.add_metric([], snap.timestamp)
        yield from (sample, exact, skipped, errors, ticks, cpu, rss, last)

    def _pools(self) -> Iterator[Metric]:
        figures, failed = collect_pool_figures()
        gauges = {
            k: GaugeMetricFamily(f"tensorferry_pool_{k}_bytes", help_, labels=["pool"])
            for k, help_ in (
                ("capacity", "Bytes the pool's buffer holds"),
                ("used", "Bytes allocated to live groups"),
                ("largest_free", "Largest contiguous free block: the biggest group that fits now"),
            )
        }
        transfers = CounterMetricFamily("tensorferry_pool_transfers", "Transfers served", labels=["pool"])
        moved = CounterMetricFamily("tensorferry_pool_moved_bytes", "Bytes moved by transfers", labels=["pool"])
        for f in figures:
            gauges["capacity"].add_metric([f.name], f.capacity_nbytes)
            gauges["used"].add_metric([f.name], f.used_nbytes)
            gauges["largest_free"].add_metric([f.name], f.largest_free_nbytes)
            transfers.add_metric([f.name], f.transfers)
            moved.add_metric([f.name], f.bytes_moved)
        failures = GaugeMetricFamily(
            "tensorferry_pool_source_failures", "Pool sources that failed at this scrape"
        )
        failures.add_metric([], failed)
        if figures or failed:
            yield from (*gauges.values(), transfers, moved, failures)


class PrometheusServer:
    """A running /metrics endpoint; :meth:`close` stops it."""

    def __init__(self, httpd, thread: threading.Thread, registry: CollectorRegistry) -> None:  # type: ignore[no-untyped-def]
        self._httpd = httpd
        self._thread = thread
        self.registry = registry
        self.host: str = httpd.server_address[0]
        self.port: int = httpd.server_address[1]

    @property
    def url(self) -> str:
        """Where to scrape."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_prometheus(
    agent: Agent | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 9464,
    labels: Literal["group", "process"] = "group",
) -> PrometheusServer:
    """Serve the agent's figures (and registered pools) on ``http://host:port/metrics``.

    Args:
        agent: the agent to expose (it must be ticking, e.g. ``agent.start()``).
        host: the address to bind; loopback by default, so nothing is exposed
            beyond the machine unless asked.
        port: the port; 0 picks a free one (see the returned ``.port``).
        labels: ``group`` or ``process`` (see :class:`MonitorCollector`).

    Returns:
        The running server.

    Raises:
        ConfigurationError: ``labels`` is neither choice, ``port`` is not in
            0..65535, or ``host:port`` cannot be bound (in use, not an
            address of this machine); the OS's error is the cause.
    """
    from prometheus_client import start_http_server

    # 65535: the largest TCP port; 0 lets the OS pick a free one.
    if check_int("serve_prometheus(port)", port, 0, "must be an int in 0..65535 (0: a free one)") > 65535:
        raise ConfigurationError(f"serve_prometheus(port={port!r}): must be an int in 0..65535 (0: a free one)")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MonitorCollector(agent, labels=labels))
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigurationError(
            f"serve_prometheus(host={host!r}, port={port}): cannot bind ({exc.strerror or exc}); "
            "pick another port (0: a free one) or an address of this machine"
        ) from exc
    return PrometheusServer(httpd, thread, registry)
