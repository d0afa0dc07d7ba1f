"""A source actor's pool that grows: segments made on demand, released when idle.

Ray holds every RDT object an actor returned until its refs are freed, and an
object may be larger than any pool sized in advance (a 1.6 GB state dict, a
1 GiB default pool). So the source side is a list of segments, each its own
:class:`~tensorferry.sender.Sender` over its own memfd pool:

* the first segment (``TENSORFERRY_RAY_POOL_BYTES``) is made on first use and
  kept for the life of the process;
* an object that fits in no segment gets a new one, at least as large as the
  first (so a run of medium objects shares it) and large enough for the
  object, as long as all segments together stay under the cap
  (``TENSORFERRY_RAY_POOL_MAX_BYTES``) and the machine has the memory;
* a segment other than the first that holds nothing for
  :data:`IDLE_RELEASE_SECONDS` is released: its pages are removed from the
  memfd (freeing them in receivers that still map it, too) and its servers
  are closed.

Runs on the source actor only. The decision to grow is one pure function,
:func:`plan_segment`, tested apart from Ray.
"""

from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple

from ..errors import PoolExhaustedError

__all__ = [
    "Segments",
    "PoolFigures",
    "PoolGrowthError",
    "plan_segment",
    "available_memory",
    "IDLE_RELEASE_SECONDS",
]

# Long enough that an actor returning a large object every step or two reuses
# its segment (whose pages are already faulted in: 0.2-0.4 s per GiB saved),
# short enough that a one-off large object's memory returns soon after its
# refs are freed.
IDLE_RELEASE_SECONDS = 5.0
# New segments are whole 2 MiB pages: shmem maps them as huge pages where the
# kernel allows it (shmem_enabled), which halves the cost of faulting them in.
SEGMENT_ALIGNMENT = 2 << 20
_SWEEP_SECONDS = 0.5


class PoolFigures(NamedTuple):
    """The segments of one source actor, summed. Bytes, except the count."""

    capacity_nbytes: int
    used_nbytes: int
    largest_free_nbytes: int
    segments: int


class PoolGrowthError(PoolExhaustedError):
    """The source actor's pool cannot grow to hold an object.

    ``limit`` says which bound was hit: ``"cap"`` (``TENSORFERRY_RAY_POOL_MAX_BYTES``)
    or ``"memory"`` (what the machine, or the process's cgroup, has
    available); ``limit_nbytes`` is that bound. Nothing was allocated.
    """

    def __init__(
        self,
        requested_nbytes: int,
        figures: PoolFigures,
        *,
        limit: Literal["cap", "memory"],
        limit_nbytes: int,
        message: str,
    ) -> None:
        super().__init__(
            requested_nbytes,
            figures.capacity_nbytes - figures.used_nbytes,
            figures.largest_free_nbytes,
            figures.capacity_nbytes,
        )
        self.figures = figures
        self.limit = limit
        self.limit_nbytes = limit_nbytes
        self.message = message
        self.args = (message,)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        # Picklable with its fields and its own message (Ray ships task errors).
        return (
            _rebuild_growth_error,
            (type(self), self.requested_nbytes, tuple(self.figures), self.limit, self.limit_nbytes, self.message),
        )


def _rebuild_growth_error(cls, requested, figures, limit, limit_nbytes, message):
    return cls(requested, PoolFigures(*figures), limit=limit, limit_nbytes=limit_nbytes, message=message)


def _align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_segment(
    need_nbytes: int,
    *,
    first_nbytes: int,
    figures: PoolFigures,
    cap_nbytes: int,
    available_nbytes: int,
    available_source: str = "MemAvailable",
) -> int:
    """Size of the new segment for an object of ``need_nbytes`` that fits in no segment.

    Source side; pure. A new segment is at least as large as the first one
    and large enough for the object, trimmed to what the cap leaves. Its
    memory is only what the object writes into it (a memfd), so the machine
    must have ``need_nbytes`` available.

    Args:
        need_nbytes: the object's packed size (its tensors plus alignment).
        first_nbytes: size of the first segment (``TENSORFERRY_RAY_POOL_BYTES``).
        figures: the segments there are now.
        cap_nbytes: cap on all segments together; 0 for none.
        available_nbytes: memory this process may still fill.
        available_source: where ``available_nbytes`` comes from, for the message.

    Returns:
        The new segment's size in bytes.

    Raises:
        PoolGrowthError: the cap or the memory does not allow it, with the
            numbers and what to do.
    """
    size = max(first_nbytes, _align_up(need_nbytes, SEGMENT_ALIGNMENT))
    held = figures.used_nbytes
    held_note = (
        f"; objects whose refs are still alive hold {held:,} bytes of it (freeing refs you no longer need returns them)"
        if held
        else ""
    )
    what = f"this actor's tensorferry pool cannot grow to hold an object of {need_nbytes:,} bytes"
    if cap_nbytes:
        room = cap_nbytes - figures.capacity_nbytes
        if need_nbytes > room:
            message = (
                f"{what}: TENSORFERRY_RAY_POOL_MAX_BYTES caps its segments at {cap_nbytes:,} bytes together, "
                f"{figures.capacity_nbytes:,} are taken by {figures.segments} segment(s) and {max(room, 0):,} are left"
                f"{held_note}; raise the cap to at least {figures.capacity_nbytes + need_nbytes:,} bytes, or to 0 for no cap "
                "(runtime_env=tensorferry.ray.runtime_env(pool_max_nbytes=...))"
            )
            raise PoolGrowthError(need_nbytes, figures, limit="cap", limit_nbytes=cap_nbytes, message=message)
        size = min(size, room)
    if need_nbytes > available_nbytes:
        message = (
            f"{what}: its copy needs that much new memory and this machine has {available_nbytes:,} bytes "
            f"available ({available_source}){held_note}; free memory on this node, or return the object in "
            "smaller parts (several calls), each of which fits"
        )
        raise PoolGrowthError(need_nbytes, figures, limit="memory", limit_nbytes=available_nbytes, message=message)
    return size


def available_memory() -> tuple[int, str]:
    """Bytes this process may still fill, and where that figure comes from.

    The smaller of the kernel's MemAvailable and the room left under the
    process's cgroup memory limit, where one is set (v2 ``memory.max``, or
    v1 ``memory.limit_in_bytes``); reclaimable file cache counts as room.
    """
    best, source = _meminfo_available(), "MemAvailable in /proc/meminfo"
    for room, where in _cgroup_rooms():
        if room < best:
            best, source = room, where
    return max(best, 0), source


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62  # unknown: do not refuse on a guess


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            raw = f.read().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() else None


def _inactive_file(stat_path: str, key: bytes) -> int:
    try:
        with open(stat_path, "rb") as f:
            for line in f:
                name, _, value = line.partition(b" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_rooms() -> list[tuple[int, str]]:
    rooms = []
    try:
        with open("/proc/self/cgroup", "rb") as f:
            v2 = next((line[3:].strip().decode() for line in f if line.startswith(b"0::")), None)
    except OSError:
        v2 = None
    if v2 is not None:
        base = "/sys/fs/cgroup" + v2.rstrip("/")
        limit, current = _read_int(base + "/memory.max"), _read_int(base + "/memory.current")
        if limit is not None and current is not None:
            room = limit - current + _inactive_file(base + "/memory.stat", b"inactive_file")
            rooms.append((room, f"cgroup memory.max {limit:,} bytes"))
    base = "/sys/fs/cgroup/memory"
    limit, current = _read_int(base + "/memory.limit_in_bytes"), _read_int(base + "/memory.usage_in_bytes")
    # v1 reports "no limit" as a huge page-aligned number.
    if limit is not None and current is not None and limit < (1 << 60):
        room = limit - current + _inactive_file(base + "/memory.stat", b"total_inactive_file")
        rooms.append((room, f"cgroup memory.limit_in_bytes {limit:,} bytes"))
    return rooms


def _remove_pages(fd: int, nbytes: int) -> None:
    """Free every page of a memfd, in this process and in every process that maps it."""
    m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    try:
        m.madvise(mmap.MADV_REMOVE)
    finally:
        m.close()


@dataclass(eq=False)
class _Segment:
    sender: Any
    keep: bool  # the first segment: never released
    putting: int = 0  # puts in progress into it
    idle_since: float | None = None


class Segments:
    """The source actor's Senders: the first segment, and more made on demand.

    Thread-safe. Each segment is a Sender serving its own memfd pool over
    the same transports; a ticket says which one served it.

    Args:
        make_sender: ``fn(capacity_nbytes) -> Sender``.
        first_nbytes: size of the first segment.
        cap_nbytes: cap on all segments together; 0 for none.
        idle_release_seconds: how long a segment other than the first must
            hold nothing before it is released.
        available: ``fn() -> (bytes, source)``: memory this process may fill.
    """

    def __init__(
        self,
        make_sender: Callable[[int], Any],
        first_nbytes: int,
        cap_nbytes: int = 0,
        *,
        idle_release_seconds: float = IDLE_RELEASE_SECONDS,
        available: Callable[[], tuple[int, str]] = available_memory,
    ) -> None:
        self._make = make_sender
        self.first_nbytes = first_nbytes
        self.cap_nbytes = cap_nbytes
        self.idle_release_seconds = idle_release_seconds
        self._available = available
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._segments = [_Segment(make_sender(first_nbytes), keep=True)]
        self._sweeper: threading.Thread | None = None
        self._closed = False
        self.released = 0  # segments released so far

    @property
    def first(self) -> Any:
        return self._segments[0].sender

    def put(self, obj: Any) -> tuple[Any, Any]:
        """Pack ``obj`` for any number of readers, until :meth:`discard`.

        Tries the segments in order, then makes one. Copies the tensors once.

        Returns:
            ``(sender, ticket)``: the segment's Sender and the object's ticket.

        Raises:
            PoolGrowthError: no segment holds it and none may be made (the
                cap, or the machine's memory); nothing was allocated.
            UnsupportedTensorError: a leaf cannot be sent.
        """
        with self._lock:
            tried = list(self._segments)
            for seg in tried:
                seg.putting += 1
        need = 0
        try:
            for seg in tried:
                try:
                    return seg.sender, seg.sender.put(obj, readers=None, one_shot=True)
                except PoolExhaustedError as exc:
                    need = max(need, exc.requested_nbytes)
        finally:
            self._done_putting(tried)
        seg = self._grow(need)
        try:
            return seg.sender, seg.sender.put(obj, readers=None, one_shot=True)
        finally:
            self._done_putting([seg])

    def discard(self, sender: Any, ticket: Any) -> None:
        """Stop serving ``ticket``; its segment may be released once idle."""
        sender.discard(ticket)
        with self._lock:
            self._wake.notify_all()

    def figures(self) -> PoolFigures:
        with self._lock:
            return self._figures()

    def stats(self) -> dict[str, int]:
        """The segments' Sender stats summed, plus ``segments`` and ``released``."""
        with self._lock:
            parts = [seg.sender.stats() for seg in self._segments]
            out = {k: sum(p[k] for p in parts) for k in parts[0]}
            out["largest_free_nbytes"] = max(p["largest_free_nbytes"] for p in parts)
            out["segments"] = len(parts)
            out["released"] = self.released
            return out

    def servers(self) -> list[dict[str, Any]]:
        """Each segment's servers (transport name -> server)."""
        with self._lock:
            return [seg.sender.servers for seg in self._segments]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segs, self._segments = self._segments, []
            self._wake.notify_all()
        for seg in segs:
            seg.sender.close()

    # -- internals --------------------------------------------------------------

    def _figures(self) -> PoolFigures:
        stats = [seg.sender.pool.stats() for seg in self._segments]
        return PoolFigures(
            capacity_nbytes=sum(s.capacity_nbytes for s in stats),
            used_nbytes=sum(s.used_nbytes for s in stats),
            largest_free_nbytes=max((s.largest_free_nbytes for s in stats), default=0),
            segments=len(stats),
        )

    def _done_putting(self, segs: list[_Segment]) -> None:
        with self._lock:
            for seg in segs:
                seg.putting -= 1
                seg.idle_since = None

    def _grow(self, need: int) -> _Segment:
        available, source = self._available()
        gone: list[_Segment] = []
        try:
            with self._lock:
                try:
                    size = self._plan(need, available, source)
                except PoolGrowthError as exc:
                    # Idle segments still waiting out their grace period
                    # count against the cap: give them up before refusing.
                    if exc.limit != "cap":
                        raise
                    gone = self._take_idle(grace=False)
                    if not gone:
                        raise
                    size = self._plan(need, available, source)
                seg = _Segment(self._make(size), keep=False, putting=1)
                self._segments.append(seg)
                if self._sweeper is None:
                    self._sweeper = threading.Thread(target=self._sweep_loop, name="tensorferry-ray-segments", daemon=True)
                    self._sweeper.start()
                return seg
        finally:
            _release(gone)

    def _plan(self, need: int, available: int, source: str) -> int:
        return plan_segment(need, first_nbytes=self.first_nbytes, figures=self._figures(), cap_nbytes=self.cap_nbytes,
                            available_nbytes=available, available_source=source)

    def _take_idle(self, *, grace: bool) -> list[_Segment]:
        """Take out the segments (not the first) that hold nothing; lock held.

        With ``grace``, only those idle for ``idle_release_seconds``. The
        caller releases them (outside the lock: closing joins threads).
        """
        now = time.monotonic()
        gone = []
        for seg in self._segments:
            if seg.keep or seg.putting:
                continue
            stats = seg.sender.stats()
            if stats["live_tickets"] or stats["used_nbytes"]:
                seg.idle_since = None
                continue
            if seg.idle_since is None:
                seg.idle_since = now
            if not grace or now - seg.idle_since >= self.idle_release_seconds:
                gone.append(seg)
        for seg in gone:
            self._segments.remove(seg)
        self.released += len(gone)
        return gone

    def _sweep_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed or all(seg.keep for seg in self._segments):
                    self._sweeper = None
                    return
                gone = self._take_idle(grace=True)
                if not gone:
                    self._wake.wait(_SWEEP_SECONDS)
            _release(gone)


def _release(segs: list[_Segment]) -> None:
    for seg in segs:
        pool = seg.sender.pool
        # Pages first: receivers on this node may still map the memfd (an
        # idle connection), which would keep its memory alive.
        if pool.fd is not None:
            _remove_pages(pool.fd, pool.capacity_nbytes)
        seg.sender.close()
