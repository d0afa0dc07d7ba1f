"""Linux: exact USS and PSS from /proc/PID/pagemap, walked in bounded slices.

``smaps_rollup`` makes the kernel walk the whole address space while holding
the target's mmap lock, so a process with GiBs of 4 KiB pages cannot mmap or
munmap for tens of ms. ``pagemap`` is read one slice of address space at a
time, and within a slice the lock is held briefly: a plain read takes it for
one 2 MiB step at a time, and ``PAGEMAP_SCAN`` (which holds it for all the
range it is given) is given ranges sized from its own measured time to hold
it at most :data:`SCAN_HOLD_SECONDS`. Slices are sized from the measured time
of the walk's own steps so that one step stays within the caller's limit.

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
    "SCAN_HOLD_SECONDS",
    "STEP_TARGET_FRACTION",
    "PagemapWalk",
    "WalkUnstable",
    "hugetlb_devices",
    "slice_nbytes_for_stall",
]

import errno
import fcntl
import math
import os
import re
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tensorferry.errors import NoSuchProcess, ZombieProcess

from ._checks import check_int, check_number
from ._oserror import translate as _translate
from ._status import PF_KTHREAD
from ._types import ExactMemory

if TYPE_CHECKING:
    import numpy as np

# Bits of a pagemap entry (Documentation/admin-guide/mm/pagemap.rst).
_PM_PRESENT_SHIFT = 63
_PM_EXCLUSIVE_SHIFT = 56
# Bits 0-54: the page frame number (zero without CAP_SYS_ADMIN).
_PFN_MASK = (1 << 55) - 1
_ENTRY_NBYTES = 8
_PAGE_NBYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# Addresses from here up are the kernel's on 64-bit Linux ([vsyscall] shows in maps).
_KERNEL_HALF = 1 << 63

StatReader = Callable[[int], "tuple[str, str, int, int, float, float, int, int]"]
"""``ProcfsBackend.stat``: (name, state, ppid, flags, user_s, system_s, threads, start ticks)."""

# PAGEMAP_SCAN (Linux 6.7+): _IOWR('f', 16, struct pm_scan_arg), 12 u64 fields.
_PM_SCAN_ARG = struct.Struct("=12Q")
_PAGEMAP_SCAN = (3 << 30) | (_PM_SCAN_ARG.size << 16) | (ord("f") << 8) | 16
_PAGE_IS_PRESENT = 1 << 3
# struct page_region: start, end, categories.
_REGION_U64S = 3
# Regions one PAGEMAP_SCAN call may return; the kernel's own buffer is 512.
_SCAN_REGIONS = 512
# Present regions closer than this (in pages) are read with one pread: 512
# pages (2 MiB of address space) cost 4 KiB of pagemap, less than a syscall.
_MERGE_GAP_PAGES = 512
# At most this many entries are counted at once, from one buffer reused for
# the whole walk: 512 KiB of pagemap (256 MiB of address space) stays in
# cache for counting and is not allocated and faulted in afresh per read.
_PREAD_PAGES = 1 << 16
# One pread asks for at most this many entries: 16 MiB of address space, ~0.1
# ms of dense pagemap at ~25 ns a page, so the walk can pause between preads
# (see LOCK_BURST_SECONDS) and a burst overruns its bound by one short call.
_PREAD_CALL_PAGES = 1 << 12
# Where a PAGEMAP_SCAN call finds all it walked present, the walk reads on
# without scanning (a scan of dense memory costs ~11 ns a page and finds
# nothing to skip) until a read finds less than this fraction present.
_DENSE_FRACTION = 0.875
# kpagecount is read in runs of sorted PFNs, reading through gaps of up to 8
# PFNs: the kernel spends ~0.2 µs per PFN read, about a pread's own cost
# (measured: 67k shared pages of a forked child, gap 0: 110 ms, 8: 15 ms,
# 64: 19 ms).
_KPC_GAP_PFNS = 8

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
SCAN_HOLD_SECONDS = 250e-6
"""The longest one ``PAGEMAP_SCAN`` call is meant to take. The kernel holds the
target's mmap lock for the whole of one call (a plain pagemap read drops it
every 2 MiB), so each call is bounded from the measured time of the calls
before it. 250 µs is ~90 MiB of present 4 KiB pages at ~11 ns each: an eighth
of the 2 ms a victim may be stalled, leaving room for the monitor to be
descheduled while it holds the lock on a busy machine."""
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
# A call is bounded twice: by the present pages it may report (max_pages; the
# cost of dense memory) and by its range of address space (the cost of page
# tables full of empty entries; ranges without page tables cost next to
# nothing, so the range grows over sparse address space). The first call's
# bounds: 64 MiB (~0.2 ms of present pages at 11 ns); each call's bounds grow
# at most _SCAN_GROWTH times over the one before, as slices do.
_FIRST_SCAN_PAGES = (64 << 20) // _PAGE_NBYTES
_SCAN_GROWTH = 4
# A call that walks or reports fewer pages than this (the end of a slice, a
# small mapping) says little about their cost: the syscall's own ~2 µs dominates.
_SCAN_MIN_SAMPLE_PAGES = 512

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

# start, end, device (major:minor, hex), inode.
_MAPS_RE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S+ [0-9a-f]+ ([0-9a-f]+:[0-9a-f]+) (\d+)", re.M)
# /proc/PID/maps is read in chunks this large: the kernel holds the lock
# for one chunk's worth of lines at a time.
_MAPS_READ_NBYTES = 65536


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


def _align_slice_pages(pages: float) -> int:
    """``pages`` rounded down to whole 2 MiB steps, at least one step."""
    nbytes = int(pages) * _PAGE_NBYTES // _SLICE_ALIGN * _SLICE_ALIGN
    return max(_MIN_SLICE_NBYTES, nbytes) // _PAGE_NBYTES


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
    return _align_slice_pages(pages) * _PAGE_NBYTES


_HUGETLB_DEVS: frozenset[int] | None = None


def hugetlb_devices() -> frozenset[int]:
    """Device numbers of the kernel's internal hugetlbfs mounts (one per huge page size).

    MAP_HUGETLB, SHM_HUGETLB and memfd MFD_HUGETLB memory are files there;
    a memfd made with MFD_HUGETLB (no pages needed) tells each one's device.
    Mounted hugetlbfs filesystems are found in the target's mountinfo.
    """
    global _HUGETLB_DEVS
    if _HUGETLB_DEVS is not None:
        return _HUGETLB_DEVS
    devs: set[int] = set()
    try:
        sizes = os.listdir("/sys/kernel/mm/hugepages")
    except OSError:
        sizes = []
    mfd_hugetlb = getattr(os, "MFD_HUGETLB", 0)
    shift = getattr(os, "MFD_HUGE_SHIFT", 26)
    for entry in sizes:
        m = re.fullmatch(r"hugepages-(\d+)kB", entry)
        if not m or not mfd_hugetlb or not hasattr(os, "memfd_create"):
            continue
        log2 = (int(m.group(1)) * 1024).bit_length() - 1
        try:
            fd = os.memfd_create("tensorferry-probe", mfd_hugetlb | os.MFD_CLOEXEC | (log2 << shift))
        except OSError:
            continue
        try:
            devs.add(os.fstat(fd).st_dev)
        finally:
            os.close(fd)
    _HUGETLB_DEVS = frozenset(devs)
    return _HUGETLB_DEVS


def _mounted_hugetlbfs(proc_root: str, pid: int) -> set[int]:
    """Devices of hugetlbfs filesystems mounted in ``pid``'s mount namespace."""
    out: set[int] = set()
    try:
        with open(f"{proc_root}/{pid}/mountinfo", "rb") as f:
            for line in f:
                # "id parent major:minor root mountpoint opts [tags] - fstype source opts"
                head, sep, tail = line.partition(b" - ")
                if sep and tail.split(b" ", 1)[0] == b"hugetlbfs":
                    major, minor = head.split(b" ")[2].split(b":")
                    out.add(os.makedev(int(major), int(minor)))
    except OSError:
        pass
    return out


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, _MAPS_READ_NBYTES)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of ``ranges`` not in ``minus`` (both merged and sorted)."""
    out: list[tuple[int, int]] = []
    j = 0
    for start, end in ranges:
        while j < len(minus) and minus[j][1] <= start:
            j += 1
        k = j
        while start < end:
            if k >= len(minus) or minus[k][0] >= end:
                out.append((start, end))
                break
            ms, me = minus[k]
            if ms > start:
                out.append((start, ms))
            start = max(start, me)
            k += 1
    return out


def _union(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges of ``a`` and ``b`` together, touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(a + b):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


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
        check_int("PagemapWalk(slice_nbytes)", slice_nbytes, _PAGE_NBYTES,
                  f"must be an int of at least a page ({_PAGE_NBYTES} bytes); slice_nbytes_for_stall() sizes one")
        if step_limit_seconds is not None:
            check_number("PagemapWalk(step_limit_seconds)", step_limit_seconds, lambda v: v > 0,
                         "must be > 0 seconds, the longest one step should take (or None for fixed slices)")
        self.pid = pid
        self.proc_root = proc_root
        self._stat = stat
        self.slice_pages = slice_nbytes // _PAGE_NBYTES
        """Address space (in pages) the next step reads."""
        self.step_limit_seconds = step_limit_seconds
        self.slice_history: list[int] = []
        """Pages of address space each step read (the end's re-read of maps included)."""
        self.scan_pages = _FIRST_SCAN_PAGES
        """Address space (in pages) the next PAGEMAP_SCAN call covers at most."""
        self.scan_max_present = _FIRST_SCAN_PAGES
        """Present pages the next PAGEMAP_SCAN call may report (its ``max_pages``)."""
        self.max_scan_seconds = 0.0
        """The longest PAGEMAP_SCAN call so far (the longest the walk held the lock at once)."""
        self.scan_calls = 0
        self.gap_seconds = 0.0
        """Time the walk paused between lock bursts (not in ``cost_seconds``)."""
        self.gaps = 0
        self._burst_start = self._last_lock_call = time.perf_counter()
        self._kpc = kpagecount_fd
        self.cost_seconds = 0.0
        self.max_step_seconds = 0.0
        self.steps = 0
        self.kernel_thread = False
        # Ranges still to read (sorted), and every range queued so far.
        self._todo: list[tuple[int, int]] = []
        self._walked: list[tuple[int, int]] = []
        self._rounds = 0
        self._present = 0
        self._exclusive = 0
        self._pss = 0.0
        self._pfns_hidden = False
        self._scan_ok = True
        # The last PAGEMAP_SCAN call found all it walked present: read on directly.
        self._dense = False
        self._buf: np.ndarray | None = None
        self._vec: np.ndarray | None = None
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
            self._todo = self._walked = self._read_spans()
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

    def _read_spans(self) -> list[tuple[int, int]]:
        """Address ranges to walk, sorted and merged: every mapping but hugetlbfs ones."""
        try:
            fd = os.open(f"{self.proc_root}/{self.pid}/maps", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise _translate(exc, self.pid) from exc
        try:
            raw = _read_all(fd)
        except OSError as exc:
            raise _translate(exc, self.pid) from exc
        finally:
            os.close(fd)
        hugetlb = hugetlb_devices()
        mounted: set[int] | None = None
        spans: list[tuple[int, int]] = []
        last_start = last_end = -1
        for a, b, dev, inode in _MAPS_RE.findall(raw):
            start, end = int(a, 16), int(b, 16)
            if start >= _KERNEL_HALF:
                # [vsyscall]: the kernel's, in no process's page tables.
                continue
            if inode != b"0" and dev.startswith(b"00:"):
                # A file on an in-memory filesystem: tmpfs, memfd, /dev/shm,
                # or hugetlbfs, whose pages smaps_rollup leaves out of Pss and
                # Private_* (it reports them as *_Hugetlb).
                major, minor = dev.split(b":")
                device = os.makedev(int(major, 16), int(minor, 16))
                if mounted is None:
                    mounted = _mounted_hugetlbfs(self.proc_root, self.pid)
                if device in hugetlb or device in mounted:
                    continue
            if start == last_end:
                last_end = end
            else:
                if last_end >= 0:
                    spans.append((last_start, last_end))
                last_start, last_end = start, end
        if last_end >= 0:
            spans.append((last_start, last_end))
        return spans

    def _pread_entries(self, start: int, npages: int) -> np.ndarray:
        """Entries of ``npages`` (at most :data:`_PREAD_PAGES`) from ``start``,
        in the walk's reused buffer: valid until the next read."""
        import numpy as np

        if self._buf is None:
            self._buf = np.empty(_PREAD_PAGES, dtype=np.uint64)
        view = memoryview(self._buf).cast("B")
        first = start // _PAGE_NBYTES
        done = 0
        while done < npages:
            lo = done * _ENTRY_NBYTES
            want = min(npages - done, _PREAD_CALL_PAGES) * _ENTRY_NBYTES
            try:
                nbytes = os.preadv(self._fd, [view[lo: lo + want]], (first + done) * _ENTRY_NBYTES)  # type: ignore[arg-type]
            except OSError as exc:
                raise _translate(exc, self.pid) from exc
            done += nbytes // _ENTRY_NBYTES
            self._pace()
            if nbytes < want:
                # A short read: the address space ended (the process exited;
                # checked at the end of the walk). Missing entries are pages
                # not present.
                break
        return self._buf[:done]

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

    def _read_pages(self, start: int, npages: int) -> int:
        """Count ``npages`` from ``start``; returns how many were present."""
        present = 0
        while npages > 0:
            k = min(npages, _PREAD_PAGES)
            present += self._count(self._pread_entries(start, k))
            start += k * _PAGE_NBYTES
            npages -= k
        return present

    def _read_range(self, start: int, end: int) -> None:
        """Count the pages of [start, end): PAGEMAP_SCAN a call at a time to
        find the present ones (read directly through dense memory, and where
        the kernel has no PAGEMAP_SCAN)."""
        page = _PAGE_NBYTES
        cursor = start
        while cursor < end:
            if self._dense or not self._scan_ok:
                n = min((end - cursor) // page, _PREAD_PAGES)
                if self._read_pages(cursor, n) < _DENSE_FRACTION * n:
                    self._dense = False
                cursor += n * page
                continue
            scanned = self._scan_call(cursor, end)
            if scanned is None:
                continue  # no PAGEMAP_SCAN: read directly
            walk_end, runs = scanned
            found = sum(n for _, n in runs)
            for run_start, n in runs:
                self._read_pages(run_start, n)
            walked = (walk_end - cursor) // page
            self._dense = walked >= _SCAN_MIN_SAMPLE_PAGES and found == walked
            cursor = walk_end

    def _scan_call(self, start: int, end: int) -> tuple[int, list[tuple[int, int]]] | None:
        """One PAGEMAP_SCAN call from ``start``: where it stopped, and
        ``[(start, npages)]`` holding the present pages it found (runs closer
        than :data:`_MERGE_GAP_PAGES` joined); None if this kernel has no
        PAGEMAP_SCAN."""
        import numpy as np

        if self._vec is None:
            self._vec = np.zeros(_SCAN_REGIONS * _REGION_U64S, dtype=np.uint64)
        vec = self._vec
        page = _PAGE_NBYTES
        # The kernel holds the target's mmap lock until the call has walked
        # [start, call_end), found max_pages present pages or filled the 512
        # regions: these bound the stall.
        call_end = min(end, start + self.scan_pages * page)
        arg = bytearray(_PM_SCAN_ARG.pack(
            _PM_SCAN_ARG.size, 0, start, call_end, 0, vec.ctypes.data, _SCAN_REGIONS,
            self.scan_max_present, 0, _PAGE_IS_PRESENT, 0, _PAGE_IS_PRESENT,
        ))
        t0 = time.perf_counter()
        try:
            n = fcntl.ioctl(self._fd, _PAGEMAP_SCAN, arg, True)  # type: ignore[arg-type]
        except OSError as exc:
            if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                # Before Linux 6.7: read every entry instead.
                self._scan_ok = False
                return None
            raise _translate(exc, self.pid) from exc
        took = time.perf_counter() - t0
        self._pace()
        walk_end = _PM_SCAN_ARG.unpack(arg)[4]
        if walk_end <= start:
            # No progress reported (not seen from Linux 6.7 to 6.18): read
            # the call's range whole rather than skip or repeat it.
            self._adapt_scan(0, 0, took)
            return call_end, [(start, (call_end - start) // page)]
        runs: list[tuple[int, int]] = []
        found = 0
        regions = vec[: n * _REGION_U64S].reshape(-1, _REGION_U64S)
        for s, e in zip(regions[:, 0].tolist(), regions[:, 1].tolist()):
            found += (e - s) // page
            if runs and s - (runs[-1][0] + runs[-1][1] * page) <= _MERGE_GAP_PAGES * page:
                runs[-1] = (runs[-1][0], (e - runs[-1][0]) // page)
            else:
                runs.append((s, (e - s) // page))
        self._adapt_scan((walk_end - start) // page, found, took)
        return walk_end, runs

    def _adapt_scan(self, pages: int, found: int, seconds: float) -> None:
        """Bound the next PAGEMAP_SCAN call from this one: ``pages`` of address
        space walked, ``found`` of them present, in ``seconds``.

        Each bound is scaled so that the call would have taken the hold target
        had it been all that kind of page (an overestimate per page, so a safe
        one), growing at most :data:`_SCAN_GROWTH` times per call.
        """
        self.scan_calls += 1
        self.max_scan_seconds = max(self.max_scan_seconds, seconds)
        hold = SCAN_HOLD_SECONDS
        if self.step_limit_seconds is not None:
            hold = min(hold, self.step_limit_seconds * STEP_TARGET_FRACTION)
        if pages >= min(_SCAN_MIN_SAMPLE_PAGES, self.scan_pages):
            want = pages * hold / seconds if seconds > 0 else math.inf
            self.scan_pages = _align_slice_pages(min(want, self.scan_pages * _SCAN_GROWTH))
        if found >= min(_SCAN_MIN_SAMPLE_PAGES, self.scan_max_present):
            want = found * hold / seconds if seconds > 0 else math.inf
            self.scan_max_present = max(_SCAN_MIN_SAMPLE_PAGES, int(min(want, self.scan_max_present * _SCAN_GROWTH)))

    def _count(self, entries: np.ndarray) -> int:
        """Add ``entries`` to the counts; returns how many were present."""
        import numpy as np

        present = (entries >> np.uint64(_PM_PRESENT_SHIFT)).astype(bool)
        exclusive = present & ((entries >> np.uint64(_PM_EXCLUSIVE_SHIFT)) & np.uint64(1)).astype(bool)
        n_present = int(np.count_nonzero(present))
        n_excl = int(np.count_nonzero(exclusive))
        self._present += n_present
        self._exclusive += n_excl
        if self._kpc is None or self._pfns_hidden or n_present == n_excl:
            return n_present
        pfns = entries[present & ~exclusive] & np.uint64(_PFN_MASK)
        if not pfns.all():
            # PFN 0 is never a mapped page: PFNs are hidden from this user
            # (no CAP_SYS_ADMIN), so there is nothing to look up.
            self._pfns_hidden = True
            return n_present
        self._pss += self._shared_pss(pfns)
        return n_present

    def _shared_pss(self, pfns: np.ndarray) -> float:
        """Sum of page size / mapcount over ``pfns`` (pages not mapped exclusively)."""
        import numpy as np

        unique, inverse = np.unique(pfns, return_inverse=True)
        # Sorted PFNs in runs: one pread per run, reading through gaps up to
        # _KPC_GAP_PFNS (a THP's 512 subpages, pages allocated together).
        breaks = np.flatnonzero(np.diff(unique) > _KPC_GAP_PFNS) + 1
        first = unique[np.concatenate(([0], breaks))]
        last = unique[np.concatenate((breaks - 1, [len(unique) - 1]))]
        lengths = (last - first + np.uint64(1)) * np.uint64(_ENTRY_NBYTES)
        kpc, pread = self._kpc, os.pread
        chunks = []
        for lo, nbytes in zip(first.tolist(), lengths.tolist()):
            try:
                raw = pread(kpc, nbytes, lo * _ENTRY_NBYTES)  # type: ignore[arg-type]
            except OSError:
                raw = b""  # PFNs past the end of memory: not RAM, not counted
            # A short read (past the end of memory) reads as mapcount 0.
            chunks.append(raw if len(raw) == nbytes else raw.ljust(nbytes, b"\0"))
        table = np.frombuffer(b"".join(chunks), dtype=np.uint64)
        # Where each run starts in the table, and each PFN's place in it.
        run_offsets = np.concatenate(([0], np.cumsum(lengths // np.uint64(_ENTRY_NBYTES))[:-1])).astype(np.uint64)
        run_of = np.repeat(np.arange(len(first)), np.diff(np.concatenate(([0], breaks, [len(unique)]))))
        counts = table[run_offsets[run_of] + (unique - first[run_of])]
        per_page = counts[inverse]
        mapped = per_page > 0
        # A page the kernel does not account (mapcount 0: the shared zero
        # page, device memory) is in neither Pss nor Rss of smaps.
        return float(np.sum(_PAGE_NBYTES / per_page[mapped].astype(np.float64)))

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
            page = _PAGE_NBYTES
            todo = self._todo
            while budget > 0 and todo:
                lo, end = todo[0]
                npages = min(budget, (end - lo) // page)
                hi = lo + npages * page
                self._read_range(lo, hi)
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
        self.slice_pages = _align_slice_pages(min(want, self.slice_pages * _SLICE_GROWTH))

    def _reconcile(self) -> None:
        added = _subtract(self._read_spans(), self._walked)
        self._check_alive(self._start_ticks)
        if added and self._rounds < CATCH_UP_ROUNDS:
            self._rounds += 1
            self._todo = added
            self._walked = _union(self._walked, added)
            return
        walked_nbytes = self._present * _PAGE_NBYTES
        added_nbytes = sum(e - s for s, e in added)
        if added_nbytes > max(CHANGE_FLOOR_NBYTES, CHANGE_TOLERANCE * walked_nbytes):
            raise WalkUnstable(self.pid, added_nbytes, walked_nbytes)
        self.close()
        self._done = True
        pss: int | None = None
        if self._kpc is not None and not self._pfns_hidden:
            pss = self._exclusive * _PAGE_NBYTES + round(self._pss)
        self._result = ExactMemory(
            uss_bytes=self._exclusive * _PAGE_NBYTES,
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
