"""Other platforms: the same figures through psutil.

On macOS ``memory_full_info`` is cheap (task_info, no page walk) and on
Windows the private working set is the USS, so there the cheap sample already
carries exact figures. On Linux this backend works too, but walks smaps_rollup
for exact figures like the procfs backend, and costs more per cheap sample.
"""

from __future__ import annotations

__all__ = ["PsutilBackend"]

import os
import sys
import time

import psutil

from ..errors import AccessDenied, NoSuchProcess, ZombieProcess
from ._types import ExactMemory, ProcessMemory

# Where memory_full_info needs no page-table walk, USS comes with every sample.
_CHEAP_USS = sys.platform == "darwin" or sys.platform.startswith("win")


def _translate(exc: psutil.Error, pid: int) -> Exception:
    name = getattr(exc, "name", None)
    if isinstance(exc, psutil.ZombieProcess):
        return ZombieProcess(pid, name)
    if isinstance(exc, psutil.NoSuchProcess):
        return NoSuchProcess(pid, name)
    if isinstance(exc, psutil.AccessDenied):
        return AccessDenied(pid, name)
    return exc


class PsutilBackend:
    """psutil-backed reads with the procfs backend's contract.

    Args:
        count_fds: count open fds (handles on Windows) per sample.
    """

    def __init__(self, *, count_fds: bool = True) -> None:
        self.count_fds = count_fds
        self._cmdline_cache: dict[tuple[int, float], tuple[str, ...]] = {}

    def pids(self) -> list[int]:
        """Every process id now running."""
        return psutil.pids()

    def ppid(self, pid: int) -> int:
        """The parent of ``pid``."""
        try:
            return psutil.Process(pid).ppid()
        except psutil.Error as exc:
            raise _translate(exc, pid) from exc

    def cmdline(self, pid: int) -> tuple[str, ...]:
        """argv of ``pid``, cached per (pid, create time)."""
        try:
            proc = psutil.Process(pid)
            key = (pid, proc.create_time())
            if key not in self._cmdline_cache:
                self._cmdline_cache[key] = tuple(proc.cmdline())
            return self._cmdline_cache[key]
        except psutil.Error as exc:
            raise _translate(exc, pid) from exc

    def cheap(self, pid: int, *, count_fds: bool | None = None) -> ProcessMemory:
        """The figures psutil reads without walking page tables.

        Raises:
            NoSuchProcess, ZombieProcess, AccessDenied: as the procfs backend.
        """
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE:
                    raise ZombieProcess(pid, proc.name())
                mem = proc.memory_info()
                full = proc.memory_full_info() if _CHEAP_USS else None
                cpu = proc.cpu_times()
                create = proc.create_time()
                name = proc.name()
                ppid = proc.ppid()
                threads = proc.num_threads()
                fds: int | None = None
                if self.count_fds if count_fds is None else count_fds:
                    try:
                        fds = proc.num_handles() if sys.platform.startswith("win") else proc.num_fds()
                    except psutil.AccessDenied:
                        fds = None
        except psutil.Error as exc:
            raise _translate(exc, pid) from exc
        key = (pid, create)
        cmdline = self._cmdline_cache.get(key)
        if cmdline is None:
            try:
                cmdline = tuple(proc.cmdline())
            except psutil.Error:
                cmdline = ()
            self._cmdline_cache[key] = cmdline
        shared = getattr(mem, "shared", 0)
        uss = getattr(full, "uss", None) if full is not None else None
        return ProcessMemory(
            pid=pid,
            ppid=ppid,
            name=name,
            cmdline=cmdline,
            create_time=create,
            timestamp=time.time(),
            rss_bytes=mem.rss,
            # Linux's shared = file + shmem, so RSS - shared is the anon part;
            # macOS and Windows do not split RSS, and 0 would be a lie: use RSS.
            anon_bytes=mem.rss - shared if shared else mem.rss,
            file_bytes=shared,
            shmem_bytes=0,
            swap_bytes=getattr(full, "swap", 0) if full is not None else 0,
            peak_rss_bytes=getattr(mem, "peak_wset", mem.rss),
            vms_bytes=mem.vms,
            page_table_bytes=0,
            cpu_user_seconds=cpu.user,
            cpu_system_seconds=cpu.system,
            num_threads=threads,
            num_fds=fds,
            uss_bytes=uss,
            uss_source="platform" if uss is not None else "none",
            exact_age_seconds=0.0 if uss is not None else None,
        )

    def exact(self, pid: int) -> ExactMemory | None:
        """USS (and PSS where the platform has it) from memory_full_info."""
        t0 = time.perf_counter()
        try:
            full = psutil.Process(pid).memory_full_info()
        except psutil.Error as exc:
            raise _translate(exc, pid) from exc
        cost = time.perf_counter() - t0
        # Without a PSS the platform has no sharing accounting; USS is the best share.
        pss = getattr(full, "pss", full.uss)
        return ExactMemory(
            uss_bytes=full.uss, pss_bytes=pss, swap_pss_bytes=getattr(full, "swap", 0),
            cost_seconds=cost,
            # On Linux psutil walks smaps_rollup (or smaps) for these.
            source="smaps_rollup" if sys.platform.startswith("linux") else "platform",
            max_step_seconds=cost,
        )

    def self_rss_bytes(self) -> int:
        """This process's own RSS."""
        return psutil.Process(os.getpid()).memory_info().rss
