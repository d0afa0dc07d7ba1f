"""Which processes the agent watches: :class:`Selection` and the selector that resolves it each tick."""

from __future__ import annotations

__all__ = ["Selection", "Selector"]

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import AccessDenied, ConfigurationError, NoSuchProcess
from ._checks import check_int
from ._sample import Backend
from ._types import ProcessMemory

# The longest a pattern's miss stands before the process's command line is
# read again (rescan_seconds at first, then twice as long each time it read
# the same): a retitle that makes a process match is seen within it.
MAX_MISS_WAIT_SECONDS = 40.0


@dataclass(frozen=True)
class Selection:
    """Which processes the agent watches; the union of what is set."""

    pids: tuple[int, ...] = ()
    """These process ids (a pid that is gone is counted as vanished each tick)."""
    pattern: str | None = None
    """A regular expression searched in each process's command line (argv joined by spaces),
    as it is now: a process chosen by the pattern alone leaves the selection when its command
    line stops matching (the tick after an exec, within 10 s of a retitle)."""
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

    Command-line matches are kept per process (a miss re-matched every
    ``rescan_seconds``: processes retitle), parents per pid (to build the
    tree), and kernel threads seen while scanning are skipped until their pid
    is gone. The agent hands it each tick's samples through
    :meth:`observe_all`: their parents, and their command lines, which the
    backend re-reads after an exec and every few seconds; a match is made
    again whenever a process's command line or start time (a reused pid)
    differs from the one it was made on. While /proc lists the same pids and
    nothing of that changed, a tick's selection is the last one.
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
        # Bumped when a known pid's parent changes (reparenting, a reused
        # pid), which invalidates _tree_cache: (root, version, listed pids,
        # descendants).
        self._ppids_version = 0
        self._tree_cache: tuple[int, int, list[int], set[int]] | None = None
        # pid -> (create_time, None before the first sample; the argv matched; matched; when)
        self._matches: dict[int, tuple[float | None, tuple[str, ...], bool, float]] = {}
        # pid -> seconds a miss stands, where it missed again with the same command line.
        self._miss_waits: dict[int, float] = {}
        self._kthreads: set[int] = set()
        # The last selection and what it was made from: /proc's listing,
        # the parents' version, the first miss due for a re-match.
        self._selected: list[int] = []
        self._selected_from: tuple[list[int], int] | None = None
        self._next_rescan_at = math.inf
        # Chosen by pids, the tree or all: a process that stops matching the
        # pattern stays selected.
        self._chosen_otherwise: set[int] = set()

    def observe(self, sample: ProcessMemory) -> bool:
        """Learn ``sample``'s parent (and check its match); False for a sample
        that must not be reported: a kernel thread that was not named by pid
        (it is skipped from now on), or a process selected by the pattern
        alone whose command line no longer matches it."""
        return bool(self.observe_all([sample]))

    def observe_all(self, samples: list[ProcessMemory]) -> list[ProcessMemory]:
        """:meth:`observe` each sample; returns those to report, in order."""
        out: list[ProcessMemory] = []
        named, ppids, matches, pattern = self.selection.pids, self._ppids, self._matches, self._pattern
        for s in samples:
            pid = s.pid
            if s.kernel_thread and pid not in named:
                if pid not in self._kthreads:
                    self._kthreads.add(pid)
                    self._selected_from = None  # --all leaves it out from now on
                continue
            if ppids.get(pid) != s.ppid:
                ppids[pid] = s.ppid
                self._ppids_version += 1
            if pattern is not None:
                m = matches.get(pid)
                if m is not None and (m[1] is not s.cmdline or m[0] != s.create_time):
                    if m[0] == s.create_time or m[0] is None:
                        if m[1] == s.cmdline:
                            # The same argv read twice (the scan's read, the backend's): the same match.
                            matches[pid] = (s.create_time, s.cmdline, m[2], m[3])
                            m = None
                    if m is not None:
                        # Another process under this pid, or an exec or a retitle: match again.
                        matched = self._match(pattern, pid, s.cmdline)
                        matches[pid] = (s.create_time, s.cmdline, matched, self._clock())
                        if matched != m[2]:
                            self._selected_from = None
                        if not matched and pid not in self._chosen_otherwise and pid not in named:
                            continue
            out.append(s)
        return out

    def _match(self, pattern: re.Pattern[str], pid: int, argv: tuple[str, ...]) -> bool:
        # The agent's own command line holds the pattern: never match itself.
        return pid != self._own_pid and bool(argv) and pattern.search(" ".join(argv)) is not None

    def _miss_wait(self, pid: int) -> float:
        """How long a miss of ``pid`` stands before its command line is read again."""
        return self._miss_waits.get(pid, self._rescan_seconds)

    def _matches_pattern(self, pattern: re.Pattern[str], pid: int, now: float) -> bool:
        cached = self._matches.get(pid)
        if cached is not None and (cached[2] or cached[3] == math.inf or now - cached[3] < self._miss_wait(pid)):
            if not cached[2]:
                self._next_rescan_at = min(self._next_rescan_at, cached[3] + self._miss_wait(pid))
            return cached[2]
        try:
            argv = self._backend.cmdline(pid)
        except (NoSuchProcess, AccessDenied):
            argv = ()
        if not argv:
            # Kernel threads have no command line, and neither has a process
            # caught in an exec (the kernel lets a vfork parent run on before
            # the new image's arguments are in place) or exiting: only the
            # first kind is a lasting miss; the others are looked at next tick.
            try:
                kthread = self._backend.cheap(pid, count_fds=False).kernel_thread
            except (NoSuchProcess, AccessDenied):
                kthread = False
            if not kthread:
                self._next_rescan_at = now
                return False
            self._matches[pid] = (None, argv, False, math.inf)
            return False
        matched = self._match(pattern, pid, argv)
        self._matches[pid] = (None, argv, matched, now)
        if matched or cached is None or cached[1] != argv:
            self._miss_waits.pop(pid, None)
        else:
            # The same command line, missed again: looked at twice as late,
            # up to MAX_MISS_WAIT_SECONDS (a node's other processes: 1,000 of
            # them every 10 s are 100 reads a tick).
            self._miss_waits[pid] = max(self._rescan_seconds, min(2 * self._miss_wait(pid), MAX_MISS_WAIT_SECONDS))
        if not matched:
            self._next_rescan_at = min(self._next_rescan_at, now + self._miss_wait(pid))
        return matched

    def _a_miss_matches(self, pattern: re.Pattern[str], now: float) -> bool:
        """Read again the command lines of the processes the pattern missed
        that are due for it; True if one matches now. Moves the next due time on."""
        self._next_rescan_at = math.inf
        due = []
        for pid, m in self._matches.items():
            if not m[2] and m[3] != math.inf:
                at = m[3] + self._miss_wait(pid)
                if now >= at:
                    due.append(pid)
                else:
                    self._next_rescan_at = min(self._next_rescan_at, at)
        # Every due one is read (its next look moves on), not only up to the first match.
        return any([self._matches_pattern(pattern, pid, now) for pid in due])

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
        """The pids selected now, sorted (the caller must not change the list)."""
        sel = self.selection
        if not (sel.all_processes or sel.pattern or sel.tree_root_pid):
            return sorted(set(sel.pids))
        listed = self._backend.pids()
        now = self._clock() if self._pattern is not None else 0.0
        last = self._selected_from
        if last is not None and last[1] == self._ppids_version and (last[0] is listed or last[0] == listed):
            if now < self._next_rescan_at:
                return self._selected
            if self._pattern is not None and not self._a_miss_matches(self._pattern, now):
                # Misses due for a look were read again and still miss: the
                # same selection (misses come due one by one, most ticks).
                return self._selected
        alive = set(listed)
        # Forget what we learned about pids that are gone (they get reused).
        for cache in (self._ppids, self._matches, self._miss_waits):
            for pid in [p for p in cache if p not in alive]:
                del cache[pid]
        self._kthreads &= alive
        other: set[int] = set(sel.pids)
        if sel.all_processes:
            other.update(p for p in listed if p not in self._kthreads)
        if sel.tree_root_pid:
            other.update(self._descendants(sel.tree_root_pid, listed) & (alive | {sel.tree_root_pid}))
        chosen = set(other)
        pattern = self._pattern
        if pattern is not None:
            self._next_rescan_at = math.inf
            chosen.update(p for p in listed if p not in other and self._matches_pattern(pattern, p, now))
        self._chosen_otherwise = other
        self._selected = sorted(chosen)
        self._selected_from = (listed, self._ppids_version)
        return self._selected
