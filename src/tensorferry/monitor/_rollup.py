"""Linux: USS and PSS from ``/proc/PID/smaps_rollup``, the fallback where pagemap is not readable.

One read walks all of the target's page tables under its mmap lock (its
mmap/munmap wait for all of it), so the agent reads it only under its stall
limit. ``smaps`` (a line per mapping, as costly per read) is never read.
"""

from __future__ import annotations

__all__ = ["read_rollup"]

import os
import re
import time
from collections.abc import Callable

from ..errors import ZombieProcess
from ._oserror import translate as _translate
from ._status import PF_KTHREAD
from ._types import ExactMemory

_ROLLUP_RE = re.compile(rb"^(Pss|Private_Clean|Private_Dirty|SwapPss):\s+(\d+) kB", re.M)
# smaps_rollup is ~1 KiB.
_READ_NBYTES = 16384


def read_rollup(
    proc_root: str,
    pid: int,
    *,
    stat: Callable[[int], tuple[str, str, int, int, float, float, int, int]],
    warn_once: Callable[[str, str], None],
) -> ExactMemory | None:
    """USS and PSS of ``pid`` from smaps_rollup, with the read's cost.

    Args:
        proc_root: where /proc is mounted.
        pid: the process.
        stat: the backend's ``stat`` (tells a gone process, a zombie and a
            kernel thread apart when the file is missing or empty).
        warn_once: ``(key, message)``: warns once per key, for a kernel that
            lacks the file or a line.

    Returns:
        None for a process without user memory (a kernel thread: the kernel
        answers ESRCH or nothing) or where the kernel has no figures.

    Raises:
        NoSuchProcess, ZombieProcess: the process is gone or exited.
        AccessDenied: another user's process (statm stays readable).
    """

    t0 = time.perf_counter()
    path = f"{proc_root}/{pid}/smaps_rollup"
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = os.read(fd, _READ_NBYTES)
        finally:
            os.close(fd)
    except ProcessLookupError:
        # ESRCH with the pid still present: no mm (kernel thread or zombie).
        raw = b""
    except FileNotFoundError:
        stat(pid)  # raises NoSuchProcess if the process is what is missing
        warn_once(
            "no-rollup",
            f"{path} does not exist (kernel < 4.14?); no exact figures "
            "(tensorferry never falls back to smaps, which costs as much per read)",
        )
        return None
    except OSError as exc:
        raise _translate(exc, pid) from exc
    cost = time.perf_counter() - t0
    if not raw:
        name, state, _, flags, *_ = stat(pid)
        if state in ("Z", "X"):
            raise ZombieProcess(pid, name)
        if not flags & PF_KTHREAD:
            warn_once("rollup-empty", f"{path} is empty for a user process; no exact figures")
        return None
    kb = {k: int(v) * 1024 for k, v in _ROLLUP_RE.findall(raw)}
    if b"Pss" not in kb:
        warn_once("rollup-pss", f"{path} has no Pss line; no exact figures")
        return None
    return ExactMemory(
        uss_bytes=kb.get(b"Private_Clean", 0) + kb.get(b"Private_Dirty", 0),
        pss_bytes=kb[b"Pss"],
        swap_pss_bytes=kb.get(b"SwapPss", 0),
        cost_seconds=cost,
        source="smaps_rollup",
        max_step_seconds=cost,
    )
