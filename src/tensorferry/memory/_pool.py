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

import os
import secrets
import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..copy import pack_leaves, vectored_io
from ..errors import ConfigurationError, PoolExhaustedError
from ..tensors import LeafInfo, flatten, gc_paused, inspect_leaves
from ..wire import Layout, packing
from ._allocator import Allocator, Block
from ._packed import Packed, PoolStats
from ._system import pool_buffer, pool_device
from ._views import owned_view, unpack

__all__ = ["Block", "Lease", "Packed", "PoolStats", "MemoryPool", "unpack", "DEFAULT_CAPACITY_NBYTES"]

# The size of a pool a Sender or a Receiver makes for itself.
DEFAULT_CAPACITY_NBYTES = 256 << 20


class Lease:
    """Raw bytes of a pool, reserved until released
    ([``MemoryPool.reserve``][tensorferry.memory.MemoryPool.reserve]).

    A context manager. ``release()`` is idempotent and safe from a
    finalizer (it never waits for the pool's lock on a thread that holds
    it). Counted in [``MemoryPool.stats``][tensorferry.memory.MemoryPool.stats]
    while alive.
    """

    __slots__ = ("pool", "offset", "nbytes", "_released", "__weakref__")

    def __init__(self, pool: "MemoryPool", block: Block) -> None:
        self.pool, self.offset, self.nbytes = pool, block.offset, block.nbytes
        self._released = False

    def view(self) -> torch.Tensor:
        """A 1-D uint8 view of the leased bytes (valid until the release)."""
        return self.pool.buffer[self.offset : self.offset + self.nbytes]

    def owned_view(self) -> torch.Tensor:
        """A 1-D uint8 view whose storage owns the lease (CPU pools).

        Every tensor made from it shares that storage, and the lease is
        released when the last of them is collected, whichever view
        outlives the others. Do not release it by hand afterwards.
        """
        if self.pool._mmap is None:
            raise ConfigurationError(f"owned_view needs a CPU pool; this pool is on {self.pool.device}")
        return owned_view(self.pool._mmap, self.offset, self.nbytes, self.release)

    def release(self) -> None:
        """Return the bytes to the pool. Releasing twice is harmless."""
        pool = self.pool
        with pool._lease_lock:
            if self._released:
                return
            self._released = True
            pool._leases -= 1
        pool._allocator.free_soon(self.offset)

    def __enter__(self) -> "Lease":
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
        self.device = pool_device(device)
        self.capacity_nbytes = capacity_nbytes
        # Distinguishes this pool from any earlier one at a recycled address.
        self.generation = secrets.randbits(63)
        self.buffer, self.fd, self._mmap = pool_buffer(capacity_nbytes, self.device, prefault=prefault, name=name)
        self._allocator = Allocator(capacity_nbytes, packing.BLOCK_ALIGNMENT)
        self._lock = threading.Lock()
        self._live: dict[int, Packed] = {}
        self._packs = 0
        self._packed_nbytes = 0
        self._leases = 0
        # Its own lock, never held while waiting for another: a finalizer's
        # release may run on any thread, inside any code of this pool.
        self._lease_lock = threading.Lock()
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

    def view(self, block: Block) -> torch.Tensor:
        """A 1-D uint8 view of one block of the pool (no copy)."""
        return self.buffer[block[0] : block[0] + block[1]]

    # -- packing -------------------------------------------------------------

    def pack(self, obj: Any) -> Packed:
        """Copy the tensors of ``obj`` into as few blocks as the pool allows.

        Runs on the sender. Copies each view's own bytes only, one copy per
        run of adjacent tensors. Atomic: on any error nothing stays allocated.
        The same packing as a fresh ``Sender.put`` that fits (its one-shot
        plan places the object with ``place``).

        Args:
            obj: a tensor, a numpy array, or any nesting of lists, tuples and
                dicts of them (a ``state_dict``).

        Returns:
            [``Packed``][tensorferry.memory.Packed]; call ``release()`` when no
                reader needs it.

        Raises:
            UnsupportedTensorError: a leaf cannot be packed (named, with a fix).
            PoolExhaustedError: the object does not fit; nothing allocated.
        """
        self._check_open()
        with gc_paused():
            leaves, ops, counts, keys, staged = flatten(obj)
            return self.place(leaves, inspect_leaves(obj, leaves, ops, counts, keys), staged=staged)

    def place(self, leaves: Sequence[torch.Tensor], info: LeafInfo, *, staged: int = 0) -> Packed:
        """Copy inspected leaves into as few blocks as the free space allows
        (sender side): the allocator places the packed layout atomically,
        then the copy plan for that placement is built and executed.
        ``staged``: numpy arrays the flatten copied (counted as strided copies).

        Raises:
            PoolExhaustedError: the object does not fit; nothing allocated.
        """
        self._check_open()
        lay = info.layout
        nbytes = lay.nbytes
        blocks, groups = self._allocator.place_packed(nbytes, lay.alignments)
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
        self._add_live(packed)
        return packed

    def _copy_in(self, leaves: Sequence[torch.Tensor], info: LeafInfo, blocks: Sequence[Block], groups: packing.BlockGroups) -> tuple[int, int]:
        """Copy leaves into their blocks; returns (copy runs, strided copies)."""
        if not blocks:
            return 0, 0
        dst = np.empty(len(leaves), dtype=np.int64)
        for b, blk in enumerate(blocks):
            lo, hi = int(groups.bounds[b]), int(groups.bounds[b + 1])
            dst[lo:hi] = groups.offsets[lo:hi] + blk.offset
        return pack_leaves(leaves, info, dst, self.buffer)

    def pack_with(self, layout: Layout, nbytes: int, fill: Callable[[torch.Tensor], tuple[int, int]], *, num_tensors: int) -> Packed:
        """One block of ``nbytes`` that ``fill(view of the block)`` writes
        and returns ``(copy runs, value-by-value copies)`` of: a piece of a
        streamed put, or a plan placed in one block. Atomic: if ``fill``
        raises, the block is free again.

        Raises:
            PoolExhaustedError: no free block of ``nbytes``; nothing allocated.
        """
        self._check_open()
        block = self._allocator.allocate(nbytes)
        try:
            with gc_paused():
                runs, strided = fill(self.view(Block(block.offset, nbytes)))
        except BaseException:
            self._allocator.free(block.offset)
            raise
        packed = Packed(
            blocks=(Block(block.offset, nbytes),),
            layout=layout,
            nbytes=nbytes,
            num_tensors=num_tensors,
            copy_runs=runs,
            strided_copies=strided,
            pool=self,
        )
        self._add_live(packed)
        return packed

    def write_buffers(self, offset: int, buffers: Sequence[Any]) -> None:
        """Write ``buffers`` back to back into the pool from byte ``offset``,
        through the pool's memory file (``pwritev``: many small buffers in
        few system calls). Host pools only; the caller holds the bytes.

        Raises:
            ConfigurationError: a device pool, or a closed one.
        """
        self._check_open()
        if self.fd is None:
            raise ConfigurationError(f"write_buffers needs a host pool; this pool is on {self.device}")
        vectored_io(os.pwritev, self.fd, buffers, offset)

    def _add_live(self, packed: Packed) -> None:
        with self._lock:
            self._live[id(packed)] = packed
            self._packs += 1
            self._packed_nbytes += packed.nbytes

    def reserve(self, nbytes: int) -> Lease:
        """Reserve ``nbytes`` of raw pool memory (a staging buffer, a receive block).

        Raises:
            PoolExhaustedError: no free block that large; the numbers say
                what is free.
        """
        self._check_open()
        lease = Lease(self, self._allocator.allocate(nbytes))
        with self._lease_lock:
            self._leases += 1
        return lease

    def reserve_up_to(self, nbytes: int, *, min_nbytes: int) -> Lease | None:
        """The largest lease of at most ``nbytes`` and at least ``min_nbytes``
        the free space allows now, or None (racing allocations retried)."""
        while True:
            size = min(nbytes, self._allocator.largest_free_nbytes())
            if size < max(min_nbytes, 1):
                return None
            try:
                return self.reserve(size)
            except PoolExhaustedError:
                continue  # taken meanwhile: look again

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
                leases=self._leases,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this MemoryPool is closed; create a new one")
