"""The agent: select processes, sample them every tick, and spend a bounded
CPU budget on exact figures without stalling any of them too long.

Cheap figures (stat every tick, status when stat shows RSS or VmSize moved
or at least every 10 s; ~8-17 µs a process with the files held open) are
taken for every selected process every tick. Exact figures need a walk of
the target's page tables, during which its mmap/munmap wait. On Linux the
agent walks ``pagemap`` one slice of address space per step (the slice sized
from ``max_stall_seconds``), so a process of any size gets exact figures and
no step stalls it longer than the limit; a walk may span ticks. Where
pagemap is not readable it reads ``smaps_rollup``, one walk under the lock,
and never for a process whose walk it estimates above ``max_stall_seconds``
(unless ``force_exact``). Either way the agent:

- spends at most ``cpu_budget_fraction`` of a core on them over time and
  re-reads a process no more often than its walk's cost allows
  (``_exact_schedule``);
- reports with every sample how old its exact figures are (from when their
  walk finished) and which source they came from.
"""

from __future__ import annotations

__all__ = ["Agent", "AgentConfig", "AgentStats", "Selection", "Snapshot"]

import operator
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import AccessDenied, ConfigurationError, NoSuchProcess, ZombieProcess
from ._cgroup import CgroupMemory, CgroupReader
from ._config import AgentConfig
from ._exact_schedule import ExactScheduler
from ._sample import Backend, default_backend
from ._selection import Selection, Selector
from ._snapshot import AgentStats, PendingSamples, Snapshot
from ._types import ProcessMemory

# Snapshots list samples largest RSS first.
_RSS = operator.itemgetter(ProcessMemory._fields.index("rss_bytes"))

@dataclass
class _Counters:
    ticks: int = 0
    samples: int = 0
    sample_seconds: float = 0.0
    tick_seconds: float = 0.0
    last_tick_seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=lambda: {"vanished": 0, "zombie": 0, "denied": 0})


class Agent:
    """Watches selected processes' memory at a bounded cost to them.

    Args:
        selection: which processes.
        config: how to sample them.
        backend: where figures come from (the platform's default when None).
        cgroup_reader: where cgroup figures come from (the real sysfs when None).
        clock: monotonic seconds; tests inject one to drive the budget.
        rng: the jitter's random source.

    Raises:
        ConfigurationError: the selection is empty.
    """

    def __init__(
        self,
        selection: Selection,
        config: AgentConfig | None = None,
        *,
        backend: Backend | None = None,
        cgroup_reader: CgroupReader | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if selection.is_empty:
            raise ConfigurationError(
                "Agent(selection=Selection()) selects nothing; give pids, a pattern, a tree_root_pid, "
                "or all_processes=True"
            )
        self.selection = selection
        self.config = config or AgentConfig()
        self.backend = backend or default_backend(count_fds=self.config.count_fds)
        self.cgroup_reader = cgroup_reader
        if self.config.cgroups and cgroup_reader is None:
            self.cgroup_reader = CgroupReader(getattr(self.backend, "proc_root", "/proc"))
        self._clock = clock
        self._rng = rng or random.Random()
        self._selector = Selector(selection, self.backend, clock=clock, rescan_seconds=self.config.rescan_seconds)
        self._exact = ExactScheduler(self.config, self.backend, clock())
        self._fds: dict[int, int] = {}
        # Linux: keep each process's stat/status open, skip status while stat
        # shows RSS and VmSize unchanged, and hand out the last sample again
        # while stat reads the same (ProcfsBackend.cheap_tick).
        self._cheap_tick = getattr(self.backend, "cheap_tick", None)
        # The selection the last tick sampled (select() returns the same
        # list while nothing changed), to know when the watched set moved.
        self._last_pids: list[int] | None = None
        self._retain = getattr(self.backend, "retain", None)
        self._counters = _Counters()
        self._cpu_start = time.process_time()
        self._latest: Snapshot | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def select(self) -> list[int]:
        """The pids selected now, sorted."""
        return self._selector.select()

    def estimate_walk_seconds(self, sample: ProcessMemory) -> float:
        """What reading ``sample``'s exact figures would cost (and stall it): its
        last walk's measured cost scaled by RSS growth, else an estimate from
        its size (``_exact_schedule.ExactScheduler.estimate``)."""
        return self._exact.estimate(sample)

    # -- ticking -----------------------------------------------------------------

    def tick(self) -> Snapshot:
        """Sample the selected processes once; returns (and keeps) the snapshot."""
        with self._lock:
            return self._tick()

    def _tick(self) -> Snapshot:
        tick_start = time.perf_counter()
        now = self._clock()
        c = self._counters
        cfg = self.config
        pids = self.select()
        t0 = time.perf_counter()
        if self._cheap_tick is None:
            samples, errors = self._sample_each(pids)
            c.sample_seconds += time.perf_counter() - t0
            c.samples += len(pids)
            samples = self._selector.observe_all(samples)
            self._forget_others(samples, pids)
            stall_skipped = self._exact.run(samples, now) if cfg.exact else set()
            attach = self._exact.attach
            out = [attach(s, now) for s in samples]
            out.sort(key=_RSS, reverse=True)
            return self._snapshot(tuple(out), errors, stall_skipped, tick_start)
        # Linux: one loop in the backend; a process whose stat reads as last
        # tick costs one pread, and its record is the last one, as it was.
        reads = self._cheap_tick(
            pids, count_fds=cfg.count_fds, max_status_age_seconds=cfg.status_max_age_seconds,
            fds_every_calls=cfg.fds_every_ticks, call=c.ticks,
        )
        c.sample_seconds += time.perf_counter() - t0
        c.samples += len(pids)
        samples, read_ats, errors = reads.samples, reads.read_ats, reads.errors
        dropped = False
        kept = reads.fresh
        if reads.fresh:
            # A record handed out again was observed when it was built: only
            # new ones can bring a new parent, command line or start time.
            kept = self._selector.observe_all(reads.fresh)
            if len(kept) != len(reads.fresh):
                dropped = True
                out_ids = {id(s) for s in reads.fresh} - {id(s) for s in kept}
                pairs = [(s, r) for s, r in zip(samples, read_ats) if id(s) not in out_ids]
                samples, read_ats = [p[0] for p in pairs], [p[1] for p in pairs]
        if dropped or reads.new or pids is not self._last_pids or any(errors.values()):
            self._forget_others(samples, pids)
        # The exact schedule looks at the records built now, and at those whose time came.
        stall_skipped = self._exact.run(samples, now, fresh=kept) if cfg.exact else set()
        pending = PendingSamples(samples, read_ats, self._exact.published(), reads.wall, reads.now, now)
        return self._snapshot(pending, errors, stall_skipped, tick_start)

    def _forget_others(self, samples: list[ProcessMemory], pids: list[int]) -> None:
        """Let go of what is kept for processes no longer sampled (gone,
        zombies, deselected): the backend's open files, fd counts, exact state."""
        self._last_pids = pids
        alive = {s.pid for s in samples}
        if self._retain is not None:
            self._retain(alive)
        fds_cache = self._fds
        if len(fds_cache) > 2 * len(samples) + 64:
            for pid in [p for p in fds_cache if p not in alive]:
                del fds_cache[pid]
        self._exact.keep_only({(s.pid, s.create_time) for s in samples})

    def _snapshot(self, samples: tuple[ProcessMemory, ...] | PendingSamples, errors: dict[str, int],
                  stall_skipped: set[int], tick_start: float) -> Snapshot:
        c = self._counters
        for k, v in errors.items():
            c.errors[k] += v
        c.ticks += 1
        cgroups: tuple[CgroupMemory, ...] = ()
        if self.cgroup_reader is not None and self.config.cgroups:
            if isinstance(samples, PendingSamples):
                samples = samples.finish()
            cgroups = tuple(self.cgroup_reader.for_samples(samples))
        c.last_tick_seconds = time.perf_counter() - tick_start
        c.tick_seconds += c.last_tick_seconds
        snap = Snapshot(
            timestamp=time.time(),
            samples=samples,
            max_groups=self.config.max_groups,
            names=self.config.names,
            max_name_chars=self.config.max_name_chars,
            cgroups=cgroups,
            errors=errors,
            stall_skipped_pids=frozenset(stall_skipped),
            stats=self.stats(),
        )
        self._latest = snap
        return snap

    def _sample_each(self, pids: list[int]) -> tuple[list[ProcessMemory], dict[str, int]]:
        """A backend without ``cheap_many`` (psutil): one ``cheap`` per process,
        fds counted staggered over ticks (a new pid at once) and carried here."""
        cfg, ticks, fds_cache, cheap = self.config, self._counters.ticks, self._fds, self.backend.cheap
        errors = {"vanished": 0, "zombie": 0, "denied": 0}
        samples: list[ProcessMemory] = []
        for pid in pids:
            count_fds = cfg.count_fds and ((ticks + pid) % cfg.fds_every_ticks == 0 or pid not in fds_cache)
            try:
                s = cheap(pid, count_fds=count_fds)
            except ZombieProcess:
                errors["zombie"] += 1
                continue
            except NoSuchProcess:
                errors["vanished"] += 1
                continue
            except AccessDenied:
                errors["denied"] += 1
                continue
            if count_fds and s.num_fds is not None:
                fds_cache[pid] = s.num_fds
            elif cfg.count_fds and pid in fds_cache:
                s = s._replace(num_fds=fds_cache[pid])
            samples.append(s)
        return samples, errors

    def stats(self) -> AgentStats:
        """The agent's own cost so far."""
        c, e = self._counters, self._exact.counters
        return AgentStats(
            ticks=c.ticks,
            samples=c.samples,
            sample_seconds=c.sample_seconds,
            exact_reads=e.exact_reads,
            exact_seconds=e.exact_seconds,
            exact_skipped_stall=e.exact_skipped_stall,
            exact_denied=e.exact_denied,
            errors=dict(c.errors),
            cpu_seconds=time.process_time() - self._cpu_start,
            rss_bytes=self.backend.self_rss_bytes(),
            budget_tokens_seconds=self._exact.tokens,
            exact_steps=e.exact_steps,
            exact_unstable=e.exact_unstable,
            walks_in_progress=self._exact.walks_in_progress,
            tick_seconds=c.tick_seconds,
            last_tick_seconds=c.last_tick_seconds,
        )

    @property
    def latest(self) -> Snapshot | None:
        """The last snapshot taken, or None before the first tick."""
        return self._latest

    def next_delay_seconds(self) -> float:
        """The wait before the next tick: the interval with jitter."""
        j = self.config.jitter_fraction
        return self.config.interval_seconds * (1.0 + self._rng.uniform(-j, j))

    def run(
        self,
        *,
        duration_seconds: float | None = None,
        on_snapshot: Callable[[Snapshot], None] | None = None,
    ) -> None:
        """Tick until [``stop``][tensorferry.monitor.Agent.stop] (or for
        ``duration_seconds``), in this thread.

        Args:
            duration_seconds: stop after this long (the first tick is at 0).
            on_snapshot: called with each snapshot, in this thread.
        """
        start = time.monotonic()
        while not self._stop.is_set():
            snap = self.tick()
            if on_snapshot is not None:
                on_snapshot(snap)
            delay = self.next_delay_seconds()
            if duration_seconds is not None:
                remaining = start + duration_seconds - time.monotonic()
                if remaining <= delay:
                    self._stop.wait(max(0.0, remaining))
                    break
            if self._stop.wait(delay):
                break

    def start(self) -> None:
        """Tick in a background (daemon) thread until
        [``stop``][tensorferry.monitor.Agent.stop]."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="tensorferry-monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Stop ticking (waits for a background thread to finish its tick)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_seconds)
            self._thread = None
        close = getattr(self.backend, "close", None)
        with self._lock:
            self._exact.close_walks()
            if close is not None:
                # The files cheap_reusing keeps open; a later tick reopens them.
                close()
