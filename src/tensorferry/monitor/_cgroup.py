"""Memory figures of the cgroups (v1 and v2) that selected processes live in.

A cgroup's usage counts page cache and kernel memory the processes' RSS does
not, and its limit is what the OOM killer enforces, so they complete the
per-process view. Read from a configurable sysfs root so tests use fixtures.
"""

from __future__ import annotations

__all__ = ["CgroupMemory", "CgroupReader"]

import os
from collections.abc import Iterable
from typing import Literal, NamedTuple

from ._types import ProcessMemory

# v1 reports "no limit" as the largest page-aligned long (9223372036854771712).
_V1_UNLIMITED_BYTES = 1 << 62


class CgroupMemory(NamedTuple):
    """One cgroup's memory, as its controller accounts it."""

    path: str
    """The cgroup's path inside its hierarchy (``/system.slice/foo.service``)."""
    version: Literal[1, 2]
    """Which cgroup hierarchy the figures come from."""
    usage_bytes: int
    """Charged memory (memory.current / memory.usage_in_bytes): RSS + page cache + kernel."""
    limit_bytes: int | None
    """The hard limit (memory.max / memory.limit_in_bytes); None when unlimited."""
    anon_bytes: int
    """Anonymous memory charged to the cgroup (``anon`` / ``rss`` in memory.stat)."""
    file_bytes: int
    """Page cache charged to the cgroup (``file`` / ``cache``); includes shmem on v1."""
    shmem_bytes: int
    """Shared memory (tmpfs, /dev/shm) charged to the cgroup."""
    swap_bytes: int
    """Swap used by the cgroup (memory.swap.current, or ``swap`` in v1's memory.stat)."""
    watched: int = 0
    """Processes of the selection in this cgroup (set by ``CgroupReader.for_samples``)."""
    watched_uss_bytes: int | None = None
    """Sum of their USS: what they alone hold of the cgroup's charge; None unless every
    one of them has exact figures (a partial sum would understate)."""


def _read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode()
    except OSError:
        return None


def _stat(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


class CgroupReader:
    """Finds a process's memory cgroup and reads its figures.

    Args:
        proc_root: the /proc tree (for /proc/PID/cgroup).
        cgroup_root: where the cgroup hierarchies are mounted.
    """

    def __init__(self, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.proc_root = proc_root
        self.cgroup_root = cgroup_root

    def locate(self, pid: int) -> tuple[Literal[1, 2], str] | None:
        """``(version, path)`` of ``pid``'s memory cgroup, or None if it has none readable."""
        text = _read_text(f"{self.proc_root}/{pid}/cgroup")
        if text is None:
            return None
        v2_path: str | None = None
        for line in text.splitlines():
            _hid, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if controllers == "" and _hid == "0":
                v2_path = path
            elif "memory" in controllers.split(","):
                # On a hybrid host the v1 memory controller holds the figures.
                return (1, path)
        if v2_path is not None:
            return (2, v2_path)
        return None

    def _dir(self, version: Literal[1, 2], path: str) -> str | None:
        rel = path.lstrip("/")
        if version == 1:
            candidates = [os.path.join(self.cgroup_root, "memory", rel)]
        else:
            candidates = [
                os.path.join(self.cgroup_root, rel),
                os.path.join(self.cgroup_root, "unified", rel),
            ]
        marker = "memory.usage_in_bytes" if version == 1 else "memory.current"
        for directory in candidates:
            if os.path.exists(os.path.join(directory, marker)):
                return directory
        return None

    def read(self, version: Literal[1, 2], path: str) -> CgroupMemory | None:
        """The figures of one cgroup; None when its files are not there (other namespace)."""
        directory = self._dir(version, path)
        if directory is None:
            return None
        if version == 2:
            usage = _read_text(f"{directory}/memory.current")
            limit_text = (_read_text(f"{directory}/memory.max") or "max").strip()
            stat = _stat(_read_text(f"{directory}/memory.stat"))
            swap = (_read_text(f"{directory}/memory.swap.current") or "0").strip()
            return CgroupMemory(
                path=path,
                version=2,
                usage_bytes=int((usage or "0").strip()),
                limit_bytes=None if limit_text == "max" else int(limit_text),
                anon_bytes=stat.get("anon", 0),
                file_bytes=stat.get("file", 0),
                shmem_bytes=stat.get("shmem", 0),
                swap_bytes=int(swap) if swap.isdigit() else 0,
            )
        usage = _read_text(f"{directory}/memory.usage_in_bytes")
        limit = int((_read_text(f"{directory}/memory.limit_in_bytes") or "0").strip() or 0)
        stat = _stat(_read_text(f"{directory}/memory.stat"))
        return CgroupMemory(
            path=path,
            version=1,
            usage_bytes=int((usage or "0").strip()),
            limit_bytes=None if limit == 0 or limit >= _V1_UNLIMITED_BYTES else limit,
            anon_bytes=stat.get("rss", 0),
            file_bytes=stat.get("cache", 0),
            shmem_bytes=stat.get("shmem", 0),
            swap_bytes=stat.get("swap", 0),
        )

    def for_pids(self, pids: list[int]) -> list[CgroupMemory]:
        """The distinct memory cgroups of ``pids``, each read once."""
        seen: dict[tuple[int, str], CgroupMemory | None] = {}
        for pid in pids:
            where = self.locate(pid)
            if where is not None and where not in seen:
                seen[where] = self.read(*where)
        return [c for c in seen.values() if c is not None]

    def for_samples(self, samples: Iterable[ProcessMemory]) -> list[CgroupMemory]:
        """The distinct memory cgroups of ``samples``, each read once, with the
        count and the USS sum of the samples in each."""
        members: dict[tuple[Literal[1, 2], str], list[ProcessMemory]] = {}
        for s in samples:
            where = self.locate(s.pid)
            if where is not None:
                members.setdefault(where, []).append(s)
        out = []
        for where, group in members.items():
            c = self.read(*where)
            if c is None:
                continue
            complete = all(m.uss_bytes is not None for m in group)
            out.append(c._replace(
                watched=len(group),
                watched_uss_bytes=sum(m.uss_bytes or 0 for m in group) if complete else None,
            ))
        return out
