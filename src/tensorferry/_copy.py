"""Byte copies at memory speed.

One core's ``memcpy`` does not saturate memory bandwidth: on the machines we
measured one thread copies 1 GiB in 0.095 s and two threads in 0.054 s. So a
large host-to-host copy is split into equal-byte parts that run at once, on a
small module-wide thread pool; each part is a batch of runs moved by
``_memcpy.copy_runs`` (a C loop of memmove over int64 arrays, the GIL
released: a run costs its bytes, not a Python call; large batches use
streaming stores). Where the extension was not built (no C compiler), a part
is a Python loop of libc ``memmove`` through ctypes, about 1 us a run.
The same extension converts float32 into bfloat16 and float16 for
``copy_converting`` (``_memcpy.convert_runs``), as torch does, bit for bit.

torch's ``copy_`` of a large CPU uint8 tensor runs about 1.5x slower than
libc ``memcpy`` here (0.25 s against 0.16 s for 1 GiB), so dense host
tensors are copied by address; anything strided, conjugated or negated, and
anything on a device, goes through torch.

``TENSORFERRY_COPY_THREADS`` sets how many threads one copy uses (default:
the CPUs this process may run on, at most 4; ``1`` turns the split off).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from . import packing
from ._tensors import data_ptrs, torch_dtype
from .errors import ConfigurationError, TransferError

try:
    from . import _memcpy as _native
except ImportError:  # installed without a C compiler: Python loops, slower per run
    _native = None
    import logging

    logging.getLogger("tensorferry").warning(
        "tensorferry._memcpy was not built (no C compiler when tensorferry was installed): copies of many small "
        "tensors and dtype conversions take slower Python paths; install a C compiler and reinstall tensorferry"
    )

__all__ = [
    "Batches",
    "CopyPlan",
    "StagedCopy",
    "batches",
    "copy_bytes",
    "copy_converting",
    "copy_from_blocks",
    "copy_staged",
    "copy_values",
    "target_addresses",
    "copy_threads",
    "dense_host_mask",
    "fill_aliases",
    "executor",
    "finish",
    "destinations_apart",
    "many_small_runs",
    "memmove_runs",
    "run_parts",
    "scatter_segments",
    "vectored_io",
]

# Below this, copy_bytes leaves the copy to torch's copy_ (lower per-call cost).
_RAW_MIN_NBYTES = 1 << 16

# A copy is split across threads only when it is big enough for the split
# to pay (thread hand-off is ~50 us) and its runs are long enough that the
# threads spend their time in memmove, not taking turns at the GIL.
_PARALLEL_MIN_NBYTES = 16 << 20
_PARALLEL_MIN_MEAN_RUN = 64 << 10  # without the C loop (a Python call a run)

# A batch moving at least this many bytes uses streaming stores (C loop,
# x86-64): its destination would not stay in the cache anyway. 100k runs of
# 10 KiB: 116 ms against 185 ms for a loop of memmove here.
_STREAM_MIN_NBYTES = 8 << 20

# Parts start on page boundaries of the concatenated runs: two threads
# never write into the same cache line.
_PART_ALIGNMENT = 4096

_MAX_DEFAULT_THREADS = 4

_ENV = "TENSORFERRY_COPY_THREADS"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()

# Threads of the one pool every background copy of this process runs on:
# parallel memcpy parts, the copy-out of streamed chunks, moving the bytes
# while views are built. A wait never blocks on a part that has not started
# (it runs it itself, see run_parts), so nested use cannot deadlock.
_POOL_THREADS = 8
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


def executor() -> ThreadPoolExecutor:
    """The process's one pool of copy threads (made on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_POOL_THREADS, thread_name_prefix="tensorferry-copy")
        return _pool


def _forget_pool_in_child() -> None:
    # A forked child has the pool object but none of its threads.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def finish(future: Any, fn: Any, *args: Any) -> Any:
    """Wait for ``future`` = ``submit(fn, *args)``; if no thread has started
    it yet, run it here instead. A wait on the copy threads never depends on
    a free one, so work submitted from a copy thread cannot deadlock."""
    if future.cancel():
        return fn(*args)
    return future.result()


def run_parts(fn: Any, parts: Sequence[tuple[Any, ...]]) -> None:
    """``fn(*part)`` for every part at once: the first on this thread, the
    rest on the copy threads. Returns when all are done; the first error is
    raised. A part no thread has started by the time this thread gets to it
    is run here instead (cancelled in the pool): a wait never depends on a
    free thread, so a part may itself call run_parts."""
    pool = executor()
    futures = [pool.submit(fn, *part) for part in parts[1:]]
    errors: list[BaseException] = []
    try:
        fn(*parts[0])
    except BaseException as exc:  # still wait: the caller frees the memory on return
        errors.append(exc)
    for part, f in zip(parts[1:], futures):
        try:
            finish(f, fn, *part)
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _memmove_serial(dst: Sequence[int], src: Sequence[int], lengths: Sequence[int]) -> None:
    move = ctypes.memmove
    for d, s, n in zip(dst, src, lengths):
        move(d, s, n)


def _copy_serial(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, stream: bool, dst_base: int = 0, src_base: int = 0) -> None:
    """The runs in order on this thread, each at its address plus the base:
    the C loop (int64 arrays, C order), else memmove a run through ctypes."""
    if _native is not None:
        _native.copy_runs(dst.ctypes.data, src.ctypes.data, lengths.ctypes.data, int(lengths.size), stream, dst_base, src_base)
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
    threads = copy_threads() if total >= _PARALLEL_MIN_NBYTES else 1
    if (
        threads == 1
        or (_native is None and total < _PARALLEL_MIN_MEAN_RUN * count)
        or (count > 1 and not (apart if apart is not None else destinations_apart(dst, lengths)))
    ):
        return Batches([(dst, src, lengths)], stream, count)
    return Batches(_parts(dst, src, lengths, threads), stream, count)


def memmove_runs(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, *, apart: bool | None = None) -> None:
    """``memmove(dst[i], src[i], lengths[i])`` for every i, on several
    threads when it pays (see :func:`batches`). Returns when every byte has
    been copied; an error in any part is raised here."""
    batches(dst, src, lengths, apart=apart).run()


# Buffers per preadv/pwritev call (the kernel's limit, UIO_MAXIOV).
_IOV_MAX = 1024

# A kept plan whose runs are at least this many and average less than
# _SMALL_RUN_NBYTES moves them through a memory file with preadv/pwritev:
# the kernel copies 1024 buffers a call, where a Python loop of memmove pays
# about 1 us a run (100k runs of 2.5 KiB: 45-60 ms against 85-95 ms here).
_VECTORED_MIN_RUNS = 256
_SMALL_RUN_NBYTES = 64 << 10


def many_small_runs(nbytes: np.ndarray) -> bool:
    """Whether runs of these sizes move faster by vectored I/O (or a gather
    of tensors) than by memmove: only without the C loop."""
    return _native is None and nbytes.size >= _VECTORED_MIN_RUNS and int(nbytes.sum()) < _SMALL_RUN_NBYTES * nbytes.size


def vectored_io(op: Any, fd: int, buffers: Sequence[Any], offset: int) -> None:
    """``op`` (``os.preadv`` or ``os.pwritev``) of ``buffers``, back to back
    from file byte ``offset``, ``_IOV_MAX`` buffers a call; a short transfer
    is resumed where it stopped. A large one is split into parts of about
    equal bytes run at once on the copy threads (the kernel copies without
    the GIL), as memmove copies are.

    Raises:
        TransferError: the file ends first.
        OSError: the system call failed.
    """
    count = len(buffers)
    if count > _IOV_MAX:
        lengths = np.fromiter(map(len, buffers), dtype=np.int64, count=count)
        total = int(lengths.sum())
        threads = copy_threads() if total >= _PARALLEL_MIN_NBYTES else 1
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
    for i in range(0, len(buffers), _IOV_MAX):
        chunk = list(buffers[i : i + _IOV_MAX])
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


def copy_converting(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair of 1-D host tensors of one length
    (a dtype conversion, sender side: a kept plan's ``dtype=``), split into
    equal parts on the copy threads when large.

    float32 into bfloat16 or float16, dense on both sides, goes through
    ``_memcpy.convert_runs`` (a vectorised C loop, streaming stores for
    large outputs, bit for bit what torch writes: see
    :func:`_native_conversions`); the rest through torch's ``copy_``, which
    converts without the GIL too.
    """
    kinds = _native_conversions()
    native: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    rest = []
    for d, src in pairs:
        kind = kinds.get(d.dtype) if src.dtype == torch.float32 else None
        if kind is not None and d.numel() == src.numel() and _dense_host(d) and _dense_host(src):
            if d.numel():
                native.setdefault(kind, []).append((d, src))
        else:
            rest.append((d, src))
    for (kind, nan), group in native.items():
        _convert_native(group, kind, nan)
    if rest:
        _convert_torch(rest)


def _dense_host(t: torch.Tensor) -> bool:
    return t.is_cpu and t.is_contiguous() and not t.is_neg()


def _convert_native(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], kind: int, nan: int) -> None:
    """float32 pairs converted by ``convert_runs`` (``kind``, ``nan`` from
    :func:`_native_conversions`), in element-equal parts on the copy threads."""
    count = len(pairs)
    dst = np.fromiter((d.data_ptr() for d, _ in pairs), dtype=np.int64, count=count)
    src = np.fromiter((s.data_ptr() for _, s in pairs), dtype=np.int64, count=count)
    nelems = np.fromiter((d.numel() for d, _ in pairs), dtype=np.int64, count=count)
    out_nbytes = 2 * int(nelems.sum())
    stream = out_nbytes >= _STREAM_MIN_NBYTES
    threads = copy_threads() if out_nbytes >= _PARALLEL_MIN_NBYTES else 1
    parts = [(dst, src, nelems)] if threads == 1 else _parts(dst, src, nelems, threads, dst_size=2, src_size=4)
    run_parts(_convert_serial, [(d, s, n, kind, stream, nan) for d, s, n in parts])


def _convert_serial(dst: np.ndarray, src: np.ndarray, nelems: np.ndarray, kind: int, stream: bool, nan: int) -> None:
    _native.convert_runs(dst.ctypes.data, src.ctypes.data, nelems.ctypes.data, int(nelems.size), kind, stream, 0, 0, nan)


def _convert_torch(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    total = sum(d.numel() * d.element_size() for d, _ in pairs)
    threads = copy_threads() if total >= _PARALLEL_MIN_NBYTES else 1
    if threads == 1:
        for d, src in pairs:
            d.copy_(src)
        return
    step = -(-sum(d.numel() for d, _ in pairs) // threads)
    parts = []
    for d, src in pairs:
        for i in range(0, d.numel(), step):
            parts.append((d[i : i + step], src[i : i + step]))
    run_parts(_copy_into, parts)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


# float32 bit patterns of every class a conversion treats apart: NaNs of
# both signs, quiet and signalling, with payloads above and below the 16
# bits bfloat16 keeps; infinities; zeros; float32 denormals; ties that round
# to even down and up; the largest finite values, which round to inf in
# bfloat16 (0x7f7f8000 and up) or float16 (65520 and up, 0x477ff000); float16's
# denormal range and its smallest tie (2**-25).
_PROBE_BITS = (
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA5A5A5, 0xFFFFFFFF, 0x7F80FFFF, 0x7FBF0000,
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00400000,
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF818000,
    0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000,
    0x33800000, 0x33000000, 0x33000001, 0xB3000000, 0x387FC000, 0x38800000, 0x38801000, 0x38803000,
)

# dtype -> (convert_runs kind, bfloat16 NaN bits) where the C loop matches
# torch; None until first use.
_native_kinds: dict[torch.dtype, tuple[int, int]] | None = None


def _native_conversions() -> dict[torch.dtype, tuple[int, int]]:
    """The conversions from float32 that ``convert_runs`` makes exactly as
    torch's ``copy_`` does in this process, learnt once: torch's bfloat16
    NaN (one pattern whatever the payload; 0xffff from its vectorised CPU
    kernels, 0x7fc0 from its scalar one, so it depends on the CPU and on
    ``ATEN_CPU_CAPABILITY``), then every kind checked against torch on
    ``_PROBE_BITS`` and random values, at an unaligned destination, through
    the vector body, head and tail. A kind that differs stays with torch."""
    global _native_kinds
    if _native is None:
        return {}
    if _native_kinds is None:
        rng = np.random.default_rng(0)
        bits = np.concatenate([np.array(_PROBE_BITS, dtype=np.uint32), rng.integers(0, 1 << 32, size=700, dtype=np.uint32)])
        values = torch.from_numpy(bits.view(np.float32))
        nan = int(torch.full((64,), float("nan")).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF
        found = {}
        for dtype, kind in ((torch.bfloat16, _native.BFLOAT16), (torch.float16, _native.FLOAT16)):
            want = values.to(dtype)
            got = torch.empty(values.numel() + 1, dtype=dtype)[1:]
            try:
                _convert_serial(*(np.array([x], dtype=np.int64) for x in (got.data_ptr(), values.data_ptr(), values.numel())), kind, True, nan)
            except ValueError:  # float16 on a CPU without F16C
                continue
            if torch.equal(got.view(torch.int16), want.view(torch.int16)):
                found[dtype] = (kind, nan)
        _native_kinds = found
    return _native_kinds


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy 1-D uint8 ``src`` into 1-D uint8 ``dst`` of the same size."""
    n = dst.numel()
    if n >= _RAW_MIN_NBYTES and dst.device.type == "cpu" and src.device.type == "cpu":
        if src.numel() != n:
            raise ConfigurationError(f"copy_bytes: the source holds {src.numel():,} bytes, the destination {n:,}; pass views of one size")
        memmove_runs(np.array([dst.data_ptr()], dtype=np.int64), np.array([src.data_ptr()], dtype=np.int64), np.array([n], dtype=np.int64))
    else:
        dst.copy_(src)


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


def target_addresses(targets: Sequence[torch.Tensor], ok: np.ndarray) -> np.ndarray:
    """int64 address of each target where ``ok`` (written by address), 0 elsewhere."""
    dst = np.zeros(len(targets), dtype=np.int64)
    if ok.any():
        dst[ok] = data_ptrs(targets)[ok]
    return dst


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
        block_start = np.zeros(len(block_nbytes), dtype=np.int64)
        if len(block_nbytes) > 1:
            block_start[1:] = np.cumsum(np.asarray(block_nbytes, dtype=np.int64))[:-1]
        block_of = np.repeat(np.arange(len(block_nbytes)), np.diff(np.asarray(bounds, dtype=np.int64)))
        start = block_start[block_of] + np.asarray(offsets, dtype=np.int64)
        n = np.asarray(nbytes, dtype=np.int64)
        ok = dense_host_mask(targets)
        dst = target_addresses(targets, ok)
        self._fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in np.flatnonzero(~ok & (n > 0)).tolist():
            staged = torch.empty(int(n[i]), dtype=torch.uint8)
            dst[i] = staged.data_ptr()
            self._fixups.append((staged, targets[i]))
        # In stream coordinates: sources ascend (tensors never overlap).
        self.plan = CopyPlan.build(dst, start, n)

    @classmethod
    def into_blocks(cls, dests: Sequence[torch.Tensor]) -> "StagedCopy":
        """A stream of whole blocks into ``dests`` (1-D uint8, one per block, in order)."""
        sizes = np.array([d.numel() for d in dests], dtype=np.int64)
        return cls(sizes.tolist(), np.arange(sizes.size + 1), np.zeros(sizes.size, dtype=np.int64), sizes, dests)

    def __call__(self, pos: int, k: int, base: int) -> None:
        self.plan.execute_window(pos, pos + k, 0, base - pos)

    def finish(self) -> None:
        """Copy the staged bytes of targets that could not be written by address."""
        copy_staged(self._fixups)


def fill_aliases(layout: Any, targets: Sequence[torch.Tensor]) -> None:
    """into= targets of tensors sent once under two names (tied weights):
    the bytes landed in the first target; a second one that is not the
    same view (untied on this side) gets a copy of it."""
    for dup, orig in layout.aliases.tolist():
        a, b = targets[dup], targets[orig]
        if a is b or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.device == b.device):
            continue
        with _writable([a]):
            a.copy_(b)


def copy_staged(fixups: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``target.copy_(staged bytes)`` for each (1-D uint8 staged, target) pair;
    targets may be parameters that require grad."""
    with _writable([t for _, t in fixups]):
        for staged, t in fixups:
            t.copy_(staged.view(t.dtype).view(t.shape))


def _writable(targets: Sequence[torch.Tensor]) -> Any:
    """The mode in-place copies into ``targets`` run in: no_grad, or where
    one was made under torch.inference_mode() (which refuses in-place writes
    outside it) inference_mode, in which writes into the others still bump
    their version counters."""
    return torch.inference_mode() if any(t.is_inference() for t in targets) else torch.no_grad()


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
    if all(blk.device.type == "cpu" for blk in blocks):
        ok = dense_host_mask(targets)
    else:
        ok = np.zeros(count, dtype=bool)
    plan = CopyPlan.build(target_addresses(targets, ok), src, nbytes, raw=ok)
    plan.execute()
    rest = plan.elementwise
    if rest.size:
        block_of = np.searchsorted(bounds, rest, side="right") - 1
        with _writable([targets[i] for i in rest.tolist()]):
            for i, b in zip(rest.tolist(), block_of.tolist()):
                t = targets[i]
                off = int(offsets[i])
                t.copy_(blocks[b][off : off + int(nbytes[i])].view(t.dtype).view(t.shape))


def pack_leaves(leaves: Sequence[torch.Tensor], info: Any, dst: np.ndarray, out: torch.Tensor, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
    """Copy leaves into ``out`` (sender side): leaf ``i``'s bytes belong at
    offset ``dst[i]``, and the bytes that fall in ``[lo, hi)`` are written to
    ``out[dst[i] - lo ...]`` (a whole object: ``lo=0``; a streamed piece:
    its byte range). Executes the leaves' copy plan: one copy per run of
    tensors adjacent in their memory and in ``out``; tensors that are not
    raw bytes are copied value by value.

    Returns:
        ``(runs, elementwise)``: copies issued for runs, and tensors copied
        value by value.
    """
    nbytes = info.layout.nbytes
    whole = hi is None  # the destinations may then lie in any order (blocks)
    hi = (1 << 62) if whole else hi
    host = info.all_cpu and out.device.type == "cpu"
    # On the host a run may be copied by address, so touching in memory is
    # enough. Device copies go through a storage's tensor, so there a run
    # must also stay inside one storage.
    breaks = None
    sptrs = info.storage_ptrs
    if not host:
        if sptrs is None:  # host leaves into a device pool
            sptrs = np.fromiter((t.untyped_storage().data_ptr() for t in leaves), dtype=np.int64, count=len(leaves))
        breaks = np.zeros(len(leaves), dtype=bool)
        breaks[1:] = sptrs[1:] != sptrs[:-1]
    plan = CopyPlan.build(dst, info.data_ptrs, nbytes, raw=info.raw, breaks=breaks)
    if whole:
        d, src, n, heads = plan.dst, plan.src, plan.nbytes, plan.heads
    else:
        d, src, n, heads = plan.window(lo, hi, by_dst=True)
    if host:
        memmove_runs(d + (out.data_ptr() - lo), src, n)
    else:
        storages: dict[tuple[int, str], torch.Tensor] = {}
        for d0, s0, k, i in zip(d.tolist(), src.tolist(), n.tolist(), heads.tolist()):
            t = leaves[i]
            key = (int(sptrs[i]), str(t.device))
            storage = storages.get(key)
            if storage is None:
                st = t.untyped_storage()
                storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
                storages[key] = storage
            off = s0 - key[0]
            copy_bytes(out[d0 - lo : d0 - lo + k], storage[off : off + k])
    return int(n.size), copy_values(leaves, info.layout, dst, out, lo, hi, plan.elementwise)


def copy_values(leaves: Sequence[torch.Tensor], layout: Any, dst: np.ndarray, out: torch.Tensor, lo: int, hi: int, indices: np.ndarray) -> int:
    """Copy the leaves ``indices`` value by value into ``out`` (sender side):
    leaf ``i`` belongs at byte ``dst[i]`` as the layout's dtype (converted
    when that differs from the leaf's), and only its bytes in ``[lo, hi)``
    are written, at ``out[... - lo]``. Returns how many were copied."""
    nbytes, codes = layout.nbytes, layout.dtype_codes
    copied = 0
    with torch.no_grad():
        for i in indices.tolist():
            start, size = int(dst[i]), int(nbytes[i])
            a, b = max(lo, start), min(hi, start + size)
            if a >= b:
                continue
            t = leaves[i]
            dtype = torch_dtype(int(codes[i]))
            value = t.resolve_conj().resolve_neg() if (t.is_conj() or t.is_neg()) else t
            if a == start and b == start + size:
                out[start - lo : start - lo + size].view(dtype).view(t.shape).copy_(value)
            else:  # a piece boundary cuts the tensor: its bytes, then the part
                part = value.to(dtype).contiguous().reshape(-1).view(torch.uint8)[a - start : b - start]
                copy_bytes(out[a - lo : b - lo], part.to(out.device))
            copied += 1
    return copied


def scatter_segments(layout: Any, block_nbytes: list[int], targets: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The byte stream of the blocks as a list of destination segments:
    each target tensor's own memory where it is dense, a scratch buffer for
    alignment gaps and for targets that are not (copied after by
    :func:`copy_staged`): tcp's into= straight off the socket."""
    groups = packing.group_by_block(layout.nbytes, layout.alignments, block_nbytes)
    nbytes = layout.nbytes.tolist()
    offsets = groups.offsets.tolist()
    bounds = groups.bounds.tolist()
    # Alignment gaps are < 16 bytes each: one small scratch covers them all.
    scratch = torch.empty(16 * (layout.num_tensors + len(block_nbytes)) + 16, dtype=torch.uint8)
    spos = 0
    segments: list[torch.Tensor] = []
    fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
    for b in range(len(block_nbytes)):
        cursor = 0
        for i in range(bounds[b], bounds[b + 1]):
            n = nbytes[i]
            if not n:
                continue
            gap = offsets[i] - cursor
            if gap:
                segments.append(scratch[spos : spos + gap])
                spos += gap
            t = targets[i]
            if t.is_contiguous() and t.device.type == "cpu" and not t.is_conj() and not t.is_neg():
                segments.append(t.detach().reshape(-1).view(torch.uint8))
            else:
                staged = torch.empty(n, dtype=torch.uint8)
                segments.append(staged)
                fixups.append((staged, t))
            cursor = offsets[i] + n
    return segments, fixups
