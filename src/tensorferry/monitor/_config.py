"""How the agent samples: :class:`AgentConfig`, checked when made."""

from __future__ import annotations

__all__ = ["AgentConfig", "DEFAULT_PORT"]

import math
from dataclasses import dataclass

from ..errors import ConfigurationError
from ._checks import check_int, check_number
from ._names import NameSource
from ._pagemap import WALK_SECONDS_PER_PAGE

DEFAULT_PORT = 21464
"""``tensorferry monitor``'s port. Prometheus' exporter ports (9100-9999) are
all allocated, and 9464 is OpenTelemetry's Prometheus exporter's; 21464 is
outside them, outside Ray's default worker ports (10002-19999), and below
Linux's ephemeral ports (32768 on). Here, not in ``_server``: the command
line's parser is built without prometheus_client."""

# A 4 KiB page costs smaps_rollup ~45 ns (45 ms for 4 GiB = 1 Mi pages,
# measured on the machines this was written for).
_DEFAULT_WALK_SECONDS_PER_PAGE = 45e-9


@dataclass(frozen=True)
class AgentConfig:
    """How the agent samples; defaults suit a node of ML workers."""

    interval_seconds: float = 1.0
    """Time between ticks."""
    jitter_fraction: float = 0.1
    """Each interval is drawn from interval * [1 - jitter, 1 + jitter], so agents on many nodes do not tick in step."""
    exact: bool = True
    """Read exact USS/PSS (pagemap, else smaps_rollup) at all, within the budget."""
    cpu_budget_fraction: float = 0.001
    """CPU spent on exact reads, as a fraction of one core over time (0.001 = 0.1%)."""
    max_stall_seconds: float = 0.02
    """The longest one step of an exact read may take: a pagemap walk sizes each slice
    from its measured steps to take half of this (its lock holds inside a step are far
    shorter); a process that only smaps_rollup can read (one walk under its lock) is
    not read if its walk is estimated above this."""
    force_exact: bool = False
    """Read smaps_rollup even where the walk would exceed max_stall_seconds (still within the budget)."""
    rss_change_fraction: float = 0.10
    """Re-read exact figures before cost/budget allows when RSS moved by more than this fraction."""
    walk_seconds_per_page: float = _DEFAULT_WALK_SECONDS_PER_PAGE
    """Estimated smaps_rollup cost of one resident 4 KiB page, for processes not read yet."""
    pagemap_seconds_per_page: float = WALK_SECONDS_PER_PAGE
    """Estimated pagemap walk cost of one resident 4 KiB page, for processes not read yet."""
    walk_base_seconds: float = 0.0002
    """Estimated walk cost of a small process (its mappings, the file itself)."""
    cgroups: bool = False
    """Also read the memory figures of the selected processes' cgroups (v1 and v2)."""
    count_fds: bool = True
    """Count each process's open fds (a listdir of /proc/PID/fd, ~6 µs: a fifth of a sample)."""
    fds_every_ticks: int = 10
    """Count fds every this many ticks per process (staggered), reporting the last count between."""
    status_max_age_seconds: float = 10.0
    """Re-read a process's status (its anon/file/shmem split, swap, peak, page tables) at
    least this often; sooner whenever stat shows its RSS or VmSize changed. In between the
    last figures carry over and ``ProcessMemory.status_age_seconds`` says how old they
    are. 0 re-reads status every tick. (Linux; other platforms read everything each tick.)"""
    max_groups: int = 50
    """Groups by name kept in each snapshot; the rest fold into ``other``."""
    names: NameSource = "cmdline"
    """Where process names (the ``name`` label, groups, ``top``'s NAME) come from:
    ``cmdline`` (the script or module an interpreter runs, Ray's ``ray::Actor``
    title, else the program's base name) or ``comm`` (the kernel's name, at most
    15 characters; Ray titles still group as ``ray::Actor``)."""
    max_name_chars: int = 48
    """Names are cut to this many characters (label values stay bounded)."""
    rescan_seconds: float = 10.0
    """Re-match command lines of processes that did not match after this long (they retitle), then
    twice as long each time the command line read the same, up to 40 s (or this, if longer)."""

    def __post_init__(self) -> None:
        w = "AgentConfig({})".format
        check_number(w("interval_seconds"), self.interval_seconds, lambda v: v > 0,
                     "must be > 0 seconds between ticks (default 1.0)")
        check_number(w("jitter_fraction"), self.jitter_fraction, lambda v: 0 <= v < 1,
                     "must be in [0, 1): each interval is drawn from interval * [1 - jitter, 1 + jitter] (default 0.1)")
        check_number(w("cpu_budget_fraction"), self.cpu_budget_fraction, lambda v: 0 < v <= 1,
                     "must be in (0, 1], a fraction of one core (0.001 = 0.1%, the default)")
        check_number(w("max_stall_seconds"), self.max_stall_seconds, lambda v: v > 0,
                     "must be > 0 seconds, the longest one walk step may stall its target (default 0.02)")
        check_number(w("rss_change_fraction"), self.rss_change_fraction, lambda v: v > 0,
                     "must be > 0, the RSS change that triggers an early exact read (default 0.10)")
        for name in ("walk_seconds_per_page", "pagemap_seconds_per_page", "walk_base_seconds"):
            check_number(w(name), getattr(self, name), lambda v: 0 <= v < math.inf,
                         "must be a finite cost estimate >= 0 seconds (or leave the default)")
        check_int(w("max_groups"), self.max_groups, 1, "must be an int >= 1 groups per snapshot (default 50)")
        if self.names not in ("cmdline", "comm"):
            raise ConfigurationError(
                f"AgentConfig(names={self.names!r}): must be 'cmdline' (the script, module or program) "
                "or 'comm' (the kernel's 15-character name)"
            )
        check_int(w("max_name_chars"), self.max_name_chars, 1, "must be an int >= 1 characters (default 48)")
        check_int(w("fds_every_ticks"), self.fds_every_ticks, 1,
                  "must be an int >= 1: count fds every this many ticks (default 10)")
        check_number(w("status_max_age_seconds"), self.status_max_age_seconds, lambda v: v >= 0,
                     "must be >= 0 seconds (0 re-reads status every tick; default 10.0)")
        check_number(w("rescan_seconds"), self.rescan_seconds, lambda v: v > 0,
                     "must be > 0 seconds between re-matches of command lines (default 10.0)")
