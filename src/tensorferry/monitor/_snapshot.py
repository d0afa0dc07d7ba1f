"""What a tick yields: :class:`Snapshot`, and the agent's own cost in :class:`AgentStats`."""

from __future__ import annotations

__all__ = ["AgentStats", "Snapshot"]

from typing import NamedTuple

from ._cgroup import CgroupMemory
from ._checks import check_int
from ._group import GroupMemory, group_key, group_samples
from ._names import NameSource
from ._types import ProcessMemory


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

    __slots__ = ("timestamp", "samples", "cgroups", "errors", "stall_skipped_pids", "stats",
                 "_max_groups", "_names", "_max_name_chars", "_groups")

    timestamp: float
    """When the tick ran, seconds since the epoch."""
    samples: tuple[ProcessMemory, ...]
    """One per selected process that could be read, largest RSS first."""
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
        samples: tuple[ProcessMemory, ...],
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
        self.samples = samples
        self.cgroups = cgroups
        self.errors = errors
        self.stall_skipped_pids = stall_skipped_pids
        self.stats = stats
        self._max_groups = max_groups
        self._names = names
        self._max_name_chars = max_name_chars
        self._groups: tuple[GroupMemory, ...] | None = None

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
        return (f"Snapshot(timestamp={self.timestamp!r}, samples=<{len(self.samples)}>, "
                f"errors={self.errors!r}, stall_skipped_pids=<{len(self.stall_skipped_pids)}>)")
