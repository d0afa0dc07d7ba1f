"""Linux: the exact figures (USS, PSS) of a process, by the reads that bound
what they cost the target. The :class:`ProcfsBackend`'s half that walks.

``pagemap`` is walked a bounded slice at a time (``_pagemap``);
``smaps_rollup`` (one walk that blocks the target's mmap for its whole
length) is read only where pagemap is not readable or the target's
mappings kept changing during the walk.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_STALL_SECONDS", "ExactReads"]

import os
from typing import Any, Callable

from ._pagemap import PagemapWalk, WalkUnstable, slice_nbytes_for_stall
from ._rollup import read_rollup
from ._types import ExactMemory

# sample(pid, exact=True) walks with the slice the agent's default stall limit gives.
DEFAULT_MAX_STALL_SECONDS = 0.02


class ExactReads:
    """Exact reads of a /proc tree; :class:`~._procfs.ProcfsBackend` is one.

    The backend sets ``proc_root`` (the /proc tree), ``pagemap`` (False once
    pagemap turned out not to be there), ``_kpagecount_fd`` (None until
    opened; -1 where it cannot be) and provides ``stat`` and ``_warn_once``.
    """

    proc_root: str
    pagemap: bool
    _kpagecount_fd: int | None
    stat: Callable[[int], Any]
    _warn_once: Callable[[str, str], None]

    def _kpagecount(self) -> int | None:
        fd = self._kpagecount_fd
        if fd is None:
            try:
                fd = os.open(f"{self.proc_root}/kpagecount", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                fd = -1  # root only: pagemap gives USS, no PSS
            self._kpagecount_fd = fd
        return fd if fd >= 0 else None

    def start_walk(
        self,
        pid: int,
        *,
        slice_nbytes: int,
        expect_start_ticks: int | None = None,
        step_limit_seconds: float | None = None,
    ) -> PagemapWalk | None:
        """A resumable pagemap walk of ``pid`` (see :class:`PagemapWalk`), or None
        where pagemap is off or not there (then :meth:`exact_rollup` is the source).

        A kernel thread's walk is done at once, with no figures. With
        ``step_limit_seconds``, slices after the first are sized from the
        walk's measured steps to stay within it.

        Raises:
            NoSuchProcess, ZombieProcess: the process is gone or exited.
            AccessDenied: another user's process.
            ConfigurationError: ``slice_nbytes`` is smaller than a page, or
                ``step_limit_seconds`` is not positive.
        """
        if not self.pagemap:
            return None
        try:
            return PagemapWalk(
                self.proc_root, pid, stat=self.stat, slice_nbytes=slice_nbytes,
                kpagecount_fd=self._kpagecount(), expect_start_ticks=expect_start_ticks,
                step_limit_seconds=step_limit_seconds,
            )
        except FileNotFoundError:
            # The process exists (the walk checked) but has no pagemap: a
            # kernel without CONFIG_PROC_PAGE_MONITOR, or a fixture tree.
            if self.pagemap:
                self._warn_once("no-pagemap", f"{self.proc_root}/{pid}/pagemap does not exist; "
                                "exact figures come from smaps_rollup (one walk under the target's mmap lock)")
                self.pagemap = False
            return None

    def exact(self, pid: int, *, max_stall_seconds: float = DEFAULT_MAX_STALL_SECONDS) -> ExactMemory | None:
        """USS and PSS of ``pid``: from pagemap in slices where readable, else smaps_rollup.

        The pagemap walk reads one slice of address space at a time (each
        slice sized from the walk's measured steps so that one takes at most
        ``max_stall_seconds``); smaps_rollup is
        the fallback where pagemap is not there, and for a process whose
        mappings kept changing during the walk. ``source`` of the result says
        which. Returns None for a process without user memory (a kernel thread).

        Raises:
            NoSuchProcess, ZombieProcess: the process is gone or exited.
            AccessDenied: another user's process (statm stays readable).
            ConfigurationError: ``max_stall_seconds`` is not positive.
        """
        walk = self.start_walk(pid, slice_nbytes=slice_nbytes_for_stall(max_stall_seconds),
                               step_limit_seconds=max_stall_seconds)
        if walk is not None:
            try:
                while not walk.step():
                    pass
                return walk.result
            except WalkUnstable:
                pass
        return self.exact_rollup(pid)

    def exact_rollup(self, pid: int) -> ExactMemory | None:
        """USS and PSS of ``pid`` from smaps_rollup; one walk of its page tables
        under its mmap lock (the target's mmap/munmap wait for all of it).

        Returns None for a process without user memory (a kernel thread).

        Raises:
            NoSuchProcess, ZombieProcess: the process is gone or exited.
            AccessDenied: another user's process (statm stays readable).
        """
        return read_rollup(self.proc_root, pid, stat=self.stat, warn_once=self._warn_once)
