"""Trainer side: each rank's local pieces of a ``WeightSource`` as ``tf.Box``es.

vLLM's ``WeightSource.iter_local`` yields plain local tensors and declares
their layout in ``metadata`` (``ParamMeta``: owners, mesh shape,
``Shard(d)``/``Replicate()`` placements). tensorferry's sharded plans need
each piece's place in the global tensor: this module computes it from the
metadata, as DTensor does (mesh dimensions in order, each ``Shard(d)``
splitting the current extent of ``d`` as ``torch.chunk``: pieces of
``ceil(n / k)``, the last ones shorter or empty). Pure arithmetic; copies
nothing.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

import tensorferry as tf

from ..errors import ConfigurationError, LayoutMismatchError

__all__ = ["chunk_span", "local_offsets", "rank_state", "state_nbytes"]


def chunk_span(extent: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``index`` of ``parts`` of ``extent``, as ``torch.chunk`` cuts it."""
    size = -(-extent // parts)  # ceil: torch.chunk's piece size
    start = min(index * size, extent)
    return start, max(0, min(size, extent - start))


def local_offsets(meta: Any, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, local shape)`` of ``rank``'s piece of the parameter ``meta`` describes.

    Raises:
        ConfigurationError: ``rank`` is not among the parameter's owners.
    """
    shape = list(meta.shape)
    offsets = [0] * len(shape)
    if meta.owners is None or meta.placements is None:
        return tuple(offsets), tuple(shape)
    if rank not in meta.owners:
        raise ConfigurationError(f"{meta.name!r}: trainer rank {rank} is not among its owners {meta.owners}")
    flat = meta.owners.index(rank)
    coords = []
    for dim in reversed(meta.mesh_shape):
        coords.append(flat % dim)
        flat //= dim
    coords.reverse()
    for mesh_dim, placement in enumerate(meta.placements):
        d = getattr(placement, "dim", None)
        if d is None:  # Replicate
            continue
        start, length = chunk_span(shape[d], meta.mesh_shape[mesh_dim], coords[mesh_dim])
        offsets[d] += start
        shape[d] = length
    return tuple(offsets), tuple(shape)


def _puts_whole(meta: Any, rank: int) -> bool:
    """A replicated parameter (every owner holds it whole) is put by its first owner only."""
    first = 0 if meta.owners is None else meta.owners[0]
    return rank == first


def rank_state(source: Any, rank: int, world_size: int) -> dict[str, Any]:
    """What ``rank`` puts each round: ``{checkpoint name: tensor or tf.Box}``.

    One rank: ``iter_full`` where the source has it (whole tensors), else
    ``iter_local``. Several ranks: ``iter_local``, each sharded piece
    boxed by its metadata, each replicated one put by its first owner
    only. Every pair the source yields is consumed (its iteration may run
    collectives that must line up across ranks). Copies nothing.

    Raises:
        LayoutMismatchError: a piece whose shape is not what the metadata says.
    """
    if world_size == 1:
        pairs: Iterator = source.iter_full() if source.implements_iter_full() else source.iter_local()
        return dict(pairs)
    metas = {m.name: m for m in source.metadata}
    state: dict[str, Any] = {}
    for name, tensor in source.iter_local():
        meta = metas.get(name)
        if meta is None:
            raise LayoutMismatchError(f"the WeightSource yielded {name!r}, which its metadata does not declare: both must name the same parameters")
        if meta.owners is None or meta.placements is None:
            if _puts_whole(meta, rank):
                state[name] = tensor
            continue
        offsets, local_shape = local_offsets(meta, rank)
        if tuple(tensor.shape) != local_shape:
            raise LayoutMismatchError(
                f"{name!r}: rank {rank}'s piece has shape {tuple(tensor.shape)}, its metadata (global {meta.shape}, mesh "
                f"{meta.mesh_shape}, {meta.placements}) says {local_shape}: the source's iter_local and metadata disagree"
            )
        if tensor.numel() == 0:
            continue  # an empty piece of an uneven split: nothing to put
        state[name] = tf.Box(tensor if tensor.is_contiguous() else tensor.contiguous(), offsets, meta.shape)
    return state


def state_nbytes(state: dict[str, Any], dtype: torch.dtype | None) -> int:
    """Bytes ``state`` takes packed (floating-point tensors as ``dtype`` where given)."""
    total = 0
    for value in state.values():
        t = value.tensor if isinstance(value, tf.Box) else value
        size = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
        total += t.numel() * size
    return total
