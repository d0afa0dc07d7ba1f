"""Worker side: the checkpoint tensors a round fills, read off the tickets' layouts.

A round's tickets (one a trainer rank) carry each rank's layout: the
checkpoint names, dtypes and shapes it put, and for a shard the global
shape (``Box``/DTensor). The worker allocates one whole tensor a name
(the union over ranks) once, plans the gets into them, and hands them to
vLLM's ``load_weights``, which fuses and slices them for its own layers.
Nothing travels besides the tickets: a worker that restarts, or joins
late, knows the names from the next round's tickets alone. Copies nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import LayoutMismatchError

__all__ = ["checkpoint_targets"]

# TreeOp codes of the layout's nesting (tensorferry.Layout.tree_ops: LEAVES
# is a run of `count` tensors): a trainer round is one flat dict of
# name -> tensor, the tokens (DICT n) (LEAVES n).
_LEAVES, _DICT = 0, 3


def _entries(layout: Any, rank: int) -> list[tuple[str, str, tuple[int, ...], int]]:
    """``(name, dtype name, global shape, alias of)`` of every tensor of one rank's layout
    (``alias of`` is the index of the tensor it is tied to, or -1)."""
    ops, counts, n = layout.tree_ops.tolist(), layout.tree_counts.tolist(), layout.num_tensors
    if not (ops == [_DICT, _LEAVES] and counts == [n, n] and len(layout.keys) == n):
        raise LayoutMismatchError(
            f"trainer rank {rank}'s ticket is not a flat dict of checkpoint names to tensors "
            f"({n} tensors, {len(layout.keys)} keys): send with TensorferryTrainerWeightTransferEngine, "
            "which puts {name: tensor} of the WeightSource"
        )
    shapes, dtypes = layout.shapes(), layout.dtype_names()
    boxes = layout.boxes
    if boxes is not None:
        pos = 0
        ndims = layout.ndims.tolist()
        flat = boxes.shapes.tolist()
        for i in boxes.index.tolist():
            shapes[i] = tuple(flat[pos : pos + ndims[i]])
            pos += ndims[i]
    tied = [-1] * n
    for tensor, earlier in layout.aliases.tolist():
        tied[tensor] = earlier
    return [(str(layout.keys[i]), dtypes[i], shapes[i], tied[i]) for i in range(n)]


def checkpoint_targets(layouts: Sequence[Any], *, pin_memory: bool = False) -> dict[str, torch.Tensor]:
    """One tensor a checkpoint name of ``layouts`` (every trainer rank's), in global shape.

    Worker side; allocates (uninitialised host memory, pinned for a CUDA
    worker's copies to the device), copies nothing. A name tied to an
    earlier one (one tensor under two names) gets the same tensor.

    Raises:
        LayoutMismatchError: a layout that is not a flat dict, or two ranks
            that disagree on a name's global shape or dtype.
    """
    seen: dict[str, tuple[str, tuple[int, ...], int]] = {}
    targets: dict[str, torch.Tensor] = {}
    for rank, layout in enumerate(layouts):
        entries = _entries(layout, rank)
        for name, dtype, shape, alias in entries:
            if name in seen:
                other_dtype, other_shape, other_rank = seen[name]
                if (other_dtype, other_shape) != (dtype, shape):
                    raise LayoutMismatchError(
                        f"{name!r}: trainer rank {other_rank} puts it as {other_dtype} {other_shape}, rank {rank} as "
                        f"{dtype} {shape}: every rank must declare the same global shape and dtype (one WeightSource metadata)"
                    )
                continue
            seen[name] = (dtype, shape, rank)
            if alias >= 0:
                targets[name] = targets[entries[alias][0]]
            else:
                targets[name] = torch.empty(shape, dtype=getattr(torch, dtype), pin_memory=pin_memory)
    return targets
