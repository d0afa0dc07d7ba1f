"""Views: received or pooled bytes back into tensors, without copying.

The receiver's half of the packing (the sender's pool uses it too): given
blocks (1-D uint8, 16-aligned) and the layout, one typed view per tensor,
made in bulk by C++ loops, rebuilt into the sent structure. And the hook
that ties a release to a view's storage: :func:`owned_view` makes a view
whose storage alone owns its memory, so a callback runs when the last
tensor sharing it is collected, whichever view that is (never tied to one
tensor object, never an attribute stuck on a tensor).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import LayoutMismatchError
from ..tensors import gc_paused, torch_dtype, unflatten
from ..wire import Layout, packing

__all__ = ["build_views", "owned_view", "unpack"]


def owned_view(buffer: Any, offset: int, nbytes: int, on_release: Callable[[], None] | None = None) -> torch.Tensor:
    """A 1-D uint8 tensor of ``buffer[offset : offset + nbytes]`` with a storage of its own.

    ``buffer`` is anything exporting the buffer protocol (an mmap). Every
    tensor made from the result shares that storage; ``on_release`` runs
    once the last of them is collected (it may run on any thread, inside
    any code: it must not block or take locks that code might hold).
    """
    arr = np.frombuffer(buffer, dtype=np.uint8, count=nbytes, offset=offset)
    view = torch.from_numpy(arr)
    if on_release is not None:
        # The storage keeps `arr` alive, and nothing else refers to it.
        weakref.finalize(arr, on_release)
    return view


def unpack(blocks: Any, layout: Layout | None = None) -> Any:
    """Rebuild the original structure as zero-copy views of ``blocks``.

    Runs on the receiver (or on the sender over its pool). Copies nothing:
    every tensor is a view with the right dtype and shape, thanks to each
    tensor's alignment inside its 16-aligned block.

    Args:
        blocks: one 1-D uint8 tensor per block, in order, each starting at a
            16-byte aligned address; or what ``MemoryPool.pack`` returned
            (a ``Packed``, then without ``layout``: views of its pool).
        layout: the sender's [``Layout``][tensorferry.wire.Layout].

    Returns:
        The object, nested as it was packed.

    Raises:
        LayoutMismatchError: the blocks' sizes or alignment do not match the
            layout (the message gives the numbers).
    """
    if layout is None:
        pool = getattr(blocks, "pool", None)
        if pool is None or not hasattr(blocks, "layout"):
            raise LayoutMismatchError(
                f"unpack({type(blocks).__name__}) needs a layout: pass unpack(blocks, layout), or the Packed that pack() returned"
            )
        return pool.unpack(blocks)
    sizes = []
    for b, blk in enumerate(blocks):
        if blk.dtype != torch.uint8 or blk.dim() != 1 or not blk.is_contiguous():
            raise LayoutMismatchError(
                f"block {b} must be a contiguous 1-D uint8 tensor, got {blk.dtype} of shape {tuple(blk.shape)}"
            )
        if blk.data_ptr() % packing.BLOCK_ALIGNMENT:
            raise LayoutMismatchError(
                f"block {b} starts at address {blk.data_ptr():#x}, not on a "
                f"{packing.BLOCK_ALIGNMENT}-byte boundary; receive into 16-byte aligned memory "
                "(a MemoryPool, or torch.empty) so typed views are possible"
            )
        sizes.append(blk.numel())
    groups = packing.group_by_block(layout.nbytes, layout.alignments, sizes)
    with gc_paused():
        leaves = build_views(blocks, layout, groups)
        return unflatten(layout, leaves)


class _Shapes:
    """``layout.shapes()`` made on first use: an object of 1-D tensors
    (fresh outputs, flat parameters) needs none (a tuple per tensor: 2.5 ms
    for 10k here)."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._list: list[tuple[int, ...]] | None = None

    def all(self) -> list[tuple[int, ...]]:
        if self._list is None:
            self._list = self._layout.shapes()
        return self._list

    def __getitem__(self, i: int) -> tuple[int, ...]:
        return self.all()[i]


def _same_shape_as_previous(layout: Layout, shapes: _Shapes) -> np.ndarray:
    """bool per tensor: its shape equals the previous tensor's."""
    n = layout.num_tensors
    same = np.zeros(n, dtype=bool)
    if n < 2:
        return same
    nd = layout.ndims
    if (nd == nd[0]).all():
        k = int(nd[0])
        rows = layout.dims.reshape(n, k)
        same[1:] = (rows[1:] == rows[:-1]).all(axis=1) if k else True
    else:
        every = shapes.all()
        same[1:] = [a == b for a, b in zip(every[1:], every[:-1])]
    return same


# A block with more runs than this, averaging under 4 tensors a run, is cut
# by dtype (_views_by_dtype) rather than run by run.
_MANY_RUNS = 64


def _typed(blk: torch.Tensor, typed: dict[int, torch.Tensor], code: int, size: int) -> torch.Tensor:
    """The block as one tensor of dtype ``code`` (made once per block and dtype)."""
    tv = typed.get(code)
    if tv is None:
        usable = blk.numel() - blk.numel() % size
        tv = typed[code] = blk[:usable].view(torch_dtype(code))
    return tv


def _views_by_dtype(blk: torch.Tensor, typed: dict[int, torch.Tensor], idx: np.ndarray, off: np.ndarray, n: np.ndarray,
                    c: np.ndarray, es: np.ndarray, ndims: np.ndarray, shapes: "_Shapes | list[tuple[int, ...]]", leaves: list) -> None:
    """The views of one block's tensors ``idx`` (at byte offsets ``off``, of
    ``n`` bytes, dtype codes ``c``), one ``split_with_sizes`` per dtype: its
    tensors and the gaps between them (other dtypes' bytes, a whole number
    of this dtype's elements, since every tensor starts on a multiple of
    its element size) as alternate parts; then a ``view`` per tensor that
    is not 1-D."""
    for code in np.unique(c).tolist():
        sel = np.flatnonzero(c == code)
        at = idx[sel]
        size = int(es[at[0]])
        start = off[sel] // size
        numel = n[sel] // size
        end = start + numel
        sizes = np.empty(2 * sel.size, dtype=np.int64)
        sizes[0] = 0
        sizes[2::2] = start[1:] - end[:-1]
        sizes[1::2] = numel
        parts = _typed(blk, typed, code, size).narrow(0, int(start[0]), int(end[-1] - start[0])).split_with_sizes(sizes.tolist())
        for j, (i, one_d) in enumerate(zip(at.tolist(), (ndims[at] == 1).tolist())):
            part = parts[2 * j + 1]
            leaves[i] = part if one_d else part.view(shapes[i])


def build_views(blocks: Sequence[torch.Tensor], layout: Layout, groups: packing.BlockGroups) -> list[torch.Tensor]:
    """One view per tensor, made in bulk by C++ loops.

    Runs of same-dtype tensors that touch are cut at once: all-1-D runs with
    one ``split_with_sizes``; otherwise each stretch of equal shapes (a
    model's layers) with one ``view(k, *shape).unbind(0)``, ~0.7 us a tensor
    against ~2.5 us for a view per tensor. A block of many short runs
    (dtypes interleaved layer by layer) is cut by dtype instead: 100k
    tensors of four dtypes in 0.2 s rather than 0.8 s run by run.
    """
    count = layout.num_tensors
    leaves: list[torch.Tensor] = [None] * count  # type: ignore[list-item]
    nbytes = layout.nbytes
    codes = layout.dtype_codes
    es = layout.alignments
    shapes = _Shapes(layout)
    ndims = layout.ndims
    same_shape = _same_shape_as_previous(layout, shapes)
    if count and not (ndims == 1).all():
        shapes = shapes.all()  # a plain list where views need their shapes
    ndims_l = ndims.tolist()
    device = blocks[0].device if blocks else torch.device("cpu")
    for b in range(len(blocks)):
        lo, hi = int(groups.bounds[b]), int(groups.bounds[b + 1])
        idx = np.arange(lo, hi)[nbytes[lo:hi] > 0]
        if not idx.size:
            continue
        off = groups.offsets[idx]
        n = nbytes[idx]
        c = codes[idx]
        # Runs of same-dtype tensors that touch: each is cut at once. A run
        # also ends around the tensors skipped here (zero-size, aliases), so
        # its views fill one slice of leaf positions.
        cut = np.zeros(idx.size, dtype=bool)
        cut[1:] = (c[1:] != c[:-1]) | (idx[1:] != idx[:-1] + 1)
        run_starts = packing.merge_runs(off, off, n, cut).heads
        blk = blocks[b]
        typed: dict[int, torch.Tensor] = {}
        if run_starts.size > _MANY_RUNS and run_starts.size * 4 > idx.size:
            # Many short runs (a state dict of small layers interleaving
            # dtypes: weight, bias, a bf16 norm, an int64 step): the loop
            # below would pay ~10 us of Python a run. Cut by dtype instead.
            _views_by_dtype(blk, typed, idx, off, n, c, es, ndims, shapes, leaves)
            continue
        brk = np.zeros(idx.size, dtype=bool)
        brk[run_starts] = True
        run_stops = np.append(run_starts[1:], idx.size)
        one_d = ndims[idx] == 1
        # Where a new shape starts inside a run (or a run starts).
        shape_brk = brk | ~same_shape[idx]
        numels = (n // es[idx]).tolist()
        idx_l = idx.tolist()
        for rs, re_ in zip(run_starts.tolist(), run_stops.tolist()):
            code = int(c[rs])
            size = int(es[idx_l[rs]])
            tv = _typed(blk, typed, code, size)
            first = int(off[rs]) // size
            if one_d[rs:re_].all():
                total = sum(numels[rs:re_])
                parts = tv.narrow(0, first, total).split_with_sizes(numels[rs:re_])
                leaves[idx_l[rs] : idx_l[rs] + (re_ - rs)] = parts
                continue
            sub = np.flatnonzero(shape_brk[rs:re_]) + rs
            sub_stops = np.append(sub[1:], re_)
            split = None
            if (sub_stops - sub == 1).any():
                # Lone shapes (weight, bias, weight, ...) come from one split.
                split = tv.narrow(0, first, sum(numels[rs:re_])).split_with_sizes(numels[rs:re_])
            for ss, se in zip(sub.tolist(), sub_stops.tolist()):
                k = se - ss
                shape = shapes[idx_l[ss]]
                if k == 1:
                    part = split[ss - rs]
                    leaves[idx_l[ss]] = part if ndims_l[idx_l[ss]] == 1 else part.view(shape)
                else:
                    start = first + (int(off[ss]) - int(off[rs])) // size
                    parts = tv.narrow(0, start, k * numels[ss]).view(k, *shape).unbind(0)
                    leaves[idx_l[ss] : idx_l[ss] + k] = parts
    empty = nbytes == 0
    if layout.aliases.size:
        empty[layout.aliases[:, 0]] = False
    for k in np.flatnonzero(empty).tolist():
        leaves[k] = torch.empty(shapes[k], dtype=torch_dtype(int(codes[k])), device=device)
    # One tensor under both names (tied weights), as torch.save keeps them.
    for dup, orig in layout.aliases.tolist():
        leaves[dup] = leaves[orig]
    return leaves
