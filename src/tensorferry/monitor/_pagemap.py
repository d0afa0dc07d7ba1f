"""Linux: exact USS and PSS from /proc/PID/pagemap, walked in bounded slices.

``smaps_rollup`` makes the kernel walk the whole address space while holding
the target's mmap lock, so a process with GiBs of 4 KiB pages cannot mmap or
munmap for tens of ms. ``pagemap`` is read one slice of address space at a
time: the kernel takes the lock for at most one slice (for a plain read, one
2 MiB step at a time), so the stall is bounded by the slice, not the process.

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
    "PagemapWalk",
    "WalkUnstable",
    "hugetlb_devices",
    "slice_nbytes_for_stall",
]

import errno
import fcntl
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
# At most this many entries per pread (8 MiB of pagemap, 4 GiB of address space).
_MAX_PREAD_PAGES = 1 << 20
# kpagecount is read in runs of sorted PFNs, reading through gaps of up to 8
# PFNs: the kernel spends ~0.2 µs per PFN read, about a pread's own cost
# (measured: 67k shared pages of a forked child, gap 0: 110 ms, 8: 15 ms,
# 64: 19 ms).
_KPC_GAP_PFNS = 8

# Reading a slice costs about this per page of address space when every page
# is a present 4 KiB page (pagemap read, PAGEMAP_SCAN and counting measured
# at 15-30 ns on a loaded 2-core machine; margin on top). The slice is sized
# so that reading it takes at most the stall limit even on a kernel that held
# the target's lock for a whole read (Linux takes it per 2 MiB step). Looking
# up shared pages in kpagecount (~0.2 µs each) takes no lock of the target.
WALK_SECONDS_PER_PAGE = 50e-9
# Slices are whole multiples of 2 MiB (the kernel's pagemap step).
_SLICE_ALIGN = 2 << 20
_MIN_SLICE_NBYTES = 2 << 20

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


def slice_nbytes_for_stall(max_stall_seconds: float) -> int:
    """Address space one slice covers so that reading it takes at most ``max_stall_seconds``.

    Raises:
        ConfigurationError: ``max_stall_seconds`` is not positive.
    """
    check_number("max_stall_seconds", max_stall_seconds, lambda v: v > 0,
                 "must be > 0 seconds, the longest one walk step may stall its target (default 0.02)")
    pages = int(max_stall_seconds / WALK_SECONDS_PER_PAGE)
    nbytes = pages * _PAGE_NBYTES // _SLICE_ALIGN * _SLICE_ALIGN
    return max(_MIN_SLICE_NBYTES, nbytes)


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
        slice_nbytes: address space per step (see :func:`slice_nbytes_for_stall`).
        kpagecount_fd: an open /proc/kpagecount for PSS, or None (no PSS).
        expect_start_ticks: the process's start time (stat field 22) if the
            caller already knows it; a different process under the pid
            raises NoSuchProcess.

    Raises:
        NoSuchProcess, ZombieProcess: the process is gone or exited.
        AccessDenied: its pagemap is not readable by this user.
        FileNotFoundError: this kernel has no pagemap (the process exists).
        ConfigurationError: ``slice_nbytes`` is smaller than a page.
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
    ) -> None:
        check_int("PagemapWalk(slice_nbytes)", slice_nbytes, _PAGE_NBYTES,
                  f"must be an int of at least a page ({_PAGE_NBYTES} bytes); slice_nbytes_for_stall() sizes one")
        self.pid = pid
        self.proc_root = proc_root
        self._stat = stat
        self.slice_pages = slice_nbytes // _PAGE_NBYTES
        self._kpc = kpagecount_fd
        self.cost_seconds = 0.0
        self.max_step_seconds = 0.0
        self.steps = 0
        self.kernel_thread = False
        self._fd: int | None = None
        # Ranges still to read (sorted), and every range queued so far.
        self._todo: list[tuple[int, int]] = []
        self._walked: list[tuple[int, int]] = []
        self._rounds = 0
        self._present = 0
        self._exclusive = 0
        self._pss = 0.0
        self._pfns_hidden = False
        self._scan_ok = True
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
        import numpy as np

        raw = b""
        try:
            raw = os.pread(self._fd, npages * _ENTRY_NBYTES, (start // _PAGE_NBYTES) * _ENTRY_NBYTES)  # type: ignore[arg-type]
        except OSError as exc:
            raise _translate(exc, self.pid) from exc
        # A short read: the address space ended (the process exited; checked
        # at the end of the walk). Missing entries are pages not present.
        return np.frombuffer(raw[: len(raw) // _ENTRY_NBYTES * _ENTRY_NBYTES], dtype=np.uint64)

    def _present_runs(self, start: int, end: int) -> list[tuple[int, int]] | None:
        """``[(start, npages)]`` in [start, end) holding present pages (PAGEMAP_SCAN), or None."""
        if not self._scan_ok:
            return None
        import numpy as np

        vec = np.zeros(_SCAN_REGIONS * _REGION_U64S, dtype=np.uint64)
        runs: list[tuple[int, int]] = []
        page = _PAGE_NBYTES
        cursor = start
        while cursor < end:
            arg = bytearray(_PM_SCAN_ARG.pack(
                _PM_SCAN_ARG.size, 0, cursor, end, 0, vec.ctypes.data, _SCAN_REGIONS, 0,
                0, _PAGE_IS_PRESENT, 0, _PAGE_IS_PRESENT,
            ))
            try:
                n = fcntl.ioctl(self._fd, _PAGEMAP_SCAN, arg, True)  # type: ignore[arg-type]
            except OSError as exc:
                if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                    # Before Linux 6.7: read every entry instead.
                    self._scan_ok = False
                    return None
                raise _translate(exc, self.pid) from exc
            walk_end = _PM_SCAN_ARG.unpack(arg)[4]
            regions = vec[: n * _REGION_U64S].reshape(-1, _REGION_U64S)
            for s, e in zip(regions[:, 0].tolist(), regions[:, 1].tolist()):
                if runs and s - (runs[-1][0] + runs[-1][1] * page) <= _MERGE_GAP_PAGES * page:
                    runs[-1] = (runs[-1][0], (e - runs[-1][0]) // page)
                else:
                    runs.append((s, (e - s) // page))
            if n < _SCAN_REGIONS or walk_end <= cursor:
                break
            cursor = walk_end
        return runs

    def _count(self, entries: np.ndarray) -> None:
        import numpy as np

        present = (entries >> np.uint64(_PM_PRESENT_SHIFT)).astype(bool)
        exclusive = present & ((entries >> np.uint64(_PM_EXCLUSIVE_SHIFT)) & np.uint64(1)).astype(bool)
        n_present = int(np.count_nonzero(present))
        n_excl = int(np.count_nonzero(exclusive))
        self._present += n_present
        self._exclusive += n_excl
        if self._kpc is None or self._pfns_hidden or n_present == n_excl:
            return
        pfns = entries[present & ~exclusive] & np.uint64(_PFN_MASK)
        if not pfns.all():
            # PFN 0 is never a mapped page: PFNs are hidden from this user
            # (no CAP_SYS_ADMIN), so there is nothing to look up.
            self._pfns_hidden = True
            return
        self._pss += self._shared_pss(pfns)

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

    def _charge(self, seconds: float) -> None:
        self.cost_seconds += seconds
        self.max_step_seconds = max(self.max_step_seconds, seconds)
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
        try:
            budget = self.slice_pages
            page = _PAGE_NBYTES
            todo = self._todo
            while budget > 0 and todo:
                lo, end = todo[0]
                npages = min(budget, (end - lo) // page)
                hi = lo + npages * page
                runs = self._present_runs(lo, hi)
                for start, n in runs if runs is not None else [(lo, npages)]:
                    while n > 0:
                        k = min(n, _MAX_PREAD_PAGES)
                        self._count(self._pread_entries(start, k))
                        start += k * page
                        n -= k
                budget -= npages
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
            self._charge(time.perf_counter() - t0)
        if self._done and self._result is not None:
            self._result = self._result._replace(
                cost_seconds=self.cost_seconds, max_step_seconds=self.max_step_seconds, steps=self.steps
            )
        return self._done

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
