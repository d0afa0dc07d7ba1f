"""Linux: read process memory from /proc, as bytes, from a configurable root.

Cheap files (``statm``, ``status``, ``stat``) are served from counters the
kernel keeps per process and cost ~10 µs whatever the process's size. Only
``smaps_rollup`` walks the page tables (and blocks the target's mmap for the
walk); it is read only when asked. ``smaps`` is never read.
"""

from __future__ import annotations

__all__ = ["ProcfsBackend"]

import os
import re
import time
import warnings

from tensorferry.errors import AccessDenied, NoSuchProcess, ZombieProcess

from ._types import ExactMemory, ProcessMemory

# PF_KTHREAD in include/linux/sched.h: the flags field of /proc/PID/stat.
_PF_KTHREAD = 0x00200000
# A process's title changes rarely but does change (setproctitle); reread it this often.
CMDLINE_REFRESH_SECONDS = 10.0
# One read covers status (~1.5 KiB) and stat; smaps_rollup is ~1 KiB.
_READ_NBYTES = 16384

_STATUS_FIELDS = (
    b"VmRSS:", b"RssAnon:", b"RssFile:", b"RssShmem:", b"VmSwap:", b"VmHWM:", b"VmSize:", b"VmPTE:",
)
_STATUS_SET = frozenset(_STATUS_FIELDS)
_ROLLUP_RE = re.compile(rb"^(Pss|Private_Clean|Private_Dirty|SwapPss):\s+(\d+) kB", re.M)


def _parse_status_kb(status: bytes) -> dict[bytes, bytes]:
    """The ``Name: N kB`` lines of status, ``{b"VmRSS:": b"1234"}`` (kB, unconverted)."""
    # The kernel prints the Vm*/Rss* lines as one block (VmPeak .. VmSwap) of
    # "Name: N kB" triples; splitting just that block once is 2-3x faster than
    # a regex or a loop over lines, and this runs for every process every tick.
    start = status.find(b"\nVm")
    if start < 0:
        return {}
    end = status.find(b"\nHugetlbPages:", start)
    if end < 0:
        end = status.find(b"\nThreads:", start)
    t = status[start:end if end > 0 else len(status)].split()
    if len(t) % 3 == 0 and t.count(b"kB") == len(t) // 3:
        # Values stay bytes: converting the 8 used of 15 halves the parse time.
        return dict(zip(t[0::3], t[1::3]))
    out: dict[bytes, bytes] = {}
    for line in status[start:].split(b"\n"):
        parts = line.split()
        if len(parts) == 3 and parts[2] == b"kB":
            out[parts[0]] = parts[1]
    return out


def _translate(exc: OSError, pid: int, name: str | None = None) -> Exception:
    # Where OS errors enter, they become the monitor's errors (psutil's way).
    if isinstance(exc, PermissionError):
        return AccessDenied(pid, name)
    if isinstance(exc, (FileNotFoundError, ProcessLookupError)):
        return NoSuchProcess(pid, name)
    return exc


class ProcfsBackend:
    """Reads processes' figures from a /proc tree (the real one or a fixture).

    Args:
        proc_root: where /proc is mounted; tests point it at a fixture tree.
        count_fds: count open fds (a listdir of /proc/PID/fd, ~5 µs) per sample.
    """

    def __init__(self, proc_root: str = "/proc", *, count_fds: bool = True) -> None:
        self.proc_root = proc_root
        self.count_fds = count_fds
        self._page_nbytes = os.sysconf("SC_PAGE_SIZE")
        self._clock_ticks = os.sysconf("SC_CLK_TCK")
        self._boot_time: float | None = None
        # (pid, starttime ticks) -> cmdline; pid reuse changes the start time.
        self._cmdline_cache: dict[tuple[int, int], tuple[tuple[str, ...], float]] = {}
        self._warned: set[str] = set()

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
            raise _translate(exc, pid) from exc

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

    def pids(self) -> list[int]:
        """Every process id now in the tree (threads are not listed)."""
        return [int(n) for n in os.listdir(self.proc_root) if n.isdigit()]

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
        (pid, start time) for :data:`CMDLINE_REFRESH_SECONDS`: processes retitle
        themselves after start (Ray's ``ray::Actor``), and pids are reused.
        Without it, the file is read now.
        """
        if starttime_ticks is None:
            return self._read_cmdline(pid)
        key = (pid, starttime_ticks)
        now = time.monotonic()
        cached = self._cmdline_cache.get(key)
        if cached is None or now - cached[1] > CMDLINE_REFRESH_SECONDS:
            if len(self._cmdline_cache) > 65536:
                # Bounded: a long-lived agent on a busy node sees pids come and go.
                self._cmdline_cache.clear()
            cached = (self._read_cmdline(pid), now)
            self._cmdline_cache[key] = cached
        return cached[0]

    def _read_cmdline(self, pid: int) -> tuple[str, ...]:
        raw = self._read(pid, "cmdline")
        return tuple(a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0") if a)

    # -- samples -----------------------------------------------------------------

    def cheap(self, pid: int, *, count_fds: bool | None = None) -> ProcessMemory:
        """The cheap figures of ``pid``: no page-table walk, ~30 µs.

        Args:
            pid: the process.
            count_fds: count its fds (a listdir, ~6 µs); None: as configured.

        Raises:
            NoSuchProcess: the process is gone.
            ZombieProcess: it exited and awaits its parent's wait().
            AccessDenied: its files are not readable by this user.
        """
        name, state, ppid, flags, user_s, sys_s, threads, start = self.stat(pid)
        if state in ("Z", "X"):
            raise ZombieProcess(pid, name)
        kthread = bool(flags & _PF_KTHREAD)
        status = self._read(pid, "status")
        kb = _parse_status_kb(status)
        page = self._page_nbytes
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
            statm = self._read(pid, "statm").split()
            vms, rss, shared = (int(x) * page for x in statm[:3])
            anon = rss - shared
            if b"RssFile:" not in kb:
                file_ = shared
        if not kthread and not _STATUS_SET <= kb.keys():
            missing = sorted(f.decode()[:-1] for f in _STATUS_FIELDS if f not in kb)
            # One warning per kind of gap, not per process per tick: a scan must go on.
            self._warn_once(
                "status:" + ",".join(missing),
                f"{self.proc_root}/{pid}/status has no {', '.join(missing)} line(s) (older kernel?); "
                "reporting 0 for them, anon as statm's RSS - shared and file as shared "
                "(which then includes shmem)",
            )
        num_fds: int | None = None
        if self.count_fds if count_fds is None else count_fds:
            try:
                num_fds = len(os.listdir(f"{self.proc_root}/{pid}/fd"))
            except OSError:
                # Another user's fds are unreadable; memory figures still are.
                num_fds = None
        # Positional: keyword construction of a 24-field tuple costs ~1 µs more.
        return ProcessMemory(
            pid,
            ppid,
            name,
            self.cmdline(pid, start) if not kthread else (),
            (self._boot_time if self._boot_time is not None else self.boot_time()) + start / self._clock_ticks,
            time.time(),
            rss,
            anon,
            file_,
            shmem,
            int(kb.get(b"VmSwap:", 0)) << 10,
            int(kb.get(b"VmHWM:", 0)) << 10,
            vms,
            int(kb.get(b"VmPTE:", 0)) << 10,
            user_s,
            sys_s,
            threads,
            num_fds,
            kthread,
        )

    def exact(self, pid: int) -> ExactMemory | None:
        """USS and PSS of ``pid`` from smaps_rollup; walks its page tables.

        Returns None for a process without user memory (a kernel thread: the
        kernel answers ESRCH or nothing).

        Raises:
            NoSuchProcess, ZombieProcess: the process is gone or exited.
            AccessDenied: another user's process (statm stays readable).
        """
        t0 = time.perf_counter()
        path = f"{self.proc_root}/{pid}/smaps_rollup"
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                raw = os.read(fd, _READ_NBYTES)
            finally:
                os.close(fd)
        except ProcessLookupError:
            # ESRCH with the pid still present: no mm (kernel thread or zombie).
            raw = b""
        except FileNotFoundError as exc:
            self.stat(pid)  # raises NoSuchProcess if the process is what is missing
            self._warn_once(
                "no-rollup",
                f"{path} does not exist (kernel < 4.14?); no exact figures "
                "(tensorferry never falls back to smaps, which costs as much per read)",
            )
            return None
        except OSError as exc:
            raise _translate(exc, pid) from exc
        cost = time.perf_counter() - t0
        if not raw:
            name, state, _, flags, *_ = self.stat(pid)
            if state in ("Z", "X"):
                raise ZombieProcess(pid, name)
            if not flags & _PF_KTHREAD:
                self._warn_once("rollup-empty", f"{path} is empty for a user process; no exact figures")
            return None
        kb = {k: int(v) * 1024 for k, v in _ROLLUP_RE.findall(raw)}
        if b"Pss" not in kb:
            self._warn_once("rollup-pss", f"{path} has no Pss line; no exact figures")
            return None
        return ExactMemory(
            uss_bytes=kb.get(b"Private_Clean", 0) + kb.get(b"Private_Dirty", 0),
            pss_bytes=kb[b"Pss"],
            swap_pss_bytes=kb.get(b"SwapPss", 0),
            cost_seconds=cost,
        )

    def self_rss_bytes(self) -> int:
        """This process's own RSS (the agent's self-cost), from the real /proc."""
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * self._page_nbytes
