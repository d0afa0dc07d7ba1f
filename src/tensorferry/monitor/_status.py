"""Linux: the figures of ``/proc/PID/status`` (and ``statm`` where status lacks them), parsed from bytes.

The agent reads status for every process every few ticks, so the common
layout is matched in one regular expression; any other layout (an older
kernel, a kernel thread) falls back to a line-by-line parse in which a
missing field becomes 0 and is reported to the caller, who warns once.
"""

from __future__ import annotations

__all__ = ["PF_KTHREAD", "StatusFigures", "parse_status_kb", "status_block_figures", "status_figures"]

import re
from collections.abc import Callable
from typing import NamedTuple

# PF_KTHREAD in include/linux/sched.h: the flag, in the flags field of
# /proc/PID/stat, of a kernel thread (no user memory, no Vm* lines in status).
PF_KTHREAD = 0x00200000
_STATUS_FIELDS = (
    b"VmRSS:", b"RssAnon:", b"RssFile:", b"RssShmem:", b"VmSwap:", b"VmHWM:", b"VmSize:", b"VmPTE:",
)
_STATUS_SET = frozenset(_STATUS_FIELDS)
# The Vm*/Rss* block of status as Linux 4.5+ prints it (task_mem() in
# fs/proc/task_mmu.c): 15 "Name: N kB" lines in this order. Matching the whole
# block checks the layout and captures the 8 figures used in one pass (~2 µs,
# half of splitting it); any other layout falls back to a line-by-line parse.
_VM_BLOCK_RE = re.compile(
    rb"VmPeak:\s+\d+ kB\nVmSize:\s+(\d+) kB\nVmLck:\s+\d+ kB\nVmPin:\s+\d+ kB\n"
    rb"VmHWM:\s+(\d+) kB\nVmRSS:\s+(\d+) kB\nRssAnon:\s+(\d+) kB\nRssFile:\s+(\d+) kB\n"
    rb"RssShmem:\s+(\d+) kB\nVmData:\s+\d+ kB\nVmStk:\s+\d+ kB\nVmExe:\s+\d+ kB\n"
    rb"VmLib:\s+\d+ kB\nVmPTE:\s+(\d+) kB\nVmSwap:\s+(\d+) kB\n"
)


class StatusFigures(NamedTuple):
    """What the fallback parse found, and which lines it had to do without."""

    figures: tuple[int, ...]
    """``(rss, anon, file, shmem, swap, peak, vms, page tables)`` in bytes."""
    missing: tuple[str, ...]
    """Field names status lacked (``RssAnon``, ...); empty for a kernel thread, which has none by nature."""


def status_block_figures(status: bytes) -> tuple[int, ...] | None:
    """``(rss, anon, file, shmem, swap, peak, vms, page tables)`` in bytes, if status has the standard layout."""
    m = _VM_BLOCK_RE.search(status)
    if m is None:
        return None
    vms, peak, rss, anon, file_, shmem, pte, swap = map(int, m.groups())
    return (rss << 10, anon << 10, file_ << 10, shmem << 10, swap << 10, peak << 10, vms << 10, pte << 10)


def parse_status_kb(status: bytes) -> dict[bytes, bytes]:
    """The ``Name: N kB`` lines of status, ``{b"VmRSS:": b"1234"}`` (kB, unconverted)."""
    start = status.find(b"\nVm")
    if start < 0:
        return {}
    out: dict[bytes, bytes] = {}
    for line in status[start:].split(b"\n"):
        parts = line.split()
        if len(parts) == 3 and parts[2] == b"kB":
            out[parts[0]] = parts[1]
    return out


def status_figures(
    status: bytes, *, kthread: bool, read_statm: Callable[[], bytes], page_nbytes: int
) -> StatusFigures:
    """The figures of ``status`` in any layout; ``statm`` fills in RSS and its split where status lacks them.

    Args:
        status: the file's bytes.
        kthread: the process is a kernel thread (no Vm* lines, nothing missing).
        read_statm: reads the process's statm, called only when needed.
        page_nbytes: statm counts pages of this size.
    """
    fast = status_block_figures(status)
    if fast is not None:
        return StatusFigures(fast, ())
    kb = parse_status_kb(status)
    shmem = int(kb.get(b"RssShmem:", 0)) << 10
    file_ = int(kb.get(b"RssFile:", 0)) << 10
    if b"VmRSS:" in kb and b"RssAnon:" in kb:
        rss = int(kb[b"VmRSS:"]) << 10
        anon = int(kb[b"RssAnon:"]) << 10
        vms = int(kb.get(b"VmSize:", 0)) << 10
    else:
        # Kernels before 4.5 lack Rss*, kernel threads lack all Vm*: statm
        # has resident and shared (file + shmem) in pages, and RSS - shared
        # is the anonymous part; shared goes to file, shmem stays 0.
        vms, rss, shared = (int(x) * page_nbytes for x in read_statm().split()[:3])
        anon = rss - shared
        if b"RssFile:" not in kb:
            file_ = shared
    missing: tuple[str, ...] = ()
    if not kthread and not _STATUS_SET <= kb.keys():
        missing = tuple(sorted(f.decode()[:-1] for f in _STATUS_FIELDS if f not in kb))
    figures = (
        rss, anon, file_, shmem, int(kb.get(b"VmSwap:", 0)) << 10, int(kb.get(b"VmHWM:", 0)) << 10,
        vms, int(kb.get(b"VmPTE:", 0)) << 10,
    )
    return StatusFigures(figures, missing)
