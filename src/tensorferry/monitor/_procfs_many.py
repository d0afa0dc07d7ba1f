"""Linux: the agent's tick over many processes, :meth:`ProcfsBackend.cheap_many`.

A mixin of :class:`~tensorferry.monitor._procfs.ProcfsBackend` (it uses the
backend's held files, last samples and ``_cheap``): one loop over every
watched process, handing a process's last sample out again while its
``stat`` reads the same bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from ..errors import AccessDenied, NoSuchProcess, ZombieProcess
from ._checks import check_int, check_number
from ._types import ProcessMemory

__all__ = ["ManyReads", "READ_NBYTES"]

# One read covers status (~1.5 KiB) or stat.
READ_NBYTES = 16384
# Where cheap_many puts a new fd count and status age into a sample it hands out again.
_FDS = ProcessMemory._fields.index("num_fds")
_STATUS_AGE = ProcessMemory._fields.index("status_age_seconds")  # the last field


class ManyReads:
    """``cheap_many`` for :class:`~tensorferry.monitor._procfs.ProcfsBackend`."""

    _last: dict[int, Any]
    _handles: dict[int, tuple[int, int]]
    _fds: Any
    count_fds: bool

    def cheap_many(
        self, pids: Iterable[int], *, count_fds: bool | None = None, max_status_age_seconds: float = 10.0,
        fds_every_calls: int = 1, call: int = 0,
    ) -> tuple[list[ProcessMemory], dict[str, int]]:
        """:meth:`cheap_reusing` of every pid in ``pids``: the agent's tick.

        One loop over the processes, with the same figures :meth:`cheap_reusing`
        gives. Most processes of a node stand still between ticks: where a
        process's stat reads the same bytes as at its last sample, nothing
        in that sample can differ (stat holds its state, CPU, threads, RSS
        and VmSize; status is carried while RSS and VmSize stand), so that
        sample is handed out again with a new timestamp and status age, for
        one ``pread``, until status or the command line are due again.

        Args:
            pids: the processes.
            count_fds: count fds at all; None: as configured.
            max_status_age_seconds: as :meth:`cheap_reusing`.
            fds_every_calls: with ``count_fds``, count a process's fds when
                ``(call + pid) % fds_every_calls == 0`` (staggered) and on its
                first sample; the last count is carried in between.
            call: the caller's call number (the agent's tick).

        Returns:
            The samples of the processes that could be read, and how many
            could not: ``{"vanished": n, "zombie": n, "denied": n}``.

        Raises:
            ConfigurationError: ``max_status_age_seconds`` is negative or
                ``fds_every_calls`` is below 1.
        """
        check_number("cheap_many(max_status_age_seconds)", max_status_age_seconds, lambda v: v >= 0,
                     "must be >= 0 seconds (0 re-reads status every call)")
        check_int("cheap_many(fds_every_calls)", fds_every_calls, 1, "must be an int >= 1 (1: count every call)")
        errors = {"vanished": 0, "zombie": 0, "denied": 0}
        out: list[ProcessMemory] = []
        append = out.append
        lasts, handles, pread, monotonic, wall = self._last, self._handles, os.pread, time.monotonic, time.time
        fds, read = self._fds, self._read
        if count_fds is None:
            count_fds = self.count_fds
        new = tuple.__new__
        for pid in pids:
            last = lasts.get(pid)
            count = count_fds and (last is None or (call + pid) % fds_every_calls == 0)
            raw = handle = None
            if last is not None:
                handle = handles.get(pid)
                try:
                    raw = pread(handle[0], READ_NBYTES, 0) if handle is not None else read(pid, "stat")
                except (OSError, NoSuchProcess, AccessDenied):
                    raw = handle = None  # _cheap reopens, or raises what it was
                else:
                    now = monotonic()
                    if raw == last.stat and now <= last.reuse_until:
                        s = last.sample
                        if count:
                            s = new(ProcessMemory, s[:5] + (wall(),) + s[6:_FDS] + (fds.count(pid),)
                                    + s[_FDS + 1:_STATUS_AGE] + (now - last.read_at,))
                            last.sample, last.num_fds = s, s[_FDS]
                        else:
                            s = new(ProcessMemory, s[:5] + (wall(),) + s[6:_STATUS_AGE] + (now - last.read_at,))
                        append(s)
                        continue
            try:
                append(self._cheap(pid, count, max_status_age_seconds, raw, handle))
            except ZombieProcess:
                errors["zombie"] += 1
            except NoSuchProcess:
                errors["vanished"] += 1
            except AccessDenied:
                errors["denied"] += 1
        return out, errors
