"""Prometheus export: a custom collector over the agent's latest snapshot.

The collector reads what the agent already sampled; a scrape never triggers
a page-table walk. Metrics are in base units (bytes, seconds), and every
family's labels can be summed: ``kind`` in ``tensorferry_process_resident_bytes``
splits RSS into parts that add up to it, and USS and PSS, which are not parts
of RSS, have families of their own. Per-process labels (``pid``) are opt-in:
pids churn, so the default labels are the bounded group names.
"""

from __future__ import annotations

__all__ = ["MonitorCollector"]

import math
from collections.abc import Iterator
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from ..errors import ConfigurationError
from ._agent import Agent, Snapshot
from ._pools import collect_labelled_pool_figures

# Where each figure comes from, said once for the HELP texts (and the docs).
_USS_FROM = (
    "Linux: /proc/PID/pagemap walked in bounded slices (pages present and mapped by this process alone), "
    "smaps_rollup Private_Clean + Private_Dirty where pagemap is not readable; macOS/Windows: the "
    "platform's private bytes"
)
_PSS_FROM = (
    "Linux: pagemap + /proc/kpagecount (root; each shared page's size divided by its mapcount), "
    "smaps_rollup Pss where pagemap is not readable"
)


def _family(kind: type, name: str, help_: str, labels: list[str]) -> Metric:
    # labels by keyword: the metric families take a value as their third argument.
    return kind(name, help_, labels=labels)


class MonitorCollector:
    """Exposes an agent's latest snapshot and the registered pool sources.

    Args:
        agent: whose snapshots to expose; None exposes only pool figures (a
            worker process exporting its own pools).
        labels: ``group`` (bounded: one series per name group) or ``process``
            (one per pid, and pools labelled with their process's pid too; for
            a handful of long-lived processes).
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
        yield from self._processes(snap)
        yield from self._groups(snap)
        if self.agent is not None and self.agent.config.cgroups:
            yield from self._cgroups(snap)
        yield from self._self_cost(snap)

    def _processes(self, snap: Snapshot) -> Iterator[Metric]:
        per_process = self.labels == "process"
        names = ["name", "pid"] if per_process else ["name"]
        resident = _family(
            GaugeMetricFamily, "tensorferry_process_resident_bytes",
            "Resident memory by kind; the kinds add up to RSS (status VmRSS): anon (RssAnon, includes pages "
            "shared copy-on-write: not USS), file (RssFile), shmem (RssShmem: /dev/shm, memfd, shared "
            "anonymous). A group's figure is the sum over its processes (shared pages counted once per process)",
            names + ["kind"],
        )
        swap = _family(GaugeMetricFamily, "tensorferry_process_swap_bytes",
                       "Swapped-out anonymous memory (status VmSwap)", names)
        uss = _family(
            GaugeMetricFamily, "tensorferry_process_uss_bytes",
            "Unique set size, what exiting would free; only where exact figures were read (a group: only when "
            f"all its processes have them). From {_USS_FROM}",
            names,
        )
        pss = _family(
            GaugeMetricFamily, "tensorferry_process_pss_bytes",
            "Proportional set size, sums across processes without double counting; only where exact figures "
            f"were read and PSS was readable. From {_PSS_FROM}",
            names,
        )
        age = _family(GaugeMetricFamily, "tensorferry_process_exact_age_seconds",
                      "Age of the uss/pss figures since their walk finished (a group: its oldest member's)", names)
        cpu = _family(CounterMetricFamily, "tensorferry_process_cpu_seconds",
                      "CPU time since the process started, by mode (/proc/PID/stat utime, stime); a group's "
                      "sum drops when a member exits", names + ["mode"])
        threads = _family(GaugeMetricFamily, "tensorferry_process_threads", "Threads (/proc/PID/stat)", names)
        if per_process:
            rows = [
                ([snap.name_of(s), str(s.pid)], s.anon_bytes, s.file_bytes, s.shmem_bytes, s.swap_bytes,
                 s.uss_bytes, s.pss_bytes, s.exact_age_seconds, s.cpu_user_seconds, s.cpu_system_seconds,
                 s.num_threads)
                for s in snap.samples
            ]
        else:
            rows = [
                ([g.name], g.anon_bytes, g.file_bytes, g.shmem_bytes, g.swap_bytes, g.uss_bytes, g.pss_bytes,
                 g.max_exact_age_seconds, g.cpu_user_seconds, g.cpu_system_seconds, g.num_threads)
                for g in snap.groups
            ]
        for base, anon, file_, shmem, swap_, uss_, pss_, age_, user, system, nthreads in rows:
            resident.add_metric(base + ["anon"], anon)
            resident.add_metric(base + ["file"], file_)
            resident.add_metric(base + ["shmem"], shmem)
            swap.add_metric(base, swap_)
            if uss_ is not None:
                uss.add_metric(base, uss_)
            if pss_ is not None:
                pss.add_metric(base, pss_)
            if age_ is not None:
                age.add_metric(base, age_)
            cpu.add_metric(base + ["user"], user)
            cpu.add_metric(base + ["system"], system)
            threads.add_metric(base, nthreads)
        yield from (resident, swap, uss, pss, age, cpu, threads)

    def _groups(self, snap: Snapshot) -> Iterator[Metric]:
        # By name in both label modes: a count per pid would be 1 everywhere.
        count = GaugeMetricFamily("tensorferry_processes", "Processes watched, by name", labels=["name"])
        exact = GaugeMetricFamily(
            "tensorferry_processes_with_exact",
            "Processes with exact figures (uss), by name; below tensorferry_processes the group has no uss",
            labels=["name"],
        )
        for g in snap.groups:
            count.add_metric([g.name], g.count)
            exact.add_metric([g.name], g.exact_count)
        yield from (count, exact)

    def _cgroups(self, snap: Snapshot) -> Iterator[Metric]:
        families = {
            "usage": ("Memory charged to the cgroup (v2 memory.current, v1 memory.usage_in_bytes): RSS, "
                      "page cache and kernel memory"),
            "limit": "The cgroup's hard limit (memory.max, memory.limit_in_bytes); +Inf when unlimited",
            "anon": "Anonymous memory charged to the cgroup (memory.stat anon; v1 rss)",
            "file": "Page cache charged to the cgroup (memory.stat file; v1 cache); includes shmem",
            "shmem": "Shared memory (tmpfs, /dev/shm, memfd) charged to the cgroup (memory.stat shmem)",
            "swap": "Swap used by the cgroup (memory.swap.current; v1 memory.stat swap)",
        }
        out = {k: GaugeMetricFamily(f"tensorferry_cgroup_memory_{k}_bytes", h, labels=["cgroup"])
               for k, h in families.items()}
        watched = GaugeMetricFamily("tensorferry_cgroup_watched_processes",
                                    "Watched processes in the cgroup", labels=["cgroup"])
        watched_uss = GaugeMetricFamily(
            "tensorferry_cgroup_watched_uss_bytes",
            "Sum of the USS of the watched processes in the cgroup (only when all have exact figures): "
            "what they alone hold of its charge",
            labels=["cgroup"],
        )
        for c in snap.cgroups:
            label = [c.path]
            out["usage"].add_metric(label, c.usage_bytes)
            out["limit"].add_metric(label, math.inf if c.limit_bytes is None else c.limit_bytes)
            out["anon"].add_metric(label, c.anon_bytes)
            out["file"].add_metric(label, c.file_bytes)
            out["shmem"].add_metric(label, c.shmem_bytes)
            out["swap"].add_metric(label, c.swap_bytes)
            watched.add_metric(label, c.watched)
            if c.watched_uss_bytes is not None:
                watched_uss.add_metric(label, c.watched_uss_bytes)
        yield from (*out.values(), watched, watched_uss)

    def _self_cost(self, snap: Snapshot) -> Iterator[Metric]:
        st = snap.stats
        cfg = self.agent.config if self.agent is not None else None
        tick = SummaryMetricFamily(
            "tensorferry_monitor_tick_seconds",
            "Wall time of the agent's ticks (cheap samples, exact walk steps, cgroups); count = ticks",
        )
        tick.add_metric([], count_value=st.ticks, sum_value=st.tick_seconds)
        last = GaugeMetricFamily("tensorferry_monitor_last_tick_seconds", "Wall time of the last tick")
        last.add_metric([], st.last_tick_seconds)
        when = GaugeMetricFamily("tensorferry_monitor_last_tick_timestamp_seconds",
                                 "When the last tick ran, seconds since the epoch")
        when.add_metric([], snap.timestamp)
        sample = SummaryMetricFamily(
            "tensorferry_monitor_sample_seconds",
            "Wall time of the agent's cheap samples (/proc/PID/stat every tick; status when RSS or VmSize moved, "
            "and by default at least every 10 s; fd counts every 10th tick)",
        )
        sample.add_metric([], count_value=st.samples, sum_value=st.sample_seconds)
        exact_spent = CounterMetricFamily(
            "tensorferry_monitor_exact_seconds",
            "Wall time of exact walk steps, charged against the exact budget (--budget): pagemap slices "
            "(pauses between lock bursts excluded) and smaps_rollup reads, finished or not; above the "
            "monitor's CPU when it waits for a CPU during a step",
        )
        exact_spent.add_metric([], st.exact_seconds)
        reads = CounterMetricFamily("tensorferry_monitor_exact_reads",
                                    "Exact figures taken (finished pagemap walks and smaps_rollup reads)")
        reads.add_metric([], st.exact_reads)
        steps = CounterMetricFamily("tensorferry_monitor_exact_steps",
                                    "Walk steps taken (a pagemap slice, or a whole smaps_rollup read)")
        steps.add_metric([], st.exact_steps)
        skipped = CounterMetricFamily(
            "tensorferry_monitor_exact_skipped",
            "Exact reads not done, by reason: stall (only smaps_rollup readable and its walk estimated over "
            "--max-stall), denied (another user's process), unstable (pagemap walk given up: mappings kept "
            "changing; retried later)",
            labels=["reason"],
        )
        skipped.add_metric(["stall"], st.exact_skipped_stall)
        skipped.add_metric(["denied"], st.exact_denied)
        skipped.add_metric(["unstable"], st.exact_unstable)
        walking = GaugeMetricFamily("tensorferry_monitor_walks_in_progress",
                                    "pagemap walks started and not finished (a walk may span ticks)")
        walking.add_metric([], st.walks_in_progress)
        errors = CounterMetricFamily(
            "tensorferry_monitor_errors",
            "Selected processes that could not be sampled, by reason (vanished, zombie, denied)",
            labels=["reason"],
        )
        for reason, n in sorted(st.errors.items()):
            errors.add_metric([reason], n)
        cpu = CounterMetricFamily("tensorferry_monitor_cpu_seconds",
                                  "CPU time of the monitor process since the agent was made")
        cpu.add_metric([], st.cpu_seconds)
        rss = GaugeMetricFamily("tensorferry_monitor_rss_bytes", "RSS of the monitor process")
        rss.add_metric([], st.rss_bytes)
        yield from (tick, last, when, sample, exact_spent, reads, steps, skipped, walking, errors, cpu, rss)
        if cfg is not None:
            interval = GaugeMetricFamily("tensorferry_monitor_interval_seconds",
                                         "Configured time between ticks (--interval)")
            interval.add_metric([], cfg.interval_seconds)
            budget = GaugeMetricFamily(
                "tensorferry_monitor_exact_budget_cores",
                "Configured CPU for exact walks, a fraction of one core (--budget); compare "
                "rate(tensorferry_monitor_exact_seconds_total)",
            )
            budget.add_metric([], cfg.cpu_budget_fraction)
            yield from (interval, budget)

    def _pools(self) -> Iterator[Metric]:
        labelled, failed = collect_labelled_pool_figures()
        names = ["pool", "role", "pid"] if self.labels == "process" else ["pool", "role"]
        gauges = {
            k: GaugeMetricFamily(f"tensorferry_pool_{k}_bytes", help_, labels=names)
            for k, help_ in (
                ("capacity", "Bytes the pool's buffer holds (a receive cache: its cap)"),
                ("used", "Bytes allocated to live groups (a receive cache: held by live results; may pass the cap)"),
                ("largest_free", "Largest contiguous free block: the biggest group that fits now"),
            )
        }
        transfers = CounterMetricFamily("tensorferry_pool_transfers", "Transfers served", labels=names)
        moved = CounterMetricFamily("tensorferry_pool_moved_bytes", "Bytes moved by transfers", labels=names)
        for f, lab in labelled:
            values = [lab.pool, lab.role, str(lab.pid)] if self.labels == "process" else [lab.pool, lab.role]
            gauges["capacity"].add_metric(values, f.capacity_nbytes)
            gauges["used"].add_metric(values, f.used_nbytes)
            gauges["largest_free"].add_metric(values, f.largest_free_nbytes)
            transfers.add_metric(values, f.transfers)
            moved.add_metric(values, f.bytes_moved)
        failing = GaugeMetricFamily(
            "tensorferry_pool_sources_failing",
            "Pool sources that raised or returned a bad dict at this scrape (a gauge, not a count over time)",
        )
        failing.add_metric([], failed)
        if labelled or failed:
            yield from (*gauges.values(), transfers, moved, failing)
