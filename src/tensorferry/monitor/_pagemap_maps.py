"""Which address ranges a pagemap walk reads: a process's mappings, as ranges.

``maps`` is parsed into sorted, merged ranges of address space, leaving out
what smaps_rollup leaves out of Pss and Private_* (hugetlbfs pages, found by
device number) and the kernel's own ``[vsyscall]``. A walk re-reads the
maps at its end; :func:`subtract` and :func:`union` say what was mapped
meanwhile and what has been queued in all.
"""

from __future__ import annotations

__all__ = ["hugetlb_devices", "read_spans", "subtract", "union"]

import os
import re

from ._oserror import translate as _translate

# Addresses from here up are the kernel's on 64-bit Linux ([vsyscall] shows in maps).
_KERNEL_HALF = 1 << 63
# start, end, device (major:minor, hex), inode.
_MAPS_RE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S+ [0-9a-f]+ ([0-9a-f]+:[0-9a-f]+) (\d+)", re.M)
# /proc/PID/maps is read in chunks this large: the kernel holds the lock
# for one chunk's worth of lines at a time.
_MAPS_READ_NBYTES = 65536


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


def subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
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


def union(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ranges of ``a`` and ``b`` together, touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(a + b):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def read_spans(proc_root: str, pid: int) -> list[tuple[int, int]]:
    """Address ranges of ``pid`` to walk, sorted and merged: every mapping but hugetlbfs ones.

    Raises:
        NoSuchProcess, AccessDenied: translated from the read of ``maps``.
    """
    try:
        fd = os.open(f"{proc_root}/{pid}/maps", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise _translate(exc, pid) from exc
    try:
        raw = _read_all(fd)
    except OSError as exc:
        raise _translate(exc, pid) from exc
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
                mounted = _mounted_hugetlbfs(proc_root, pid)
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
