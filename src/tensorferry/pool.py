"""``MemoryPool``: one pre-allocated buffer that packs groups of tensor views.

A transport registers the pool's buffer once; every transfer then moves
bytes out of (or into) it. On CPU the buffer is a memfd mapping: shareable
with other local processes by passing the file descriptor, readable by no
one else, and freed by the kernel when the last process holding it exits
(nothing is ever left in /dev/shm). On CUDA it is one device tensor.

Packing copies only each view's own bytes (``numel * element_size``), never
the storage behind it, and issues one copy per run of tensors that are
adjacent both in their source storage and in the pool: a model's parameters
as views of one flat buffer become a single memcpy.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from . import packing
from ._allocator import Allocator, Extent
from ._copy import copy_bytes, memmove_runs
from ._tensors import LeafInfo, flatten, gc_paused, inspect_leaves, torch_dtype, unflatten
from .errors import (
    BackendUnavailableError,
    ConfigurationError,
    LayoutMismatchError,
    PoolCreationError,
    PoolExhaustedError,
)
from .layout import Layout

__all__ = ["Block", "Packed", "PoolStats", "MemoryPool", "unpack"]


class Block(NamedTuple):
    """One contiguous block of a packed object, inside its pool."""

    offset: int
    nbytes: int


class PoolStats(NamedTuple):
    """A snapshot of a pool. Bytes, except the counts."""

    capacity_nbytes: int
    used_nbytes: int
    free_nbytes: int
    largest_free_nbytes: int
    free_blocks: int
    live_objects: int
    packs: int
    packed_nbytes: int


@dataclass(eq=False)
class Packed:
    """An object packed into a pool: its blocks, its layout, its costs.

    Attributes:
        blocks: where the object's bytes are in the pool, in tensor order.
        layout: dtypes, shapes and nesting; what a receiver needs.
        nbytes: bytes of tensor data (without alignment padding).
        num_tensors: number of leaf tensors.
        copy_runs: contiguous copies issued for the runs of adjacent tensors.
        strided_copies: tensors that were not contiguous (transposed,
            strided, expanded, conjugated) and were copied element-wise into
            the pool instead of as raw bytes, plus numpy arrays torch cannot
            share (negative strides, read-only) that were staged through a copy.
    """

    blocks: tuple[Block, ...]
    layout: Layout
    nbytes: int
    num_tensors: int
    copy_runs: int
    strided_copies: int
    pool: "MemoryPool" = field(repr=False)
    _released: bool = field(default=False, repr=False)

    @property
    def released(self) -> bool:
        return self._released

    @property
    def block_nbytes(self) -> list[int]:
        return [b.nbytes for b in self.blocks]

    def release(self) -> None:
        """Return the blocks to the pool. Releasing twice is harmless."""
        self.pool.free(self)

    def __enter__(self) -> "Packed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class MemoryPool:
    """One pre-allocated, shareable buffer that packs groups of tensors.

    Args:
        capacity_nbytes: size of the buffer, rounded up to 16 bytes.
        device: ``"cpu"`` (a shareable memfd mapping) or a CUDA device.
        prefault: touch every page now (``MAP_POPULATE``), so the first
            transfers do not pay for page faults.
        name: a label for the memfd (shown in /proc/PID/maps).

    Raises:
        ConfigurationError: a capacity that is not a positive int, or a
            device that is neither ``"cpu"`` nor a CUDA device of this machine.
        BackendUnavailableError: a CUDA device on a build or machine without CUDA.
        PoolCreationError: the host (memfd, mapping) or the device refused
            the memory; the message gives the numbers.
    """

    def __init__(
        self,
        capacity_nbytes: int,
        device: str | torch.device = "cpu",
        *,
        prefault: bool = False,
        name: str = "tensorferry-pool",
    ) -> None:
        if isinstance(capacity_nbytes, bool) or not isinstance(capacity_nbytes, (int, np.integer)) or capacity_nbytes <= 0:
            raise ConfigurationError(
                f"MemoryPool(capacity_nbytes={capacity_nbytes!r}): the capacity must be a positive int of bytes, "
                "for example 256 << 20"
            )
        capacity_nbytes = packing.align_up(int(capacity_nbytes), packing.BLOCK_ALIGNMENT)
        self.device = _pool_device(device)
        self.capacity_nbytes = capacity_nbytes
        # Distinguishes this pool from any earlier one at a recycled address.
        self.generation = secrets.randbits(63)
        self.fd: int | None = None
        self._mmap: mmap.mmap | None = None
        if self.device.type == "cpu":
            try:
                self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
            except OSError as exc:
                raise PoolCreationError(capacity_nbytes, "cpu", f"memfd_create failed ({exc})") from exc
            try:
                os.ftruncate(self.fd, capacity_nbytes)
                flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
                self._mmap = mmap.mmap(self.fd, capacity_nbytes, flags=flags)
            except BaseException as exc:
                os.close(self.fd)
                if isinstance(exc, OSError):
                    raise PoolCreationError(capacity_nbytes, "cpu", f"{exc.strerror or exc}; {_host_memory()}") from exc
                raise
            self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
        else:
            try:
                self.buffer = torch.empty(capacity_nbytes, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError as exc:
                free, total = torch.cuda.mem_get_info(self.device)
                detail = f"the device has {free:,} of {total:,} bytes free"
                raise PoolCreationError(capacity_nbytes, str(self.device), detail) from exc
            if prefault:
                self.buffer.zero_()
        self._allocator = Allocator(capacity_nbytes, packing.BLOCK_ALIGNMENT)
        self._lock = threading.Lock()
        self._live: dict[int, Packed] = {}
        self._packs = 0
        self._packed_nbytes = 0
        self._closed = False

    # -- lifetime ------------------------------------------------------------

    def close(self) -> None:
        """Drop the buffer. Views of it that are still alive keep it mapped."""
        if self._closed:
            return
        self._closed = True
        self.buffer = torch.empty(0, dtype=torch.uint8)
        # Never mmap.close(): torch.frombuffer holds a reference to the mmap,
        # not a buffer export, so close() would succeed and unmap memory that
        # live views still read (a segfault). Dropping our reference unmaps it
        # now when nothing else holds it, or with the last view's storage.
        self._mmap = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "MemoryPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"MemoryPool(capacity_nbytes={s.capacity_nbytes:,}, device={str(self.device)!r}, "
            f"used_nbytes={s.used_nbytes:,}, live_objects={s.live_objects})"
        )

    @property
    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    def view(self, block: Block | Extent) -> torch.Tensor:
        """A 1-D uint8 view of one block of the pool (no copy)."""
        return self.buffer[block[0] : block[0] + block[1]]

    # -- packing -------------------------------------------------------------

    def pack(self, obj: Any) -> Packed:
        """Copy the tensors of ``obj`` into as few blocks as the pool allows.

        Runs on the sender. Copies each view's own bytes only, one copy per
        run of adjacent tensors. Atomic: on any error nothing stays allocated.

        Args:
            obj: a tensor, a numpy array, or any nesting of lists, tuples and
                dicts of them (a ``state_dict``).

        Returns:
            :class:`Packed`; call ``release()`` when no reader needs it.

        Raises:
            UnsupportedTensorError: a leaf cannot be packed (named, with a fix).
            PoolExhaustedError: the object does not fit; nothing allocated.
        """
        self._check_open()
        with gc_paused():
            return self._pack(obj)

    def _pack(self, obj: Any) -> Packed:
        leaves, ops, counts, keys, staged = flatten(obj)
        info = inspect_leaves(obj, leaves, ops, counts, keys)
        lay = info.layout
        nbytes = lay.nbytes
        blocks, groups = self._allocate(nbytes, lay.alignments)
        packed = Packed(
            blocks=tuple(blocks),
            layout=lay,
            nbytes=int(nbytes.sum()),
            num_tensors=len(leaves),
            copy_runs=0,
            strided_copies=0,
            pool=self,
        )
        try:
            with torch.no_grad():
                packed.copy_runs, strided = self._copy_in(leaves, info, blocks, groups)
            # numpy arrays flatten had to copy are staging copies too: count them.
            packed.strided_copies = strided + staged
        except BaseException:
            for b in blocks:
                self._allocator.free(b.offset)
            raise
        with self._lock:
            self._live[id(packed)] = packed
            self._packs += 1
            self._packed_nbytes += packed.nbytes
        return packed

    def _allocate(self, nbytes: np.ndarray, alignments: np.ndarray) -> tuple[list[Block], packing.BlockGroups]:
        """Plan and take the blocks for tensors of these sizes, all or none."""
        offsets, total = packing.packed_offsets(nbytes, alignments)
        count = nbytes.size
        if total == 0:
            return [], packing.BlockGroups(np.zeros(1, np.int64), offsets)
        try:
            ext = self._allocator.allocate(total)
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
            for ext in self._allocator.free_extents(largest_first=True):
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
            stats = self._allocator.stats()
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
            rounded = [Extent(b.offset, packing.align_up(b.nbytes, packing.BLOCK_ALIGNMENT)) for b in plan]
            try:
                self._allocator.reserve(rounded)
            except ValueError:
                # Another thread took part of the plan between the snapshot of
                # the free extents and now. Its allocation succeeded, so this
                # retry is progress, not a livelock: plan again.
                continue
            return plan, packing.BlockGroups(np.asarray(bounds_list, dtype=np.int64), rel)

    def _copy_in(
        self,
        leaves: Sequence[torch.Tensor],
        info: LeafInfo,
        blocks: Sequence[Block],
        groups: packing.BlockGroups,
    ) -> tuple[int, int]:
        """Copy leaves into their blocks; returns (copy runs, strided copies)."""
        count = len(leaves)
        nbytes = info.layout.nbytes
        if not blocks:
            return 0, 0
        dst = np.empty(count, dtype=np.int64)
        for b, blk in enumerate(blocks):
            lo, hi = int(groups.bounds[b]), int(groups.bounds[b + 1])
            dst[lo:hi] = groups.offsets[lo:hi] + blk.offset
        live = np.flatnonzero(nbytes > 0)
        if live.size == count:
            sel = leaves
        else:
            sel = [leaves[i] for i in live.tolist()]
        n = nbytes[live]
        d = dst[live]
        ptr = info.data_ptrs[live]
        host = info.all_cpu and self.device.type == "cpu"
        # On the host a run may be copied by address, so touching in memory
        # is enough (every byte of the run belongs to one of its tensors, even
        # across two storages). Device copies go through a storage's tensor,
        # so there a run must also stay inside one storage.
        sptr = None if host else info.storage_ptrs[live]
        simple = info.raw[live]
        joins = np.zeros(len(sel), dtype=bool)
        if len(sel) > 1:
            joins[1:] = simple[1:] & simple[:-1] & (ptr[1:] == ptr[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
            if sptr is not None:
                joins[1:] &= sptr[1:] == sptr[:-1]
        # Runs: maximal stretches where every tensor joins the one before.
        starts = np.flatnonzero(~joins)
        stops = np.append(starts[1:], len(sel))
        keep = simple[starts]
        starts, stops = starts[keep], stops[keep]
        ends = np.cumsum(n)
        lengths = ends[stops - 1] - (ends[starts] - n[starts])
        buf = self.buffer
        if host:
            # By address (libc memmove, on several threads when large): no
            # tensor objects per run, which is what dominates with 10k runs.
            memmove_runs(d[starts] + buf.data_ptr(), ptr[starts], lengths)
            starts_l: list[int] = []
        else:
            starts_l = starts.tolist()
        storages: dict[tuple[int, str], torch.Tensor] = {}
        for i, length in zip(starts_l, lengths[: len(starts_l)].tolist()):
            t = sel[i]
            key = (int(sptr[i]), str(t.device))
            src_all = storages.get(key)
            if src_all is None:
                st = t.untyped_storage()
                src_all = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
                storages[key] = src_all
            s0 = int(ptr[i] - sptr[i])
            d0 = int(d[i])
            copy_bytes(buf[d0 : d0 + length], src_all[s0 : s0 + length])
        runs = int(starts.size)
        strided = 0
        for i in np.flatnonzero(~simple).tolist():
            t = sel[i]
            off = int(d[i])
            target = buf[off : off + int(n[i])].view(t.dtype).view(t.shape)
            target.copy_(t.resolve_conj().resolve_neg() if (t.is_conj() or t.is_neg()) else t)
            strided += 1
        return runs, strided

    # -- release and views -----------------------------------------------------

    def free(self, packed: Packed) -> None:
        """Return a packed object's blocks. Freeing twice is harmless.

        Raises:
            ValueError: ``packed`` belongs to another pool.
        """
        if packed.pool is not self:
            raise ConfigurationError("free(packed): this Packed belongs to another pool; call packed.release()")
        with self._lock:
            if packed._released:
                return
            packed._released = True
            self._live.pop(id(packed), None)
            for b in packed.blocks:
                self._allocator.free(b.offset)

    def lease_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 view of ``[offset, offset + nbytes)`` with its OWN storage.

        CPU only. Tensors made from it share that storage, whose owner is
        ``view._tf_owner`` (a numpy array): watch it to learn when the last
        of them is gone, whichever view outlives the others.
        """
        if self._mmap is None:
            raise ConfigurationError(f"lease_view needs a CPU pool; this pool is on {self.device}")
        arr = np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=offset)
        view = torch.from_numpy(arr)
        view._tf_owner = arr  # type: ignore[attr-defined]
        return view

    def _adopt(self, packed: Packed) -> None:
        """Count a Packed made from this pool's blocks by another packer
        (a streamed piece) as live, so stats and release treat it alike."""
        with self._lock:
            self._live[id(packed)] = packed
            self._packs += 1
            self._packed_nbytes += packed.nbytes

    def unpack(self, packed: Packed) -> Any:
        """Views of the pool's memory in the original structure (no copy).

        The views are valid until ``packed`` is released.
        """
        self._check_open()
        if packed.pool is not self or packed._released:
            state = "was released" if packed._released else "belongs to another pool"
            raise ConfigurationError(f"unpack(packed): this Packed {state}; unpack a live Packed of this pool")
        return unpack([self.view(b) for b in packed.blocks], packed.layout)

    def stats(self) -> PoolStats:
        s = self._allocator.stats()
        with self._lock:
            return PoolStats(
                capacity_nbytes=s.capacity_nbytes,
                used_nbytes=s.used_nbytes,
                free_nbytes=s.free_nbytes,
                largest_free_nbytes=s.largest_free_nbytes,
                free_blocks=s.free_blocks,
                live_objects=len(self._live),
                packs=self._packs,
                packed_nbytes=self._packed_nbytes,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this MemoryPool is closed; create a new one")


def _pool_device(device: str | torch.device) -> torch.device:
    """The pool's device, checked: CPU, or a CUDA device this process can use."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"MemoryPool(device={device!r}) is not a device; use 'cpu' or 'cuda[:N]'") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigurationError(f"MemoryPool(device={device!r}): a pool lives on 'cpu' or a CUDA device, not {dev.type}")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise BackendUnavailableError(
            f"MemoryPool(device={device!r}): {why}; use device='cpu', or a CUDA build of torch on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigurationError(f"MemoryPool(device={device!r}): this machine has {count} CUDA device(s), 0 to {count - 1}")
    return dev


def _host_memory() -> str:
    """What the host has, for the message of a refused pool mapping."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    free = os.sysconf("SC_AVPHYS_PAGES") * page
    return f"this host has {total:,} bytes of memory, {free:,} of them free"


def unpack(blocks: Sequence[torch.Tensor], layout: Layout) -> Any:
    """Rebuild the original structure as zero-copy views of ``blocks``.

    Runs on the receiver (or on the sender over its pool). Copies nothing:
    every tensor is a view with the right dtype and shape, thanks to each
    tensor's alignment inside its 16-aligned block.

    Args:
        blocks: one 1-D uint8 tensor per block, in order, each starting at a
            16-byte aligned address.
        layout: the sender's :class:`Layout`.

    Returns:
        The object, nested as it was packed.

    Raises:
        LayoutMismatchError: the blocks' sizes or alignment do not match the
            layout (the message gives the numbers).
    """
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
        leaves = _views(blocks, layout, groups)
        return unflatten(layout, leaves)


def _same_shape_as_previous(layout: Layout, shapes: list[tuple[int, ...]]) -> np.ndarray:
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
        same[1:] = [a == b for a, b in zip(shapes[1:], shapes[:-1])]
    return same


def _views(blocks: Sequence[torch.Tensor], layout: Layout, groups: packing.BlockGroups) -> list[torch.Tensor]:
    """One view per tensor, made in bulk by C++ loops.

    Runs of same-dtype tensors that touch are cut at once: all-1-D runs with
    one ``split_with_sizes``; otherwise each stretch of equal shapes (a
    model's layers) with one ``view(k, *shape).unbind(0)``, ~0.7 us a tensor
    against ~2.5 us for a view per tensor.
    """
    count = layout.num_tensors
    leaves: list[torch.Tensor] = [None] * count  # type: ignore[list-item]
    nbytes = layout.nbytes
    codes = layout.dtype_codes
    es = layout.alignments
    shapes = layout.shapes()
    ndims = layout.ndims
    same_shape = _same_shape_as_previous(layout, shapes)
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
        brk = np.ones(idx.size, dtype=bool)
        # A run is cut where dtype or adjacency changes, and around the
        # tensors skipped here (zero-size, aliases): its views fill one
        # slice of leaf positions.
        brk[1:] = (c[1:] != c[:-1]) | (off[1:] != off[:-1] + n[:-1]) | (idx[1:] != idx[:-1] + 1)
        run_starts = np.flatnonzero(brk)
        run_stops = np.append(run_starts[1:], idx.size)
        one_d = ndims[idx] == 1
        # Where a new shape starts inside a run (or a run starts).
        shape_brk = brk | ~same_shape[idx]
        blk = blocks[b]
        typed: dict[int, torch.Tensor] = {}
        numels = (n // es[idx]).tolist()
        idx_l = idx.tolist()
        for rs, re_ in zip(run_starts.tolist(), run_stops.tolist()):
            code = int(c[rs])
            tv = typed.get(code)
            size = int(es[idx_l[rs]])
            if tv is None:
                usable = blk.numel() - blk.numel() % size
                tv = blk[:usable].view(torch_dtype(code))
                typed[code] = tv
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
