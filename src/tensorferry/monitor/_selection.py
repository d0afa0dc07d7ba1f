"""Which processes the agent watches: :class:`Selection` and the selector that resolves it each tick."""

from __future__ import annotations

__all__ = ["Selection", "Selector"]

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import AccessDenied, ConfigurationError, NoSuchProcess
from ._checks import check_int
from ._sample import Backend
from ._types import ProcessMemory


@dataclass(frozen=True)
class Selection:
    """Which processes the agent watches; the union of what is set."""

    pids: tuple[int, ...] = ()
    """These process ids (a pid that is gone is counted as vanished each tick)."""
    pattern: str | None = None
    """A regular expression searched in each process's command line (argv joined by spaces)."""
    tree_root_pid: int | None = None
    """This process and all its descendants (a raylet's workers, a trainer's ranks)."""
    all_processes: bool = False
    """Every process on the node (kernel threads excluded: they hold no user memory)."""

    def __post_init__(self) -> None:
        for pid in self.pids:
            check_int("Selection(pids)", pid, 1, "each pid must be a positive int (a process id)")
        if self.tree_root_pid is not None:
            check_int("Selection(tree_root_pid)", self.tree_root_pid, 1,
                      "must be a positive int (the root process's id) or None")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except (re.error, TypeError) as exc:
                raise ConfigurationError(
                    f"Selection(pattern={self.pattern!r}) is not a valid regular expression ({exc}); "
                    "escape special characters with re.escape() to match them literally"
                ) from exc

    @property
    def is_empty(self) -> bool:
        """True when nothing is selected."""
        return not (self.pids or self.pattern or self.tree_root_pid or self.all_processes)


class Selector:
    """Resolves a :class:`Selection` to pids, tick after tick, with what it learned cached.

    Command-line matches are kept per pid (a miss re-matched every
    ``rescan_seconds``: processes retitle), parents per pid (to build the
    tree), and kernel threads seen while scanning are skipped until their pid
    is gone. The agent tells it each sample's parent through :meth:`observe`.
    """

    def __init__(
        self, selection: Selection, backend: Backend, *, clock: Callable[[], float], rescan_seconds: float
    ) -> None:
        self.selection = selection
        self._backend = backend
        self._clock = clock
        self._rescan_seconds = rescan_seconds
        self._pattern = re.compile(selection.pattern) if selection.pattern else None
        self._own_pid = os.getpid()
        self._ppids: dict[int, int] = {}
        # Bumped when a known pid's parent changes (reparenting), which
        # invalidates _tree_cache: (root, version, listed pids, descendants).
        self._ppids_version = 0
        self._tree_cache: tuple[int, int, list[int], set[int]] | None = None
        self._matches: dict[int, tuple[bool, float]] = {}
        self._kthreads: set[int] = set()

    def observe(self, sample: ProcessMemory) -> bool:
        """Learn ``sample``'s parent; False for a kernel thread that was not
        named by pid (it is skipped from now on and must not be reported)."""
        pid = sample.pid
        if sample.kernel_thread and pid not in self.selection.pids:
            self._kthreads.add(pid)
            return False
        if self._ppids.get(pid) != sample.ppid:
            self._ppids[pid] = sample.ppid
            self._ppids_version += 1
        return True

    def _matches_pattern(self, pattern: re.Pattern[str], pid: int, now: float) -> bool:
        cached = self._matches.get(pid)
        if cached is not None and (cached[0] or now - cached[1] < self._rescan_seconds):
            return cached[0]
        try:
            argv = self._backend.cmdline(pid)
        except (NoSuchProcess, AccessDenied):
            argv = ()
        matched = bool(argv) and pattern.search(" ".join(argv)) is not None
        self._matches[pid] = (matched, now)
        return matched

    def _descendants(self, root: int, listed: list[int]) -> set[int]:
        cached = self._tree_cache
        if cached is not None and cached[0] == root and cached[1] == self._ppids_version and cached[2] == listed:
            # Same pids, no parent changed: the same tree (rebuilding it costs
            # ~0.3 ms a tick on a node of a few hundred processes).
            return cached[3]
        for pid in listed:
            if pid not in self._ppids:
                try:
                    self._ppids[pid] = self._backend.ppid(pid)
                except (NoSuchProcess, AccessDenied):
                    continue
        children: dict[int, list[int]] = {}
        for pid, ppid in self._ppids.items():
            children.setdefault(ppid, []).append(pid)
        out = {root}
        stack = [root]
        while stack:
            for child in children.get(stack.pop(), ()):
                if child not in out:
                    out.add(child)
                    stack.append(child)
        self._tree_cache = (root, self._ppids_version, listed, out)
        return out

    def select(self) -> list[int]:
        """The pids selected now, sorted."""
        sel = self.selection
        chosen: set[int] = set(sel.pids)
        if sel.all_processes or sel.pattern or sel.tree_root_pid:
            listed = self._backend.pids()
            alive = set(listed)
            # Forget what we learned about pids that are gone (they get reused).
            for cache in (self._ppids, self._matches):
                for pid in [p for p in cache if p not in alive]:
                    del cache[pid]
            self._kthreads &= alive
            if sel.all_processes:
                chosen.update(p for p in listed if p not in self._kthreads)
            pattern = self._pattern
            if pattern is not None:
                now = self._clock()
                # The agent's own command line holds the pattern: never match itself.
                chosen.update(
                    p for p in listed if p != self._own_pid and self._matches_pattern(pattern, p, now)
                )
            if sel.tree_root_pid:
                chosen.update(self._descendants(sel.tree_root_pid, listed) & (alive | {sel.tree_root_pid}))
        return sorted(chosen)
