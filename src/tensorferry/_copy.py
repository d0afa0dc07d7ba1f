"""Byte copies at memory speed.

One core's ``memcpy`` does not saturate memory bandwidth: on the machines we
measured one thread copies 1 GiB in 0.095 s and two threads in 0.054 s. So a
large host-to-host copy is split into equal-byte parts that run at once, on a
small module-wide thread pool; each part is a list of ``memmove`` calls
(libc, through ctypes: memcpy speed, the GIL released, about 1 us a call and
no tensor objects per run).

torch's ``copy_`` of a large CPU uint8 tensor runs about 1.5x slower than
libc ``memcpy`` here (0.25 s against 0.16 s for 1 GiB), so dense host
tensors are copied by address; anything strided, conjugated or negated, and
anything on a device, goes through torch.

``TENSORFERRY_COPY_THREADS`` sets how many threads one copy uses (default:
the CPUs this process may run on, at most 4; ``1`` turns the split off).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter

import numpy as np
import torch

from .errors import ConfigurationError

__all__ = ["StagedCopy", "copy_bytes", "copy_from_blocks", "copy_staged", "copy_threads", "dense_host_mask", "memmove_runs", "new_host_bytes"]

# Below this, copy_bytes leaves the copy to torch's copy_ (lower per-call cost).
_RAW_MIN_NBYTES = 1 << 16

# A copy is split across threads only when it is big enough for the split
# to pay (thread hand-off is ~50 us) and its runs are long enough that the
# threads spend their time in memmove, not taking turns at the GIL.
_PARALLEL_MIN_NBYTES = 16 << 20
_PARALLEL_MIN_MEAN_RUN = 64 << 10

# Parts start on page boundaries of the concatenated runs: two threads
# never write into the same cache line.
_PART_ALIGNMENT = 4096

_MAX_DEFAULT_THREADS = 4

# New host memory of at least this size gets its own mapping with huge pages
# (TENSORFERRY_HUGE_PAGES=0: never).
_HUGE_MIN_NBYTES = 8 << 20
_HUGE_ENV = "TENSORFERRY_HUGE_PAGES"
_ENV = "TENSORFERRY_COPY_THREADS"

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()
_worker = threading.local()


def copy_threads() -> int:
    """How many threads one large copy uses (``TENSORFERRY_COPY_THREADS``)."""
    raw = os.environ.get(_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if not 1 <= value <= 64:
            raise ConfigurationError(f"{_ENV}={raw!r}: expected a whole number of threads from 1 to 64 (1 turns the parallel copy off)")
        return value
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_DEFAULT_THREADS, cpus))


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tensorferry-copy", initializer=_mark_worker)
            _pool_size = workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _mark_worker() -> None:
    _worker.active = True


def _forget_pool_in_child() -> None:
    # A forked child has the pool object but none of its threads.
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _memmove_serial(dst: Sequence[int], src: Sequence[int], lengths: Sequence[int]) -> None:
    move = ctypes.memmove
    for d, s, n in zip(dst, src, lengths):
        move(d, s, n)


def _parts(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, k: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Split runs into ``k`` parts of about equal bytes, cutting runs at the seams."""
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
        out.append(((dst[first:last] + skip).tolist(), (src[first:last] + skip).tolist(), (e - s).tolist()))
    return out


def _destinations_overlap(dst: np.ndarray, lengths: np.ndarray) -> bool:
    order = np.argsort(dst, kind="stable")
    d, n = dst[order], lengths[order]
    return bool((d[1:] < d[:-1] + n[:-1]).any())


def memmove_runs(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> None:
    """``memmove(dst[i], src[i], lengths[i])`` for every i, on several threads when it pays.

    Arguments are int64 arrays of host addresses and byte counts; the runs
    must not overlap one another's destinations. Returns when every byte
    has been copied; an error in any part is raised here.
    """
    count = int(lengths.size)
    if count == 0:
        return
    total = int(lengths.sum())
    threads = copy_threads() if total >= _PARALLEL_MIN_NBYTES else 1
    if (
        threads == 1
        or total < _PARALLEL_MIN_MEAN_RUN * count
        or getattr(_worker, "active", False)
        or (count > 1 and _destinations_overlap(dst, lengths))
    ):
        # In order, on this thread: where two runs write the same bytes
        # (one tensor given twice as a target), the later one wins, as with
        # a loop of copy_.
        _memmove_serial(dst.tolist(), src.tolist(), lengths.tolist())
        return
    parts = _parts(dst.astype(np.int64, copy=False), src.astype(np.int64, copy=False), lengths.astype(np.int64, copy=False), threads)
    pool = _executor(threads - 1)
    futures = [pool.submit(_memmove_serial, *part) for part in parts[1:]]
    try:
        _memmove_serial(*parts[0])
    finally:
        # Always wait: the caller may free or reuse the memory on return.
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error


def new_host_bytes(nbytes: int) -> torch.Tensor:
    """A new 1-D uint8 host tensor of ``nbytes`` (contents undefined).

    New memory costs a page fault per page on its first write, and at 4 KiB
    a page that is most of the cost of receiving into it: copying 1 GiB into
    ``torch.empty`` memory took 556 ms here, against 96 ms into memory
    already touched. A large one is therefore its own anonymous mapping
    with transparent huge pages asked for (``MADV_HUGEPAGE``; most kernels
    give them only to mappings that ask): faults of 2 MiB, and the same copy
    took 253 ms. The mapping goes back to the kernel when the last tensor
    sharing its storage is collected.

    Where the kernel compacts memory synchronously for such mappings
    (``/sys/kernel/mm/transparent_hugepage/defrag`` says ``madvise``) and
    memory is fragmented, a fault may wait for that compaction; set
    ``TENSORFERRY_HUGE_PAGES=0`` to get plain ``torch.empty`` memory.
    """
    if nbytes < _HUGE_MIN_NBYTES or not hasattr(mmap, "MADV_HUGEPAGE") or _huge_pages_off():
        return torch.empty(nbytes, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # no transparent huge pages here: plain pages, still correct
    return torch.from_numpy(np.frombuffer(m, dtype=np.uint8))


def _huge_pages_off() -> bool:
    raw = os.environ.get(_HUGE_ENV, "").strip()
    if raw in ("", "1"):
        return False
    if raw == "0":
        return True
    raise ConfigurationError(f"{_HUGE_ENV}={raw!r}: expected 1 (ask for transparent huge pages for new memory, the default) or 0 (never)")


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy 1-D uint8 ``src`` into 1-D uint8 ``dst`` of the same size."""
    n = dst.numel()
    if n >= _RAW_MIN_NBYTES and dst.device.type == "cpu" and src.device.type == "cpu":
        if src.numel() != n:
            raise ValueError(f"copy of {src.numel():,} bytes into {n:,}")
        memmove_runs(np.array([dst.data_ptr()], dtype=np.int64), np.array([src.data_ptr()], dtype=np.int64), np.array([n], dtype=np.int64))
    else:
        dst.copy_(src)


def _merge_adjacent(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge each run that continues the previous one on both sides into it."""
    if lengths.size < 2:
        return dst, src, lengths
    joins = np.zeros(lengths.size, dtype=bool)
    joins[1:] = (dst[1:] == dst[:-1] + lengths[:-1]) & (src[1:] == src[:-1] + lengths[:-1])
    if not joins.any():
        return dst, src, lengths
    heads = np.flatnonzero(~joins)
    ends = np.cumsum(lengths)
    stops = np.append(heads[1:], lengths.size) - 1
    return dst[heads], src[heads], ends[stops] - (ends[heads] - lengths[heads])


_get_is_cpu = attrgetter("is_cpu")


def dense_host_mask(targets: Sequence[torch.Tensor]) -> np.ndarray:
    """Which targets can be written by address: contiguous host tensors
    that are neither conjugated nor negated views (one pass per attribute)."""
    count = len(targets)
    ok = np.fromiter(map(torch.Tensor.is_contiguous, targets), dtype=bool, count=count)
    ok &= ~np.fromiter(map(torch.Tensor.is_neg, targets), dtype=bool, count=count)
    if any(map(torch.Tensor.is_complex, targets)):
        ok &= ~np.fromiter(map(torch.Tensor.is_conj, targets), dtype=bool, count=count)
    ok &= np.fromiter(map(_get_is_cpu, targets), dtype=bool, count=count)
    return ok


class StagedCopy:
    """Copies a byte stream that arrives a chunk at a time into its targets.

    The stream is the concatenation of an object's blocks (``block_nbytes``,
    tensor ``i`` at byte ``offsets[i]`` of block ``b`` for ``bounds[b] <= i
    < bounds[b + 1]``). Each call ``(pos, k, base)`` says that the ``k``
    bytes at host address ``base`` are stream bytes ``[pos, pos + k)``; the
    parts of every tensor in that range are copied by address, neighbours
    merged, as one (parallel) copy. Targets that cannot be written by
    address get a host buffer each, copied into them by :meth:`finish`.
    No view of any chunk is made, and no tensor object per call.
    """

    def __init__(self, block_nbytes: Sequence[int], bounds: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, targets: Sequence[torch.Tensor]) -> None:
        count = len(targets)
        block_start = np.zeros(len(block_nbytes), dtype=np.int64)
        if len(block_nbytes) > 1:
            block_start[1:] = np.cumsum(np.asarray(block_nbytes, dtype=np.int64))[:-1]
        block_of = np.repeat(np.arange(len(block_nbytes)), np.diff(np.asarray(bounds, dtype=np.int64)))
        start = block_start[block_of] + np.asarray(offsets, dtype=np.int64)
        n = np.asarray(nbytes, dtype=np.int64)
        ok = dense_host_mask(targets)
        dst = np.zeros(count, dtype=np.int64)
        raw = np.flatnonzero(ok)
        if raw.size:
            dst[raw] = np.fromiter(map(torch.Tensor.data_ptr, targets), dtype=np.int64, count=count)[raw]
        self._fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in np.flatnonzero(~ok & (n > 0)).tolist():
            staged = torch.empty(int(n[i]), dtype=torch.uint8)
            dst[i] = staged.data_ptr()
            self._fixups.append((staged, targets[i]))
        live = np.flatnonzero(n > 0)
        # Stream order: starts ascend, and so do ends (tensors never overlap).
        self._start = start[live]
        self._end = self._start + n[live]
        self._dst = dst[live]

    @classmethod
    def into_blocks(cls, dests: Sequence[torch.Tensor]) -> "StagedCopy":
        """A stream of whole blocks into ``dests`` (1-D uint8, one per block, in order)."""
        sizes = np.array([d.numel() for d in dests], dtype=np.int64)
        return cls(sizes.tolist(), np.arange(sizes.size + 1), np.zeros(sizes.size, dtype=np.int64), sizes, dests)

    def __call__(self, pos: int, k: int, base: int) -> None:
        lo = int(np.searchsorted(self._end, pos, side="right"))
        hi = int(np.searchsorted(self._start, pos + k, side="left"))
        if lo >= hi:
            return
        start = self._start[lo:hi]
        s = np.maximum(start, pos)
        e = np.minimum(self._end[lo:hi], pos + k)
        memmove_runs(*_merge_adjacent(self._dst[lo:hi] + (s - start), base + (s - pos), e - s))

    def finish(self) -> None:
        """Copy the staged bytes of targets that could not be written by address."""
        copy_staged(self._fixups)


def copy_staged(fixups: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``target.copy_(staged bytes)`` for each (1-D uint8 staged, target) pair;
    targets may be parameters that require grad."""
    with torch.no_grad():
        for staged, t in fixups:
            t.copy_(staged.view(t.dtype).view(t.shape))


def copy_from_blocks(blocks: Sequence[torch.Tensor], bounds: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, targets: Sequence[torch.Tensor]) -> None:
    """Copy packed tensors out of their blocks into ``targets``, making no views of the blocks.

    Tensor ``i`` lies in block ``b`` (``bounds[b] <= i < bounds[b + 1]``) at
    byte ``offsets[i]``, ``nbytes[i]`` long; ``targets[i]`` has its dtype and
    shape (the caller checked). Dense host targets are written by address,
    neighbours merged, as one (parallel) copy; any other target (strided,
    conjugated or negated, on a device) gets a typed view of its bytes and
    torch's ``copy_``.
    """
    count = len(targets)
    if count == 0:
        return
    src = np.empty(count, dtype=np.int64)
    for b, blk in enumerate(blocks):
        lo, hi = int(bounds[b]), int(bounds[b + 1])
        src[lo:hi] = offsets[lo:hi] + blk.data_ptr()
    live = nbytes > 0
    if all(blk.device.type == "cpu" for blk in blocks):
        ok = dense_host_mask(targets)
    else:
        ok = np.zeros(count, dtype=bool)
    raw = np.flatnonzero(ok & live)
    if raw.size:
        dst = np.fromiter(map(torch.Tensor.data_ptr, targets), dtype=np.int64, count=count)[raw]
        memmove_runs(*_merge_adjacent(dst, src[raw], nbytes[raw].astype(np.int64, copy=False)))
    rest = np.flatnonzero(~ok & live)
    if rest.size:
        block_of = np.searchsorted(bounds, rest, side="right") - 1
        with torch.no_grad():
            for i, b in zip(rest.tolist(), block_of.tolist()):
                t = targets[i]
                off = int(offsets[i])
                view = blocks[b][off : off + int(nbytes[i])].view(t.dtype).view(t.shape)
                t.copy_(view)
