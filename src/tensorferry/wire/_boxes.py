"""Boxes: the part of a global tensor one rank holds, as offsets and sizes.

Both sides of a sharded transfer use this. A sender's layout records, for
each tensor that is a shard, the global shape and the offsets of its box
(the local tensor's shape is the box's sizes, already in the layout); a
receiver intersects every target box with the source boxes once and turns
each intersection into byte runs on both sides.

Pure numpy (imported by :mod:`.layout`); the torch side (DTensor, the
public :class:`~tensorferry.Box` wrapper) is :mod:`.shards`.
"""

from __future__ import annotations

import itertools
import struct
from typing import NamedTuple

import numpy as np

from ..errors import LayoutMismatchError, TicketError

__all__ = ["Boxes", "Cell", "cover", "box_runs", "region", "HEADER"]

# After the layout's header (and its alias count): boxed tensors, and the
# dimensions of their boxes in all (each box has one global size and one
# offset per dimension of its tensor).
HEADER = struct.Struct("<II")


class Boxes(NamedTuple):
    """Which tensors of a layout are boxes of a larger global tensor.

    Attributes:
        index: int64, increasing: the boxed tensors (others are whole).
        shapes: int64, the global shapes of the boxed tensors, concatenated.
        offsets: int64, where each box starts, concatenated like ``shapes``.
    """

    index: np.ndarray
    shapes: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, found: list[tuple[int, tuple[int, ...], tuple[int, ...]]]) -> "Boxes | None":
        """From ``(tensor index, global shape, offsets)`` in tensor order; None if empty."""
        if not found:
            return None
        index = np.fromiter((i for i, _, _ in found), dtype=np.int64, count=len(found))
        shapes = np.fromiter(itertools.chain.from_iterable(s for _, s, _ in found), dtype=np.int64)
        offsets = np.fromiter(itertools.chain.from_iterable(o for _, _, o in found), dtype=np.int64)
        return cls(index, shapes, offsets)

    def nbytes(self) -> int:
        """Bytes of the section in a layout's body."""
        return 4 * self.index.size + 16 * self.shapes.size

    def encode(self) -> tuple[bytes, bytes]:
        """``(header extension, body tail)``."""
        return (
            HEADER.pack(self.index.size, self.shapes.size),
            b"".join((self.index.astype("<u4").tobytes(), self.shapes.astype("<i8").tobytes(), self.offsets.astype("<i8").tobytes())),
        )

    def same_as(self, other: "Boxes | None") -> bool:
        return other is not None and all(np.array_equal(a, b) for a, b in zip(self, other))

    def global_boxes(self, ndims: np.ndarray, dims: np.ndarray) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """``(global shape, offsets, sizes)`` of every tensor of the layout
        (``ndims``, ``dims``): a tensor not boxed is its own whole."""
        starts = np.zeros(ndims.size + 1, dtype=np.int64)
        np.cumsum(ndims, out=starts[1:])
        dl = dims.tolist()
        out = []
        for i in range(ndims.size):
            local = tuple(dl[starts[i] : starts[i + 1]])
            out.append((local, (0,) * len(local), local))
        at = 0
        sl, ol = self.shapes.tolist(), self.offsets.tolist()
        for i in self.index.tolist():
            k = int(ndims[i])
            out[i] = (tuple(sl[at : at + k]), tuple(ol[at : at + k]), out[i][2])
            at += k
        return out


def decode(view: memoryview | bytes, head: int) -> tuple[int, int, int]:
    """The section's counts from the header extension at ``head``:
    ``(boxed tensors, box dimensions, next header position)``.

    Raises:
        TicketError: truncated.
    """
    if len(view) < head + HEADER.size:
        raise TicketError("layout is truncated: its box counts are missing")
    k, m = HEADER.unpack_from(view, head)
    return k, m, head + HEADER.size


def check(index: np.ndarray, shapes: np.ndarray, offsets: np.ndarray, ndims: np.ndarray, dims: np.ndarray, max_dim: int) -> Boxes:
    """Validate a decoded section against the layout's tensors (bytes from
    the network: every box must lie inside its global tensor).

    Raises:
        LayoutMismatchError: a box that cannot describe a shard.
    """
    n = ndims.size
    if index.size and (int(index[-1]) >= n or (np.diff(index) <= 0).any()):
        raise LayoutMismatchError("layout boxes must name tensors of the layout, in increasing order")
    if int(ndims[index].sum()) != shapes.size:
        raise LayoutMismatchError(f"layout boxes have {shapes.size} dimensions, their tensors {int(ndims[index].sum())}")
    if shapes.size and (int(shapes.min()) < 0 or int(shapes.max()) > max_dim or int(offsets.min()) < 0):
        raise LayoutMismatchError("layout has a box with a negative or oversized dimension")
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(ndims, out=starts[1:])
    local = np.concatenate([dims[starts[i] : starts[i + 1]] for i in index.tolist()]) if index.size else shapes
    if (offsets + local > shapes).any():
        raise LayoutMismatchError("layout has a box that extends past its global tensor")
    return Boxes(index, shapes, offsets)


class Cell(NamedTuple):
    """A part of a target box that lies inside the same source boxes:
    ``offsets``, ``sizes`` (global coordinates) and those sources."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    sources: list[int]


def cover(offsets: tuple[int, ...], sizes: tuple[int, ...], sources: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[list[Cell], Cell | None]:
    """Cut the box ``(offsets, sizes)`` by every source box's edges.

    Returns ``(cells, uncovered)``: the cells (each inside the same
    sources, listed by position in ``sources``), and the first cell no
    source covers (None when all are covered). A box with a zero size has
    no cells; a 0-d box is one cell.
    """
    nd = len(sizes)
    if any(s == 0 for s in sizes):
        return [], None
    ends = tuple(o + s for o, s in zip(offsets, sizes))
    touching = [k for k, (so, ss) in enumerate(sources)
                if all(a < b + n and b < a + m for a, m, b, n in zip(offsets, sizes, so, ss))]
    cuts = []
    for d in range(nd):
        edges = {offsets[d], ends[d]}
        for k in touching:
            so, ss = sources[k]
            edges.update(e for e in (so[d], so[d] + ss[d]) if offsets[d] < e < ends[d])
        cuts.append(sorted(edges))
    cells: list[Cell] = []
    uncovered = None
    for parts in itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts]):
        lo = tuple(a for a, _ in parts)
        size = tuple(b - a for a, b in parts)
        inside = [k for k in touching if all(so <= a and b <= so + ss for (a, b), so, ss in zip(parts, *sources[k]))]
        cell = Cell(lo, size, inside)
        if not inside and uncovered is None:
            uncovered = cell
        cells.append(cell)
    return cells, uncovered


def _strides(sizes: tuple[int, ...]) -> np.ndarray:
    out = np.ones(len(sizes), dtype=np.int64)
    for d in range(len(sizes) - 2, -1, -1):
        out[d] = out[d + 1] * sizes[d + 1]
    return out


def box_runs(cell: Cell, src: tuple[tuple[int, ...], tuple[int, ...]], dst: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, int]:
    """The element runs that copy ``cell`` from the source box to the
    target box, both row-major and contiguous: ``(source element offsets,
    target element offsets, elements per run)``.

    A run spans the innermost dimensions that the cell covers whole on both
    sides (and one more, in part): a Shard(0) source to a Shard(0) target is
    one run; to a Shard(1) target, a run per row.
    """
    (src_off, src_size), (dst_off, dst_size) = src, dst
    nd = len(cell.sizes)
    if nd == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), 1
    k = nd - 1
    while k > 0 and cell.sizes[k] == src_size[k] == dst_size[k]:
        k -= 1
    run = int(np.prod(cell.sizes[k:], dtype=np.int64))
    ss, ds = _strides(src_size), _strides(dst_size)
    rel_src = np.asarray(cell.offsets, dtype=np.int64) - np.asarray(src_off, dtype=np.int64)
    rel_dst = np.asarray(cell.offsets, dtype=np.int64) - np.asarray(dst_off, dtype=np.int64)
    base_src, base_dst = int(rel_src @ ss), int(rel_dst @ ds)
    if k == 0:
        return np.array([base_src]), np.array([base_dst]), run
    outer = np.indices(cell.sizes[:k], dtype=np.int64).reshape(k, -1)
    return base_src + ss[:k] @ outer, base_dst + ds[:k] @ outer, run


def region(cell: Cell) -> str:
    """A cell as index ranges: ``[4:8, 0:3]``."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(cell.offsets, cell.sizes)) + "]"
