"""Exact figures under a CPU budget: which process to walk next, and how much.

The budget is a token bucket refilled at ``cpu_budget_fraction`` of a core
and charged per walk step. A process is re-read no more often than
``cost / budget`` (a 5 ms walk at 0.1% of a core: every 5 s), sooner when its
RSS moved by more than ``rss_change_fraction``. A pagemap walk advances one
slice per step and may span ticks; a smaps_rollup read is one step, never
taken for a process whose walk is estimated above ``max_stall_seconds``
(unless ``force_exact``).
"""

from __future__ import annotations

__all__ = ["ExactCounters", "ExactScheduler"]

import heapq
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import AccessDenied, NoSuchProcess
from ._config import AgentConfig
from ._pagemap import PagemapWalk, WalkUnstable, slice_nbytes_for_stall
from ._sample import Backend, with_exact
from ._types import ExactMemory, ProcessMemory

# A walk estimate counts 4 KiB pages; 8 bytes of page table map one such
# page, so the page table bounds how many of them are resident.
_PID = operator.itemgetter(0)  # ProcessMemory.pid
_SMALL_PAGE_NBYTES = 4096
_PTE_NBYTES = 8


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
    sample: ProcessMemory | None = None
    """The record last looked at (run(fresh=...): a still process's stays the same object)."""
    next_at: float | None = None
    """When its time comes (run(fresh=...)'s heap holds this entry; others there are stale)."""
    rollup_only: bool = False
    """pagemap is not readable for this process: smaps_rollup, under the stall limit."""


@dataclass
class ExactCounters:
    """What exact reads have cost so far (reported in ``AgentStats``)."""

    exact_reads: int = 0
    exact_seconds: float = 0.0
    exact_skipped_stall: int = 0
    exact_denied: int = 0
    exact_steps: int = 0
    exact_unstable: int = 0


class ExactScheduler:
    """Decides, tick by tick, whose exact figures to read within the budget, and keeps them.

    Args:
        config: the budget, the stall limit and the cost estimates.
        backend: reads smaps_rollup (``exact``) and, where it has pagemap,
            starts resumable walks (``start_walk``).
        now: the clock's time at creation (the bucket starts full).
    """

    def __init__(self, config: AgentConfig, backend: Backend, now: float) -> None:
        self._config = config
        self._backend = backend
        self._states: dict[tuple[int, float], _ExactState] = {}
        # Linux: resumable pagemap walks (ProcfsBackend.start_walk).
        self._start_walk: Callable[..., PagemapWalk | None] | None = (
            getattr(backend, "start_walk", None) if getattr(backend, "pagemap", False) else None
        )
        self._slice_nbytes = slice_nbytes_for_stall(config.max_stall_seconds)
        self.counters = ExactCounters()
        cap = max(config.max_stall_seconds, config.cpu_budget_fraction * config.interval_seconds)
        # The bucket holds at most one maximal permitted walk: a burst never
        # stalls more than max_stall_seconds beyond the long-run rate.
        self._bucket_cap = cap
        self.tokens = cap
        self._last_refill = now
        # Every process's figures as attach() would attach them, kept up to
        # date where they change; published() hands out a copy (a snapshot
        # keeps it), made anew only after a tick changed some.
        self._figures: dict[tuple[int, float], tuple[ExactMemory, float]] = {}
        self._published: dict[tuple[int, float], tuple[ExactMemory, float]] = {}
        self._changed = False
        # The keys whose state has a walk in progress (the agent's stats read
        # their number every tick).
        self._walking: set[tuple[int, float]] = set()
        # run(fresh=...): (when, order, key) of processes to look at again
        # once their time comes; those due but not served at the last tick;
        # those the stall limit forbids (looked at every tick).
        self._heap: list[tuple[float, int, tuple[int, float]]] = []
        self._seq = 0
        self._unserved: dict[tuple[int, float], ProcessMemory] = {}
        self._forbidden: dict[tuple[int, float], ProcessMemory] = {}

    @property
    def walks_in_progress(self) -> int:
        """pagemap walks started and not finished."""
        return len(self._walking)

    def keep_only(self, alive: Iterable[tuple[int, float]]) -> None:
        """Forget processes not in ``alive`` ((pid, create_time) keys), closing their walks."""
        keep = alive if isinstance(alive, (set, frozenset)) else set(alive)
        for pending in (self._unserved, self._forbidden):
            for key in [k for k in pending if k not in keep]:
                del pending[key]
        for key in [k for k in self._states if k not in keep]:
            gone = self._states.pop(key)
            self._publish(key, None)
            self._walking.discard(key)
            if gone.walk is not None:
                gone.walk.close()

    def close_walks(self) -> None:
        """Close walks in progress (they hold their target's pagemap open); later ticks restart them."""
        for state in self._states.values():
            if state.walk is not None:
                state.walk.close()
                state.walk = None
        self._walking.clear()

    def published(self) -> dict[tuple[int, float], tuple[ExactMemory, float]]:
        """(pid, create_time) -> (exact figures, when read) of every process
        with some: what :meth:`attach` attaches, as of now. The dict is not
        changed later (a new one is made once figures change), so a snapshot
        may keep it and attach them when it is read."""
        if self._changed:
            self._changed = False
            self._published = self._figures.copy()  # ~10 µs for 1,000 (a loop over the states: ~0.5 ms)
        return self._published

    def _publish(self, key: tuple[int, float], state: _ExactState | None) -> None:
        """``key``'s figures changed (or it went: ``state`` None)."""
        self._changed = True
        if state is not None and state.exact is not None:
            self._figures[key] = (state.exact, state.read_at)
        else:
            self._figures.pop(key, None)

    def attach(self, s: ProcessMemory, now: float) -> ProcessMemory:
        """``s`` with its last exact figures and their age, if any were read."""
        state = self._states.get((s.pid, s.create_time))
        if state is not None and state.exact is not None and s.uss_source == "none":
            return with_exact(s, state.exact, now - state.read_at)
        return s

    def _uses_pagemap(self, state: _ExactState | None) -> bool:
        return self._start_walk is not None and not (state is not None and state.rollup_only)

    def estimate(self, sample: ProcessMemory, state: _ExactState | None = None) -> float:
        """What reading ``sample``'s exact figures would cost (and stall it).

        Measured cost, scaled by RSS growth since, once read; before that,
        base + per-page cost x resident 4 KiB pages, where the page count is
        bounded by the page table (huge pages need no PTE and walk fast).
        """
        if state is None:
            state = self._states.get((sample.pid, sample.create_time))
        if state is not None and state.exact is not None:
            growth = sample.rss_bytes / state.rss_at_read if state.rss_at_read else 1.0
            return state.exact.cost_seconds * max(growth, 1.0)
        pages = sample.rss_bytes // _SMALL_PAGE_NBYTES
        if self._uses_pagemap(state):
            # pagemap reads every resident page, huge or not.
            return self._config.walk_base_seconds + pages * self._config.pagemap_seconds_per_page
        if sample.page_table_bytes:
            pages = min(pages, sample.page_table_bytes // _PTE_NBYTES)
        return self._config.walk_base_seconds + pages * self._config.walk_seconds_per_page

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._last_refill)
        self._last_refill = now
        self.tokens = min(self._bucket_cap, self.tokens + elapsed * self._config.cpu_budget_fraction)

    def _due(self, sample: ProcessMemory, state: _ExactState, now: float) -> tuple[int, float] | None:
        """``(priority, order)`` if a process read (or tried) before should be read now, else None.
        Needs no cost estimate: most of a node's processes stand still and are not due."""
        if state.denied:
            return None
        age = now - (state.tried_at if state.tried_at is not None else state.read_at)
        if state.rss_at_read and abs(sample.rss_bytes - state.rss_at_read) > (
            self._config.rss_change_fraction * state.rss_at_read
        ):
            return (1, -age)
        cost = state.exact.cost_seconds if state.exact is not None else self._config.walk_base_seconds
        if age >= cost / self._config.cpu_budget_fraction:
            return (2, -age)
        return None

    def run(self, samples: list[ProcessMemory], now: float, fresh: list[ProcessMemory] | None = None) -> set[int]:
        """Spend the budget on the samples' exact figures (walks in progress
        first, oldest first, then due processes); returns the pids whose read
        the stall limit forbids.

        With ``fresh`` (the records built at this tick; every other record
        is the object the last tick had, its process standing still), only
        what can be due is looked at: those records, walks in progress,
        processes due but not served at the last tick, those the stall limit
        forbids, and those whose time has come (kept in a heap): the same
        choice as looking at every sample, without a pass over them all."""
        self._refill(now)
        cfg = self._config
        stall_skipped: set[int] = set()
        # (order, sample, estimated cost of what is left): walks in progress
        # first (oldest first), then due processes.
        due: list[tuple[tuple[int, float], ProcessMemory, float]] = []
        max_stall = math.inf if cfg.force_exact else cfg.max_stall_seconds
        consider = self._consider
        if fresh is None:
            for s in samples:
                consider(s, now, due, stall_skipped, max_stall)
        else:
            looked = self._candidates(fresh, now)
            # In pid order, as the samples are: equal priorities are read in the same order.
            for s in sorted(looked.values(), key=_PID):
                consider(s, now, due, stall_skipped, max_stall)
        due.sort(key=lambda d: d[0])
        served = 0
        for _, s, est in due:
            if not self._read_exact(s, now, est, max_stall, stall_skipped):
                break
            served += 1
        if fresh is not None:
            self._schedule(looked, due[served:], stall_skipped, now)
        return stall_skipped

    def _consider(self, s: ProcessMemory, now: float, due: list[tuple[tuple[int, float], ProcessMemory, float]],
                  stall_skipped: set[int], max_stall: float) -> None:
        """Append ``s`` to ``due`` if its exact figures should be read now (or
        its walk goes on); note it in ``stall_skipped`` where the stall limit forbids it."""
        if s.kernel_thread or s.uss_source != "none":
            return
        cfg, estimate = self._config, self.estimate
        state = self._states.get((s.pid, s.create_time))
        if state is not None and state.walk is not None:
            left = max(estimate(s, state) - state.walk.cost_seconds, cfg.walk_base_seconds)
            due.append(((-1, -(now - (state.tried_at or 0.0))), s, left))
            return
        if state is not None and self._start_walk is not None and not state.rollup_only:
            # A pagemap walk stalls its target a slice at a time: no stall
            # check, and the estimate only for those due.
            when = self._due(s, state, now)
            if when is not None:
                due.append((when, s, estimate(s, state)))
            return
        est = estimate(s, state)
        if not self._uses_pagemap(state) and est > max_stall:
            stall_skipped.add(s.pid)
            self.counters.exact_skipped_stall += 1
            return
        when = (0, est) if state is None else self._due(s, state, now)
        if when is not None:
            due.append((when, s, est))

    def _candidates(self, fresh: list[ProcessMemory], now: float) -> dict[tuple[int, float], ProcessMemory]:
        """The records that can be due at ``now`` (see :meth:`run`), by key."""
        states, looked = self._states, {}
        for s in fresh:
            key = (s.pid, s.create_time)
            looked[key] = s
            state = states.get(key)
            if state is not None:
                state.sample = s
        for key in self._walking:
            state = states.get(key)
            if state is not None and state.sample is not None:
                looked.setdefault(key, state.sample)
        for key, s in (*self._unserved.items(), *self._forbidden.items()):
            looked.setdefault(key, s)
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, key = heapq.heappop(heap)
            state = states.get(key)
            if state is not None and state.next_at == at and state.sample is not None:
                state.next_at = None
                looked.setdefault(key, state.sample)
        return looked

    def _schedule(self, looked: dict[tuple[int, float], ProcessMemory],
                  unserved: list[tuple[tuple[int, float], ProcessMemory, float]], stall_skipped: set[int], now: float) -> None:
        """After a tick: when each record looked at is to be looked at again."""
        self._unserved = {(s.pid, s.create_time): s for _, s, _ in unserved}
        self._forbidden = {}
        rate = self._config.cpu_budget_fraction
        for key, s in looked.items():
            state = self._states.get(key)
            if state is not None:
                state.sample = s
            if key in self._unserved or key in self._walking:
                continue
            if s.pid in stall_skipped:
                self._forbidden[key] = s
                continue
            if state is None or state.denied:
                continue  # gone, never due (another user's), or not a candidate (kernel thread, USS from elsewhere)
            cost = state.exact.cost_seconds if state.exact is not None else self._config.walk_base_seconds
            base = state.tried_at if state.tried_at is not None else state.read_at
            at = base + cost / rate  # _due's pace: not before it (its RSS rule needs a new record, looked at anyway)
            if state.next_at != at:
                state.next_at = at
                self._seq += 1
                heapq.heappush(self._heap, (at, self._seq, key))

    def _affordable(self, est: float) -> bool:
        # A full bucket may pay for a step larger than itself (the debt is
        # repaid before the next one); otherwise the estimate must fit.
        return self.tokens >= est or self.tokens >= self._bucket_cap

    def _charge(self, cost: float) -> None:
        self.tokens -= cost
        self.counters.exact_seconds += cost
        self.counters.exact_steps += 1

    def _read_exact(
        self, s: ProcessMemory, now: float, est: float, max_stall: float, stall_skipped: set[int]
    ) -> bool:
        """Spend budget on ``s``'s exact figures: steps of its walk, or one
        smaps_rollup read. False when the budget ran out."""
        key = (s.pid, s.create_time)
        state = self._states.get(key)
        c = self.counters
        try:
            if self._uses_pagemap(state):
                walk = state.walk if state is not None else None
                if walk is None:
                    if not self._affordable(min(est, self._config.max_stall_seconds)):
                        return False
                    walk = self._start_walk(  # type: ignore[misc]
                        s.pid, slice_nbytes=self._slice_nbytes, step_limit_seconds=self._config.max_stall_seconds
                    )
                    if walk is None:
                        # No pagemap for it: smaps_rollup, under the stall limit.
                        state = self._state(key, s, now)
                        state.rollup_only = True
                        est = self.estimate(s, state)
                        if est > max_stall:
                            stall_skipped.add(s.pid)
                            c.exact_skipped_stall += 1
                            return True
                        return self._read_rollup(s, state, now, est)
                    state = self._state(key, s, now)
                    state.walk = walk
                    self._walking.add(key)
                    self._charge(walk.cost_seconds)
                return self._step_walk(s, state, walk, now, est)
            state = self._state(key, s, now)
            return self._read_rollup(s, state, now, est)
        except AccessDenied:
            st = self._state(key, s, now)
            st.denied, st.walk = True, None
            self._walking.discard(key)
            c.exact_denied += 1
        except NoSuchProcess:
            self._states.pop(key, None)
            self._publish(key, None)
            self._walking.discard(key)
        return True

    def _state(self, key: tuple[int, float], s: ProcessMemory, now: float) -> _ExactState:
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _ExactState(None, now, s.rss_bytes, tried_at=now)
        return state

    def _step_walk(self, s: ProcessMemory, state: _ExactState, walk: PagemapWalk, now: float, est: float) -> bool:
        max_step = self._config.max_stall_seconds
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
                self._walking.discard((s.pid, s.create_time))
                self.counters.exact_unstable += 1
                return True
            except BaseException:
                self._charge(walk.cost_seconds - spent)
                raise
            self._charge(walk.cost_seconds - spent)
        state.walk = None
        self._walking.discard((s.pid, s.create_time))
        state.tried_at = state.read_at = now
        state.rss_at_read = s.rss_bytes
        if walk.result is not None:
            state.exact = walk.result
            self.counters.exact_reads += 1
        self._publish((s.pid, s.create_time), state)
        return True

    def _read_rollup(self, s: ProcessMemory, state: _ExactState, now: float, est: float) -> bool:
        if not self._affordable(est):
            return False
        exact = self._backend.exact(s.pid)
        self._charge(exact.cost_seconds if exact is not None else 0.0)
        self.counters.exact_reads += 1
        state.exact, state.read_at, state.tried_at, state.rss_at_read = exact, now, now, s.rss_bytes
        self._publish((s.pid, s.create_time), state)
        return True
