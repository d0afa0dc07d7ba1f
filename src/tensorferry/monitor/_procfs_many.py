"""Linux: the agent's tick over many processes, :meth:`ProcfsBackend.cheap_tick`
(and :meth:`ProcfsBackend.cheap_many`, the same with finished records).

A mixin of :class:`~tensorferry.monitor._procfs.ProcfsBackend` (it uses the
backend's held files, last samples and ``_cheap``): one loop over every
watched process, handing a process's last record out again, as the same
object, while its ``stat`` reads the same bytes.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..errors import AccessDenied, NoSuchProcess, ZombieProcess
from ._checks import check_int, check_number
from ._types import restamp
from ._status import status_block_figures
from ._types import ProcessMemory

try:
    from . import _still as _native  # the still processes' loop in C (setup.py builds it where a compiler is)
except ImportError:  # pragma: no cover - a build without a compiler
    _native = None

__all__ = ["LISTING_MAX_AGE_SECONDS", "ManyReads", "PROBE_MAX_PIDS", "READ_NBYTES", "TickReads"]

# One read covers status (~1.5 KiB) or stat.
READ_NBYTES = 16384
# The longest a listing of the kernel's /proc is handed out again (pids):
# while no pid was handed out since it was made, and no watched process went,
# it is still the listing; this bounds what a gap in that reasoning could cost.
LISTING_MAX_AGE_SECONDS = 30.0
# Pids handed out since the last listing that pids() looks at one by one
# (~15 µs each: is it a process, not a thread?) before it lists /proc again
# instead (~3 µs a process listed): a node's threads come and go.
PROBE_MAX_PIDS = 64
_TGID = re.compile(rb"\nTgid:\s*(\d+)")
# Where a record handed out again gets a new fd count.
_FDS = ProcessMemory._fields.index("num_fds")


class TickReads(NamedTuple):
    """What :meth:`ManyReads.cheap_tick` read: records, most of them handed out
    again as they were (their timestamp and status age are brought up to the
    call's time by :func:`~tensorferry.monitor._types.restamp`, by whoever needs the finished record)."""

    samples: list[ProcessMemory]
    """One record per process that could be read, in the order asked."""
    read_ats: list[float | None]
    """Per record: None where it was built by this call (finished as it is);
    else when (monotonic) its status figures were read, for ``_types.restamp``."""
    fresh: list[ProcessMemory]
    """The records this call built: a process that moved (its stat changed),
    or whose status or command line were due again. Only these can carry a
    new parent, command line or start time."""
    errors: dict[str, int]
    """Processes that could not be read: ``{"vanished": n, "zombie": n, "denied": n}``."""
    new: int
    """Processes read for the first time (or under a pid another process had)."""
    wall: float
    """When the call began, seconds since the epoch (the timestamp of the records handed out again)."""
    now: float
    """The same instant, monotonic."""


def _open_loadavg(proc_root: str) -> int | None:
    """/proc/loadavg, open, where ``proc_root`` is the kernel's /proc of this
    process's pid namespace (its ``self`` is us); else None."""
    try:
        if os.readlink(f"{proc_root}/self") != str(os.getpid()):
            return None
        return os.open(f"{proc_root}/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class ManyReads:
    """``cheap_tick`` and ``cheap_many`` for :class:`~tensorferry.monitor._procfs.ProcfsBackend`."""

    _last: dict[int, Any]
    _fds: Any
    count_fds: bool
    carry_status: bool
    proc_root: str
    _read: Any
    _cheap: Any
    # pids()'s listing, and what it was made under: /proc/loadavg's last pid
    # (None: not the kernel's /proc, list every call), when (monotonic), and
    # whether a watched process went since.
    _loadavg_fd: int | None = -1  # -1: not opened yet
    _listed: list[int] | None = None
    _listed_under = b""
    _listed_at = 0.0
    _listing_stale = True
    _listing_kept = False  # the last pids() handed out a kept listing
    # cheap_tick's still processes in C (where it was built); the Python loop does the same.
    use_native = True

    def pids(self) -> list[int]:
        """Every process id now in the tree (threads are not listed).

        On the kernel's /proc the last listing is kept while no watched
        process went (:meth:`cheap_tick` saw it gone) and is handed out
        again, the same list, while no pid was handed out since it was made
        (the last pid in ``/proc/loadavg`` stands: a new process or thread
        moves it). Where at most :data:`PROBE_MAX_PIDS` pids were handed out
        since, those pids are looked at one by one (a process, or a thread?)
        and the processes among them are added. Listing /proc costs ~3 µs a
        process, more than reading each one's stat; it is listed again
        otherwise, and at least every :data:`LISTING_MAX_AGE_SECONDS`. The
        caller must not change the list.
        """
        fd = self._loadavg_fd
        if fd == -1:
            fd = self._loadavg_fd = _open_loadavg(self.proc_root)
        under = b""
        if fd is not None:
            try:
                under = os.pread(fd, 256, 0).rpartition(b" ")[2].strip()
            except OSError:
                under = b""
            now = time.monotonic()
            listed = self._listed
            if (under and listed is not None and not self._listing_stale
                    and now - self._listed_at <= LISTING_MAX_AGE_SECONDS):
                if under == self._listed_under:
                    self._listing_kept = True
                    return listed
                first, last = int(self._listed_under) + 1, int(under)
                if 0 < last - first + 1 <= PROBE_MAX_PIDS:  # no wrap past pid_max either
                    born = [p for p in range(first, last + 1) if self._is_process(p)]
                    if born:
                        listed = self._listed = sorted({*listed, *born})
                    self._listed_under, self._listing_kept = under, True
                    return listed
            self._listed_at = now
        listed = [int(n) for n in os.listdir(self.proc_root) if n.isdigit()]
        self._listed, self._listed_under, self._listing_stale, self._listing_kept = listed, under, False, False
        return listed

    def _is_process(self, pid: int) -> bool:
        """Whether ``pid`` is a live process (its thread group's leader), not a thread."""
        try:
            with open(f"{self.proc_root}/{pid}/status", "rb") as f:
                m = _TGID.search(f.read(1024))
        except OSError:
            return False  # gone already, or never a process's
        return m is not None and int(m.group(1)) == pid

    def close_listing(self) -> None:
        """Forget the listing and close /proc/loadavg (reopened if listed again)."""
        fd, self._loadavg_fd, self._listed = self._loadavg_fd, -1, None
        if fd is not None and fd >= 0:
            os.close(fd)

    def cheap_many(
        self, pids: Iterable[int], *, count_fds: bool | None = None, max_status_age_seconds: float = 10.0,
        fds_every_calls: int = 1, call: int = 0,
    ) -> tuple[list[ProcessMemory], dict[str, int]]:
        """:meth:`cheap_reusing` of every pid in ``pids``: :meth:`cheap_tick`
        with every record finished (timestamped now).

        Returns:
            The samples of the processes that could be read, and how many
            could not: ``{"vanished": n, "zombie": n, "denied": n}``.
        """
        reads = self.cheap_tick(pids, count_fds=count_fds, max_status_age_seconds=max_status_age_seconds,
                                fds_every_calls=fds_every_calls, call=call)
        wall, now = reads.wall, reads.now
        return [restamp(s, r, wall, now) for s, r in zip(reads.samples, reads.read_ats)], reads.errors

    def cheap_tick(
        self, pids: Iterable[int], *, count_fds: bool | None = None, max_status_age_seconds: float = 10.0,
        fds_every_calls: int = 1, call: int = 0,
    ) -> TickReads:
        """:meth:`cheap_reusing` of every pid in ``pids``, the agent's tick, at
        the cost of what moved.

        One loop over the processes, with the same figures :meth:`cheap_reusing`
        gives. Most processes of a node stand still between ticks: where a
        process's stat reads the same bytes as at its last sample, nothing
        in that sample can differ (stat holds its state, CPU, threads, RSS
        and VmSize; status is carried while RSS and VmSize stand), so that
        record is handed out again, the same object, for one ``pread``, until
        status or the command line are due again. Its timestamp and status
        age are those of when it was built; ``_types.restamp`` gives the record
        as of this call (``TickReads.wall``/``now``), so a caller that keeps
        the records but reads few of them pays for those it reads.

        Args:
            pids: the processes.
            count_fds: count fds at all; None: as configured.
            max_status_age_seconds: as :meth:`cheap_reusing`.
            fds_every_calls: with ``count_fds``, count a process's fds when
                ``(call + pid) % fds_every_calls == 0`` (staggered) and on its
                first sample; the last count is carried in between.
            call: the caller's call number (the agent's tick).

        Raises:
            ConfigurationError: ``max_status_age_seconds`` is negative or
                ``fds_every_calls`` is below 1.
        """
        check_number("cheap_many(max_status_age_seconds)", max_status_age_seconds, lambda v: v >= 0,
                     "must be >= 0 seconds (0 re-reads status every call)")
        check_int("cheap_many(fds_every_calls)", fds_every_calls, 1, "must be an int >= 1 (1: count every call)")
        vanished = zombie = denied = new = 0
        pids = pids if isinstance(pids, list) else list(pids)
        n = len(pids)
        out: list[Any] = [None] * n
        read_ats: list[float | None] = [None] * n
        fresh: list[ProcessMemory] = []
        append_fresh = fresh.append
        lasts, pread = self._last, os.pread
        fds, read, cheap, refresh = self._fds, self._read, self._cheap, self._refresh
        if count_fds is None:
            count_fds = self.count_fds
        wall, now = time.time(), time.monotonic()
        if _native is not None and self.use_native:
            # The processes that stand still, in C: their records go into
            # out/read_ats; the others come back here, with stat as read.
            todo: Any = _native.still_many(pids, lasts, now, call, fds_every_calls if count_fds else 0, out, read_ats)
        else:
            todo = ((i, None) for i in range(n))
        for i, raw in todo:
            pid = pids[i]
            last = lasts.get(pid)
            count = count_fds and (last is None or (call + pid) % fds_every_calls == 0)
            handle = None
            if last is not None:
                handle = last.handle
                if raw is None:
                    try:
                        raw = pread(handle[0], READ_NBYTES, 0) if handle is not None else read(pid, "stat")
                    except (OSError, NoSuchProcess, AccessDenied):
                        raw = handle = None  # _cheap reopens, or raises what it was
                if raw is not None and raw == last.stat and (now <= last.reuse_until
                                                             or refresh(pid, last, handle, now, max_status_age_seconds)):
                    s = last.sample
                    if count:
                        k = fds.count(pid)
                        if k != last.num_fds:
                            s = last.sample = tuple.__new__(ProcessMemory, s[:_FDS] + (k,) + s[_FDS + 1:])
                            last.num_fds = k
                    out[i] = s
                    read_ats[i] = last.read_at
                    continue
            try:
                s = cheap(pid, count, max_status_age_seconds, raw, handle)
            except ZombieProcess:
                zombie += 1
                continue
            except NoSuchProcess:
                vanished += 1
                continue
            except AccessDenied:
                denied += 1
                continue
            if last is None or last.start != lasts[pid].start:
                new += 1
            out[i] = s
            append_fresh(s)
        if zombie or vanished or denied:
            kept = [i for i in range(n) if out[i] is not None]
            out, read_ats = [out[i] for i in kept], [read_ats[i] for i in kept]
        if vanished:
            # A process went: the next pids() lists /proc again. Where this
            # tick's pids came from a kept listing, they went before the tick
            # (a listing made now would not hold them): not counted, as a
            # process that is not listed is not.
            self._listing_stale = True
            if self._listing_kept:
                vanished = 0
        return TickReads(out, read_ats, fresh, {"vanished": vanished, "zombie": zombie, "denied": denied}, new, wall, now)

    def _refresh(self, pid: int, last: Any, handle: tuple[int, int] | None, now: float, max_age: float) -> bool:
        """A still process (its stat reads as at its last sample) whose status
        or command line are due: status read again where due, and True where
        it reads as before, so its record stands (its status read now, its
        next due time moved on); False to build it anew (:meth:`_cheap`).

        Its command line is not read again while it stands still (a read
        costs ~50 µs here: the kernel reads the target's memory): a retitle
        runs the process, and setproctitle's (Ray's ``ray::Actor`` too) also
        changes its comm, in stat; it is read again, on its schedule, once
        the process moves."""
        if not (self.carry_status and max_age) or last.sample.kernel_thread:
            return False
        read_at = last.read_at
        if now - read_at > max_age:
            try:
                status = os.pread(handle[1], READ_NBYTES, 0) if handle is not None else self._read(pid, "status")
            except (OSError, NoSuchProcess, AccessDenied):
                return False  # _cheap reads it again, and raises what it is
            if status_block_figures(status) != last.figures:
                return False  # moved, or another layout: _cheap reads it
            read_at = last.read_at = now
        last.reuse_until = read_at + max_age
        return True
