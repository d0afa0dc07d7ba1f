"""The reads under a pagemap walk: pagemap entries, found with PAGEMAP_SCAN
and counted, and /proc/kpagecount for the shares of shared pages.

:class:`PageCounter` reads the ranges of address space it is given and adds
up the pages present, those mapped by this process alone (USS) and, where
page frame numbers and /proc/kpagecount are readable (root), each shared
page's share (PSS). Every call that takes the target's mmap lock (a pread of
pagemap, a ``PAGEMAP_SCAN`` call) is followed by the caller's ``pace``
callback: the walk (``_pagemap``) decides when to pause; this module only
keeps each call short.
"""

from __future__ import annotations

__all__ = ["PAGE_NBYTES", "SCAN_HOLD_SECONDS", "PageCounter", "align_pages", "shared_pss"]

import errno
import fcntl
import math
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._oserror import translate as _translate

if TYPE_CHECKING:
    import numpy as np

# Bits of a pagemap entry (Documentation/admin-guide/mm/pagemap.rst).
_PM_PRESENT_SHIFT = 63
_PM_EXCLUSIVE_SHIFT = 56
# Bits 0-54: the page frame number (zero without CAP_SYS_ADMIN).
_PFN_MASK = (1 << 55) - 1
_ENTRY_NBYTES = 8
PAGE_NBYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
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
# (see ``_pagemap.LOCK_BURST_SECONDS``) and a burst overruns its bound by one short call.
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
# The kernel walks pagemap (and takes the target's lock) 2 MiB of address
# space at a time: slices and scan ranges are whole multiples of it.
_STEP_NBYTES = 2 << 20

SCAN_HOLD_SECONDS = 250e-6
"""The longest one ``PAGEMAP_SCAN`` call is meant to take. The kernel holds the
target's mmap lock for the whole of one call (a plain pagemap read drops it
every 2 MiB), so each call is bounded from the measured time of the calls
before it. 250 µs is ~90 MiB of present 4 KiB pages at ~11 ns each: an eighth
of the 2 ms a victim may be stalled, leaving room for the monitor to be
descheduled while it holds the lock on a busy machine."""
# A call is bounded twice: by the present pages it may report (max_pages; the
# cost of dense memory) and by its range of address space (the cost of page
# tables full of empty entries; ranges without page tables cost next to
# nothing, so the range grows over sparse address space). The first call's
# bounds: 64 MiB (~0.2 ms of present pages at 11 ns); each call's bounds grow
# at most _SCAN_GROWTH times over the one before, as slices do.
_FIRST_SCAN_PAGES = (64 << 20) // PAGE_NBYTES
_SCAN_GROWTH = 4
# A call that walks or reports fewer pages than this (the end of a slice, a
# small mapping) says little about their cost: the syscall's own ~2 µs dominates.
_SCAN_MIN_SAMPLE_PAGES = 512


def align_pages(pages: float) -> int:
    """``pages`` rounded down to whole 2 MiB steps (the kernel's pagemap step), at least one step."""
    nbytes = int(pages) * PAGE_NBYTES // _STEP_NBYTES * _STEP_NBYTES
    return max(_STEP_NBYTES, nbytes) // PAGE_NBYTES


class _Buffers(threading.local):
    """One pread buffer and one PAGEMAP_SCAN region buffer per thread, reused
    by every walk: a thread reads for one walk at a time and counts each read
    before the next. Allocating them per walk (512 KiB) made the monitor's RSS
    creep up by tens of MiB as the allocator kept the freed buffers."""

    def __init__(self) -> None:
        import numpy as np

        self.entries = np.empty(_PREAD_PAGES, dtype=np.uint64)
        self.vec = np.zeros(_SCAN_REGIONS * _REGION_U64S, dtype=np.uint64)


_thread_buffers: _Buffers | None = None


def _buffers() -> _Buffers:
    global _thread_buffers
    if _thread_buffers is None:
        # Made on first use: importing the monitor does not import numpy.
        _thread_buffers = _Buffers()
    return _thread_buffers


class PageCounter:
    """Counts the pages of one process's pagemap, a range at a time.

    Runs in the monitor; copies nothing of the target's memory.

    Args:
        pid: the process (for the errors).
        pagemap_fd: its open /proc/PID/pagemap (the caller closes it).
        kpagecount_fd: an open /proc/kpagecount for PSS, or None (no PSS).
        pace: called after every call that took the target's mmap lock.
        hold_seconds: the longest one ``PAGEMAP_SCAN`` call should take
            (:data:`SCAN_HOLD_SECONDS`, or less under a short step limit).
    """

    def __init__(
        self, pid: int, pagemap_fd: int, *, kpagecount_fd: int | None, pace: Callable[[], None], hold_seconds: float
    ) -> None:
        self.pid = pid
        self._fd = pagemap_fd
        self._kpc = kpagecount_fd
        self._pace = pace
        self.hold_seconds = hold_seconds
        self.scan_pages = _FIRST_SCAN_PAGES
        """Address space (in pages) the next PAGEMAP_SCAN call covers at most."""
        self.scan_max_present = _FIRST_SCAN_PAGES
        """Present pages the next PAGEMAP_SCAN call may report (its ``max_pages``)."""
        self.max_scan_seconds = 0.0
        """The longest PAGEMAP_SCAN call so far (the longest the walk held the lock at once)."""
        self.scan_calls = 0
        self.present = 0
        """Pages present so far."""
        self.exclusive = 0
        """Pages present and mapped by this process alone so far (USS, in pages)."""
        self.pss = 0.0
        """Bytes of the shared pages' shares so far (PSS less the exclusive pages)."""
        self.pfns_hidden = False
        """Page frame numbers read as 0 (no CAP_SYS_ADMIN): no PSS."""
        self._scan_ok = True
        # The last PAGEMAP_SCAN call found all it walked present: read on directly.
        self._dense = False

    @property
    def pss_readable(self) -> bool:
        """True when the shares of shared pages could be read (kpagecount open, PFNs shown)."""
        return self._kpc is not None and not self.pfns_hidden

    def read_range(self, start: int, end: int) -> None:
        """Count the pages of [start, end): PAGEMAP_SCAN a call at a time to
        find the present ones (read directly through dense memory, and where
        the kernel has no PAGEMAP_SCAN)."""
        page = PAGE_NBYTES
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

        vec = _buffers().vec
        page = PAGE_NBYTES
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
        hold = self.hold_seconds
        if pages >= min(_SCAN_MIN_SAMPLE_PAGES, self.scan_pages):
            want = pages * hold / seconds if seconds > 0 else math.inf
            self.scan_pages = align_pages(min(want, self.scan_pages * _SCAN_GROWTH))
        if found >= min(_SCAN_MIN_SAMPLE_PAGES, self.scan_max_present):
            want = found * hold / seconds if seconds > 0 else math.inf
            self.scan_max_present = max(_SCAN_MIN_SAMPLE_PAGES, int(min(want, self.scan_max_present * _SCAN_GROWTH)))

    def _read_pages(self, start: int, npages: int) -> int:
        """Count ``npages`` from ``start``; returns how many were present."""
        present = 0
        while npages > 0:
            k = min(npages, _PREAD_PAGES)
            present += self._count(self._pread_entries(start, k))
            start += k * PAGE_NBYTES
            npages -= k
        return present

    def _pread_entries(self, start: int, npages: int) -> np.ndarray:
        """Entries of ``npages`` (at most :data:`_PREAD_PAGES`) from ``start``,
        in this thread's reused buffer: valid until its next read."""

        buf = _buffers().entries
        view = memoryview(buf).cast("B")
        first = start // PAGE_NBYTES
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
        return buf[:done]

    def _count(self, entries: np.ndarray) -> int:
        """Add ``entries`` to the counts; returns how many were present."""
        import numpy as np

        present = (entries >> np.uint64(_PM_PRESENT_SHIFT)).astype(bool)
        exclusive = present & ((entries >> np.uint64(_PM_EXCLUSIVE_SHIFT)) & np.uint64(1)).astype(bool)
        n_present = int(np.count_nonzero(present))
        n_excl = int(np.count_nonzero(exclusive))
        self.present += n_present
        self.exclusive += n_excl
        if self._kpc is None or self.pfns_hidden or n_present == n_excl:
            return n_present
        pfns = entries[present & ~exclusive] & np.uint64(_PFN_MASK)
        if not pfns.all():
            # PFN 0 is never a mapped page: PFNs are hidden from this user
            # (no CAP_SYS_ADMIN), so there is nothing to look up.
            self.pfns_hidden = True
            return n_present
        self.pss += shared_pss(self._kpc, pfns)
        return n_present


def shared_pss(kpagecount_fd: int, pfns: np.ndarray) -> float:
    """Sum of page size / mapcount over ``pfns`` (pages not mapped exclusively),
    from /proc/kpagecount (open in ``kpagecount_fd``); takes no lock of the target."""
    import numpy as np

    unique, inverse = np.unique(pfns, return_inverse=True)
    # Sorted PFNs in runs: one pread per run, reading through gaps up to
    # _KPC_GAP_PFNS (a THP's 512 subpages, pages allocated together).
    breaks = np.flatnonzero(np.diff(unique) > _KPC_GAP_PFNS) + 1
    first = unique[np.concatenate(([0], breaks))]
    last = unique[np.concatenate((breaks - 1, [len(unique) - 1]))]
    lengths = (last - first + np.uint64(1)) * np.uint64(_ENTRY_NBYTES)
    kpc, pread = kpagecount_fd, os.pread
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
    return float(np.sum(PAGE_NBYTES / per_page[mapped].astype(np.float64)))
