"""Shards: tensors that are a part (a box) of a larger global tensor.

A sender's ``plan``/``put`` and a receiver's sharded ``plan``/``get`` take
two kinds of shard among the leaves of an object:

* a ``torch.distributed.tensor.DTensor`` (any device mesh, ``Shard(d)`` or
  ``Replicate()`` on each mesh dimension, uneven sizes included): its local
  shard is what moves, and its box is where that shard lies in the global
  tensor;
* a :class:`Box`: a plain tensor declared as the box of a global tensor
  (for engines that slice weights themselves: a tensor-parallel worker's
  column, row or vocabulary slice).

Both sides run this; nothing is copied.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .errors import ConfigurationError

__all__ = ["Box", "local_box", "is_shard"]


class Box:
    """A plain tensor declared as the part of a global tensor it holds.

    ``Box(t, offsets=(0, 512), global_shape=(1024, 1024))``: ``t`` (of
    shape ``(1024, 512)``) holds columns 512 to 1023 of a 1024 x 1024
    tensor. On a sender the box travels in the layout; as a receiver's
    target it says which part of the global tensor to write into ``t``.

    Args:
        tensor: the local part (contiguous for a receiver's target).
        offsets: where the part starts, per dimension of the global tensor.
        global_shape: the global tensor's shape.

    Raises:
        ConfigurationError: not a tensor, the part does not lie inside the
            global shape, or the numbers of dimensions differ.
    """

    __slots__ = ("tensor", "offsets", "global_shape")

    def __init__(self, tensor: torch.Tensor, offsets: Sequence[int], global_shape: Sequence[int]) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigurationError(f"Box(tensor=...) takes a torch.Tensor, not a {type(tensor).__name__}: wrap the local part's tensor")
        offsets, global_shape = tuple(int(o) for o in offsets), tuple(int(s) for s in global_shape)
        if not len(offsets) == len(global_shape) == tensor.dim():
            raise ConfigurationError(
                f"Box: a {tensor.dim()}-d tensor needs {tensor.dim()} offsets and a {tensor.dim()}-d global shape; "
                f"got offsets {offsets} and global shape {global_shape}"
            )
        if any(o < 0 or o + n > g for o, n, g in zip(offsets, tensor.shape, global_shape)):
            raise ConfigurationError(
                f"Box: a part of shape {tuple(tensor.shape)} at offsets {offsets} does not lie inside the global shape {global_shape}"
            )
        self.tensor, self.offsets, self.global_shape = tensor, offsets, global_shape

    def __repr__(self) -> str:
        return f"Box(shape={tuple(self.tensor.shape)}, offsets={self.offsets}, global_shape={self.global_shape}, dtype={self.tensor.dtype})"


def is_shard(x: Any) -> bool:
    """Whether ``x`` is a :class:`Box` or a DTensor (without importing
    ``torch.distributed`` for a process that never made one)."""
    return type(x) is Box or (isinstance(x, torch.Tensor) and _is_dtensor(x))


def _is_dtensor(x: torch.Tensor) -> bool:
    return type(x).__name__ == "DTensor" and type(x).__module__.startswith("torch.distributed")


def local_box(x: Any) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | str:
    """``(local tensor, global shape, offsets)`` of a shard, or why it
    cannot be sent as one (a message fragment naming the fix).

    A DTensor's box comes from its mesh and placements (torch's own
    ``compute_local_shape_and_global_offset``: uneven ``Shard(d)`` sizes
    follow ``torch.chunk``); placements other than ``Shard(d)`` and
    ``Replicate()`` (``Partial``, strided shards) are refused.
    """
    if type(x) is Box:
        return x.tensor, x.global_shape, x.offsets
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    odd = [p for p in x.placements if not (type(p) is Replicate or type(p) is Shard)]
    if odd:
        return (
            f"is a DTensor with placements {tuple(x.placements)}; tensorferry sends Shard(d) and Replicate() shards: "
            "redistribute it first (e.g. .redistribute(placements=[Replicate()]) to reduce a Partial)"
        )
    local = x.to_local()
    shape, offsets = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    if tuple(local.shape) != tuple(shape):
        return f"is a DTensor whose local tensor has shape {tuple(local.shape)}, its placements say {tuple(shape)}"
    return local, tuple(x.shape), tuple(int(o) for o in offsets)
