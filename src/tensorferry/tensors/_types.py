"""The tensors adapter's shared ground: wire dtype codes, the names of
places in a nested object for messages, and the GC pause around loops that
make a tensor object per leaf. Used by both sides (:mod:`._flatten`,
:mod:`._rebuild`)."""

from __future__ import annotations

import contextlib
import gc
from operator import attrgetter
from typing import Any, Iterator

import torch

from ..wire import DTYPES

__all__ = ["torch_dtype", "dtype_code", "gc_paused"]

_TORCH_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in DTYPES if isinstance(getattr(torch, name, None), torch.dtype)
}
_CODE_BY_TORCH: dict[torch.dtype, int] = {dt: DTYPES[name][0] for name, dt in _TORCH_BY_NAME.items()}
_TORCH_BY_CODE: dict[int, torch.dtype] = {code: _TORCH_BY_NAME[name] for name, (code, _) in DTYPES.items() if name in _TORCH_BY_NAME}


def torch_dtype(code: int) -> torch.dtype:
    """The torch dtype of a wire code."""
    return _TORCH_BY_CODE[code]


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a torch dtype."""
    return _CODE_BY_TORCH[dtype]


def listed(problems: list[str], shown: int) -> str:
    """The first ``shown`` problems, and how many more there are."""
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


def _path(parts: list[Any]) -> str:
    return "obj" + "".join(f"[{p!r}]" for p in parts)


_get_dtype = attrgetter("dtype")
_get_shape = attrgetter("shape")
# What a fast walk takes as a plain tensor (subclasses go the slow way).
_PLAIN_TENSOR_TYPES = {torch.Tensor, torch.nn.Parameter}


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic GC around loops that make ~100k tensor objects.

    Each tensor wrapper is a GC-tracked object; a collection every 700 of
    them doubles the cost of building 100k views. Nothing made here is cyclic.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
