"""Aggregate processes by name so metric label cardinality stays bounded.

Pids churn (a Ray node starts thousands of workers a day); names do not. A
process's name comes from its command line (``_names.process_name``): Ray
sets its workers' titles to ``ray::ClassName.method`` / ``ray::task_name`` /
``ray::IDLE``, and those group by the part before the method.
"""

from __future__ import annotations

__all__ = ["GroupMemory", "group_key", "group_samples"]

from collections.abc import Iterable
from typing import NamedTuple

from ._checks import check_int
from ._names import NameSource, process_name
from ._types import ProcessMemory

OTHER_GROUP = "other"
"""Where groups beyond ``max_groups`` (the smallest by RSS) are folded."""


class GroupMemory(NamedTuple):
    """Sums over the processes of one group."""

    name: str
    """The group: ``ray::Actor`` for Ray workers, else the process's name (``_names.process_name``)."""
    count: int
    """Processes in the group."""
    rss_bytes: int
    """Sum of RSS (double-counts pages shared between members)."""
    anon_bytes: int
    """Sum of anonymous RSS (counts shared copy-on-write pages once per member)."""
    file_bytes: int
    """Sum of file-backed RSS."""
    shmem_bytes: int
    """Sum of shared-memory RSS (a segment mapped by every member counts each time)."""
    swap_bytes: int
    """Sum of swap."""
    uss_bytes: int | None
    """Sum of USS; None unless every member has exact figures (a partial sum would lie)."""
    pss_bytes: int | None
    """Sum of PSS (does not double-count sharing); None unless every member has one."""
    exact_count: int
    """Members with exact figures."""
    max_exact_age_seconds: float | None
    """Age of the oldest exact figures among members; None if no member has any."""
    cpu_user_seconds: float
    """Sum of user CPU time (processes that exited leave the sum: not monotonic)."""
    cpu_system_seconds: float
    """Sum of system CPU time."""
    num_threads: int
    """Sum of threads."""


def group_key(sample: ProcessMemory, names: NameSource = "cmdline", max_chars: int = 48) -> str:
    """The group a process belongs to: its name (``ray::Actor`` for ``ray::Actor.method``)."""
    return process_name(sample, names, max_chars)


def _sum(name: str, members: list[ProcessMemory]) -> GroupMemory:
    exact = [m for m in members if m.uss_source != "none"]
    complete = len(exact) == len(members)
    ages = [m.exact_age_seconds for m in exact if m.exact_age_seconds is not None]
    return GroupMemory(
        name=name,
        count=len(members),
        rss_bytes=sum(m.rss_bytes for m in members),
        anon_bytes=sum(m.anon_bytes for m in members),
        file_bytes=sum(m.file_bytes for m in members),
        shmem_bytes=sum(m.shmem_bytes for m in members),
        swap_bytes=sum(m.swap_bytes for m in members),
        uss_bytes=sum(m.uss_bytes or 0 for m in members) if complete else None,
        pss_bytes=sum(m.pss_bytes or 0 for m in members)
        if complete and all(m.pss_bytes is not None for m in members) else None,
        exact_count=len(exact),
        max_exact_age_seconds=max(ages) if ages else None,
        cpu_user_seconds=sum(m.cpu_user_seconds for m in members),
        cpu_system_seconds=sum(m.cpu_system_seconds for m in members),
        num_threads=sum(m.num_threads for m in members),
    )


def group_samples(
    samples: Iterable[ProcessMemory], *, max_groups: int = 50, names: NameSource = "cmdline", max_name_chars: int = 48
) -> list[GroupMemory]:
    """Group samples by name, largest RSS first.

    A process's group is its name (``ray::Actor`` for ``ray::Actor.method``;
    ``group_key``).

    Args:
        samples: one tick's samples.
        max_groups: keep at most this many groups; the smallest (by RSS) are
            folded into one ``other`` group so the label set stays bounded.
        names: where names come from (``AgentConfig.names``).
        max_name_chars: names are cut to this many characters.

    Raises:
        ConfigurationError: ``max_groups`` is not an int of at least 1.
    """
    check_int("group_samples(max_groups)", max_groups, 1, "must be an int >= 1 groups (default 50)")
    by_key: dict[str, list[ProcessMemory]] = {}
    for s in samples:
        by_key.setdefault(group_key(s, names, max_name_chars), []).append(s)
    groups = sorted(
        (_sum(k, v) for k, v in by_key.items()), key=lambda g: g.rss_bytes, reverse=True
    )
    if len(groups) <= max_groups:
        return groups
    kept = [g.name for g in groups[: max_groups - 1]]
    rest = [s for k, v in by_key.items() if k not in kept for s in v]
    return groups[: max_groups - 1] + [_sum(OTHER_GROUP, rest)]
