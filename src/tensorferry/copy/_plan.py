"""``CopyPlan``: the merged runs under every copy, built once, executed by address."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..wire import packing
from ._memmove import Batches, batches, destinations_apart
from ._threads import copy_threads

__all__ = ["CopyPlan"]


class CopyPlan:
    """One copy of many tensors: merged runs, plus the tensors copied value by value.

    Built in O(N), vectorised, from one (destination, source, byte count)
    per tensor; executing it is O(runs). Tensors that are adjacent on both
    sides become one run (:func:`packing.merge_runs`, the one merger); a
    model's parameters as views of one flat buffer are one memcpy. Plain
    data: a plan can be kept and executed again (same addresses), or
    executed a window at a time as a stream arrives.

    Attributes:
        dst, src, nbytes: int64 per run, in the plan's coordinates
            (addresses, or offsets that :meth:`execute` shifts by a base).
        heads: int64 index of the first tensor of each run.
        elementwise: int64 indices of the tensors that cannot be copied as
            raw bytes (strided, conjugated, negated, on a device): the
            caller copies those value by value.
    """

    __slots__ = ("dst", "src", "nbytes", "heads", "elementwise", "_ends", "_apart", "_batches")
    _ends: tuple[np.ndarray, bool] | None

    def __init__(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, heads: np.ndarray, elementwise: np.ndarray) -> None:
        self.dst, self.src, self.nbytes, self.heads, self.elementwise = dst, src, nbytes, heads, elementwise
        self._ends = None  # (run ends on the side windowed last, that side)
        self._apart: bool | None = None
        # Batches of the windows copied so far, kept: a kept plan copies the
        # same windows every sync, at other base addresses at most.
        self._batches: dict[tuple[Any, ...], Batches] = {}

    @classmethod
    def build(cls, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, *, raw: np.ndarray | None = None, breaks: np.ndarray | None = None) -> "CopyPlan":
        """The plan of copying ``nbytes[i]`` bytes from ``src[i]`` to ``dst[i]``.

        Zero-byte entries are left out. ``raw`` (bool per tensor, default
        all) says which may be copied as bytes; the rest are listed in
        ``elementwise``. ``breaks`` (bool per tensor) starts a run where
        something else changes (a storage, a region).
        """
        n = np.asarray(nbytes, dtype=np.int64)
        live = n > 0
        elementwise = _EMPTY
        if raw is not None:
            raw = np.asarray(raw, dtype=bool)
            elementwise = np.flatnonzero(live & ~raw)
            live = live & raw
        sel = np.flatnonzero(live)
        if sel.size == n.size:
            runs = packing.merge_runs(dst, src, n, breaks)
            return cls(runs.dst, runs.src, runs.nbytes, runs.heads, elementwise)
        br = None if breaks is None else np.asarray(breaks, dtype=bool)[sel]
        runs = packing.merge_runs(np.asarray(dst)[sel], np.asarray(src)[sel], n[sel], br)
        return cls(runs.dst, runs.src, runs.nbytes, sel[runs.heads], elementwise)

    @property
    def num_runs(self) -> int:
        return int(self.nbytes.size)

    @property
    def apart(self) -> bool:
        """Whether no two runs write the same byte (checked once; a window
        of runs that are apart is too)."""
        if self._apart is None:
            self._apart = destinations_apart(self.dst, self.nbytes)
        return self._apart

    def execute(self, dst_base: int = 0, src_base: int = 0) -> int:
        """Copy every run by address (host memory), on several threads when
        large. Returns the number of runs."""
        b = self._batched(None, lambda: (self.dst, self.src, self.nbytes))
        b.run(dst_base, src_base)
        return b.count

    def execute_window(self, lo: int, hi: int, dst_base: int, src_base: int, *, by_dst: bool = False) -> int:
        """Copy the parts of the runs whose sources (or destinations,
        ``by_dst``) lie in ``[lo, hi)``; that side must ascend (a stream).
        The first copy of a window costs ``O(log runs + runs in it)``; the
        window's batches are kept, so the next costs the bytes. Returns the
        number of runs copied."""
        b = self._batched((lo, hi, by_dst), lambda: self.window(lo, hi, by_dst=by_dst)[:3])
        b.run(dst_base, src_base)
        return b.count

    def _batched(self, key: Any, runs: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]]) -> "Batches":
        """The kept batches of a window (made on first use); the least
        recently used of more than ``_KEPT_WINDOWS`` windows are let go
        (a stream's chunks at arbitrary places never repeat)."""
        key = (key, copy_threads())
        b = self._batches.pop(key, None)
        if b is None:
            if len(self._batches) >= _KEPT_WINDOWS:
                del self._batches[next(iter(self._batches))]
            d, s, n = runs()
            b = batches(d, s, n, apart=self.apart)
        self._batches[key] = b  # re-inserted: most recently used last
        return b

    def window(self, lo: int, hi: int, *, by_dst: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(dst, src, nbytes, heads)`` of the runs cut to the part whose
        destination (``by_dst``) or source lies in ``[lo, hi)``; that side
        must ascend."""
        key = self.dst if by_dst else self.src
        if self._ends is None or self._ends[1] is not by_dst:
            self._ends = (key + self.nbytes, by_dst)
        end = self._ends[0]
        first = int(np.searchsorted(end, lo, side="right"))
        last = int(np.searchsorted(key, hi, side="left"))
        k0 = key[first:last]
        skip = np.maximum(k0, lo) - k0
        n = np.minimum(end[first:last], hi) - k0 - skip
        return self.dst[first:last] + skip, self.src[first:last] + skip, n, self.heads[first:last]


_EMPTY = np.zeros(0, dtype=np.int64)

# Windows whose batches a CopyPlan keeps (a streamed plan's pieces, a few
# block geometries), least recently used let go first.
_KEPT_WINDOWS = 64
