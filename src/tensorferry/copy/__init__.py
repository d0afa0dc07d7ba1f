"""Byte copies at memory speed.

One core's ``memcpy`` does not saturate memory bandwidth: on the machines we
measured one thread copies 1 GiB in 0.095 s and two threads in 0.054 s. So a
large host-to-host copy is split into equal-byte parts that run at once, on a
small module-wide thread pool; each part is a batch of runs moved by
``_memcpy.copy_runs`` (a C loop of memmove over int64 arrays, the GIL
released: a run costs its bytes, not a Python call; large batches use
streaming stores). Where the extension was not built (no C compiler), a part
is a Python loop of libc ``memmove`` through ctypes, about 1 us a run.
The same extension converts float32 into bfloat16 and float16 for
``copy_converting`` (``_memcpy.convert_runs``), as torch does, bit for bit.

torch's ``copy_`` of a large CPU uint8 tensor runs about 1.5x slower than
libc ``memcpy`` here (0.25 s against 0.16 s for 1 GiB), so dense host
tensors are copied by address; anything strided, conjugated or negated, and
anything on a device, goes through torch.

``TENSORFERRY_COPY_THREADS`` sets how many threads one copy uses (default:
the CPUs this process may run on, at most 4; ``1`` turns the split off).

The package, one concept a module: :mod:`._threads` (the copy threads),
:mod:`._memmove` (runs moved by address, vectored file I/O), :mod:`._convert`
(dtype conversions), :mod:`._plan` (``CopyPlan``), :mod:`._pack` (sender:
tensors into a pool block) and :mod:`._targets` (receiver: bytes into the
caller's tensors). :mod:`._native` holds the C loop (``_memcpy.c``), or None.

May import: the tensors and wire layers and :mod:`tensorferry.errors`;
memory, plans and the transports import this layer, never the reverse.
"""

from __future__ import annotations

from ._convert import copy_converting, native_nan_bits
from ._memmove import (
    Batches,
    batches,
    copy_bytes,
    destinations_apart,
    many_small_runs,
    memmove_runs,
    vectored_io,
)
from ._pack import copy_values, leaf_runs, pack_leaves
from ._plan import CopyPlan
from ._targets import (
    StagedCopy,
    copy_staged,
    dense_host_mask,
    fill_aliases,
    stage_rest,
    staged_addresses,
    target_addresses,
)
from ._threads import PARALLEL_MIN_NBYTES, copy_threads, executor, finish, run_parts

__all__ = [
    "PARALLEL_MIN_NBYTES",
    "Batches",
    "CopyPlan",
    "StagedCopy",
    "batches",
    "copy_bytes",
    "copy_converting",
    "copy_staged",
    "copy_threads",
    "copy_values",
    "dense_host_mask",
    "destinations_apart",
    "executor",
    "fill_aliases",
    "finish",
    "leaf_runs",
    "many_small_runs",
    "native_nan_bits",
    "memmove_runs",
    "pack_leaves",
    "run_parts",
    "stage_rest",
    "staged_addresses",
    "target_addresses",
    "vectored_io",
]
