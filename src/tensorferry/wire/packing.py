"""The wire contract as pure math over numpy integer arrays.

Sender and receiver call the same functions on the same metadata, so both
compute the same byte layout without exchanging per-tensor offsets:

* [``packed_offsets``][tensorferry.wire.packing.packed_offsets] places tensors
  one after another, each at a multiple of its own alignment (its element
  size), with no trailing pad;
* [``group_by_block``][tensorferry.wire.packing.group_by_block] is the
  receiver's inverse: given only the byte count of each received block, it
  finds which consecutive tensors each block holds;
* [``merge_runs``][tensorferry.wire.packing.merge_runs] merges copies adjacent
  on both sides (byte ranges that touch: the same ranges as both sides), so one
  copy or one transfer descriptor covers a whole run of tensors; ``window``
  cuts runs to a byte range of one side (a piece of a stream).

Zero-size tensors take no space and never move the cursor: their offset is the
cursor, unaligned, and they are not part of any block's bytes.

This module imports numpy only (no torch): it is the contract, not the packer.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import ConfigurationError, LayoutMismatchError

__all__ = [
    "BLOCK_ALIGNMENT",
    "align_up",
    "packed_offsets",
    "group_by_block",
    "merge_runs",
    "Runs",
    "fit_prefix",
    "BlockGroups",
]

# 16: complex128's element size, the largest of any torch dtype. Every pool
# block starts on this boundary, so every tensor inside a block is aligned
# in absolute memory too, and `.view(dtype)` of a received buffer works.
BLOCK_ALIGNMENT = 16

# Tensors per chunk for the vectorized scan of packed_offsets. 64 keeps the
# sequential steps few and the per-chunk tables (16 residues each) small.
_CHUNK = 64


def align_up(value, alignment):
    """Round ``value`` up to a multiple of ``alignment`` (a power of two).

    Works on Python ints and on numpy integer arrays alike.
    """
    if not isinstance(alignment, np.ndarray) and alignment < 1:
        raise ConfigurationError(f"alignment must be a positive integer, got {alignment}")
    return (value + (alignment - 1)) // alignment * alignment


def _as_int64(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ConfigurationError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ConfigurationError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_inputs(nbytes, alignments) -> tuple[np.ndarray, np.ndarray]:
    n = _as_int64("nbytes", nbytes)
    a = _as_int64("alignments", alignments)
    if n.shape != a.shape:
        raise ConfigurationError(f"nbytes has {n.size} entries but alignments has {a.size}")
    if n.size:
        if int(n.min()) < 0:
            raise ConfigurationError("nbytes must be non-negative")
        # Powers of two that divide BLOCK_ALIGNMENT: what every torch dtype has,
        # and what makes the mod-16 scan below exact.
        if int(a.min()) < 1 or int(a.max()) > BLOCK_ALIGNMENT or np.any(a & (a - 1)):
            bad = a[(a < 1) | (a > BLOCK_ALIGNMENT) | ((a & (a - 1)) != 0)][:5].tolist()
            raise ConfigurationError(
                f"alignments must be powers of two from 1 to {BLOCK_ALIGNMENT}, got {bad}"
            )
    return n, a


def packed_offsets(nbytes, alignments) -> tuple[np.ndarray, int]:
    """Place tensors in order, each at a multiple of its alignment.

    Runs on both sides: the sender to pack, the receiver to unpack. Copies
    nothing. O(N), vectorized: one cumulative sum when no padding is needed
    (a model's float32 parameters), a chunked 16-residue scan otherwise.

    Args:
        nbytes: byte size of each tensor (``numel * element_size``).
        alignments: alignment of each tensor (its element size), a power of
            two dividing 16.

    Returns:
        ``(offsets, total_nbytes)``: int64 start of each tensor, and the end of
            the last byte (no trailing pad).

    Raises:
        ValueError: inputs of different lengths, negative sizes, or an
            alignment that is not a power of two dividing 16.
    """
    n, a = _check_inputs(nbytes, alignments)
    if n.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    nonzero = n > 0
    # Zero-size tensors take no space; the cursor they see is whatever came
    # before, so only non-empty tensors take part in the placement.
    if not nonzero.all():
        idx = np.flatnonzero(nonzero)
        if not idx.size:
            return np.zeros(n.size, dtype=np.int64), 0
        sub_off, total = packed_offsets(n[idx], a[idx])
        ends = sub_off + n[idx]
        # Each zero-size tensor sits at the end of the last non-empty one before it.
        prior = np.cumsum(nonzero) - 1  # index into idx of the last non-empty <= i
        offsets = np.where(prior >= 0, ends[np.maximum(prior, 0)], 0)
        offsets[idx] = sub_off
        return offsets.astype(np.int64, copy=False), int(total)

    starts = np.empty_like(n)
    starts[0] = 0
    np.cumsum(n[:-1], out=starts[1:])
    if not np.any(starts & (a - 1)):
        return starts, int(starts[-1] + n[-1])
    return _scan_offsets(n, a)


def _scan_offsets(n: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, int]:
    """Exact placement when padding is needed, vectorized across chunks.

    Placement f_i(x) = align_up(x, a_i) + n_i commutes with adding multiples of
    16 (every a_i divides 16), so each chunk's effect is fully described by
    what it does to the 16 possible residues of its start offset. Step 1 runs
    all chunks for all 16 residues at once; step 2 chains the chunks (one
    lookup per chunk); step 3 replays each chunk from its true start.
    """
    count = n.size
    nchunks = -(-count // _CHUNK)
    pad = nchunks * _CHUNK - count
    # Padding entries: size 0, alignment 1 -> identity placement.
    n2 = np.concatenate([n, np.zeros(pad, np.int64)]).reshape(nchunks, _CHUNK)
    a2 = np.concatenate([a, np.ones(pad, np.int64)]).reshape(nchunks, _CHUNK)
    mask2 = a2 - 1

    # Step 1: end of each chunk for each start residue r in [0, 16).
    cur = np.broadcast_to(np.arange(BLOCK_ALIGNMENT, dtype=np.int64), (nchunks, BLOCK_ALIGNMENT)).copy()
    for j in range(_CHUNK):
        m = mask2[:, j : j + 1]
        cur = ((cur + m) & ~m) + n2[:, j : j + 1]
    chunk_end = cur.tolist()  # chunk_end[c][r]: end when the chunk starts at r

    # Step 2: chain chunks. start(c+1) = chunk_end[c][start%16] + start - start%16.
    starts = [0] * nchunks
    x = 0
    for c in range(nchunks):
        starts[c] = x
        r = x & (BLOCK_ALIGNMENT - 1)
        x = chunk_end[c][r] + x - r

    # Step 3: replay each chunk from its real start, recording offsets.
    offsets = np.empty((nchunks, _CHUNK), dtype=np.int64)
    pos = np.asarray(starts, dtype=np.int64)
    for j in range(_CHUNK):
        m = mask2[:, j]
        pos = (pos + m) & ~m
        offsets[:, j] = pos
        pos = pos + n2[:, j]
    offsets = offsets.reshape(-1)[:count]
    return offsets, int(offsets[-1] + n[-1])


class BlockGroups(NamedTuple):
    """Which tensors each block holds, and where inside its block.

    ``bounds`` has one entry more than there are blocks: block ``b`` holds
    tensors ``bounds[b]:bounds[b + 1]``. ``offsets`` is each tensor's byte
    offset inside its own block.
    """

    bounds: np.ndarray
    offsets: np.ndarray


def group_by_block(nbytes, alignments, block_nbytes) -> BlockGroups:
    """Split tensors into consecutive groups, one per block, from byte counts.

    The receiver's inverse of the sender's packing: each block is packed with
    [``packed_offsets``][tensorferry.wire.packing.packed_offsets] from offset
    0, and a zero-size tensor stays with the block before it (the sender places
    it where its cursor is). O(N) overall: each block's search window doubles
    until the block is covered.

    Args:
        nbytes: byte size of each tensor.
        alignments: alignment (element size) of each tensor.
        block_nbytes: byte count of each received block, in order.

    Returns:
        ``BlockGroups`` with the tensor bounds of each block and each
            tensor's offset inside its block.

    Raises:
        LayoutMismatchError: the block sizes do not add up to a packing of
            these tensors; the message gives the exact sizes.
    """
    n, a = _check_inputs(nbytes, alignments)
    blocks = _as_int64("block_nbytes", block_nbytes)
    count = n.size
    offsets = np.zeros(count, dtype=np.int64)
    bounds = np.zeros(blocks.size + 1, dtype=np.int64)
    start = 0
    for b, want in enumerate(blocks.tolist()):
        last = b == blocks.size - 1
        if want <= 0:
            raise LayoutMismatchError(
                f"block {b} has {want} bytes; every block must hold at least one byte"
            )
        # The last block must hold every remaining tensor: look at all of them.
        window = count - start if last else 64
        while True:
            stop = min(count, start + window)
            off, _ = packed_offsets(n[start:stop], a[start:stop])
            ends = off + n[start:stop]
            covered = stop == count or (ends.size and ends[-1] > want)
            if covered:
                break
            window *= 2
        # Tensors whose end is <= want belong here (zero-size ones too).
        k = int(np.searchsorted(ends, want, side="right"))
        end_here = int(ends[k - 1]) if k else 0
        if end_here != want or (last and start + k != count):
            got = int(ends[-1]) if ends.size else 0
            raise LayoutMismatchError(
                f"block {b} has {want:,} bytes but the tensors from index {start} "
                f"pack to {end_here:,} bytes at the nearest tensor boundary "
                f"(tensors {start}..{stop - 1} pack to {got:,} bytes); "
                f"{blocks.size} blocks of {blocks.sum():,} bytes in all for "
                f"{count} tensors of {int(n.sum()):,} bytes; sender and receiver "
                "must use the same layout"
            )
        offsets[start : start + k] = off[:k]
        start += k
        bounds[b + 1] = start
    if start != count:
        if blocks.size == 0 and not n.any():
            bounds = np.array([0], dtype=np.int64)
        else:
            raise LayoutMismatchError(
                f"{count - start} tensors ({int(n[start:].sum()):,} bytes) are left "
                f"over after {blocks.size} blocks of {int(blocks.sum()):,} bytes; "
                "sender and receiver must use the same layout"
            )
    return BlockGroups(bounds, offsets)


class Runs(NamedTuple):
    """Merged copy runs: run ``r`` copies ``nbytes[r]`` bytes from ``src[r]``
    to ``dst[r]``; ``heads[r]`` is the index of its first input range."""

    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray
    heads: np.ndarray


def merge_runs(dst, src, nbytes, breaks=None) -> Runs:
    """Merge copies that continue the previous one on both sides into it.

    The one range merger of tensorferry: pool packing, ``into=`` copies,
    shm block copies, NIXL descriptor lists and view building all merge
    through it. O(N), vectorized. Range ``i`` joins range ``i - 1`` when
    ``dst[i] == dst[i-1] + nbytes[i-1]`` and ``src[i] == src[i-1] +
    nbytes[i-1]`` and ``breaks[i]`` (if given) is false: a caller breaks
    runs where something else changes (a storage, a dtype, a region).
    Callers leave zero-length ranges out.

    Args:
        dst: destination of each range (an address or an offset).
        src: source of each range.
        nbytes: byte count of each range.
        breaks: optional bool per range: start a new run here regardless.

    Returns:
        ``Runs``, one entry per merged run.
    """
    d = _as_int64("dst", dst)
    s = _as_int64("src", src)
    n = _as_int64("nbytes", nbytes)
    if not d.shape == s.shape == n.shape:
        raise ConfigurationError(f"dst, src and nbytes have {d.size}, {s.size} and {n.size} entries; they must match")
    if n.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty, empty)
    starts = np.empty(n.size, dtype=bool)
    starts[0] = True
    if n.size > 1:
        starts[1:] = (d[1:] != d[:-1] + n[:-1]) | (s[1:] != s[:-1] + n[:-1])
        if breaks is not None:
            starts[1:] |= np.asarray(breaks, dtype=bool)[1:]
    heads = np.flatnonzero(starts)
    if heads.size == n.size:
        return Runs(d, s, n, heads)
    return Runs(d[heads], s[heads], np.add.reduceat(n, heads), heads)


def window(runs: tuple[np.ndarray, np.ndarray, np.ndarray], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The parts inside ``[lo, hi)`` of runs ``(position, other side,
    nbytes)``, ascending by position and not overlapping there; positions
    from ``lo``, the other side moved by as much as a run was cut."""
    pos, other, n = runs
    first = int(np.searchsorted(pos + n, lo, side="right"))
    last = int(np.searchsorted(pos, hi, side="left"))
    pos, other, n = pos[first:last], other[first:last], n[first:last]
    if pos.size:
        cut_lo = np.maximum(lo - pos, 0)
        end = np.minimum(pos + n, hi)
        pos, other, n = pos + cut_lo, other + cut_lo, end - pos - cut_lo
    return pos - lo, other, n


def fit_prefix(nbytes, alignments, capacity_nbytes: int) -> tuple[int, int]:
    """How many leading tensors pack into ``capacity_nbytes`` from offset 0.

    The sender's half of
    [``group_by_block``][tensorferry.wire.packing.group_by_block]: zero-size
    tensors right after the last tensor that fits are taken too, exactly as the
    receiver assigns them. O(k) for a result of k tensors (doubling windows).

    Returns:
        ``(count, used_nbytes)``: the number of tensors and the end of the
            last byte they occupy.
    """
    n, a = _check_inputs(nbytes, alignments)
    count = n.size
    window = 64
    while True:
        stop = min(count, window)
        off, _ = packed_offsets(n[:stop], a[:stop])
        ends = off + n[:stop]
        if stop == count or (ends.size and ends[-1] > capacity_nbytes):
            break
        window *= 2
    k = int(np.searchsorted(ends, capacity_nbytes, side="right"))
    return k, int(ends[k - 1]) if k else 0
