"""Linux: exact USS and PSS from /proc/PID/pagemap, walked in bounded slices.

``smaps_rollup`` makes the kernel walk the whole address space while holding
the target's mmap lock, so a process with GiBs of 4 KiB pages cannot mmap or
munmap for tens of ms. ``pagemap`` is read one slice of address space at a
time, and within a slice the lock is held briefly: a plain read takes it for
one 2 MiB step at a time, and ``PAGEMAP_SCAN`` (which holds it for all the
range it is given) is given ranges sized from its own measured time to hold
it at most :data:`SCAN_HOLD_SECONDS`. Slices are sized from the measured time
of the walk's own steps so that one step stays within the caller's limit.

This module is the paced walk: slices, pauses between lock bursts, the
re-read of ``maps`` at the end and the races. Which ranges are walked is
``_pagemap_maps``; the pagemap and kpagecount reads and their counting are
``_pagemap_reads``.

A walk (:class:`PagemapWalk`) is resumable: :meth:`~PagemapWalk.step` reads
one slice and returns, so a caller (the agent) spreads a large process over
several ticks. What is counted, against the kernel's own ``smaps_rollup``:

- USS: pages that are present and mapped exclusively by this process (bits 63
  and 56 of a pagemap entry). The kernel sets bit 56 exactly when smaps counts
  a page as Private_* (its precise mapcount is 1), for anonymous, file-backed,
  /dev/shm, memfd, shared anonymous and THP (per 4 KiB subpage) pages alike.
- PSS (only where ``/proc/kpagecount`` is readable and pagemap shows PFNs,
  which needs CAP_SYS_ADMIN): a page's share is its size divided by its
  mapcount; exclusive pages count whole, pages the kernel does not account
  (the shared zero page: mapcount 0) count nothing.
- Not counted, as in smaps_rollup's Private_* and Pss: hugetlbfs pages (the
  kernel reports them as Private_/Shared_Hugetlb) and swapped-out pages
  (smaps_rollup's Swap/SwapPss). Pages in migration at the instant of the
  read are not present here; smaps counts them private.

Races are answered, never papered over: an exit during the walk raises
NoSuchProcess (or ZombieProcess); mappings made while the walk runs are walked
too, and a process whose mappings keep changing by more than
:data:`CHANGE_TOLERANCE` of the walked resident memory makes the walk
:class:`WalkUnstable` (no figures).
"""

from __future__ import annotations

__all__ = [
    "CHANGE_TOLERANCE",
    "LOCK_BURST_SECONDS",
    "LOCK_GAP_SECONDS",
    "STEP_TARGET_FRACTION",
    "WALK_SECONDS_PER_PAGE",
    "PagemapWalk",
    "WalkUnstable",
    "slice_nbytes_for_stall",
]

import math
import os
import time
from collections.abc import Callable

from ..errors import NoSuchProcess, ZombieProcess
from ._checks import check_int, check_number
from ._oserror import translate as _translate
from ._pagemap_maps import read_spans, subtract, union
from ._pagemap_reads import PAGE_NBYTES, SCAN_HOLD_SECONDS, PageCounter, align_pages
from ._status import PF_KTHREAD
from ._types import ExactMemory

StatReader = Callable[[int], "tuple[str, str, int, int, float, float, int, int]"]
"""``ProcfsBackend.stat``: (name, state, ppid, flags, user_s, system_s, threads, start ticks)."""


# Reading a slice costs about this per page of address space when every page
# is a present 4 KiB page (PAGEMAP_SCAN ~11 ns, pagemap read ~25 ns and
# counting, on a quiet 2-core machine; margin on top). The agent's cost
# estimate of a process not walked yet.
WALK_SECONDS_PER_PAGE = 50e-9
# A walk's first slice assumes this per page, four times the estimate: a step
# of a 4 GiB process measured 60-250 ns per page on a loaded 2-core machine.
# Later slices follow the walk's measured rate.
_FIRST_SLICE_SECONDS_PER_PAGE = 200e-9
STEP_TARGET_FRACTION = 0.5
"""Adaptive slices aim each step at this fraction of the step limit, so a step
that runs twice as slow as the one before it still fits the limit."""
# A slice grows at most this much per step: a fast step over sparse address
# space must not size the next one for dense memory it has not measured.
_SLICE_GROWTH = 2
# Slices are whole multiples of 2 MiB (the kernel's pagemap step).
_SLICE_ALIGN = 2 << 20
_MIN_SLICE_NBYTES = 2 << 20

LOCK_BURST_SECONDS = SCAN_HOLD_SECONDS
"""The longest the walk takes the target's mmap lock again and again without a
pause. A pagemap read drops the lock every 2 MiB, but retakes it within ~2 µs;
a writer waiting for the lock (the target's mmap, munmap, mprotect) is woken
at each drop and needs 5-60 µs to run, and by then this reader has taken the
lock again: the kernel lets a reader take a rwsem a writer waits for ("reader
lock stealing") until that writer has waited 1-2 jiffies (4-8 ms at HZ=250).
Traced on a 4 GiB target (mmap_lock and sched tracepoints): one munmap woken
109 times in an 11 ms wait, the walk holding the lock again 2-3 µs after each
wake. So after this much time of lock-taking calls the walk pauses for
:data:`LOCK_GAP_SECONDS`."""
LOCK_GAP_SECONDS = 100e-6
"""How long the walk pauses between bursts, with the lock free: longer than a
woken writer's 5-60 µs to run on an idle CPU (measured), so it takes the lock.
The pause is a sleep (the monitor's CPU is free too, for a writer on the
same CPU); it is not charged as the walk's cost."""

CHANGE_TOLERANCE = 0.01
"""Mappings may change during a walk by this fraction of the resident memory
walked (or :data:`CHANGE_FLOOR_NBYTES`, whichever is larger) before the figure
is refused: a page mapped or unmapped meanwhile can move the count by at most
the address space that changed."""
CHANGE_FLOOR_NBYTES = 1 << 20
"""The least change always tolerated: 1 MiB (a malloc arena, a thread stack)."""
CATCH_UP_ROUNDS = 2
"""Times a walk reads what was mapped while it ran before it gives up on a
process whose mappings keep changing by more than the tolerance."""


class WalkUnstable(Exception):
    """The target's mappings changed too much during the walk; try again later.

    Internal: the backend falls back to smaps_rollup or the agent retries;
    callers never see it.
    """

    def __init__(self, pid: int, changed_nbytes: int, walked_nbytes: int) -> None:
        self.pid = pid
        self.changed_nbytes = changed_nbytes
        self.walked_nbytes = walked_nbytes
        super().__init__(
            f"pid {pid}: {changed_nbytes:,} bytes of address space were mapped or unmapped "
            f"during a pagemap walk of {walked_nbytes:,} resident bytes"
        )


def slice_nbytes_for_stall(max_stall_seconds: float) -> int:
    """A walk's first slice under a step limit of ``max_stall_seconds``.

    Sized at a pessimistic rate (:data:`_FIRST_SLICE_SECONDS_PER_PAGE`) to
    take :data:`STEP_TARGET_FRACTION` of the limit; a walk given the limit
    (``PagemapWalk(step_limit_seconds=...)``) sizes later slices from its
    measured steps.

    Raises:
        ConfigurationError: ``max_stall_seconds`` is not positive.
    """
    check_number("max_stall_seconds", max_stall_seconds, lambda v: v > 0,
                 "must be > 0 seconds, the longest one walk step may stall its target (default 0.02)")
    pages = max_stall_seconds * STEP_TARGET_FRACTION / _FIRST_SLICE_SECONDS_PER_PAGE
    return align_pages(pages) * PAGE_NBYTES


class PagemapWalk:
    """One walk of one process's pagemap, a slice of address space per :meth:`step`.

    Runs in the monitor, never in the target; copies nothing of the target's
    memory (8 bytes of pagemap per page of address space read). Mappings made
    while the walk runs are found when it re-reads ``maps`` at its end and
    walked too (at most :data:`CATCH_UP_ROUNDS` times); a mapping removed
    meanwhile counts as it was when its slice was read, as smaps_rollup counts
    it when it resumes a walk after yielding the lock.

    Args:
        proc_root: where /proc is mounted.
        pid: the process.
        stat: reads the process's stat (``ProcfsBackend.stat``).
        slice_nbytes: address space of the first step (of every step when
            ``step_limit_seconds`` is None); see :func:`slice_nbytes_for_stall`.
        kpagecount_fd: an open /proc/kpagecount for PSS, or None (no PSS).
        expect_start_ticks: the process's start time (stat field 22) if the
            caller already knows it; a different process under the pid
            raises NoSuchProcess.
        step_limit_seconds: the longest one step should take, or None for
            fixed slices. After each step the next slice is scaled from the
            step's measured time per page to take :data:`STEP_TARGET_FRACTION`
            of it (growing at most 2x a step, never below 2 MiB), so a slow
            or busy machine gets smaller slices.

    Raises:
        NoSuchProcess, ZombieProcess: the process is gone or exited.
        AccessDenied: its pagemap is not readable by this user.
        FileNotFoundError: this kernel has no pagemap (the process exists).
        ConfigurationError: ``slice_nbytes`` is smaller than a page, or
            ``step_limit_seconds`` is not positive.
    """

    def __init__(
        self,
        proc_root: str,
        pid: int,
        *,
        stat: StatReader,
        slice_nbytes: int,
        kpagecount_fd: int | None,
        expect_start_ticks: int | None = None,
        step_limit_seconds: float | None = None,
    ) -> None:
        # First: __del__ closes it, even when a check below raises.
        self._fd: int | None = None
        check_int("PagemapWalk(slice_nbytes)", slice_nbytes, PAGE_NBYTES,
                  f"must be an int of at least a page ({PAGE_NBYTES} bytes); slice_nbytes_for_stall() sizes one")
        if step_limit_seconds is not None:
            check_number("PagemapWalk(step_limit_seconds)", step_limit_seconds, lambda v: v > 0,
                         "must be > 0 seconds, the longest one step should take (or None for fixed slices)")
        self.pid = pid
        self.proc_root = proc_root
        self._stat = stat
        self.slice_pages = slice_nbytes // PAGE_NBYTES
        """Address space (in pages) the next step reads."""
        self.step_limit_seconds = step_limit_seconds
        self.slice_history: list[int] = []
        """Pages of address space each step read (the end's re-read of maps included)."""
        self.gap_seconds = 0.0
        """Time the walk paused between lock bursts (not in ``cost_seconds``)."""
        self.gaps = 0
        self._burst_start = self._last_lock_call = time.perf_counter()
        self.cost_seconds = 0.0
        self.max_step_seconds = 0.0
        self.steps = 0
        self.kernel_thread = False
        # Ranges still to read (sorted), and every range queued so far.
        self._todo: list[tuple[int, int]] = []
        self._walked: list[tuple[int, int]] = []
        self._rounds = 0
        self._counter: PageCounter | None = None
        self._result: ExactMemory | None = None
        self._done = False
        # Loaded before maps is read (in a walk of this very process, the
        # import's own mappings would otherwise appear mid-walk), and not
        # charged to the walk: it happens once per monitor.
        import numpy  # noqa: F401

        t0 = time.perf_counter()
        start = self._start_ticks = self._check_alive(expect_start_ticks)
        if self.kernel_thread:
            # No user memory: nothing to walk, no figures.
            self._done = True
            return
        try:
            self._fd = os.open(f"{proc_root}/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._check_alive(start)  # NoSuchProcess if the process is what is missing
            raise
        except OSError as exc:
            raise _translate(exc, pid) from exc
        try:
            hold = SCAN_HOLD_SECONDS
            if step_limit_seconds is not None:
                hold = min(hold, step_limit_seconds * STEP_TARGET_FRACTION)
            self._counter = PageCounter(pid, self._fd, kpagecount_fd=kpagecount_fd, pace=self._pace, hold_seconds=hold)
            self._walked = read_spans(proc_root, pid)
            self._todo = list(self._walked)
            # pagemap and maps were opened after the first stat read: the same
            # start time now means they belong to that same process.
            self._check_alive(start)
        except BaseException:
            self.close()
            raise
        self._charge(time.perf_counter() - t0)

    # -- reading ---------------------------------------------------------------

    def _check_alive(self, expect_start_ticks: int | None) -> int:
        name, state, _, flags, _, _, _, start = self._stat(self.pid)
        if expect_start_ticks is not None and start != expect_start_ticks:
            # The pid now belongs to another process.
            raise NoSuchProcess(self.pid, name)
        if state in ("Z", "X"):
            raise ZombieProcess(self.pid, name)
        self.kernel_thread = bool(flags & PF_KTHREAD)
        return start

    def _pace(self) -> None:
        """After a call that took the target's lock: pause once the calls since
        the last pause have taken :data:`LOCK_BURST_SECONDS`, so a writer the
        kernel woke gets the lock before this walk takes it again."""
        now = self._last_lock_call = time.perf_counter()
        if now - self._burst_start < LOCK_BURST_SECONDS:
            return
        time.sleep(LOCK_GAP_SECONDS)
        self._burst_start = time.perf_counter()
        self.gap_seconds += self._burst_start - now
        self.gaps += 1

    # -- what the reads found (see PageCounter) ---------------------------------

    @property
    def scan_pages(self) -> int:
        """Address space (in pages) the next PAGEMAP_SCAN call covers at most."""
        return self._counter.scan_pages if self._counter is not None else 0

    @property
    def scan_max_present(self) -> int:
        """Present pages the next PAGEMAP_SCAN call may report (its ``max_pages``)."""
        return self._counter.scan_max_present if self._counter is not None else 0

    @property
    def scan_calls(self) -> int:
        """PAGEMAP_SCAN calls made (0 where the kernel has none)."""
        return self._counter.scan_calls if self._counter is not None else 0

    @property
    def max_scan_seconds(self) -> float:
        """The longest PAGEMAP_SCAN call so far (the longest the walk held the lock at once)."""
        return self._counter.max_scan_seconds if self._counter is not None else 0.0

    def _charge(self, seconds: float, wall_seconds: float | None = None) -> None:
        self.cost_seconds += seconds
        self.max_step_seconds = max(self.max_step_seconds, seconds if wall_seconds is None else wall_seconds)
        self.steps += 1

    # -- the walk --------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the walk has finished (``result`` is set, or there is none)."""
        return self._done

    @property
    def result(self) -> ExactMemory | None:
        """The figures once :attr:`done`; None for a process without user memory."""
        return self._result

    @property
    def remaining_nbytes(self) -> int:
        """Address space not read yet (before the end's re-read of ``maps``)."""
        return sum(e - s for s, e in self._todo)

    def step(self) -> bool:
        """Read the next slice of address space; returns :attr:`done`.

        When nothing is left, the step re-reads ``maps``, queues what was
        mapped meanwhile, and checks the process is the same and alive; the
        walk is done when nothing new was mapped.

        Raises:
            NoSuchProcess, ZombieProcess: it exited (the walk is over, no figures).
            AccessDenied: reading was refused.
            WalkUnstable: mappings kept changing (the walk is over, no figures).
        """
        if self._done:
            return True
        t0 = time.perf_counter()
        if t0 - self._last_lock_call >= LOCK_GAP_SECONDS:
            # Idle since the last lock-taking call for at least a pause (the
            # agent resumes walks tick by tick): a new burst starts here.
            self._burst_start = t0
        gaps_before = self.gap_seconds
        read_pages = 0
        try:
            budget = self.slice_pages
            page = PAGE_NBYTES
            counter = self._counter
            todo = self._todo
            while budget > 0 and todo:
                lo, end = todo[0]
                npages = min(budget, (end - lo) // page)
                hi = lo + npages * page
                counter.read_range(lo, hi)
                budget -= npages
                read_pages += npages
                if hi >= end:
                    todo.pop(0)
                else:
                    todo[0] = (hi, end)
            if not todo:
                self._reconcile()
        except BaseException:
            self._done = True
            self.close()
            raise
        finally:
            took = time.perf_counter() - t0
            # The pauses cost the monitor no CPU: the budget is charged without
            # them, the step's length (and the next slice) includes them.
            self._charge(took - (self.gap_seconds - gaps_before), took)
            self.slice_history.append(read_pages)
        self._adapt_slice(read_pages, took)
        if self._done and self._result is not None:
            self._result = self._result._replace(
                cost_seconds=self.cost_seconds, max_step_seconds=self.max_step_seconds, steps=self.steps
            )
        return self._done

    def _adapt_slice(self, pages: int, seconds: float) -> None:
        """Size the next slice from this step: ``pages`` of address space read in ``seconds``.

        The step's time per page (its fixed costs included, so small slices
        are not underestimated) scaled to :data:`STEP_TARGET_FRACTION` of the
        limit; growth at most 2x, as a fast step may have read sparse memory.
        """
        if self.step_limit_seconds is None or pages <= 0 or self._done:
            return
        target = self.step_limit_seconds * STEP_TARGET_FRACTION
        want = pages * target / seconds if seconds > 0 else math.inf
        self.slice_pages = align_pages(min(want, self.slice_pages * _SLICE_GROWTH))

    def _reconcile(self) -> None:
        added = subtract(read_spans(self.proc_root, self.pid), self._walked)
        self._check_alive(self._start_ticks)
        if added and self._rounds < CATCH_UP_ROUNDS:
            self._rounds += 1
            self._todo = added
            self._walked = union(self._walked, added)
            return
        counter = self._counter
        walked_nbytes = counter.present * PAGE_NBYTES
        added_nbytes = sum(e - s for s, e in added)
        if added_nbytes > max(CHANGE_FLOOR_NBYTES, CHANGE_TOLERANCE * walked_nbytes):
            raise WalkUnstable(self.pid, added_nbytes, walked_nbytes)
        self.close()
        self._done = True
        pss: int | None = None
        if counter.pss_readable:
            pss = counter.exclusive * PAGE_NBYTES + round(counter.pss)
        self._result = ExactMemory(
            uss_bytes=counter.exclusive * PAGE_NBYTES,
            pss_bytes=pss,
            swap_pss_bytes=None,
            cost_seconds=self.cost_seconds,
            source="pagemap",
            max_step_seconds=self.max_step_seconds,
            steps=self.steps,
        )

    def close(self) -> None:
        """Close the pagemap file (a finished or failed walk closes it itself)."""
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def __del__(self) -> None:
        self.close()
