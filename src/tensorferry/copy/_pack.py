"""Sender side: a group of tensors copied into a pool block (or a piece of one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..tensors import torch_dtype
from ._memmove import copy_bytes
from ._plan import CopyPlan

__all__ = ["copy_values", "leaf_runs", "pack_leaves"]


def leaf_runs(leaves: Sequence[torch.Tensor], info: Any, dst: np.ndarray, *, host: bool) -> CopyPlan:
    """The copy plan of leaves into a pool (sender side): leaf ``i``'s bytes
    go to offset ``dst[i]``. Built once, O(N) and vectorised; a streamed
    put executes a window of it per piece. ``host``: leaves and pool are
    host memory, so a run may be copied by address and touching in memory
    is enough; device copies go through a storage's tensor, so there a run
    must also stay inside one storage."""
    breaks = None
    if not host:
        sptrs = info.storage_ptrs
        if sptrs is None:  # host leaves into a device pool
            sptrs = np.fromiter((t.untyped_storage().data_ptr() for t in leaves), dtype=np.int64, count=len(leaves))
        breaks = np.zeros(len(leaves), dtype=bool)
        breaks[1:] = sptrs[1:] != sptrs[:-1]
    return CopyPlan.build(dst, info.data_ptrs, info.layout.nbytes, raw=info.raw, breaks=breaks)


def pack_leaves(leaves: Sequence[torch.Tensor], info: Any, dst: np.ndarray, out: torch.Tensor, lo: int = 0, hi: int | None = None, *, runs: CopyPlan | None = None) -> tuple[int, int]:
    """Copy leaves into ``out`` (sender side): leaf ``i``'s bytes belong at
    offset ``dst[i]``, and the bytes that fall in ``[lo, hi)`` are written to
    ``out[dst[i] - lo ...]`` (a whole object: ``lo=0``; a streamed piece:
    its byte range). Executes the leaves' copy plan (``runs``, from
    :func:`leaf_runs`; built here when not given): one copy per run of
    tensors adjacent in their memory and in ``out``; tensors that are not
    raw bytes are copied value by value.

    Returns:
        ``(runs, elementwise)``: copies issued for runs, and tensors copied
        value by value.
    """
    whole = hi is None  # the destinations may then lie in any order (blocks)
    hi = (1 << 62) if whole else hi
    host = info.all_cpu and out.device.type == "cpu"
    plan = runs if runs is not None else leaf_runs(leaves, info, dst, host=host)
    if host:
        count = plan.execute(dst_base=out.data_ptr()) if whole else plan.execute_window(lo, hi, out.data_ptr() - lo, 0, by_dst=True)
        return count, copy_values(leaves, info.layout, dst, out, lo, hi, plan.elementwise)
    d, src, n, heads = (plan.dst, plan.src, plan.nbytes, plan.heads) if whole else plan.window(lo, hi, by_dst=True)
    storages: dict[tuple[int, str], torch.Tensor] = {}
    for d0, s0, k, i in zip(d.tolist(), src.tolist(), n.tolist(), heads.tolist()):
        t = leaves[i]
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device))
        storage = storages.get(key)
        if storage is None:
            storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
            storages[key] = storage
        off = s0 - key[0]
        copy_bytes(out[d0 - lo : d0 - lo + k], storage[off : off + k])
    return int(n.size), copy_values(leaves, info.layout, dst, out, lo, hi, plan.elementwise)


def copy_values(leaves: Sequence[torch.Tensor], layout: Any, dst: np.ndarray, out: torch.Tensor, lo: int, hi: int, indices: np.ndarray) -> int:
    """Copy the leaves ``indices`` value by value into ``out`` (sender side):
    leaf ``i`` belongs at byte ``dst[i]`` as the layout's dtype (converted
    when that differs from the leaf's), and only its bytes in ``[lo, hi)``
    are written, at ``out[... - lo]``. Returns how many were copied."""
    nbytes, codes = layout.nbytes, layout.dtype_codes
    copied = 0
    with torch.no_grad():
        for i in indices.tolist():
            start, size = int(dst[i]), int(nbytes[i])
            a, b = max(lo, start), min(hi, start + size)
            if a >= b:
                continue
            t = leaves[i]
            dtype = torch_dtype(int(codes[i]))
            value = t.resolve_conj().resolve_neg() if (t.is_conj() or t.is_neg()) else t
            if a == start and b == start + size:
                out[start - lo : start - lo + size].view(dtype).view(t.shape).copy_(value)
            else:  # a piece boundary cuts the tensor: its bytes, then the part
                part = value.to(dtype).contiguous().reshape(-1).view(torch.uint8)[a - start : b - start]
                copy_bytes(out[a - lo : b - lo], part.to(out.device))
            copied += 1
    return copied
