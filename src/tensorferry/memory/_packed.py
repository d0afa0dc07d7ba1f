"""What a pool hands out for a packed object (:class:`Packed`), and a
snapshot of a pool's figures (:class:`PoolStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ..wire import Layout
from ._allocator import Block

if TYPE_CHECKING:
    from ._pool import MemoryPool

__all__ = ["Packed", "PoolStats"]


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
    leases: int = 0  # raw-byte reservations alive (staging buffers, receive blocks)


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

    def buffers(self) -> list[memoryview]:
        """The blocks' bytes, in order, as buffers (host pools; a server sends them)."""
        host = self.pool.buffer.numpy()
        return [memoryview(host[b.offset : b.offset + b.nbytes]) for b in self.blocks]

    def runs(self) -> None:
        """None: the bytes are in the pool, which readers map or fetch (the
        ``Held`` protocol a server serves by; a sourced piece has runs)."""
        return None

    def __enter__(self) -> "Packed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
