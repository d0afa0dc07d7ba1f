"""The tensors layer: torch/numpy <-> Layout, one concept a module.

* :mod:`._flatten` (sender): flatten nested objects into leaves and
  nesting tokens, inspect the leaves in bulk (refusing every leaf that
  cannot be sent, by name, before anything is copied);
* :mod:`._rebuild` (receiver): rebuild the nesting around received leaves,
  match ``into=`` targets;
* :mod:`._types`: what both use (wire dtype codes, the GC pause);
* :mod:`._meta`: every tensor's address, dtype, sizes, strides and flags
  in one C++ pass (``_ptrs.cpp`` over torch's C shim), and the marking of
  tensors written by address (their autograd version counters).

This module is their one face: import the adapter from here. May import:
the wire layer, :mod:`tensorferry.shards` and :mod:`tensorferry.errors`;
never memory, copy or anything above.
"""

from __future__ import annotations

from ._flatten import LeafInfo, data_ptrs, first_replaced, flatten, inspect_leaves
from ._meta import Recorded, mark_written
from ._rebuild import match_into, unflatten
from ._types import dtype_code, gc_paused, listed, torch_dtype

__all__ = ["flatten", "unflatten", "match_into", "torch_dtype", "dtype_code", "inspect_leaves", "LeafInfo", "gc_paused", "data_ptrs", "first_replaced",
           "Recorded", "listed", "mark_written"]
