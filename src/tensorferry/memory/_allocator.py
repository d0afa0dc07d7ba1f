"""Free-space bookkeeping over ``[0, capacity)``: best fit, atomic groups.

Pure Python, no torch. Free extents are kept three ways so every operation
stays near O(log n) as the pool fragments: a list sorted by (size, offset)
for best fit (bisect), and two dicts keyed by start and by end so that a freed
extent merges with both neighbours in O(1).
"""

from __future__ import annotations

import bisect
import threading
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from ..errors import ConfigurationError, PoolExhaustedError
from ..wire import packing

__all__ = ["Block", "AllocatorStats", "Allocator"]


class Block(NamedTuple):
    """A byte range ``[offset, offset + nbytes)`` of a pool: a free extent,
    an allocation, or one contiguous block of a packed object (the one
    record for all three; ``tensorferry.Block``)."""

    offset: int
    nbytes: int


class AllocatorStats(NamedTuple):
    """A snapshot of the allocator, all in bytes except ``free_blocks``."""

    capacity_nbytes: int
    used_nbytes: int
    free_nbytes: int
    largest_free_nbytes: int
    free_blocks: int
    allocated_blocks: int


class Allocator:
    """Best-fit allocator of aligned extents inside ``[0, capacity)``.

    Every extent it hands out starts at a multiple of ``alignment`` and has a
    size rounded up to it, so free space stays aligned too. Thread-safe.

    Args:
        capacity_nbytes: size of the managed range; rounded down to
            ``alignment``.
        alignment: granularity of every extent, a power of two.
    """

    def __init__(self, capacity_nbytes: int, alignment: int = 16) -> None:
        if alignment < 1 or alignment & (alignment - 1):
            raise ConfigurationError(f"alignment must be a power of two, got {alignment}")
        if capacity_nbytes < 0:
            raise ConfigurationError(f"capacity_nbytes must be >= 0, got {capacity_nbytes}")
        self.alignment = alignment
        self.capacity_nbytes = capacity_nbytes - capacity_nbytes % alignment
        self._lock = threading.Lock()
        # The thread inside _locked() (0: none), and the frees that garbage
        # collection ran on that thread while it was inside (see free_soon).
        self._owner = 0
        self._deferred: list[int] = []
        self._by_size: list[tuple[int, int]] = []  # (nbytes, offset), sorted
        self._by_start: dict[int, int] = {}  # offset -> nbytes
        self._by_end: dict[int, int] = {}  # offset + nbytes -> offset
        self._allocated: dict[int, int] = {}  # offset -> nbytes
        self._free_nbytes = 0
        if self.capacity_nbytes:
            self._insert_free(0, self.capacity_nbytes)

    # -- free-extent index -------------------------------------------------

    def _insert_free(self, offset: int, nbytes: int) -> None:
        bisect.insort(self._by_size, (nbytes, offset))
        self._by_start[offset] = nbytes
        self._by_end[offset + nbytes] = offset
        self._free_nbytes += nbytes

    def _remove_free(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect_left(self._by_size, (nbytes, offset))
        del self._by_size[i]
        del self._by_start[offset]
        del self._by_end[offset + nbytes]
        self._free_nbytes -= nbytes

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.alignment) * self.alignment

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield
            finally:
                # Frees deferred by finalizers that ran inside this section;
                # the bookkeeping is whole again here.
                while self._deferred:
                    self._release_quiet(self._deferred.pop())
                self._owner = 0

    # -- public contract ---------------------------------------------------

    def allocate(self, nbytes: int) -> Block:
        """Allocate one extent of at least ``nbytes`` (best fit, lowest offset).

        Raises:
            ValueError: ``nbytes`` is not positive.
            PoolExhaustedError: no free extent is large enough; nothing changed.
        """
        return self.allocate_group([nbytes])[0]

    def allocate_group(self, sizes: Sequence[int]) -> list[Block]:
        """Allocate one extent per size, all or none.

        Sizes are placed largest first, each in the smallest free extent that
        holds it. If any does not fit, every extent taken so far is returned
        and :class:`PoolExhaustedError` is raised: the allocator is exactly as
        it was.

        Returns:
            The extents, in the order of ``sizes``; each extent's ``nbytes`` is
            the size rounded up to the alignment.
        """
        rounded = [self._round(s) for s in sizes]
        for s in sizes:
            if s <= 0:
                raise ConfigurationError(f"every size must be positive, got {s}")
        with self._locked():
            order = sorted(range(len(rounded)), key=lambda i: -rounded[i])
            taken: list[tuple[int, Block]] = []
            for i in order:
                ext = self._take_best_fit(rounded[i])
                if ext is None:
                    for _, e in taken:
                        self._release(e.offset)
                    raise PoolExhaustedError(
                        sum(rounded),
                        self._free_nbytes,
                        self._largest_locked(),
                        self.capacity_nbytes,
                        detail=f"no free block holds {rounded[i]:,} of them contiguously",
                    )
                taken.append((i, ext))
            taken.sort()
            return [e for _, e in taken]

    def reserve(self, extents: Sequence[Block]) -> None:
        """Take exactly these extents (each inside one free extent), all or none.

        The pool uses this to commit a plan made from :meth:`free_extents`.

        Raises:
            ValueError: an extent is misaligned, or not entirely free; nothing
                changed.
        """
        with self._locked():
            done: list[int] = []
            try:
                for ext in extents:
                    self._carve(ext)
                    done.append(ext.offset)
            except ValueError:
                for off in done:
                    self._release(off)
                raise

    def place_packed(self, nbytes: np.ndarray, alignments: np.ndarray) -> tuple[list[Block], packing.BlockGroups]:
        """Take blocks for tensors of these sizes and alignments, packed in
        order (:func:`packing.packed_offsets`), all or none: one block if a
        free extent holds them all; else the largest free extents in turn,
        each packed from its own 16-aligned start.

        Raises:
            PoolExhaustedError: they cannot be placed; nothing allocated.
        """
        offsets, total = packing.packed_offsets(nbytes, alignments)
        count = nbytes.size
        if total == 0:
            return [], packing.BlockGroups(np.zeros(1, np.int64), offsets)
        try:
            ext = self.allocate(total)
            bounds = np.array([0, count], dtype=np.int64)
            return [Block(ext.offset, total)], packing.BlockGroups(bounds, offsets)
        except PoolExhaustedError:
            pass
        # No single free block holds it: fill the largest free blocks in turn,
        # tensors in order, each block packed from its own 16-aligned start.
        while True:
            plan: list[Block] = []
            bounds_list = [0]
            rel = np.zeros(count, dtype=np.int64)
            start = 0
            for ext in self.free_extents(largest_first=True):
                if start == count:
                    break
                k, used = packing.fit_prefix(nbytes[start:], alignments[start:], ext.nbytes)
                if k == 0 or used == 0:
                    break
                off, _ = packing.packed_offsets(nbytes[start : start + k], alignments[start : start + k])
                rel[start : start + k] = off
                plan.append(Block(ext.offset, used))
                start += k
                bounds_list.append(start)
            stats = self.stats()
            if start < count:
                biggest = int(nbytes.max())
                raise PoolExhaustedError(
                    total,
                    stats.free_nbytes,
                    stats.largest_free_nbytes,
                    stats.capacity_nbytes,
                    detail=(
                        f"the {count} tensors cannot be placed in the {stats.free_blocks} free "
                        f"blocks (tensor {start} needs {int(nbytes[start]):,} bytes; the largest "
                        f"tensor is {biggest:,})"
                    ),
                )
            rounded = [Block(b.offset, packing.align_up(b.nbytes, packing.BLOCK_ALIGNMENT)) for b in plan]
            try:
                self.reserve(rounded)
            except ValueError:
                # Another thread took part of the plan between the snapshot of
                # the free extents and now. Its allocation succeeded, so this
                # retry is progress, not a livelock: plan again.
                continue
            return plan, packing.BlockGroups(np.asarray(bounds_list, dtype=np.int64), rel)

    def free(self, offset: int) -> int:
        """Return the extent that starts at ``offset``; merge it with neighbours.

        Returns:
            The extent's byte count.

        Raises:
            KeyError: no extent was allocated at ``offset``.
        """
        with self._locked():
            return self._release(offset)

    def free_soon(self, offset: int) -> None:
        """:meth:`free` for finalizers and ``__del__``: never blocks on itself.

        The garbage collector runs finalizers on whatever thread allocates,
        including one that is inside this allocator with its lock held;
        :meth:`free` would wait there for itself forever. On that thread the
        free is deferred to the moment the thread leaves the lock; on any
        other thread it happens now. An offset not allocated is ignored.
        """
        if self._owner == threading.get_ident():
            self._deferred.append(offset)
            return
        with self._locked():
            self._release_quiet(offset)

    def free_extents(self, *, largest_first: bool = True) -> Iterator[Block]:
        """The free extents, largest first (a snapshot; safe to iterate)."""
        with self._locked():
            snap = list(reversed(self._by_size)) if largest_first else sorted(self._by_size, key=lambda t: t[1])
        return iter([Block(off, size) for size, off in snap])

    def allocated_extents(self) -> list[Block]:
        """The allocated extents, by offset."""
        with self._locked():
            return [Block(o, n) for o, n in sorted(self._allocated.items())]

    def largest_free_nbytes(self) -> int:
        with self._locked():
            return self._largest_locked()

    def stats(self) -> AllocatorStats:
        with self._locked():
            return AllocatorStats(
                capacity_nbytes=self.capacity_nbytes,
                used_nbytes=self.capacity_nbytes - self._free_nbytes,
                free_nbytes=self._free_nbytes,
                largest_free_nbytes=self._largest_locked(),
                free_blocks=len(self._by_size),
                allocated_blocks=len(self._allocated),
            )

    # -- internals (lock held) ---------------------------------------------

    def _largest_locked(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def _take_best_fit(self, nbytes: int) -> Block | None:
        i = bisect.bisect_left(self._by_size, (nbytes, -1))
        if i == len(self._by_size):
            return None
        size, off = self._by_size[i]
        self._remove_free(off, size)
        if size > nbytes:
            self._insert_free(off + nbytes, size - nbytes)
        self._allocated[off] = nbytes
        return Block(off, nbytes)

    def _carve(self, ext: Block) -> None:
        off, nbytes = ext
        if nbytes <= 0 or off % self.alignment or nbytes % self.alignment:
            raise ConfigurationError(f"extent {ext} is not a positive multiple of {self.alignment} bytes")
        # The free extent that contains `off`: the one whose start is the
        # greatest start <= off. Found through the size list only when the
        # carve does not start at a free extent's start (rare: plans start there).
        host = self._by_start.get(off)
        host_off = off
        if host is None:
            for size, start in self._by_size:
                if start <= off < start + size:
                    host, host_off = size, start
                    break
        if host is None or off + nbytes > host_off + host:
            raise ConfigurationError(f"extent {ext} is not entirely free")
        self._remove_free(host_off, host)
        if off > host_off:
            self._insert_free(host_off, off - host_off)
        tail = host_off + host - (off + nbytes)
        if tail:
            self._insert_free(off + nbytes, tail)
        self._allocated[off] = nbytes

    def _release_quiet(self, offset: int) -> None:
        if offset in self._allocated:
            self._release(offset)

    def _release(self, offset: int) -> int:
        nbytes = self._allocated.pop(offset)
        start, end = offset, offset + nbytes
        left = self._by_end.get(start)
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        right = self._by_start.get(end)
        if right is not None:
            self._remove_free(end, right)
            end += right
        self._insert_free(start, end - start)
        return nbytes
