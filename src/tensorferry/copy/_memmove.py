"""Runs of bytes moved by address: batches of memmove (the C loop, split
across the copy threads when large) and vectored file I/O (preadv/pwritev)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigurationError, TransferError
from ..wire.protocol import IOV_MAX
from . import _native, _threads
from ._threads import copy_threads, run_parts

__all__ = ["Batches", "batches", "copy_bytes", "destinations_apart", "many_small_runs", "memmove_runs", "vectored_io"]

# Below this, copy_bytes leaves the copy to torch's copy_ (lower per-call cost).
_RAW_MIN_NBYTES = 1 << 16

_PARALLEL_MIN_MEAN_RUN = 64 << 10  # without the C loop (a Python call a run)

# A batch moving at least this many bytes uses streaming stores (C loop,
# x86-64): its destination would not stay in the cache anyway. 100k runs of
# 10 KiB: 116 ms against 185 ms for a loop of memmove here.
_STREAM_MIN_NBYTES = 8 << 20

# Parts start on page boundaries of the concatenated runs: two threads
# never write into the same cache line.
_PART_ALIGNMENT = 4096


def _memmove_serial(dst: Sequence[int], src: Sequence[int], lengths: Sequence[int]) -> None:
    move = ctypes.memmove
    for d, s, n in zip(dst, src, lengths):
        move(d, s, n)


def _copy_serial(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, stream: bool, dst_base: int = 0, src_base: int = 0) -> None:
    """The runs in order on this thread, each at its address plus the base:
    the C loop (int64 arrays, C order), else memmove a run through ctypes."""
    if _native.loop is not None:
        _native.loop.copy_runs(dst.ctypes.data, src.ctypes.data, lengths.ctypes.data, int(lengths.size), stream, dst_base, src_base)
    else:
        _memmove_serial((dst + dst_base).tolist(), (src + src_base).tolist(), lengths.tolist())


def _parts(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, k: int, dst_size: int = 1, src_size: int = 1) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Split runs into ``k`` parts of about equal length, cutting runs at
    the seams. Lengths count elements of ``dst_size`` bytes at the
    destination and ``src_size`` at the source (bytes: 1 and 1)."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    total = int(ends[-1])
    step = -(-total // k)
    step = -(-step // _PART_ALIGNMENT) * _PART_ALIGNMENT
    out = []
    for lo in range(0, total, step):
        hi = min(lo + step, total)
        first = int(np.searchsorted(ends, lo, side="right"))
        last = int(np.searchsorted(starts, hi, side="left"))
        s = np.maximum(starts[first:last], lo)
        e = np.minimum(ends[first:last], hi)
        skip = s - starts[first:last]
        out.append((dst[first:last] + skip * dst_size, src[first:last] + skip * src_size, e - s))
    return out


def destinations_apart(dst: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether no two runs write the same byte (ascending destinations are
    checked in one pass; others are sorted first)."""
    if dst.size < 2:
        return True
    if bool((dst[1:] >= dst[:-1] + lengths[:-1]).all()):
        return True
    order = np.argsort(dst, kind="stable")
    d, n = dst[order], lengths[order]
    return not bool((d[1:] < d[:-1] + n[:-1]).any())


class Batches:
    """Runs split for one copy: one batch (this thread), or equal-byte
    parts run at once on the copy threads; made by :func:`batches`, run any
    number of times at any base addresses (a kept plan makes them once)."""

    __slots__ = ("parts", "stream", "count")

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], stream: bool, count: int) -> None:
        self.parts, self.stream = parts, stream
        self.count = count  # runs, before any was cut at a seam

    def run(self, dst_base: int = 0, src_base: int = 0) -> None:
        """Copy every run at ``dst_base + dst[i]`` from ``src_base + src[i]``
        (one part: on this thread). Returns when every byte has been
        copied; an error in any part is raised here."""
        if len(self.parts) == 1:
            _copy_serial(*self.parts[0], self.stream, dst_base, src_base)
        elif self.parts:
            run_parts(_copy_serial, [(d, s, n, self.stream, dst_base, src_base) for d, s, n in self.parts])


def batches(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, *, apart: bool | None = None) -> Batches:
    """How ``memmove(dst[i], src[i], lengths[i])`` for every i runs: on
    several threads when it pays, else in order on the calling thread.

    Arguments are int64 arrays of addresses (or offsets from the bases
    given to :meth:`Batches.run`) and byte counts. ``apart``: whether no two
    runs write the same byte, if the caller knows (a kept plan does); else
    it is checked. Runs that do overlap are copied in order on one thread:
    the later one wins, as with a loop of ``copy_``. Parallel parts also
    assume that no run reads what another writes (every caller copies
    between separate buffers).

    Raises:
        TransferError: a negative byte count (the C loop would read it as huge).
    """
    count = int(lengths.size)
    if count == 0:
        return Batches([], False, 0)
    dst, src, lengths = (np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, lengths))
    if int(lengths.min()) < 0:
        raise TransferError(
            f"copy runs: {int((lengths < 0).sum()):,} negative byte counts (the first {int(lengths[lengths < 0][0]):,}); "
            "nothing was copied: the runs were computed wrong (a tensorferry bug: please report it)"
        )
    total = int(lengths.sum())
    stream = total >= _STREAM_MIN_NBYTES
    threads = copy_threads() if total >= _threads.PARALLEL_MIN_NBYTES else 1
    if (
        threads == 1
        or (_native.loop is None and total < _PARALLEL_MIN_MEAN_RUN * count)
        or (count > 1 and not (apart if apart is not None else destinations_apart(dst, lengths)))
    ):
        return Batches([(dst, src, lengths)], stream, count)
    return Batches(_parts(dst, src, lengths, threads), stream, count)


def memmove_runs(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, *, apart: bool | None = None) -> None:
    """``memmove(dst[i], src[i], lengths[i])`` for every i, on several
    threads when it pays (see :func:`batches`). Returns when every byte has
    been copied; an error in any part is raised here."""
    batches(dst, src, lengths, apart=apart).run()



# A kept plan whose runs are at least this many and average less than
# _SMALL_RUN_NBYTES moves them through a memory file with preadv/pwritev:
# the kernel copies 1024 buffers a call, where a Python loop of memmove pays
# about 1 us a run (100k runs of 2.5 KiB: 45-60 ms against 85-95 ms here).
_VECTORED_MIN_RUNS = 256
_SMALL_RUN_NBYTES = 64 << 10


def many_small_runs(nbytes: np.ndarray) -> bool:
    """Whether runs of these sizes move faster by vectored I/O (or a gather
    of tensors) than by memmove: only without the C loop."""
    return _native.loop is None and nbytes.size >= _VECTORED_MIN_RUNS and int(nbytes.sum()) < _SMALL_RUN_NBYTES * nbytes.size


def vectored_io(op: Any, fd: int, buffers: Sequence[Any], offset: int) -> None:
    """``op`` (``os.preadv`` or ``os.pwritev``) of ``buffers``, back to back
    from file byte ``offset``, ``IOV_MAX`` buffers a call; a short transfer
    is resumed where it stopped. A large one is split into parts of about
    equal bytes run at once on the copy threads (the kernel copies without
    the GIL), as memmove copies are.

    Raises:
        TransferError: the file ends first.
        OSError: the system call failed.
    """
    count = len(buffers)
    if count > IOV_MAX:
        lengths = np.fromiter(map(len, buffers), dtype=np.int64, count=count)
        total = int(lengths.sum())
        threads = copy_threads() if total >= _threads.PARALLEL_MIN_NBYTES else 1
        if threads > 1:
            ends = np.cumsum(lengths)
            cuts = np.searchsorted(ends, np.arange(1, threads) * (total // threads), side="left") + 1
            bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < count)), count]
            parts = [(op, fd, buffers[a:b], offset + (int(ends[a - 1]) if a else 0)) for a, b in zip(bounds, bounds[1:])]
            run_parts(_vectored_serial, parts)
            return
    _vectored_serial(op, fd, buffers, offset)


def _vectored_serial(op: Any, fd: int, buffers: Sequence[Any], offset: int) -> None:
    pos = offset
    for i in range(0, len(buffers), IOV_MAX):
        chunk = list(buffers[i : i + IOV_MAX])
        want = sum(map(len, chunk))
        while want:
            done = op(fd, chunk, pos)
            if done <= 0:
                raise TransferError(f"{op.__name__} moved {done} bytes at file offset {pos:,} ({want:,} left): the file ends there")
            pos += done
            want -= done
            if want:  # a short transfer: go on from the first byte it left
                ends = np.cumsum(np.fromiter(map(len, chunk), dtype=np.int64, count=len(chunk)))
                k = int(np.searchsorted(ends, done, side="right"))
                into = done - (int(ends[k - 1]) if k else 0)
                chunk = chunk[k:]
                if into:
                    chunk[0] = chunk[0][into:]


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy 1-D uint8 ``src`` into 1-D uint8 ``dst`` of the same size."""
    n = dst.numel()
    if n >= _RAW_MIN_NBYTES and dst.device.type == "cpu" and src.device.type == "cpu":
        if src.numel() != n:
            raise ConfigurationError(f"copy_bytes: the source holds {src.numel():,} bytes, the destination {n:,}; pass views of one size")
        memmove_runs(np.array([dst.data_ptr()], dtype=np.int64), np.array([src.data_ptr()], dtype=np.int64), np.array([n], dtype=np.int64))
    else:
        dst.copy_(src)
