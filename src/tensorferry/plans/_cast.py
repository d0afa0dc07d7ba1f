"""A send plan's ``dtype=``: the layout as sent (floating-point tensors cast
to the given dtype) and the runs converted on the way. Sender side.

An fp32 trainer feeding a bf16 engine halves the bytes by converting as it
packs; integer and bool tensors are always sent as they are. Dense host
tensors that touch on both sides are converted as one run each (views of a
flat buffer: one run); the rest are cast value by value by the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ..errors import ConfigurationError
from ..tensors import LeafInfo, dtype_code, torch_dtype
from ..wire import DTYPES, Layout, packing
from ._buffers import buffer_at

__all__ = ["converted_layout", "conversion_runs"]


def converted_layout(layout: Layout, dtype: torch.dtype | None) -> tuple[Layout, np.ndarray]:
    """The layout with floating-point tensors as ``dtype``, and which changed."""
    if dtype is None:
        return layout, np.zeros(layout.num_tensors, dtype=bool)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigurationError(
            f"plan(dtype={dtype!r}): expected a floating-point torch dtype (torch.bfloat16, torch.float16, ...); "
            "integer and bool tensors are always sent as they are"
        )
    try:
        target = dtype_code(dtype)
    except KeyError as exc:
        raise ConfigurationError(f"plan(dtype={dtype}): tensorferry cannot send {dtype}; use torch.bfloat16 or torch.float16") from exc
    codes = layout.dtype_codes
    convert = _FLOATING[codes] & (codes != target) if codes.size else np.zeros(0, dtype=bool)
    if not convert.any():
        return layout, convert
    new_codes = codes.copy()
    new_codes[convert] = target
    return dataclasses.replace(layout, dtype_codes=new_codes), convert


def _floating_codes() -> np.ndarray:
    """bool per wire code: a floating-point dtype (what ``dtype=`` converts)."""
    out = np.zeros(max(code for code, _ in DTYPES.values()) + 1, dtype=bool)
    for code, _ in DTYPES.values():
        out[code] = torch_dtype(code).is_floating_point
    return out


_FLOATING = _floating_codes()


def conversion_runs(leaves: Sequence[torch.Tensor], info: LeafInfo, sent: Layout, offsets: np.ndarray, convert: np.ndarray) -> tuple[list[tuple[int, int, torch.dtype, torch.Tensor]], np.ndarray]:
    """Dense host tensors converted on the way, merged into runs of one
    source dtype that touch on both sides (views of a flat buffer: one
    run), each with a tensor over its source memory made once.

    Returns ``(runs, converted)``: ``(destination offset, destination
    bytes, destination dtype, source tensor)`` per run, and the indices of
    the tensors the runs cover.
    """
    src_size = info.layout.alignments
    idx = np.flatnonzero(convert & info.raw & (sent.nbytes > 0))
    idx = idx[info.data_ptrs[idx] % src_size[idx] == 0]
    if not idx.size:
        return [], idx
    codes = info.layout.dtype_codes[idx]
    breaks = np.zeros(idx.size, dtype=bool)
    breaks[1:] = codes[1:] != codes[:-1]
    dst_size = sent.alignments[idx]
    # In elements: a run is adjacent on both sides in its own element size.
    runs = packing.merge_runs(offsets[idx] // dst_size, info.data_ptrs[idx] // src_size[idx], sent.numels[idx], breaks)
    out = []
    for de, se, n, h in zip(runs.dst.tolist(), runs.src.tolist(), runs.nbytes.tolist(), runs.heads.tolist()):
        i = int(idx[h])
        sdt, ddt = leaves[i].dtype, torch_dtype(int(sent.dtype_codes[i]))
        src = torch.frombuffer(buffer_at(se * sdt.itemsize, n * sdt.itemsize), dtype=sdt)
        out.append((de * ddt.itemsize, n * ddt.itemsize, ddt, src))
    return out, idx
