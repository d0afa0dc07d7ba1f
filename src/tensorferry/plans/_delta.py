"""Delta plans: the version a sender's plan keeps, and what a receiver's plan holds.

A kept :class:`~tensorferry.plans.SendPlan` made with ``delta=True`` keeps
the version it last sent, packed in the one-block layout, in the sent dtype:
a lease of the sender's pool (so ``Sender.stats()`` and the monitor's pool
figures count it). Each put compares the current values (after the cast)
with it, bitwise, word by word (``tensorferry._diff``: one pass over each,
on the copy threads), updates it, and encodes the changed words per chunk in
the smallest of three encodings (positions, bitmap, the whole chunk).

Every put gets a fresh version id; its ticket carries the id and the base
(the id the delta is against). A receive plan records the id of the last
version it received whole or by delta; it applies a delta only when its id
is the base, so a receiver that skipped a put, joined late, restarted or
made its plan again gets the whole object from the same ticket. Ids are
random 63-bit numbers, never guessed from a count.

Sender and receiver compute the chunk table (offset, words, word size of
each chunk) from the layout with :func:`chunk_table`, so a record names
only its chunk's index.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from ..copy import PARALLEL_MIN_NBYTES, copy_threads, native_nan_bits, run_parts
from ..errors import ConfigurationError, PoolExhaustedError, ProtocolError
from ..memory import Block
from ..wire import Layout

try:
    from . import _diff as native
except ImportError:  # built without a C compiler: delta plans cannot be made
    native = None

if TYPE_CHECKING:
    from ..memory import Lease, MemoryPool, Packed

__all__ = ["ACROSS_HOSTS_MAX_FRACTION", "BF16", "RAW", "SAME_HOST_MAX_FRACTION", "ChunkTable", "DeltaPut", "DeltaVersion", "KeptBlock", "Values", "apply_delta", "apply_records", "chunk_table", "delta_runs", "new_version"]

# Words a chunk holds (the C module's CHUNK_WORDS): a position is a uint16.
CHUNK_WORDS = 4096
# The largest word compared: complex128 elements are compared as two words.
_MAX_WORD = 8
# At most this many puts refresh in a row after a delta too dense to pay.
_MAX_BACKOFF = 16
# On one host the whole object is a memory copy away (about 0.3 ns a
# bfloat16 here), and a delta costs a scattered write a changed word (about
# 10 ns) besides the compare: bench_delta's shm part (256 MiB of bfloat16,
# an idle machine) measured a delta of 0.37% of the bytes (0.1% of the
# elements changed) at 0.85x a full sync and one of 2.2% (1% changed) at
# 1.29x: past about 1% of the bytes the whole object is sent. Across hosts a byte not sent is link time saved, but a
# delta byte costs more than a whole-object byte (the compare, the encoded
# records, a scattered write a changed word on every receiver of a relay
# chain): bench_delta's namespace hosts (512 MiB bfloat16, 1 Gbit/s, four
# receivers in a chain) measured 10% changed (a delta of 0.16 of the bytes)
# at 0.43x a full sync and 50% (0.56 of the bytes) at 1.33x, about 2.5x
# the time a byte; past about 0.35 of the bytes the whole object is sent.
SAME_HOST_MAX_FRACTION = 0.01
ACROSS_HOSTS_MAX_FRACTION = 0.35
# A delta's index entry: a chunk's record end, int64 (a delta may exceed 4 GiB).
_INDEX_ENTRY_NBYTES = 8


class ChunkTable(NamedTuple):
    """Where each chunk of the packed object is: int64 arrays, one entry a
    chunk; and the size of the index a delta of this layout ends with (0:
    none). A layout of shards (its boxes section) has one: each chunk's
    record end, an int64 a chunk, after the records, so that a sharded
    receiver reads only the records of the chunks its ranges touch
    (``plans/_delta_sharded.py``)."""

    offsets: np.ndarray
    words: np.ndarray
    word_nbytes: np.ndarray
    index_nbytes: int = 0

    @property
    def count(self) -> int:
        return int(self.offsets.size)


def chunk_table(layout: Layout, offsets: np.ndarray) -> ChunkTable:
    """The chunks of the one-block layout: runs of adjacent tensors of one
    element size, cut every ``CHUNK_WORDS`` words. Alignment gaps belong to
    no chunk (their bytes are never compared nor sent). Both sides call it;
    O(tensors), vectorized."""
    nbytes = layout.nbytes
    keep = np.flatnonzero(nbytes > 0)
    if not keep.size:
        empty = np.zeros(0, dtype=np.int64)
        return ChunkTable(empty, empty.copy(), empty.copy())
    indexed = layout.boxes is not None
    start = offsets[keep].astype(np.int64)
    size = nbytes[keep].astype(np.int64)
    word = np.minimum(layout.alignments[keep].astype(np.int64), _MAX_WORD)
    # A segment starts where the word size changes or a gap opens.
    head = np.ones(keep.size, dtype=bool)
    head[1:] = (word[1:] != word[:-1]) | (start[1:] != start[:-1] + size[:-1])
    seg = np.cumsum(head) - 1
    seg_start = start[head]
    seg_word = word[head]
    seg_words = np.bincount(seg, weights=size).astype(np.int64) // seg_word
    per_seg = -(-seg_words // CHUNK_WORDS)
    which = np.repeat(np.arange(seg_start.size), per_seg)
    first = np.concatenate([[0], np.cumsum(per_seg)[:-1]])
    k = np.arange(which.size, dtype=np.int64) - first[which]
    w = seg_word[which]
    return ChunkTable(
        seg_start[which] + k * CHUNK_WORDS * w,
        np.minimum(CHUNK_WORDS, seg_words[which] - k * CHUNK_WORDS),
        w,
        _INDEX_ENTRY_NBYTES * int(which.size) if indexed else 0,
    )


def bf16_nan() -> int | None:
    """The bfloat16 bits torch writes for a NaN cast from float32 on this
    machine, where the C conversion matches torch (else None: no compare
    of cast values by address)."""
    return native_nan_bits(torch.bfloat16)


def new_version() -> int:
    """A fresh version id: random, never 0 (0 means "no version")."""
    return secrets.randbits(63) | 1


class Values(NamedTuple):
    """The current values of a put, as runs of the packed object: stream
    position, address, length in stream bytes (int64 arrays, ascending),
    and how each run's bytes are made (``kinds``: None, all raw; else an
    int64 array, ``RAW`` or ``BF16``: float32 at the address, converted as
    torch converts, a NaN becoming ``nan``)."""

    pos: np.ndarray
    addr: np.ndarray
    nbytes: np.ndarray
    kinds: np.ndarray | None = None
    nan: int = 0x7FC0


RAW, BF16 = 0, 1


class DeltaPut(NamedTuple):
    """What one put of a delta plan did (``SendPlan.last_delta``).

    Attributes:
        version: the id of the version this put sent.
        base: the id its delta is against (0: no delta: receivers read the
            whole object, this put having nothing to compare with, or a delta
            not smaller than the whole object).
        full_nbytes: bytes of the whole object (what other receivers read).
        delta_nbytes: bytes of the delta (what a receiver holding ``base``
            reads; 0 if nothing changed or there is no delta).
        changed: elements (words of at most 8 bytes) that changed; all of
            them where no compare counted them (``compared`` False).
        compared: whether this put compared every element with the kept
            version (not the first put, a refresh, or a compare stopped at
            the delta's size limit).
    """

    version: int
    base: int
    full_nbytes: int
    delta_nbytes: int
    changed: int
    compared: bool = False


class DeltaVersion:
    """The version a delta plan last sent, kept in the sender's pool; sender side.

    Made with the plan (the lease is taken then: a pool without room for
    it refuses the plan). Released with the plan (or :meth:`close`).

    A snapshot put whose values it can read by address (host tensors, raw
    or cast to bfloat16) compares them straight with the kept version and
    then serves the kept version as the whole object (:meth:`place`): one
    pass over the values and one over the kept bytes, no other copy. While
    a ticket serves it, it is *busy*: a put meanwhile packs the object
    into the pool as any plan does and offers no delta (the kept bytes
    cannot change under their readers); the put after starts over.
    """

    def __init__(self, pool: "MemoryPool", layout: Layout, offsets: np.ndarray, total_nbytes: int) -> None:
        if native is None:
            raise ConfigurationError(
                "plan(delta=True) needs tensorferry._diff, which was not built (no C compiler when tensorferry was installed): "
                "install a C compiler and reinstall tensorferry, or plan without delta"
            )
        if pool.device.type != "cpu":
            raise ConfigurationError(
                f"plan(delta=True) keeps the version it sent in the sender's pool and compares it on the CPU; this pool is on "
                f"{pool.device}: use a host pool (the tensors may be anywhere), or plan without delta"
            )
        self.pool = pool
        self.table = chunk_table(layout, offsets)
        self.num_words = int(self.table.words.sum())
        self.total_nbytes = total_nbytes
        self.kept: "Lease | None" = pool.reserve(total_nbytes) if total_nbytes else None
        self.version = 0  # the id the kept bytes are; 0: they are not a version (never filled, or left stale)
        self.last: DeltaPut | None = None
        self.pending: tuple[DeltaPut, "Packed | None"] | None = None  # what place() compared, for the ticket
        self.busy = 0  # tickets serving the kept bytes
        # A delta larger than this fraction of the whole object is not sent
        # (set by Sender.plan from its servers).
        self.max_fraction = 1.0
        self.last_base_held = False
        self._skip = 0  # puts to refresh before comparing again
        self._backoff = 1
        self.lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _release, self.kept)

    @property
    def kept_nbytes(self) -> int:
        return self.kept.nbytes if self.kept is not None else 0

    def close(self) -> None:
        self._finalizer()

    def place(self, values: Values | None, check: "Callable[[], None]", layout: Layout,
              fill: "Callable[[torch.Tensor], object]") -> "KeptBlock | None":
        """A resident put's whole object as the kept bytes, brought up to
        ``values`` by the compare (its delta left in :attr:`pending`), or
        None where this put cannot be served so (no values by address, the
        kept bytes busy): the caller packs the object as usual. ``check``
        raises if the plan's tensors moved (before any byte is read);
        ``fill(out)`` packs the object into ``out`` as a plain put does (a
        refresh, see :meth:`put`)."""
        with self.lock:
            if values is None or self.kept is None or self.busy:
                return None
            check()
            self.busy += 1
        try:
            self.pending = self.put(values, layout, serving=True, fill=fill)
        except BaseException:
            self._served_back()
            raise
        return KeptBlock(self)

    def take_pending(self) -> "tuple[DeltaPut, Packed | None] | None":
        pending, self.pending = self.pending, None
        return pending

    def _served_back(self) -> None:
        with self.lock:
            self.busy -= 1

    def put(self, values: Values | None, layout: Layout, *, serving: bool = False,
            fill: "Callable[[torch.Tensor], object] | None" = None) -> tuple[DeltaPut, "Packed | None"]:
        """As :meth:`compare`, or, after deltas too dense to pay, a refresh
        (the values copied into the kept version, not compared: by ``fill``
        where given, the plan's own copy) for the next 1, 2, 4, ... 16 puts
        in turn: a delta is tried again after each run of refreshes."""
        with self.lock:
            refresh = self._skip > 0 and values is not None
            if refresh:
                self._skip -= 1
        put, packed = self.compare(values, layout, serving=serving, refresh=refresh, fill=fill)
        with self.lock:
            if not refresh and put.version and not put.base and self.last_base_held:
                self._skip = self._backoff
                self._backoff = min(2 * self._backoff, _MAX_BACKOFF)
            elif not refresh and put.base:
                self._backoff = 1
        return put, packed

    def compare(self, values: Values | None, layout: Layout, *, serving: bool = False, refresh: bool = False,
                fill: "Callable[[torch.Tensor], object] | None" = None) -> tuple[DeltaPut, "Packed | None"]:
        """Compare the current values with the kept version, update it, and
        encode the changes into a pool block of their size. ``values`` None
        (streamed in pieces, a broadcast), or kept bytes that a ticket
        serves (and ``serving`` is not this put's own): nothing is compared,
        the kept version is dropped and receivers read the whole object.

        Returns the put's :class:`DeltaPut` and the delta's block (None
        when there is nothing to read: no delta, or nothing changed).
        """
        with self.lock:
            base, self.version = self.version, 0
            self.last_base_held = bool(base)
            if values is None or self.kept is None or self.busy > int(serving):
                # Nothing kept to compare with next time: the next put
                # starts over (fills the kept version, sends the whole).
                self.last = DeltaPut(0, 0, self.total_nbytes, 0, 0)
                return self.last, None
            # Worth a delta only below the whole object's size (then every
            # receiver could as well read the whole).
            budget = int(self.total_nbytes * min(self.max_fraction, 1.0)) - 1 if base and not refresh else 0
            scratch = self.pool.reserve_up_to(budget, min_nbytes=min(budget, 1 << 16)) if budget > 0 else None
            try:
                if refresh and fill is not None:
                    fill(self.kept.view())
                    sizes, changed = [], 0
                else:
                    sizes, changed = self._encode(values, scratch, refresh=refresh)
                version = new_version()
                fits = base != 0 and scratch is not None and all(n >= 0 for n, _ in sizes)
                nbytes = sum(n for n, _ in sizes) if fits else 0
                index = self._index(sizes) if nbytes and self.table.index_nbytes else None
                if index is not None and nbytes + index.nbytes > budget:
                    fits, nbytes, index = False, 0, None  # with its index, no smaller than the whole
                if index is not None:
                    nbytes += index.nbytes
                packed = None
                if nbytes:
                    try:
                        packed = self.pool.pack_with(layout, nbytes, lambda out: _gather(out, scratch, sizes, index), num_tensors=0)
                    except PoolExhaustedError:
                        fits, nbytes = False, 0  # no room for the delta: this put's receivers read the whole
            finally:
                if scratch is not None:
                    scratch.release()
            self.version = version
            compared = bool(base) and not refresh and scratch is not None and all(n >= 0 for n, _ in sizes)
            if not compared:
                changed = self.num_words  # not (all) compared with a version: all of it is sent
            self.last = DeltaPut(version, base if fits else 0, self.total_nbytes, nbytes, changed, compared)
            return self.last, packed

    def _encode(self, values: Values, scratch: "Lease | None", *, refresh: bool = False) -> tuple[list[tuple[int, int]], int]:
        """Compare and encode on the copy threads, each a range of chunks
        into its share of ``scratch``. Returns ``[(bytes written or -1,
        where in scratch)]`` a part, and the words changed."""
        t = self.table
        pos, addr, length = (np.ascontiguousarray(a, dtype=np.int64) for a in values[:3])
        kinds = np.ascontiguousarray(values.kinds, dtype=np.int64) if values.kinds is not None else None
        kinds_at, nan = (kinds.ctypes.data if kinds is not None else 0), values.nan
        parts = copy_threads() if self.total_nbytes >= PARALLEL_MIN_NBYTES else 1
        bounds = np.linspace(0, t.count, parts + 1).astype(np.int64)
        cap = scratch.nbytes if scratch is not None else 0
        base = scratch.view().data_ptr() if scratch is not None else 0
        # Each part writes into a share of the scratch in proportion to its bytes.
        jobs, at = [], 0
        for i, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            lo_b = int(t.offsets[lo]) if lo < t.count else self.total_nbytes
            hi_b = int(t.offsets[hi]) if hi < t.count else self.total_nbytes
            share = -1 if refresh else cap * (hi_b - lo_b) // max(self.total_nbytes, 1) // 8 * 8
            jobs.append((i, lo, hi, share, at))
            at += share
        results: list[tuple[int, int]] = [(0, 0)] * len(jobs)
        kept = self.kept.view().data_ptr() if self.kept is not None else 0
        # Each compared chunk's record end within its part, for the index.
        self._ends = ends = np.zeros(t.count, dtype=np.int64) if t.index_nbytes and not refresh else None
        self._parts = [(lo, hi) for _, lo, hi, _, _ in jobs]
        ends_at = ends.ctypes.data if ends is not None else 0

        def one(i: int, lo: int, hi: int, share: int, at: int) -> None:
            results[i] = native.encode(kept, pos.ctypes.data, addr.ctypes.data, length.ctypes.data, kinds_at, pos.size,
                                       t.offsets.ctypes.data, t.words.ctypes.data, t.word_nbytes.ctypes.data, lo, hi, base + at, share, nan,
                                       ends_at)

        try:
            run_parts(one, jobs)
        except BaseException:
            self.version = 0  # the kept bytes may be half updated
            raise
        starts = [j[4] for j in jobs]
        return [(n, s) for (n, _), s in zip(results, starts)], sum(c for _, c in results)

    def _index(self, sizes: list[tuple[int, int]]) -> np.ndarray:
        """The delta's index: each chunk's record end in the records back
        to back (little-endian int64, one a chunk; an unchanged chunk's
        record is empty)."""
        ends = self._ends.copy()
        at = 0
        for (lo, hi), (n, _) in zip(self._parts, sizes):
            ends[lo:hi] += at
            at += n
        return ends.astype("<i8", copy=False)


def _gather(out: "torch.Tensor", scratch: "Lease", sizes: list[tuple[int, int]], index: np.ndarray | None = None) -> tuple[int, int]:
    """The parts' records back to back into ``out`` (a pool block), then
    the index, if any."""
    src, at = scratch.view(), 0
    for n, start in sizes:
        out[at : at + n].copy_(src[start : start + n])
        at += n
    if index is not None:
        out[at : at + index.nbytes].copy_(torch.from_numpy(index.view(np.uint8)))
    return len(sizes), 0


class KeptBlock:
    """The kept bytes served as a put's whole object (the ``Held`` protocol
    of :mod:`tensorferry.transports._base`, as a pool ``Packed``): its
    release frees nothing, it only lets a later put change them."""

    def __init__(self, version: DeltaVersion) -> None:
        self._version: DeltaVersion | None = version
        lease = version.kept
        self.blocks: tuple[Block, ...] = (Block(lease.offset, version.total_nbytes),)
        self._pool = version.pool

    def buffers(self) -> list[memoryview]:
        b = self.blocks[0]
        return [memoryview(self._pool.buffer.numpy()[b.offset : b.offset + b.nbytes])]

    def runs(self) -> None:
        return None

    def release(self) -> None:
        version, self._version = self._version, None
        if version is not None:
            version._served_back()


def _release(lease: "Lease | None") -> None:
    if lease is not None:
        lease.release()


def delta_runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A receive plan's runs (target address, stream position, length) as
    the apply reads them: ascending stream positions."""
    order = np.argsort(src, kind="stable")
    return (np.ascontiguousarray(src[order], dtype=np.int64), np.ascontiguousarray(dst[order], dtype=np.int64),
            np.ascontiguousarray(nbytes[order], dtype=np.int64))


def apply_delta(delta: "torch.Tensor", runs: tuple[np.ndarray, np.ndarray, np.ndarray], table: ChunkTable) -> int:
    """Write a delta's records (``delta``: 1-D uint8, host) through a
    receive plan's ``runs`` (:func:`delta_runs`); receiver side, without
    the GIL. Returns the words written.

    Raises:
        ValueError: a malformed delta (from the network: checked record by record).
    """
    return _apply(delta, delta.numel() - table.index_nbytes, runs, table, partial=False)


def apply_records(records: "torch.Tensor", runs: tuple[np.ndarray, np.ndarray, np.ndarray], table: ChunkTable) -> int:
    """Write records of a delta (``records``: 1-D uint8, host; some chunks'
    records back to back, ascending) through a sharded receiver's runs of
    one source, skipping words no run holds; receiver side, without the
    GIL. Returns the words seen.

    Raises:
        ValueError: a malformed record (from the network: checked record by record, in C).
        ProtocolError: records shorter than the index they end with.
    """
    return _apply(records, records.numel(), runs, table, partial=True)


def _apply(delta: "torch.Tensor", nbytes: int, runs: tuple[np.ndarray, np.ndarray, np.ndarray], table: ChunkTable, *, partial: bool) -> int:
    pos, addr, length = runs
    if nbytes < 0:  # the records, without the index a delta of shards ends with
        raise ProtocolError(f"{delta.numel()} bytes, shorter than its index of {table.index_nbytes} bytes")
    return native.apply(delta.data_ptr(), nbytes, pos.ctypes.data, addr.ctypes.data, length.ctypes.data, pos.size,
                        table.offsets.ctypes.data, table.words.ctypes.data, table.word_nbytes.ctypes.data, table.count, partial)
