"""A byte stream as buffers over host memory someone else owns (no copy):
tcp's scatter/gather lists and vectored I/O over a plan's runs."""

from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["BufferList", "buffer_at"]


def buffer_at(address: int, nbytes: int) -> memoryview:
    """A writable byte buffer over host memory someone else owns (no copy)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")



class BufferList:
    """A byte stream ``[0, total)`` as buffers over host memory, made once:
    run ``i`` (stream bytes from ``pos[i]``, ``nbytes[i]`` long, ascending
    and apart) is the memory at ``address[i]``; the gaps between runs (and
    after the last) share one scratch (zeros to send, or bytes to drop).
    :meth:`window` cuts the list to any range without touching the rest."""

    def __init__(self, pos: np.ndarray, address: np.ndarray, nbytes: np.ndarray, total: int) -> None:
        bufs: list[memoryview] = []
        starts: list[int] = []
        gaps: list[tuple[int, int]] = []
        at = 0
        for p, a, n in zip(pos.tolist(), address.tolist(), nbytes.tolist()):
            if p > at:
                gaps.append((len(bufs), p - at))
                bufs.append(memoryview(b""))
                starts.append(at)
            bufs.append(buffer_at(a, n))
            starts.append(p)
            at = p + n
        if at < total:
            gaps.append((len(bufs), total - at))
            bufs.append(memoryview(b""))
            starts.append(at)
        self.scratch = bytearray(max((k for _, k in gaps), default=0))
        for i, k in gaps:
            bufs[i] = memoryview(self.scratch)[:k]
        self.bufs = bufs
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = self.starts + np.fromiter(map(len, bufs), dtype=np.int64, count=len(bufs))

    def window(self, lo: int, hi: int) -> list[memoryview]:
        """The buffers of stream bytes ``[lo, hi)``, the first and last cut to it."""
        first = int(np.searchsorted(self.ends, lo, side="right"))
        last = int(np.searchsorted(self.starts, hi, side="left"))
        out = self.bufs[first:last]
        if out:
            s0, s1, e1 = int(self.starts[first]), int(self.starts[last - 1]), int(self.ends[last - 1])
            if s0 < lo or e1 > hi:
                if len(out) == 1:
                    out[0] = out[0][max(lo, s0) - s0 : min(hi, e1) - s0]
                else:
                    out[0] = out[0][max(lo, s0) - s0 :]
                    out[-1] = out[-1][: min(hi, e1) - s1]
        return out
