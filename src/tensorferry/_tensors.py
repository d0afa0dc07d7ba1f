"""The tensors adapter: torch/numpy <-> Layout, one concept a module.

* :mod:`._flatten` (sender): flatten nested objects into leaves and
  nesting tokens, inspect the leaves in bulk (refusing every leaf that
  cannot be sent, by name, before anything is copied);
* :mod:`._rebuild` (receiver): rebuild the nesting around received leaves,
  match ``into=`` targets;
* :mod:`._tensor_types`: what both use (wire dtype codes, the GC pause).

This module is their one face: import the adapter from here.
"""

from __future__ import annotations

from ._flatten import LeafInfo, data_ptrs, first_replaced, flatten, inspect_leaves
from ._rebuild import match_into, unflatten
from ._tensor_types import dtype_code, gc_paused, torch_dtype

__all__ = ["flatten", "unflatten", "match_into", "torch_dtype", "dtype_code", "inspect_leaves", "LeafInfo", "gc_paused", "data_ptrs", "first_replaced"]
