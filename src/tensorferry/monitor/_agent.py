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

- spends at most ``cpu_budget_fraction`` of a core on them over time (a
  token bucket refilled at that rate, charged per step);
- re-reads a process no more often than ``cost / budget`` (a 5 ms walk at
  0.1% of a core: every 5 s), sooner when its RSS moved by more than
  ``rss_change_fraction``;
- reports with every sample how old its exact figures are (from when their
  walk finished) and which source they came from.
"""

from __future__ import annotations

__all__ = ["Agent", "AgentConfig", "AgentStats", "Selection", "Snapshot"]

import math
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from tensorferry.errors import AccessDenied, NoSuchProcess, ZombieProcess

from ._cgroup import CgroupMemory, CgroupReader
from ._group import GroupMemory, group_samples
from ._pagemap import WALK_SECONDS_PER_PAGE, PagemapWalk, WalkUnstable, slice_nbytes_for_stall
from ._sample import Backend, default_backend, with_exact
from ._types import ExactMemory, ProcessMemory

# A 4 KiB page costs the walk ~45 ns (45 ms for 4 GiB = 1 Mi pages, measured
# on the machines this was written for); 8 bytes of page table map one page.
_DEFAULT_WALK_SECONDS_PER_PAGE = 45e-9
_SMALL_PAGE_NBYTES = 4096
_PTE_NBYTES = 8


@dataclass(frozen=True)
class Selection:
    """Which processes the agent watches; the union of what is set."""

    pids: tuple[int, ...] = ()
    """These process ids (a pid that is gone is counted as vanished each tick)."""
    pattern: str | None = None
    """A regular expression searched in each process's command line (argv joined by spaces)."""
    tree_root_pid: int | None = None
    """This process and all its descendants (a raylet's workers, a trainer's ranks)."""
    all_processes: bool = False
    """Every process on the node (kernel threads excluded: they hold no user memory)."""

    def __post_init__(self) -> None:
        for pid in self.pids:
            if not isinstance(pid, int) or pid <= 0:
                raise ValueError(f"pids must be positive ints, got {pid!r}")
        if self.tree_root_pid is not None and self.tree_root_pid <= 0:
            raise ValueError(f"tree_root_pid must be a positive int, got {self.tree_root_pid!r}")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as exc:
                raise ValueError(f"pattern {self.pattern!r} is not a valid regular expression: {exc}") from exc

    @property
    def is_empty(self) -> bool:
        """True when nothing is selected."""
        return not (self.pids or self.pattern or self.tree_root_pid or self.all_processes)


@dataclass(frozen=True)
class AgentConfig:
    """How the agent samples; defaults suit a node of ML workers."""

    interval_seconds: float = 1.0
    """Time between ticks."""
    jitter_fraction: float = 0.1
    """Each interval is drawn from interval * [1 - jitter, 1 + jitter], so agents on many nodes do not tick in step."""
    exact: bool = True
    """Read exact USS/PSS (pagemap, else smaps_rollup) at all, within the budget."""
    cpu_budget_fraction: float = 0.001
    """CPU spent on exact reads, as a fraction of one core over time (0.001 = 0.1%)."""
    max_stall_seconds: float = 0.02
    """The longest a walk may stall its target at once: a pagemap walk's slice is sized
    so that one slice takes at most this; a process that only smaps_rollup can read
    (one walk under its lock) is not read if its walk is estimated above this."""
    force_exact: bool = False
    """Read smaps_rollup even where the walk would exceed max_stall_seconds (still within the budget)."""
    rss_change_fraction: float = 0.10
    """Re-read exact figures before cost/budget allows when RSS moved by more than this fraction."""
    walk_seconds_per_page: float = _DEFAULT_WALK_SECONDS_PER_PAGE
    """Estimated smaps_rollup cost of one resident 4 KiB page, for processes not read yet."""
    pagemap_seconds_per_page: float = WALK_SECONDS_PER_PAGE
    """Estimated pagemap walk cost of one resident 4 KiB page, for processes not read yet."""
    walk_base_seconds: float = 0.0002
    """Estimated walk cost of a small process (its mappings, the file itself)."""
    cgroups: bool = False
    """Also read the memory figures of the selected processes' cgroups (v1 and v2)."""
    count_fds: bool = True
    """Count each process's open fds (a listdir of /proc/PID/fd, ~6 µs: a fifth of a sample)."""
    fds_every_ticks: int = 10
    """Count fds every this many ticks per process (staggered), reporting the last count between."""
    status_max_age_seconds: float = 10.0
    """Re-read a process's status (its anon/file/shmem split, swap, peak, page tables) at
    least this often; sooner whenever stat shows its RSS or VmSize changed. In between the
    last figures carry over and ``ProcessMemory.status_age_seconds`` says how old they
    are. 0 re-reads status every tick. (Linux; other platforms read everything each tick.)"""
    max_groups: int = 50
    """Groups by name kept in each snapshot; the rest fold into ``other``."""
    rescan_seconds: float = 10.0
    """Re-match command lines of processes that did not match this often (they retitle)."""

    def __post_init__(self) -> None:
        if not self.interval_seconds > 0:
            raise ValueError(f"interval_seconds must be > 0, got {self.interval_seconds}")
        if not 0 <= self.jitter_fraction < 1:
            raise ValueError(f"jitter_fraction must be in [0, 1), got {self.jitter_fraction}")
        if not 0 < self.cpu_budget_fraction <= 1:
            raise ValueError(
                f"cpu_budget_fraction must be in (0, 1] (a fraction of one core; 0.001 = 0.1%), "
                f"got {self.cpu_budget_fraction}"
            )
        if not self.max_stall_seconds > 0:
            raise ValueError(f"max_stall_seconds must be > 0, got {self.max_stall_seconds}")
        if not self.rss_change_fraction > 0:
            raise ValueError(f"rss_change_fraction must be > 0, got {self.rss_change_fraction}")
        if self.walk_seconds_per_page < 0 or self.walk_base_seconds < 0 or self.pagemap_seconds_per_page < 0:
            raise ValueError("walk cost estimates must be >= 0")
        if self.max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {self.max_groups}")
        if self.fds_every_ticks < 1:
            raise ValueError(f"fds_every_ticks must be >= 1, got {self.fds_every_ticks}")
        if not self.status_max_age_seconds >= 0:
            raise ValueError(f"status_max_age_seconds must be >= 0, got {self.status_max_age_seconds}")
        if not self.rescan_seconds > 0:
            raise ValueError(f"rescan_seconds must be > 0, got {self.rescan_seconds}")


class AgentStats(NamedTuple):
    """What the agent itself has cost, since it was made."""

    ticks: int
    """Ticks taken."""
    samples: int
    """Cheap samples taken."""
    sample_seconds: float
    """Wall time spent in cheap samples."""
    exact_reads: int
    """Exact figures taken (finished pagemap walks and smaps_rollup reads)."""
    exact_seconds: float
    """Wall time spent walking, all steps of all walks (finished or not)."""
    exact_skipped_stall: int
    """smaps_rollup reads not done because the walk would stall the target too long."""
    exact_denied: int
    """Exact reads refused (another user's process)."""
    errors: dict[str, int]
    """Processes skipped, by reason: ``vanished``, ``zombie``, ``denied``."""
    cpu_seconds: float
    """CPU time of this process (the agent, its server, Python) since the agent was made."""
    rss_bytes: int
    """This process's RSS now."""
    budget_tokens_seconds: float
    """Exact-read budget left in the bucket (may be negative after an expensive read)."""
    exact_steps: int = 0
    """Steps taken (a pagemap slice, or a whole smaps_rollup read)."""
    exact_unstable: int = 0
    """pagemap walks given up because the target's mappings kept changing (retried later)."""
    walks_in_progress: int = 0
    """pagemap walks started and not finished yet."""


class Snapshot:
    """One tick's view of the selected processes (read-only).

    ``groups`` is computed on first use and kept: a tick nobody reads (most of
    them, at a 15 s scrape interval and 1 Hz ticks) never pays for grouping.
    """

    __slots__ = ("timestamp", "samples", "cgroups", "errors", "stall_skipped_pids", "stats",
                 "_max_groups", "_groups")

    timestamp: float
    """When the tick ran, seconds since the epoch."""
    samples: tuple[ProcessMemory, ...]
    """One per selected process that could be read, largest RSS first."""
    cgroups: tuple[CgroupMemory, ...]
    """Memory cgroups of the samples (empty unless AgentConfig.cgroups)."""
    errors: dict[str, int]
    """Processes skipped this tick, by reason."""
    stall_skipped_pids: frozenset[int]
    """Processes whose exact read the stall limit forbids."""
    stats: AgentStats
    """The agent's own cost so far."""

    def __init__(
        self,
        *,
        timestamp: float,
        samples: tuple[ProcessMemory, ...],
        cgroups: tuple[CgroupMemory, ...] = (),
        errors: dict[str, int],
        stall_skipped_pids: frozenset[int] = frozenset(),
        stats: AgentStats,
        max_groups: int = 50,
    ) -> None:
        if max_groups < 1:
            raise ValueError(f"max_groups must be at least 1, got {max_groups}")
        self.timestamp = timestamp
        self.samples = samples
        self.cgroups = cgroups
        self.errors = errors
        self.stall_skipped_pids = stall_skipped_pids
        self.stats = stats
        self._max_groups = max_groups
        self._groups: tuple[GroupMemory, ...] | None = None

    @property
    def groups(self) -> tuple[GroupMemory, ...]:
        """The samples grouped by name (``ray::Actor`` style), at most ``max_groups``."""
        groups = self._groups
        if groups is None:
            # Two threads may both compute it; they get equal tuples.
            groups = self._groups = tuple(group_samples(self.samples, max_groups=self._max_groups))
        return groups

    def __repr__(self) -> str:
        return (f"Snapshot(timestamp={self.timestamp!r}, samples=<{len(self.samples)}>, "
                f"errors={self.errors!r}, stall_skipped_pids=<{len(self.stall_skipped_pids)}>)")


@dataclass
class _ExactState:
    exact: ExactMemory | None
    read_at: float
    """When the figures' walk finished (the agent's clock)."""
    rss_at_read: int
    denied: bool = False
    tried_at: float | None = None
    """When a walk last finished or failed; re-reads are paced from here."""
    walk: PagemapWalk | None = None
    """A pagemap walk in progress."""
    rollup_only: bool = False
    """pagemap is not readable for this process: smaps_rollup, under the stall limit."""


@dataclass
class _Counters:
    ticks: int = 0
    samples: int = 0
    sample_seconds: float = 0.0
    exact_reads: int = 0
    exact_seconds: float = 0.0
    exact_skipped_stall: int = 0
    exact_denied: int = 0
    exact_steps: int = 0
    exact_unstable: int = 0
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
        ValueError: the selection is empty.
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
            raise ValueError(
                "the selection is empty; give pids, a pattern, a tree root pid, or all_processes=True"
            )
        self.selection = selection
        self.config = config or AgentConfig()
        self.backend = backend or default_backend(count_fds=self.config.count_fds)
        self.cgroup_reader = cgroup_reader
        if self.config.cgroups and cgroup_reader is None:
            self.cgroup_reader = CgroupReader(getattr(self.backend, "proc_root", "/proc"))
        self._clock = clock
        self._rng = rng or random.Random()
        self._pattern = re.compile(selection.pattern) if selection.pattern else None
        self._own_pid = os.getpid()
        self._exact: dict[tuple[int, float], _ExactState] = {}
        self._ppids: dict[int, int] = {}
        # Bumped when a known pid's parent changes (reparenting), which
        # invalidates _tree_cache: (root, version, listed pids, descendants).
        self._ppids_version = 0
        self._tree_cache: tuple[int, int, list[int], set[int]] | None = None
        self._matches: dict[int, tuple[bool, float]] = {}
        # Kernel threads seen while scanning: skipped until their pid is gone.
        self._kthreads: set[int] = set()
        self._fds: dict[int, int] = {}
        # Linux: keep each process's stat/status open and skip status while
        # stat shows RSS and VmSize unchanged (ProcfsBackend.cheap_reusing).
        self._cheap_reusing = getattr(self.backend, "cheap_reusing", None)
        self._retain = getattr(self.backend, "retain", None)
        # Linux: resumable pagemap walks (ProcfsBackend.start_walk).
        self._start_walk = getattr(self.backend, "start_walk", None) if getattr(self.backend, "pagemap", False) else None
        self._slice_nbytes = slice_nbytes_for_stall(self.config.max_stall_seconds)
        self._sampled: set[int] = set()
        self._counters = _Counters()
        cap = max(self.config.max_stall_seconds, self.config.cpu_budget_fraction * self.config.interval_seconds)
        # The bucket holds at most one maximal permitted walk: a burst never
        # stalls more than max_stall_seconds beyond the long-run rate.
        self._bucket_cap = cap
        self._tokens = cap
        self._last_refill = clock()
        self._cpu_start = time.process_time()
        self._latest: Snapshot | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- selection ---------------------------------------------------------------

    def _matches_pattern(self, pattern: re.Pattern[str], pid: int, now: float) -> bool:
        cached = self._matches.get(pid)
        if cached is not None and (cached[0] or now - cached[1] < self.config.rescan_seconds):
            return cached[0]
        try:
            argv = self.backend.cmdline(pid)
        except (NoSuchProcess, AccessDenied):
            argv = ()
        matched = bool(argv) and pattern.search(" ".join(argv)) is not None
        self._matches[pid] = (matched, now)
        return matched

    def _descendants(self, root: int, listed: list[int]) -> set[int]:
        cached = self._tree_cache
        if cached is not None and cached[0] == root and cached[1] == self._ppids_version and cached[2] == listed:
            # Same pids, no parent changed: the same tree (rebuilding it costs
            # ~0.3 ms a tick on a node of a few hundred processes).
            return cached[3]
        for pid in listed:
            if pid not in self._ppids:
                try:
                    self._ppids[pid] = self.backend.ppid(pid)
                except (NoSuchProcess, AccessDenied):
                    continue
        children: dict[int, list[int]] = {}
        for pid, ppid in self._ppids.items():
            children.setdefault(ppid, []).append(pid)
        out = {root}
        stack = [root]
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in out:
                    out.add(child)
                    stack.append(child)
        self._tree_cache = (root, self._ppids_version, listed, out)
        return out

    def select(self) -> list[int]:
        """The pids selected now, sorted."""
        sel = self.selection
        chosen: set[int] = set(sel.pids)
        if sel.all_processes or sel.pattern or sel.tree_root_pid:
            listed = self.backend.pids()
            alive = set(listed)
            # Forget what we learned about pids that are gone (they get reused).
            for cache in (self._ppids, self._matches):
                for pid in [p for p in cache if p not in alive]:
                    del cache[pid]
            self._kthreads &= alive
            if sel.all_processes:
                chosen.update(p for p in listed if p not in self._kthreads)
            pattern = self._pattern
            if pattern is not None:
                now = self._clock()
                # The agent's own command line holds the pattern: never match itself.
                chosen.update(
                    p for p in listed if p != self._own_pid and self._matches_pattern(pattern, p, now)
                )
            if sel.tree_root_pid:
                chosen.update(self._descendants(sel.tree_root_pid, listed) & (alive | {sel.tree_root_pid}))
        return sorted(chosen)

    # -- exact figures under the budget -------------------------------------------

    def estimate_walk_seconds(self, sample: ProcessMemory) -> float:
        """What reading ``sample``'s exact figures would cost (and stall it).

        Measured cost, scaled by RSS growth since, once read; before that,
        base + per-page cost x resident 4 KiB pages, where the page count is
        bounded by the page table (huge pages need no PTE and walk fast).
        """
        return self._estimate(sample, self._exact.get((sample.pid, sample.create_time)))

    def _uses_pagemap(self, state: _ExactState | None) -> bool:
        return self._start_walk is not None and not (state is not None and state.rollup_only)

    def _estimate(self, sample: ProcessMemory, state: _ExactState | None) -> float:
        if state is not None and state.exact is not None:
            growth = sample.rss_bytes / state.rss_at_read if state.rss_at_read else 1.0
            return state.exact.cost_seconds * max(growth, 1.0)
        pages = sample.rss_bytes // _SMALL_PAGE_NBYTES
        if self._uses_pagemap(state):
            # pagemap reads every resident page, huge or not.
            return self.config.walk_base_seconds + pages * self.config.pagemap_seconds_per_page
        if sample.page_table_bytes:
            pages = min(pages, sample.page_table_bytes // _PTE_NBYTES)
        return self.config.walk_base_seconds + pages * self.config.walk_seconds_per_page

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._last_refill)
        self._last_refill = now
        self._tokens = min(self._bucket_cap, self._tokens + elapsed * self.config.cpu_budget_fraction)

    def _due(self, sample: ProcessMemory, state: _ExactState | None, now: float, est: float) -> tuple[int, float] | None:
        """``(priority, order)`` if the process should be read now, else None."""
        if state is None:
            return (0, est)
        if state.denied:
            return None
        age = now - (state.tried_at if state.tried_at is not None else state.read_at)
        if state.rss_at_read and abs(sample.rss_bytes - state.rss_at_read) > (
            self.config.rss_change_fraction * state.rss_at_read
        ):
            return (1, -age)
        cost = state.exact.cost_seconds if state.exact is not None else self.config.walk_base_seconds
        if age >= cost / self.config.cpu_budget_fraction:
            return (2, -age)
        return None

    def _exact_pass(self, samples: list[ProcessMemory], now: float) -> set[int]:
        cfg = self.config
        stall_skipped: set[int] = set()
        # (order, sample, estimated cost of what is left): walks in progress
        # first (oldest first), then due processes.
        due: list[tuple[tuple[int, float], ProcessMemory, float]] = []
        states, estimate, is_due = self._exact, self._estimate, self._due
        max_stall = math.inf if cfg.force_exact else cfg.max_stall_seconds
        for s in samples:
            if s.kernel_thread or s.uss_source != "none":
                continue
            state = states.get((s.pid, s.create_time))
            est = estimate(s, state)
            if state is not None and state.walk is not None:
                left = max(est - state.walk.cost_seconds, cfg.walk_base_seconds)
                due.append(((-1, -(now - (state.tried_at or 0.0))), s, left))
                continue
            if not self._uses_pagemap(state) and est > max_stall:
                stall_skipped.add(s.pid)
                self._counters.exact_skipped_stall += 1
                continue
            when = is_due(s, state, now, est)
            if when is not None:
                due.append((when, s, est))
        due.sort(key=lambda d: d[0])
        for _, s, est in due:
            if not self._read_exact(s, now, est, max_stall, stall_skipped):
                break
        return stall_skipped

    def _affordable(self, est: float) -> bool:
        # A full bucket may pay for a step larger than itself (the debt is
        # repaid before the next one); otherwise the estimate must fit.
        return self._tokens >= est or self._tokens >= self._bucket_cap

    def _charge(self, cost: float) -> None:
        self._tokens -= cost
        self._counters.exact_seconds += cost
        self._counters.exact_steps += 1

    def _read_exact(
        self, s: ProcessMemory, now: float, est: float, max_stall: float, stall_skipped: set[int]
    ) -> bool:
        """Spend budget on ``s``'s exact figures: steps of its walk, or one
        smaps_rollup read. False when the budget ran out."""
        key = (s.pid, s.create_time)
        state = self._exact.get(key)
        c = self._counters
        try:
            if self._uses_pagemap(state):
                walk = state.walk if state is not None else None
                if walk is None:
                    if not self._affordable(min(est, self.config.max_stall_seconds)):
                        return False
                    walk = self._start_walk(s.pid, slice_nbytes=self._slice_nbytes)  # type: ignore[misc]
                    if walk is None:
                        # No pagemap for it: smaps_rollup, under the stall limit.
                        state = self._state(key, s, now)
                        state.rollup_only = True
                        est = self._estimate(s, state)
                        if est > max_stall:
                            stall_skipped.add(s.pid)
                            c.exact_skipped_stall += 1
                            return True
                        return self._read_rollup(s, state, now, est)
                    state = self._state(key, s, now)
                    state.walk = walk
                    self._charge(walk.cost_seconds)
                return self._step_walk(s, state, walk, now, est)
            state = self._state(key, s, now)
            return self._read_rollup(s, state, now, est)
        except AccessDenied:
            st = self._state(key, s, now)
            st.denied, st.walk = True, None
            c.exact_denied += 1
        except NoSuchProcess:
            self._exact.pop(key, None)
        return True

    def _state(self, key: tuple[int, float], s: ProcessMemory, now: float) -> _ExactState:
        state = self._exact.get(key)
        if state is None:
            state = self._exact[key] = _ExactState(None, now, s.rss_bytes, tried_at=now)
        return state

    def _step_walk(self, s: ProcessMemory, state: _ExactState, walk: PagemapWalk, now: float, est: float) -> bool:
        max_step = self.config.max_stall_seconds
        while not walk.done:
            if not self._affordable(min(max(est - walk.cost_seconds, 0.0), max_step)):
                return False
            spent = walk.cost_seconds
            try:
                walk.step()
            except WalkUnstable:
                # The target kept mapping and unmapping while walked: no
                # figure this time, the last one stands with its age.
                self._charge(walk.cost_seconds - spent)
                state.walk, state.tried_at = None, now
                self._counters.exact_unstable += 1
                return True
            except BaseException:
                self._charge(walk.cost_seconds - spent)
                raise
            self._charge(walk.cost_seconds - spent)
        state.walk = None
        state.tried_at = state.read_at = now
        state.rss_at_read = s.rss_bytes
        if walk.result is not None:
            state.exact = walk.result
            self._counters.exact_reads += 1
        return True

    def _read_rollup(self, s: ProcessMemory, state: _ExactState, now: float, est: float) -> bool:
        if not self._affordable(est):
            return False
        exact = self.backend.exact(s.pid)
        self._charge(exact.cost_seconds if exact is not None else 0.0)
        self._counters.exact_reads += 1
        state.exact, state.read_at, state.tried_at, state.rss_at_read = exact, now, now, s.rss_bytes
        return True

    # -- ticking -----------------------------------------------------------------

    def tick(self) -> Snapshot:
        """Sample the selected processes once; returns (and keeps) the snapshot."""
        with self._lock:
            return self._tick()

    def _tick(self) -> Snapshot:
        now = self._clock()
        self._refill(now)
        c = self._counters
        errors = {"vanished": 0, "zombie": 0, "denied": 0}
        samples: list[ProcessMemory] = []
        perf = time.perf_counter
        cfg = self.config
        fds_every, fds_cache = cfg.fds_every_ticks, self._fds
        reusing, status_age, sampled = self._cheap_reusing, cfg.status_max_age_seconds, self._sampled
        cheap = self.backend.cheap
        for pid in self.select():
            # Stagger fd counts over ticks; a new pid is counted at once.
            t0 = perf()
            try:
                if reusing is not None:
                    # The backend carries the last fd count between counts.
                    count_fds = cfg.count_fds and ((c.ticks + pid) % fds_every == 0 or pid not in sampled)
                    s = reusing(pid, count_fds=count_fds, max_status_age_seconds=status_age)
                else:
                    count_fds = cfg.count_fds and ((c.ticks + pid) % fds_every == 0 or pid not in fds_cache)
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
            finally:
                c.sample_seconds += perf() - t0
                c.samples += 1
            if s.kernel_thread and pid not in self.selection.pids:
                self._kthreads.add(pid)
                continue
            if self._ppids.get(pid) != s.ppid:
                self._ppids[pid] = s.ppid
                self._ppids_version += 1
            if reusing is None:
                if count_fds and s.num_fds is not None:
                    fds_cache[pid] = s.num_fds
                elif cfg.count_fds and pid in fds_cache:
                    s = s._replace(num_fds=fds_cache[pid])
            samples.append(s)
        alive = self._sampled = {s.pid for s in samples}
        if self._retain is not None:
            # Close the files of processes no longer sampled (gone, zombies, deselected).
            self._retain(alive)
        if len(fds_cache) > 2 * len(samples) + 64:
            for pid in [p for p in fds_cache if p not in alive]:
                del fds_cache[pid]
        alive_keys = {(s.pid, s.create_time) for s in samples}
        for key in [k for k in self._exact if k not in alive_keys]:
            gone = self._exact.pop(key)
            if gone.walk is not None:
                gone.walk.close()
        stall_skipped = self._exact_pass(samples, now) if self.config.exact else set()
        out: list[ProcessMemory] = []
        for s in samples:
            state = self._exact.get((s.pid, s.create_time))
            if state is not None and state.exact is not None and s.uss_source == "none":
                s = with_exact(s, state.exact, now - state.read_at)
            out.append(s)
        out.sort(key=lambda s: s.rss_bytes, reverse=True)
        for k, v in errors.items():
            c.errors[k] += v
        c.ticks += 1
        cgroups: tuple[CgroupMemory, ...] = ()
        if self.cgroup_reader is not None and self.config.cgroups:
            cgroups = tuple(self.cgroup_reader.for_pids([s.pid for s in out]))
        snap = Snapshot(
            timestamp=time.time(),
            samples=tuple(out),
            max_groups=self.config.max_groups,
            cgroups=cgroups,
            errors=errors,
            stall_skipped_pids=frozenset(stall_skipped),
            stats=self.stats(),
        )
        self._latest = snap
        return snap

    def stats(self) -> AgentStats:
        """The agent's own cost so far."""
        c = self._counters
        return AgentStats(
            ticks=c.ticks,
            samples=c.samples,
            sample_seconds=c.sample_seconds,
            exact_reads=c.exact_reads,
            exact_seconds=c.exact_seconds,
            exact_skipped_stall=c.exact_skipped_stall,
            exact_denied=c.exact_denied,
            errors=dict(c.errors),
            cpu_seconds=time.process_time() - self._cpu_start,
            rss_bytes=self.backend.self_rss_bytes(),
            budget_tokens_seconds=self._tokens,
            exact_steps=c.exact_steps,
            exact_unstable=c.exact_unstable,
            walks_in_progress=sum(1 for st in self._exact.values() if st.walk is not None),
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
        """Tick until :meth:`stop` (or for ``duration_seconds``), in this thread.

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
        """Tick in a background (daemon) thread until :meth:`stop`."""
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
            # Walks in progress hold their target's pagemap open; a later
            # tick starts them again.
            for state in self._exact.values():
                if state.walk is not None:
                    state.walk.close()
                    state.walk = None
            if close is not None:
                # The files cheap_reusing keeps open; a later tick reopens them.
                close()
