"""What a tick yields: :class:`Snapshot`, and the agent's own cost in :class:`AgentStats`."""

from __future__ import annotations

__all__ = ["AgentStats", "PendingSamples", "Snapshot"]

import operator
from typing import NamedTuple

from ._cgroup import CgroupMemory
from ._checks import check_int
from ._group import GroupMemory, group_key, group_samples
from ._names import NameSource
from ._sample import with_exact
from ._types import ExactMemory, ProcessMemory, restamp

_RSS = operator.itemgetter(ProcessMemory._fields.index("rss_bytes"))
_PID, _CREATE_TIME, _USS_SOURCE = (ProcessMemory._fields.index(f) for f in ("pid", "create_time", "uss_source"))


class PendingSamples(NamedTuple):
    """A tick's records before they are finished: what :class:`Snapshot`
    needs to make its ``samples`` when they are first read. Everything in it
    stays as it is after the tick (the records are immutable, the dicts are
    made anew when they change), so a snapshot read late reads its own tick."""

    samples: list[ProcessMemory]
    """The backend's records (``ProcfsBackend.cheap_tick``), in pid order."""
    read_ats: list[float | None]
    """Per record: when its status was read, for a record handed out again; None for one built at the tick."""
    exact: dict[tuple[int, float], tuple[ExactMemory, float]]
    """(pid, create_time) -> exact figures and when read (the agent's clock)."""
    wall: float
    """The tick's time, seconds since the epoch."""
    now: float
    """The same, monotonic (status ages)."""
    exact_now: float
    """The same, on the agent's clock (exact ages)."""

    def finish(self) -> tuple[ProcessMemory, ...]:
        """The records as the tick saw them, exact figures attached, largest RSS first."""
        wall, now, exact, exact_now = self.wall, self.now, self.exact, self.exact_now
        out = [restamp(s, r, wall, now) for s, r in zip(self.samples, self.read_ats)]
        if exact:
            get = exact.get
            for i, s in enumerate(out):
                e = get((s[_PID], s[_CREATE_TIME])) if s[_USS_SOURCE] == "none" else None
                if e is not None:
                    out[i] = with_exact(s, e[0], exact_now - e[1])
        out.sort(key=_RSS, reverse=True)
        return tuple(out)


class AgentStats(NamedTuple):
    """What the agent itself has cost, since it was made."""

    ticks: int
    """Ticks taken."""
    samples: int
    """Cheap samples taken."""
    sample_seconds: float
    """Wall time spent in cheap samples."""
    exact_reads: int
    """Exact figures taken (finished pagemap walks and smaps_rollup reads)."""
    exact_seconds: float
    """Wall time spent walking, all steps of all walks (finished or not)."""
    exact_skipped_stall: int
    """smaps_rollup reads not done because the walk would stall the target too long."""
    exact_denied: int
    """Exact reads refused (another user's process)."""
    errors: dict[str, int]
    """Processes skipped, by reason: ``vanished``, ``zombie``, ``denied``."""
    cpu_seconds: float
    """CPU time of this process (the agent, its server, Python) since the agent was made."""
    rss_bytes: int
    """This process's RSS now."""
    budget_tokens_seconds: float
    """Exact-read budget left in the bucket (may be negative after an expensive read)."""
    exact_steps: int = 0
    """Steps taken (a pagemap slice, or a whole smaps_rollup read)."""
    exact_unstable: int = 0
    """pagemap walks given up because the target's mappings kept changing (retried later)."""
    walks_in_progress: int = 0
    """pagemap walks started and not finished yet."""
    tick_seconds: float = 0.0
    """Wall time of all ticks (sampling, exact steps, grouping left out: groups are built when read)."""
    last_tick_seconds: float = 0.0
    """Wall time of the last tick."""


class Snapshot:
    """One tick's view of the selected processes (read-only).

    ``groups`` is computed on first use and kept: a tick nobody reads (most of
    them, at a 15 s scrape interval and 1 Hz ticks) never pays for grouping.
    """

    __slots__ = ("timestamp", "_samples", "_pending", "cgroups", "errors", "stall_skipped_pids", "stats",
                 "_max_groups", "_names", "_max_name_chars", "_groups")

    timestamp: float
    """When the tick ran, seconds since the epoch."""
    cgroups: tuple[CgroupMemory, ...]
    """Memory cgroups of the samples (empty unless AgentConfig.cgroups)."""
    errors: dict[str, int]
    """Processes skipped this tick, by reason."""
    stall_skipped_pids: frozenset[int]
    """Processes whose exact read the stall limit forbids."""
    stats: AgentStats
    """The agent's own cost so far."""

    def __init__(
        self,
        *,
        timestamp: float,
        samples: tuple[ProcessMemory, ...] | PendingSamples,
        cgroups: tuple[CgroupMemory, ...] = (),
        errors: dict[str, int],
        stall_skipped_pids: frozenset[int] = frozenset(),
        stats: AgentStats,
        max_groups: int = 50,
        names: NameSource = "cmdline",
        max_name_chars: int = 48,
    ) -> None:
        check_int("Snapshot(max_groups)", max_groups, 1, "must be an int >= 1 groups (default 50)")
        self.timestamp = timestamp
        if isinstance(samples, PendingSamples):
            self._samples: tuple[ProcessMemory, ...] | None = None
            self._pending: PendingSamples | None = samples
        else:
            self._samples, self._pending = samples, None
        self.cgroups = cgroups
        self.errors = errors
        self.stall_skipped_pids = stall_skipped_pids
        self.stats = stats
        self._max_groups = max_groups
        self._names = names
        self._max_name_chars = max_name_chars
        self._groups: tuple[GroupMemory, ...] | None = None

    @property
    def samples(self) -> tuple[ProcessMemory, ...]:
        """One per selected process that could be read, largest RSS first.

        The agent's snapshot makes them when they are first read (a tick
        nobody reads, such as most ticks between two scrapes, never pays for
        a record per process): the same records either way."""
        samples = self._samples
        if samples is None:
            # Two threads may both make them; they get equal tuples.
            samples = self._samples = self._pending.finish()  # type: ignore[union-attr]
        return samples

    @property
    def groups(self) -> tuple[GroupMemory, ...]:
        """The samples grouped by name (``ray::Actor`` style), at most ``max_groups``."""
        groups = self._groups
        if groups is None:
            # Two threads may both compute it; they get equal tuples.
            groups = self._groups = tuple(group_samples(
                self.samples, max_groups=self._max_groups, names=self._names, max_name_chars=self._max_name_chars
            ))
        return groups

    def name_of(self, sample: ProcessMemory) -> str:
        """``sample``'s name as its group has it (the ``name`` label)."""
        return group_key(sample, self._names, self._max_name_chars)

    def __repr__(self) -> str:
        n = len(self._samples) if self._samples is not None else len(self._pending.samples)  # type: ignore[union-attr]
        return (f"Snapshot(timestamp={self.timestamp!r}, samples=<{n}>, "
                f"errors={self.errors!r}, stall_skipped_pids=<{len(self.stall_skipped_pids)}>)")
