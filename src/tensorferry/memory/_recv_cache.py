"""The receive cache: memory of collected results, kept faulted in for the next get.

Receiver side. A plain ``Receiver.get`` (no ``into=``, no receive pool)
puts the bytes in memory it takes for the result, and memory the process
has not touched yet costs a page fault per page on its first write: a get
of 1 GiB as 10k tensors over shm ran at 0.35x memcpy, most of it faults.
A receiver that gets an object of the same size every few seconds (a
weight sync) can use the memory of the previous result instead, once that
result was collected.

:class:`ReceiveCache` hands out such memory (:meth:`ReceiveCache.take`) as
a 1-D uint8 tensor whose storage owns one anonymous mapping; when the last
tensor sharing that storage is collected (whichever view of the result
outlives the others) the mapping comes back, pages and all, and the next
take of about its size gets it again:

* reuse: the smallest idle mapping that holds the request and is at most
  ``_MAX_OVERSIZE`` times its size (best fit);
* a cap: the idle bytes it keeps never exceed ``cap_nbytes`` (the oldest
  idle mappings go first); a take larger than the cap, or smaller than
  ``_MIN_CACHED_NBYTES``, is plain new memory and never comes back;
* trimming: a mapping idle for ``idle_seconds`` is unmapped, by the next
  take or by a daemon thread that wakes every ``idle_seconds / 2`` while
  the cache holds anything (idle or in live results) and ends when it
  holds nothing;
* nothing a live tensor points to is ever unmapped: a mapping is dropped
  only when it is idle, and the kernel unmaps it only once the last buffer
  exported from it is gone;
* shared (``shared=True``, a relaying receiver's cache): every mapping is
  a sealed memfd (:func:`~tensorferry._memory.shared_host_mapping`), so
  :meth:`ReceiveCache.take_shared` can name the file that children on the
  relay's host map;
* a forked child gets fresh locks and no trimmer thread (the parent's lock
  may have been held by a thread the child does not have); results it
  inherited come back to its own copy of the cache.
"""

from __future__ import annotations

import collections
import itertools
import math
import mmap
import numbers
import os
import re
import threading
import time
import weakref
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from ..errors import ConfigurationError, positive_seconds
from ..monitor import register_pool_source, unregister_pool_source
from ._system import host_mapping, new_host_bytes, shared_host_mapping
from ._views import owned_view

# The figures a monitor pool source reports (tensorferry.monitor.register_pool_source).
_POOL_FIGURES = ("capacity_nbytes", "used_nbytes", "largest_free_nbytes", "transfers", "bytes_moved")

__all__ = ["CACHE_ENV", "DEFAULT_IDLE_SECONDS", "CacheStats", "ReceiveCache", "cap_nbytes", "idle_seconds"]

CACHE_ENV = "TENSORFERRY_RECEIVE_CACHE_BYTES"
# The default cap: enough to keep one result of a typical weight sync
# (a few hundred MiB to 1-2 GiB) between gets, and never more than an
# eighth of the host's memory on a small machine.
_DEFAULT_CAP_NBYTES = 2 << 30
_DEFAULT_CAP_MEMORY_FRACTION = 8
# A sync every few seconds to a minute keeps its memory; a receiver that
# stopped getting gives it back a minute or so later.
DEFAULT_IDLE_SECONDS = 60.0
# Below this, a result comes from torch's allocator, whose heap already
# keeps freed memory (glibc raises its mmap threshold up to 32 MiB after
# the first free); a mapping each would only add mappings (vm.max_map_count).
_MIN_CACHED_NBYTES = 1 << 20
# Reuse wastes at most this factor: a 1 GiB mapping never serves 400 MiB.
_MAX_OVERSIZE = 2
# Mappings of at least _memory's huge-page size are rounded up to whole
# 2 MiB pages (at most 25% more at 8 MiB, 0.2% at 1 GiB), so results of
# nearly the same size share a mapping; smaller ones to whole 4 KiB pages.
_HUGE_ROUND_MIN_NBYTES = 8 << 20
_HUGE_PAGE_NBYTES = 2 << 20
# The trimmer never wakes more often than this, whatever idle_seconds says.
_MIN_TRIM_PERIOD_SECONDS = 0.01

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)


class CacheStats(NamedTuple):
    """A snapshot of a receive cache. Bytes, except the counts."""

    capacity_nbytes: int
    """The cap on idle bytes kept (0: the cache is off)."""
    cached_nbytes: int
    """Idle bytes kept, faulted in, ready for the next get."""
    cached_buffers: int
    """Idle mappings kept."""
    live_nbytes: int
    """Bytes of the cache's mappings that live results hold now (not capped:
    they are the results' memory; they come back when collected)."""
    hits: int
    """Takes served by an idle mapping (no page faults)."""
    misses: int
    """Takes that mapped new memory (it comes back to the cache when collected)."""
    bypassed: int
    """Takes served by plain new memory that never comes back: smaller than
    1 MiB, larger than the cap, the cache off or closed."""
    taken_nbytes: int
    """Bytes handed out by hits and misses."""
    trimmed_nbytes: int
    """Bytes unmapped after sitting idle for ``idle_seconds``, or at close."""
    evicted_nbytes: int
    """Bytes unmapped to keep the idle bytes within the cap."""


class _Mapping:
    """One mapping the cache owns (anonymous, or a memfd's in a shared cache); idle or held by a result."""

    __slots__ = ("mapping", "nbytes", "idle_since", "fd")

    def __init__(self, mapping: mmap.mmap, nbytes: int, fd: int = -1) -> None:
        # fd: the memfd of a shared mapping (closed with the mapping), else -1.
        self.mapping, self.nbytes, self.idle_since, self.fd = mapping, nbytes, 0.0, fd


_caches: "weakref.WeakSet[ReceiveCache]" = weakref.WeakSet()
_serial = itertools.count(1)


class ReceiveCache:
    """Host memory for received results, reused once a result is collected.

    Receiver side; thread-safe (gets run on several threads, and a result's
    memory comes back on whatever thread collects it). Each cache with a
    cap above 0 is a monitor pool source (:meth:`pool_figures`) named
    :attr:`name` until :meth:`close`.

    Args:
        cap_nbytes: the most idle bytes kept (0: off, every take is new memory).
        idle_seconds: an idle mapping older than this is unmapped.
        shared: every mapping is a sealed memfd (a relay's children map it).
    """

    def __init__(self, cap_nbytes: int, idle_seconds: float = DEFAULT_IDLE_SECONDS, *, shared: bool = False) -> None:
        self.cap_nbytes = cap_nbytes
        self.shared = shared
        self.idle_seconds = idle_seconds
        self.name = f"receive-cache:{os.getpid()}:{next(_serial)}"
        self._lock = threading.Lock()
        # Mappings whose results were collected, not yet sorted in: a
        # finalizer only appends here (deque appends are atomic) and sorts
        # them in only if it gets the lock without waiting.
        self._returned: collections.deque[_Mapping] = collections.deque()
        self._idle: list[_Mapping] = []  # by nbytes, ascending
        self._idle_nbytes = 0
        self._live_nbytes = 0
        self._live_count = 0
        self._hits = self._misses = self._bypassed = 0
        self._taken_nbytes = self._trimmed_nbytes = self._evicted_nbytes = 0
        self._closed = False
        self._trimmer: threading.Thread | None = None
        self._wake = threading.Event()
        _caches.add(self)
        if cap_nbytes > 0:
            register_pool_source(self.name, _weak_source(self))

    # -- taking and giving back ------------------------------------------------------

    def take(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """``nbytes`` of host memory for a result (contents undefined).

        Returns ``(buffer, reused)``: a 1-D uint8 tensor, page-aligned, whose
        storage returns its mapping to the cache when the last tensor sharing
        it is collected; ``reused`` is True when the pages are already
        faulted in (an idle mapping of an earlier result).
        """
        buffer, reused, _fd = self._take(nbytes)
        return buffer, reused

    def take_shared(self, nbytes: int) -> tuple[torch.Tensor, bool, int]:
        """As :meth:`take`, from a ``shared=True`` cache, with the memfd
        whose bytes from 0 on are the buffer's: ``(buffer, reused, fd)``.
        The fd stays open as long as the buffer (any tensor sharing its
        storage) is alive; do not close it."""
        if not self.shared:
            raise ConfigurationError("take_shared needs a cache made with ReceiveCache(shared=True) (a relaying receiver's); this one is private")
        return self._take(nbytes)

    def _take(self, nbytes: int) -> tuple[torch.Tensor, bool, int]:
        if self._closed or nbytes < _MIN_CACHED_NBYTES or _rounded(nbytes) > self.cap_nbytes:
            with self._locked():
                self._bypassed += 1
            if self.shared:
                # Not kept: unmapped (and the fd closed) with the result.
                mapping, fd = shared_host_mapping(max(nbytes, 1), "tensorferry-relay")
                return owned_view(mapping, 0, nbytes), False, fd
            return new_host_bytes(nbytes), False, -1
        size = _rounded(nbytes)
        start = None
        with self._locked():
            dropped = self._expire_locked(time.monotonic())
            found = self._best_fit_locked(size)
            if found is not None:
                self._hits += 1
            else:
                self._misses += 1
            self._live_nbytes += found.nbytes if found is not None else size
            self._live_count += 1
            self._taken_nbytes += nbytes
            if self._trimmer is None and math.isfinite(self.idle_seconds):
                start = self._trimmer = threading.Thread(target=self._trim_loop, name=f"tensorferry-{self.name}", daemon=True)
        dropped.clear()  # unmapped here, outside the lock
        if start is not None:
            start.start()
        reused = found is not None
        if found is None:
            try:
                if self.shared:
                    mapping, fd = shared_host_mapping(size, "tensorferry-relay")
                    found = _Mapping(mapping, size, fd)
                else:
                    found = _Mapping(host_mapping(size), size)
            except BaseException:
                with self._locked():
                    self._live_nbytes -= size
                    self._live_count -= 1
                raise
        # The callback holds the record, never a tensor: the mapping stays
        # alive through the record and through the buffer exported from it.
        return owned_view(found.mapping, 0, nbytes, _Giver(self, found)), reused, found.fd

    def _give_back(self, m: _Mapping) -> None:
        """A result's mapping came back (its last tensor was collected).

        Runs in a finalizer, on any thread, possibly inside this cache with
        its lock held: never waits for the lock.
        """
        self._returned.append(m)
        if not self._lock.acquire(blocking=False):
            return  # sorted in when the holder (maybe this thread) leaves the lock
        try:
            dropped = self._sort_in_locked()
        finally:
            self._lock.release()
        dropped.clear()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            try:
                yield
            finally:
                # Finalizers (of this thread too) may have returned mappings meanwhile.
                dropped = self._sort_in_locked()
        dropped.clear()

    def _sort_in_locked(self) -> list[_Mapping]:
        """Returned mappings become idle; returns those dropped (unmap them
        after leaving the lock): any past the cap, the oldest first, and all
        of them once the cache is closed."""
        dropped: list[_Mapping] = []
        now = time.monotonic()
        while self._returned:
            m = self._returned.popleft()
            self._live_nbytes -= m.nbytes
            self._live_count -= 1
            m.idle_since = now
            if self._closed:
                dropped.append(m)
                self._trimmed_nbytes += m.nbytes
                continue
            self._idle.insert(bisect_left(self._idle, m.nbytes, key=_nbytes), m)
            self._idle_nbytes += m.nbytes
        while self._idle_nbytes > self.cap_nbytes:
            oldest = min(self._idle, key=_idle_since)
            self._idle.remove(oldest)
            self._idle_nbytes -= oldest.nbytes
            self._evicted_nbytes += oldest.nbytes
            dropped.append(oldest)
        return dropped

    def _best_fit_locked(self, size: int) -> _Mapping | None:
        i = bisect_left(self._idle, size, key=_nbytes)
        if i == len(self._idle) or self._idle[i].nbytes > _MAX_OVERSIZE * size:
            return None
        m = self._idle.pop(i)
        self._idle_nbytes -= m.nbytes
        return m

    # -- trimming --------------------------------------------------------------------

    def _expire_locked(self, now: float) -> list[_Mapping]:
        """Drop the mappings idle for ``idle_seconds`` or more; returns them."""
        old = [m for m in self._idle if now - m.idle_since >= self.idle_seconds]
        if old:
            self._idle = [m for m in self._idle if now - m.idle_since < self.idle_seconds]
            gone = sum(m.nbytes for m in old)
            self._idle_nbytes -= gone
            self._trimmed_nbytes += gone
        return old

    def _trim_loop(self) -> None:
        period = max(self.idle_seconds / 2, _MIN_TRIM_PERIOD_SECONDS)
        while not self._wake.wait(period):
            with self._locked():
                dropped = self._expire_locked(time.monotonic())
                done = self._closed or (not self._idle and self._live_count == 0 and not self._returned)
                if done:
                    self._trimmer = None
            dropped.clear()
            if done:
                return

    # -- figures and lifetime --------------------------------------------------------

    def stats(self) -> CacheStats:
        with self._locked():
            return CacheStats(
                capacity_nbytes=self.cap_nbytes,
                cached_nbytes=self._idle_nbytes,
                cached_buffers=len(self._idle),
                live_nbytes=self._live_nbytes,
                hits=self._hits,
                misses=self._misses,
                bypassed=self._bypassed,
                taken_nbytes=self._taken_nbytes,
                trimmed_nbytes=self._trimmed_nbytes,
                evicted_nbytes=self._evicted_nbytes,
            )

    def pool_figures(self) -> dict[str, int]:
        """The monitor's pool figures (:data:`_POOL_FIGURES`) of this cache.

        ``capacity_nbytes``: the cap on idle bytes; ``used_nbytes``: bytes
        live results hold (may exceed the cap: results are never refused);
        ``largest_free_nbytes``: the largest idle mapping (a get up to that
        size faults nothing); ``transfers``: takes served by the cache (hits
        and misses); ``bytes_moved``: the bytes of those takes.
        """
        with self._locked():
            return {
                "capacity_nbytes": self.cap_nbytes,
                "used_nbytes": self._live_nbytes,
                "largest_free_nbytes": self._idle[-1].nbytes if self._idle else 0,
                "transfers": self._hits + self._misses,
                "bytes_moved": self._taken_nbytes,
            }

    def close(self) -> None:
        """Unmap the idle mappings and stop caching; idempotent.

        Results still alive keep their memory; it is unmapped when they are
        collected. The cache stops being a monitor pool source.
        """
        with self._locked():
            if self._closed:
                return
            self._closed = True
            dropped = self._idle  # unmapped below, outside the lock
            self._idle = []
            self._trimmed_nbytes += self._idle_nbytes
            self._idle_nbytes = 0
        dropped.clear()
        self._wake.set()
        if self.cap_nbytes > 0:
            unregister_pool_source(self.name)

    def _after_fork_in_child(self) -> None:
        # The parent's lock may have been held by a thread the child does
        # not have, and the trimmer thread is not copied.
        self._lock = threading.Lock()
        self._trimmer = None
        self._wake = threading.Event()


class _Giver:
    """The release callback of one taken mapping (a finalizer's target)."""

    __slots__ = ("cache", "mapping")

    def __init__(self, cache: ReceiveCache, mapping: _Mapping) -> None:
        self.cache, self.mapping = cache, mapping

    def __call__(self) -> None:
        self.cache._give_back(self.mapping)


def _nbytes(m: _Mapping) -> int:
    return m.nbytes


def _idle_since(m: _Mapping) -> float:
    return m.idle_since


def _rounded(nbytes: int) -> int:
    unit = _HUGE_PAGE_NBYTES if nbytes >= _HUGE_ROUND_MIN_NBYTES else mmap.PAGESIZE
    return -(-nbytes // unit) * unit


def _weak_source(cache: ReceiveCache):
    """A pool source that does not keep ``cache`` alive; once the cache is
    gone (its receiver dropped unclosed) it reports zeros and unregisters."""
    ref = weakref.ref(cache)
    name = cache.name

    def source() -> dict[str, int]:
        c = ref()
        if c is None:
            unregister_pool_source(name)  # collect_pool_figures calls sources outside its lock
            return dict.fromkeys(_POOL_FIGURES, 0)
        return c.pool_figures()

    return source


def cap_nbytes(value: object = None) -> int:
    """The cap of a receiver's cache: ``value`` (``Receiver(cache_nbytes=)``)
    if given, else ``TENSORFERRY_RECEIVE_CACHE_BYTES``, else the default
    (2 GiB, at most an eighth of the host's memory). 0 turns the cache off.

    Raises:
        ConfigurationError: ``value`` is not an int of at least 0, or the
            variable is not a size (``2147483648``, ``2G``, ``512MiB``, ``0``).
    """
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ConfigurationError(
                f"Receiver(cache_nbytes={value!r}): the receive cache's cap must be an int of bytes of at least 0, "
                f"for example 2 << 30 (0 turns the cache off, None takes {CACHE_ENV} or the default)"
            )
        return int(value)
    raw = os.environ.get(CACHE_ENV, "").strip()
    if not raw:
        return _default_cap_nbytes()
    match = _SIZE.fullmatch(raw)
    if match is None:
        raise ConfigurationError(
            f"{CACHE_ENV}={raw!r}: expected a number of bytes, optionally with a binary unit "
            "(2147483648, 2G, 512MiB), or 0 to turn the receive cache off"
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def idle_seconds(value: object) -> float:
    """``Receiver(cache_idle_seconds=)`` checked: seconds above 0 (``inf``: never trim)."""
    return positive_seconds("Receiver(cache_idle_seconds)", value, allow_inf=True)


def _default_cap_nbytes() -> int:
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return _DEFAULT_CAP_NBYTES
    return min(_DEFAULT_CAP_NBYTES, total // _DEFAULT_CAP_MEMORY_FRACTION)


def _after_fork_in_child() -> None:
    for cache in list(_caches):
        cache._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
