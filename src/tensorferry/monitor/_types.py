"""The records the monitor hands out: one process's memory, its exact figures.

Every figure is in bytes or seconds, and every estimate says what it is.
"""

from __future__ import annotations

__all__ = ["ExactMemory", "ProcessMemory", "SortKey", "UssSource", "restamp"]

from typing import Literal, NamedTuple

UssSource = Literal["pagemap", "smaps_rollup", "platform", "none"]
# The columns ``tensorferry top`` sorts by (``--sort``, ``build_table(sort_by=)``).
SortKey = Literal["rss", "uss", "pss", "anon", "shmem", "swap", "cpu"]
"""Where a sample's USS came from: ``pagemap`` (Linux: /proc/PID/pagemap walked
in bounded slices), ``smaps_rollup`` (Linux: one walk under the target's mmap
lock; where pagemap is not readable), ``platform`` (macOS, Windows: the
platform's private-bytes counter), ``none`` (not read; anonymous RSS is NOT a
USS)."""


class ExactMemory(NamedTuple):
    """Figures that cost a page-table walk (Linux: pagemap slices or smaps_rollup)."""

    uss_bytes: int
    """Pages present and mapped by this process alone (smaps' Private_Clean +
    Private_Dirty): what exiting the process would free."""
    pss_bytes: int | None
    """Pss: resident memory with each shared page divided among its sharers. None
    from pagemap where /proc/kpagecount or the page frame numbers are not readable
    (they need root)."""
    swap_pss_bytes: int | None
    """SwapPss: swapped-out memory with shared swap divided among its sharers; None
    from pagemap (which cannot divide swap; the cheap ``swap_bytes`` has VmSwap)."""
    cost_seconds: float
    """Wall time the monitor spent on the walk, all steps together."""
    source: UssSource = "smaps_rollup"
    """Which source the figures came from (never ``none``)."""
    max_step_seconds: float | None = None
    """The longest single step: what the walk could have stalled the target at
    most. A whole smaps_rollup read is one step."""
    steps: int = 1
    """Steps (reads of a slice of address space) the walk took."""


class ProcessMemory(NamedTuple):
    """One process's memory and CPU at one instant.

    Cheap figures come from counters the kernel keeps (statm, status, stat) and
    cost the target nothing. ``uss_bytes`` and ``pss_bytes`` are only set when
    exact figures were read (``uss_source != "none"``); ``anon_bytes`` is what
    tools that compute "RSS - shared" call USS, and it is not: it counts
    copy-on-write pages a forked child still shares with its parent and leaves
    out shared memory (/dev/shm) the process alone maps.

    A NamedTuple, not a dataclass: the agent builds one per process per tick
    and a frozen dataclass costs ~4 µs more to build than the read itself.
    """

    pid: int
    """Process id."""
    ppid: int
    """Parent's process id (0 for the kernel's own)."""
    name: str
    """The kernel's name for the process (comm, at most 15 characters)."""
    cmdline: tuple[str, ...]
    """argv as the process presents it now (``ray::Worker`` style titles show here)."""
    create_time: float
    """When the process started, seconds since the epoch (pid + create_time is unique)."""
    timestamp: float
    """When this sample was taken, seconds since the epoch (the agent's tick: when
    the tick began, for a process that stood still since its last sample)."""
    rss_bytes: int
    """Resident set size: anon + file + shmem pages mapped now."""
    anon_bytes: int
    """Resident anonymous pages (RssAnon; statm's RSS - shared). Includes pages shared copy-on-write."""
    file_bytes: int
    """Resident file-backed pages (RssFile): code, libraries, mapped files."""
    shmem_bytes: int
    """Resident shared-memory pages (RssShmem): /dev/shm, memfd, SysV, shared anonymous."""
    swap_bytes: int
    """Swapped-out anonymous memory (VmSwap)."""
    peak_rss_bytes: int
    """High-water mark of rss_bytes (VmHWM)."""
    vms_bytes: int
    """Virtual size (VmSize): address space reserved, mostly not memory."""
    page_table_bytes: int
    """Page-table size (VmPTE); an exact read walks about this much."""
    cpu_user_seconds: float
    """CPU time spent in user mode since start."""
    cpu_system_seconds: float
    """CPU time spent in the kernel since start."""
    num_threads: int
    """Threads in the process."""
    num_fds: int | None
    """Open file descriptors; None when not counted or not readable."""
    kernel_thread: bool = False
    """A kernel thread: it has no user memory, every memory figure is 0."""
    uss_bytes: int | None = None
    """Unique set size (smaps' Private_Clean + Private_Dirty); None when uss_source is ``none``."""
    pss_bytes: int | None = None
    """Proportional set size; None unless exact figures were read (and, from pagemap,
    unless /proc/kpagecount was readable)."""
    uss_source: UssSource = "none"
    """Where uss_bytes came from; ``none`` means it was not measured."""
    exact_age_seconds: float | None = None
    """How old uss_bytes/pss_bytes are, counted from when their walk finished (the agent
    reuses them between walks, and a pagemap walk may span ticks); None if unset."""
    exact_cost_seconds: float | None = None
    """What the walk for the exact figures cost the monitor, all its steps together."""
    status_age_seconds: float = 0.0
    """How old anon/file/shmem/swap/peak/page-table figures are (from status): 0.0 when
    read with this sample. The agent re-reads status only when stat shows RSS or VmSize
    changed, or at least every ``AgentConfig.status_max_age_seconds``; in between it
    carries them over and this says for how long. RSS, VmSize, CPU and threads are
    always read fresh."""


_TIMESTAMP = ProcessMemory._fields.index("timestamp")
_STATUS_AGE = ProcessMemory._fields.index("status_age_seconds")  # the last field


def restamp(sample: ProcessMemory, read_at: float | None, wall: float, now: float) -> ProcessMemory:
    """``sample`` as taken at ``wall`` (epoch) / ``now`` (monotonic): a record
    handed out again by ``ProcfsBackend.cheap_tick`` because the process
    stood still, whose figures stand while its timestamp and the age of its
    status figures (read at ``read_at``) move. ``sample`` itself where
    ``read_at`` is None (a record built at the tick)."""
    if read_at is None:
        return sample
    return tuple.__new__(ProcessMemory, sample[:_TIMESTAMP] + (wall,) + sample[_TIMESTAMP + 1:_STATUS_AGE] + (now - read_at,))
