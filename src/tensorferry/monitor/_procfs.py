"""Linux: read process memory from /proc, as bytes, from a configurable root.

Cheap files (``statm``, ``status``, ``stat``) are served from counters the
kernel keeps per process and cost ~10 µs whatever the process's size. Exact
figures (USS, PSS) come from ``pagemap``, walked a bounded slice at a time
(``_pagemap``), and from ``smaps_rollup`` (one walk that blocks the target's
mmap for its whole length) only where pagemap is not readable or the
target's mappings kept changing during the walk. ``smaps`` is never read.
"""

from __future__ import annotations

__all__ = ["ProcfsBackend"]

import math
import os
import re
import time
import warnings
from collections.abc import Iterable

from ..errors import AccessDenied, NoSuchProcess, ZombieProcess
from ._checks import check_number
from ._fds import FdCounter
from ._oserror import translate as _translate
from ._procfs_exact import ExactReads
from ._procfs_many import READ_NBYTES as _READ_NBYTES
from ._procfs_many import ManyReads
from ._status import PF_KTHREAD, status_block_figures, status_figures
from ._types import ExactMemory, ProcessMemory

# A process's title changes rarely but does change (setproctitle); reread it
# this often at first, then twice as long after each read that found it the
# same, up to CMDLINE_REFRESH_MAX_SECONDS (a read costs 10-50 µs: at 1,000
# processes every 10 s, 0.1-0.5% of a core), and not while the process stands
# still (cheap_tick). A retitle that changes comm too (setproctitle does,
# Ray's included) moves stat, and is read at once.
CMDLINE_REFRESH_SECONDS = 10.0
CMDLINE_REFRESH_MAX_SECONDS = 40.0


def _is_kernel_proc(proc_root: str) -> bool:
    """Whether ``proc_root`` is a procfs of this process's pid namespace."""
    try:
        return os.readlink(f"{proc_root}/self") == str(os.getpid())
    except OSError:
        return False


class _Held:
    """What :meth:`ProcfsBackend.cheap_reusing` keeps per process between calls."""

    __slots__ = ("start", "vsize", "rss", "figures", "read_at", "num_fds", "stat", "sample", "reuse_until", "handle")

    def __init__(self, start: int, vsize: bytes, rss: bytes, figures: tuple[int, ...], read_at: float,
                 num_fds: int | None, stat: bytes, sample: ProcessMemory, reuse_until: float,
                 handle: tuple[int, int] | None) -> None:
        self.start = start
        """stat's starttime (ticks since boot): a reused pid has another."""
        self.vsize = vsize
        """stat's VmSize and RSS when status was last read: status is carried while they stand."""
        self.rss = rss
        self.figures = figures
        """status's figures (``_status_figures``)."""
        self.read_at = read_at
        """When status was read (monotonic)."""
        self.num_fds = num_fds
        """The last fd count."""
        self.stat = stat
        """The whole of stat as last read."""
        self.sample = sample
        """The sample built from it."""
        self.reuse_until = reuse_until
        """Until when (monotonic) ``sample`` may be handed out again while stat reads the same bytes:
        status and the command line are then due again."""
        self.handle = handle
        """The held (stat, status) files it was read through (None: opened per read); closed with it."""


def _exec_identity(f: list[bytes]) -> bytes:
    """startstack (stat field 28): every exec gets a new, randomized stack;
    0 where stat hides it (another user's process without ptrace rights)."""
    return f[25]


class ProcfsBackend(ManyReads, ExactReads):
    """Reads processes' figures from a /proc tree (the real one or a fixture).

    :meth:`cheap` opens, reads and closes each file (a one-shot sample holds
    nothing open). :meth:`cheap_reusing` is for a caller that samples the same
    processes again and again (the :class:`~tensorferry.monitor.Agent`): it
    keeps ``stat`` and ``status`` open per process and re-reads them with
    ``pread`` (the kernel regenerates a /proc file read from offset 0), and it
    skips re-reading ``status`` while ``stat`` shows the same RSS and virtual
    size. Such a caller must call :meth:`retain` with the pids it still watches
    (it closes the rest) and :meth:`close` at the end; one caller at a time
    (the agent serializes its ticks).

    Args:
        proc_root: where /proc is mounted; tests point it at a fixture tree.
        count_fds: count open fds per sample: the kernel's count in the size of
            /proc/PID/fd (Linux 6.2+, ~2 µs), else a listdir (~6 µs).
        keep_open: let :meth:`cheap_reusing` keep files open and ``pread``
            them. None: only on a kernel /proc (its ``self`` is this process);
            a fixture's files are plain files that may be replaced.
        carry_status: let :meth:`cheap_reusing` skip status while stat is
            unchanged. None: only on a kernel /proc, where stat's RSS and
            VmSize are status's VmRSS and VmSize (the same counters); a
            fixture tree need not keep that invariant.
        pagemap: take exact figures from pagemap where it is readable
            (False: always smaps_rollup). None: only on a kernel /proc (a
            fixture tree has no pagemap).
    """

    def __init__(
        self,
        proc_root: str = "/proc",
        *,
        count_fds: bool = True,
        keep_open: bool | None = None,
        carry_status: bool | None = None,
        pagemap: bool | None = None,
    ) -> None:
        self.proc_root = proc_root
        # None: not opened yet; -1: not readable here (no PSS from pagemap).
        self._kpagecount_fd: int | None = None
        self.count_fds = count_fds
        if keep_open is None or carry_status is None or pagemap is None:
            kernel = _is_kernel_proc(proc_root)
            keep_open = kernel if keep_open is None else keep_open
            carry_status = kernel if carry_status is None else carry_status
            pagemap = kernel if pagemap is None else pagemap
        self.pagemap = pagemap
        self.keep_open = keep_open
        self.carry_status = carry_status
        self._page_nbytes = os.sysconf("SC_PAGE_SIZE")
        self._clock_ticks = os.sysconf("SC_CLK_TCK")
        self._boot_time: float | None = None
        # (pid, starttime ticks) -> (cmdline, monotonic time read, comm,
        # startstack, seconds until the next read): pid reuse changes the
        # start time; an exec keeps it but gives the process a new comm and a
        # new stack (see _exec_identity).
        self._cmdline_cache: dict[tuple[int, int], tuple[tuple[str, ...], float, bytes, bytes, float]] = {}
        self._warned: set[str] = set()
        # cheap_reusing's state. pid -> (stat fd, status fd): a /proc/PID file
        # stays bound to its process, so a reused pid reads ESRCH, never the
        # newcomer's figures.
        self._handles: dict[int, tuple[int, int]] = {}
        # pid -> _Held: what the last sample read, and the sample itself.
        self._last: dict[int, _Held] = {}
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if soft == resource.RLIM_INFINITY:
                soft = 1 << 20
        except (ImportError, OSError, ValueError):
            soft = 1024
        # Two fds per process, at most a quarter of the fd limit in all; past
        # that, processes are read with open/read/close as cheap() does. The
        # command line, read every CMDLINE_REFRESH_SECONDS, is not held: a
        # third file would leave a third fewer processes held under a limit.
        self.max_open_processes = max(0, min(4096, soft // 8))
        self._fds = FdCounter(proc_root)

    # -- raw reads ---------------------------------------------------------------

    def _read(self, pid: int, name: str) -> bytes:
        path = f"{self.proc_root}/{pid}/{name}"
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                return os.read(fd, _READ_NBYTES)
            finally:
                os.close(fd)
        except OSError as exc:
            err = _translate(exc, pid)
            if isinstance(err, NoSuchProcess):
                self._listing_stale = True  # pids() lists again
            raise err from exc

    def _open_handle(self, pid: int) -> tuple[int, int] | None:
        if len(self._handles) >= self.max_open_processes:
            return None
        base = f"{self.proc_root}/{pid}/"
        try:
            stat_fd = os.open(base + "stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise _translate(exc, pid) from exc
        try:
            status_fd = os.open(base + "status", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            os.close(stat_fd)
            raise _translate(exc, pid) from exc
        handle = self._handles[pid] = (stat_fd, status_fd)
        return handle

    def _close_handle(self, pid: int) -> None:
        handle = self._handles.pop(pid, None)
        if handle is not None:
            for fd in handle:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def retain(self, pids: Iterable[int]) -> None:
        """Close the files and forget the state :meth:`cheap_reusing` keeps, except for ``pids``."""
        keep = pids if isinstance(pids, (set, frozenset, dict)) else set(pids)
        for pid in [p for p in self._handles if p not in keep]:
            self._close_handle(pid)
        for pid in [p for p in self._last if p not in keep]:
            del self._last[pid]

    def close(self) -> None:
        """Close every file :meth:`cheap_reusing` holds open (it reopens them if used again)."""
        for pid in list(self._handles):
            self._close_handle(pid)
        self._last.clear()
        self.close_listing()
        if self._kpagecount_fd is not None and self._kpagecount_fd >= 0:
            os.close(self._kpagecount_fd)
            self._kpagecount_fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def boot_time(self) -> float:
        """Seconds since the epoch when the kernel booted (``btime`` in /proc/stat)."""
        if self._boot_time is None:
            try:
                with open(f"{self.proc_root}/stat", "rb") as f:
                    m = re.search(rb"^btime\s+(\d+)", f.read(), re.M)
            except OSError:
                m = None
            if m is None:
                self._warn_once("btime", f"{self.proc_root}/stat has no btime; create_time counts from 0")
                self._boot_time = 0.0
            else:
                self._boot_time = float(m.group(1))
        return self._boot_time

    # -- listing -----------------------------------------------------------------

    def stat(self, pid: int) -> tuple[str, str, int, int, float, float, int, int]:
        """``(name, state, ppid, flags, user_s, system_s, threads, starttime_ticks)``.

        Raises:
            NoSuchProcess: the process is gone.
        """
        raw = self._read(pid, "stat")
        # comm may hold spaces and parentheses; the last ')' ends it.
        head, _, rest = raw.rpartition(b")")
        if not head:
            raise NoSuchProcess(pid, msg=f"pid {pid}: {self.proc_root}/{pid}/stat is empty")
        name = head.partition(b"(")[2].decode("utf-8", "replace")
        # Field n of proc(5) is f[n - 3] once pid and comm are cut off;
        # starttime is field 22, so nothing past it is split.
        f = rest.split(None, 20)
        tick = self._clock_ticks
        return (
            name, f[0].decode(), int(f[1]), int(f[6]),
            int(f[11]) / tick, int(f[12]) / tick, int(f[17]), int(f[19]),
        )

    def ppid(self, pid: int) -> int:
        """The parent of ``pid``."""
        return self.stat(pid)[2]

    def cmdline(self, pid: int, starttime_ticks: int | None = None) -> tuple[str, ...]:
        """argv of ``pid``; empty for kernel threads.

        With ``starttime_ticks`` (from :meth:`stat`) the answer is cached per
        (pid, start time), read again after :data:`CMDLINE_REFRESH_SECONDS`,
        then after twice as long each time it read the same, up to
        :data:`CMDLINE_REFRESH_MAX_SECONDS`: processes retitle themselves
        after start (Ray's ``ray::Actor``), and pids are reused. Without it,
        the file is read now.
        """
        if starttime_ticks is None:
            return self._read_cmdline(pid)
        cached = self._cmdline_cache.get((pid, starttime_ticks))
        if cached is not None and time.monotonic() - cached[1] <= cached[4]:
            return cached[0]
        return self._cached_cmdline(pid, starttime_ticks, b"", b"", time.monotonic())[0]

    def _cached_cmdline(
        self, pid: int, start: int, comm: bytes, identity: bytes, now: float
    ) -> tuple[tuple[str, ...], float, bytes, bytes, float]:
        """The cache entry of (pid, start): read now unless it is fresh and
        the process has not exec'd since (same comm, same stack)."""
        key = (pid, start)
        cached = self._cmdline_cache.get(key)
        same_image = cached is not None and cached[2] == comm and cached[3] == identity
        if same_image and now - cached[1] <= cached[4]:  # type: ignore[index]
            return cached  # type: ignore[return-value]
        if len(self._cmdline_cache) > 65536:
            # Bounded: a long-lived agent on a busy node sees pids come and go.
            self._cmdline_cache.clear()
        argv = self._read_cmdline(pid)
        wait = CMDLINE_REFRESH_SECONDS
        if cached is not None and cached[0] == argv:
            argv = cached[0]  # the same object: a caller may compare by identity
            if same_image:
                wait = max(wait, min(2 * cached[4], CMDLINE_REFRESH_MAX_SECONDS))
        entry = self._cmdline_cache[key] = (argv, now, comm, identity, wait)
        return entry

    def _read_cmdline(self, pid: int) -> tuple[str, ...]:
        raw = self._read(pid, "cmdline")
        return tuple(a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0") if a)

    # -- samples -----------------------------------------------------------------

    def cheap(self, pid: int, *, count_fds: bool | None = None) -> ProcessMemory:
        """The cheap figures of ``pid``: no page-table walk, ~20 µs.

        Reads stat and status (open, read, close: nothing stays open).

        Args:
            pid: the process.
            count_fds: count its fds (~2 µs on Linux 6.2+, ~6 µs before); None: as configured.

        Raises:
            NoSuchProcess: the process is gone.
            ZombieProcess: it exited and awaits its parent's wait().
            AccessDenied: its files are not readable by this user.
        """
        return self._cheap(pid, self.count_fds if count_fds is None else count_fds, None)

    def cheap_reusing(
        self, pid: int, *, count_fds: bool | None = None, max_status_age_seconds: float = 10.0
    ) -> ProcessMemory:
        """:meth:`cheap` for a caller that samples ``pid`` again and again (the agent).

        Keeps the process's stat and status open (``pread`` from offset 0
        regenerates them; a pid reused by another process reads ESRCH and is
        reopened). Re-reads status (the anon/file/shmem split, swap, peak and
        page-table figures) only when stat's RSS or virtual size changed since
        status was last read, or status is older than ``max_status_age_seconds``
        (0: every call); ``status_age_seconds`` of the sample says how old they
        are. RSS, CPU, threads and state are read every call. Without an fd
        count the last count taken here is reported. Call :meth:`retain` with
        the pids still watched, so the files of the others are closed.

        Raises:
            NoSuchProcess, ZombieProcess, AccessDenied: as :meth:`cheap`.
            ConfigurationError: ``max_status_age_seconds`` is negative.
        """
        check_number("cheap_reusing(max_status_age_seconds)", max_status_age_seconds, lambda v: v >= 0,
                     "must be >= 0 seconds (0 re-reads status every call)")
        return self._cheap(pid, self.count_fds if count_fds is None else count_fds, max_status_age_seconds)

    def _read_stat(self, pid: int) -> tuple[bytes, tuple[int, int] | None]:
        if not self.keep_open:
            return self._read(pid, "stat"), None
        for _ in range(2):
            handle = self._handles.get(pid) or self._open_handle(pid)
            if handle is None:  # at the open-file limit
                return self._read(pid, "stat"), None
            try:
                return os.pread(handle[0], _READ_NBYTES, 0), handle
            except ProcessLookupError:
                # The process these files belong to is gone; the pid may
                # already be another's: reopen (ENOENT there means gone).
                self._close_handle(pid)
                self._last.pop(pid, None)
            except OSError as exc:
                raise _translate(exc, pid) from exc
        raise NoSuchProcess(pid)

    def _status_figures(self, pid: int, status: bytes, kthread: bool) -> tuple[int, ...]:
        """``(rss, anon, file, shmem, swap, peak, vms, page tables)`` in bytes, from status (statm where it lacks them)."""
        figures, missing = status_figures(
            status, kthread=kthread, read_statm=lambda: self._read(pid, "statm"), page_nbytes=self._page_nbytes
        )
        if missing:
            # One warning per kind of gap, not per process per tick: a scan must go on.
            self._warn_once(
                "status:" + ",".join(missing),
                f"{self.proc_root}/{pid}/status has no {', '.join(missing)} line(s) (older kernel?); "
                "reporting 0 for them, anon as statm's RSS - shared and file as shared "
                "(which then includes shmem)",
            )
        return figures

    def _cheap(
        self, pid: int, count_fds: bool, reuse_age: float | None, raw: bytes | None = None,
        handle: tuple[int, int] | None = None,
    ) -> ProcessMemory:
        # This runs for every process whose stat changed since the last tick:
        # plain bytes operations, no file objects, no per-line splitting (see
        # benchmarks/bench_monitor.py). ``raw``/``handle``: stat as cheap_many
        # just read it through its held-open file.
        reuse = reuse_age is not None
        if raw is None:
            if reuse:
                raw, handle = self._read_stat(pid)
            else:
                raw = self._read(pid, "stat")
        close = raw.rfind(b")")
        if close < 0:
            raise NoSuchProcess(pid, msg=f"pid {pid}: {self.proc_root}/{pid}/stat is empty")
        # comm may hold spaces and parentheses; the last ')' ends it. Field n
        # of proc(5) is f[n - 3] once pid and comm are cut off (f[20] vsize,
        # f[21] rss, f[25] startstack); nothing past startstack is split.
        f = raw[close + 1:].split(None, 26)
        comm = raw[raw.find(b"(") + 1:close]
        name = comm.decode("utf-8", "replace")
        state = f[0]
        if state == b"Z" or state == b"X":
            raise ZombieProcess(pid, name)
        kthread = bool(int(f[6]) & PF_KTHREAD)
        start = int(f[19])
        now = time.monotonic()
        last = self._last.get(pid) if reuse else None
        if last is not None and last.start != start:
            last = None
        if (
            last is not None and reuse_age and self.carry_status and last.vsize == f[20] and last.rss == f[21]
            and now - last.read_at <= reuse_age
        ):
            # stat's RSS and VmSize are status's VmRSS and VmSize (the same
            # counters); while both stand still the split is carried over.
            figures, read_at = last.figures, last.read_at
        else:
            if handle is not None:
                try:
                    status = os.pread(handle[1], _READ_NBYTES, 0)
                except OSError as exc:
                    raise _translate(exc, pid) from exc
            else:
                status = self._read(pid, "status")
            figures = status_block_figures(status) or self._status_figures(pid, status, kthread)
            read_at = now
        if count_fds:
            num_fds = self._fds.count(pid)
        else:
            num_fds = last.num_fds if last is not None else None
        if kthread:
            cmdline: tuple[str, ...] = ()
            cmdline_until = math.inf
        else:
            cmdline, cmdline_at, _, _, wait = self._cached_cmdline(pid, start, comm, _exec_identity(f), now)
            cmdline_until = cmdline_at + wait
        tick = self._clock_ticks
        rss, anon, file_, shmem, swap, peak, vms, pte = figures
        # Positional: keyword construction of a 25-field tuple costs ~1 µs more.
        sample = ProcessMemory(
            pid,
            int(f[1]),
            name,
            cmdline,
            (self._boot_time if self._boot_time is not None else self.boot_time()) + start / tick,
            time.time(),
            rss,
            anon,
            file_,
            shmem,
            swap,
            peak,
            vms,
            pte,
            int(f[11]) / tick,
            int(f[12]) / tick,
            int(f[17]),
            num_fds,
            kthread,
            None,
            None,
            "none",
            None,
            None,
            now - read_at,
        )
        if reuse:
            # The same stat bytes mean the same sample until status or the
            # command line are due again (cheap_many); never where status is
            # read every call.
            until = min(read_at + reuse_age, cmdline_until) if reuse_age and self.carry_status else -math.inf
            self._last[pid] = _Held(start, f[20], f[21], figures, read_at, num_fds, raw, sample, until, handle)
        return sample

    def self_rss_bytes(self) -> int:
        """This process's own RSS (the agent's self-cost), from the real /proc."""
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * self._page_nbytes
