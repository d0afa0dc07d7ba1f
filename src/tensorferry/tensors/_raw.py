"""Raw reads for a kept plan's check: where a TensorImpl and a StorageImpl
keep the fields the check compares, found on sample tensors of this torch.

A kept plan checks every planned tensor before each put and each get
(``Recorded.first_changed``). Through torch's C shim that is five calls a
tensor, each with its own checks and exception guard; ``_ptrs.raw_differs``
reads the fields in place instead, at offsets learned here:

- the DataPtr in a StorageImpl (its data, deleter and context words);
- the storage offset, the dtype's 16-bit TypeMeta index and the sizes and
  strides (inline for up to 5 dims) in a TensorImpl.

What it saves is the calls' CPU, not the cache misses: 100k tensors of a
1 GiB state dict, 75k of them separately allocated, 7.5 -> 5.5 ms a check;
100k tensors of 64 bytes, 3.3 -> 2.7 ms (``bench_checks.py``).

Each offset must be the only one that fits every sample, and the whole
must then tell apart, on probes, every change a check exists to catch
(``set_``, ``as_strided_``, a dtype, a ``resize_`` that moves, a storage
resized in place, a copy-on-write clone); anything else leaves raw reads
off and the shim's pass in use. A plan's records are checked against the
shim's columns when it is made, and a tensor whose words differ later is
read again through the shim before it is called changed, so a word that
moves for another reason costs one shim read, never a false alarm.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable

import numpy as np
import torch

from ..wire import ELEMENT_SIZE_BY_CODE
from ._types import _CODE_BY_TORCH

__all__ = ["RAW_WORDS", "bind", "records", "first_changed"]

RAW_WORDS = 5  # per tensor: data, deleter, context, storage offset, dtype index (-1: not read raw)

_WORDS = 24  # of a TensorImpl read when learning (every TensorImpl is larger)
_INLINE_DIMS = 5  # sizes and strides a TensorImpl keeps in itself (c10's SizesAndStrides)
# Element size by the columns' uint8 wire code; 0 for NOT_SENDABLE and any
# other code no dtype has (its record then agrees with no address).
_SIZE_BY_UINT8 = np.zeros(256, np.int64)
_SIZE_BY_UINT8[: ELEMENT_SIZE_BY_CODE.size] = ELEMENT_SIZE_BY_CODE


class _NoFit(Exception):
    """Raw reads cannot be learned on this torch (a field fits no word or
    several, or a probe fails); caught by :func:`bind`, which leaves them
    off: it never reaches a caller."""


def _words(address: int, count: int) -> list[int]:
    return [ctypes.c_uint64.from_address(address + 8 * k).value for k in range(count)]


def _only(found: list[int], what: str) -> int:
    if len(found) != 1:
        raise _NoFit(f"{what}: {len(found)} words fit")
    return found[0]


def _learn() -> tuple[int, int, int, int, int]:
    """``bind_raw``'s arguments, from samples; _NoFit where an offset is
    not the only fit."""
    base = torch.arange(128, dtype=torch.float32)
    shapes = [((5,), (2,), 3), ((2, 3), (11, 2), 7), ((2, 2, 3), (29, 13, 3), 5), ((2, 1, 2, 3), (31, 17, 5, 2), 13),
              ((1, 2, 2, 1, 3), (37, 23, 9, 6, 1), 2)]
    samples = [base.as_strided(size, stride, offset) for size, stride, offset in shapes]
    impl = [_words(t._cdata, _WORDS) for t in samples]
    k = _INLINE_DIMS
    sizes_at = 8 * _only([w0 for w0 in range(_WORDS - 1 - 2 * k) if all(
        w[w0] == t.dim() and w[w0 + 1:w0 + 1 + t.dim()] == list(t.shape) and w[w0 + 1 + k:w0 + 1 + k + t.dim()] == list(t.stride())
        for w, t in zip(impl, samples))], "sizes")
    offset_at = 8 * _only([w0 for w0 in range(_WORDS) if all(w[w0] == t.storage_offset() for w, t in zip(impl, samples))], "offset")
    # The data word: the first that holds the data in every StorageImpl, a
    # numpy array's (another deleter and context) included.
    owned = [base.untyped_storage(), torch.zeros(3, dtype=torch.float64).untyped_storage(), torch.from_numpy(np.arange(4.0)).untyped_storage()]
    data = [w0 for w0 in range(4) if all(_words(s._cdata, 4)[w0] == s.data_ptr() for s in owned)]
    if not data:
        raise _NoFit("data: no word fits")
    # The dtype: 16 bits past the offset, the same for two tensors of a
    # dtype and another for every other dtype.
    with warnings.catch_warnings():  # complex32: "experimental"
        warnings.simplefilter("ignore")
        pairs = [(torch.zeros(4, dtype=dt)[1:], torch.zeros(2, 3, dtype=dt)) for dt in _CODE_BY_TORCH]
    halves = [[np.frombuffer(np.asarray(_words(t._cdata, _WORDS), np.uint64).tobytes(), np.uint16) for t in pair] for pair in pairs]
    for h in range(offset_at // 2 + 4, _WORDS * 4):
        # Equal within every pair, and as many values as dtypes.
        if len({int(a[h]) for a, b in halves if a[h] == b[h]}) == len(halves):
            return 8 * data[0], offset_at, 2 * h, sizes_at, k
    raise _NoFit("dtype: no field fits")


def _probe(native: object) -> bool:
    """Whether raw reads, as bound, see each change a check must catch,
    made on a fresh probe, and none where the values alone changed."""

    def changed(change: Callable[[torch.Tensor], object]) -> bool:
        keep = [torch.arange(72, dtype=torch.float32)[4:64].view(6, 10)]
        t = keep[0]
        rec = np.empty((1, RAW_WORDS), np.int64)
        ndims, sizes, strides = np.asarray([2], np.int64), np.asarray(t.shape, np.int64), np.asarray(t.stride(), np.int64)
        if native.raw_words(keep, rec) >= 0 or native.raw_differs(keep, rec, ndims, sizes, strides, 0, 0) >= 0:  # type: ignore[attr-defined]
            raise _NoFit("a probe differs from itself")
        clone = change(t)  # noqa: F841  (a lazy clone is held while compared)
        return native.raw_differs(keep, rec, ndims, sizes, strides, 0, 0) == 0  # type: ignore[attr-defined]

    changes: list[Callable[[torch.Tensor], object]] = [
        lambda t: t.set_(torch.zeros(60).untyped_storage(), 0, (6, 10), (10, 1)),  # another storage
        lambda t: t.as_strided_((6, 10), (10, 1), 5),  # another offset
        lambda t: t.as_strided_((10, 6), (1, 10), 4),  # re-viewed in place, as t_()
        lambda t: t.as_strided_((6, 9), (10, 1), 4),  # a size
        lambda t: t.untyped_storage().resize_(4096),  # the storage reallocated under the tensor
        lambda t: setattr(t, "data", t.view(torch.int32)),  # the dtype alone
    ]
    if hasattr(torch, "_lazy_clone"):
        changes.append(torch._lazy_clone)  # the storage made copy-on-write, its data where it was
    return all(map(changed, changes)) and not changed(lambda t: t.add_(1))


def bind(native: object, storage_at: int) -> bool:
    """Learn the offsets and hand them to the extension: whether raw reads
    are on (off wherever a fit or a probe fails)."""
    if native is None or not hasattr(native, "bind_raw") or storage_at < 0:
        return False
    try:
        native.bind_raw(*_learn())  # type: ignore[attr-defined]
        if _probe(native):
            return True
        why = "a probe's change went unseen"
    except (_NoFit, ValueError, TypeError, AttributeError, RuntimeError) as exc:
        why = str(exc) or type(exc).__name__
    native.bind_raw(-1, 0, 0, 0, 0)  # type: ignore[attr-defined]
    warnings.warn(
        f"tensorferry: kept plans check tensors through torch's calls on torch {torch.__version__}, not by raw reads "
        f"(its TensorImpl layout could not be proved: {why}); results are the same, checks of many tensors slower",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def records(native: object, tensors: list, ptrs: np.ndarray, codes: np.ndarray) -> np.ndarray | None:
    """Each tensor's raw record, where they agree with the shim's
    addresses (``ptrs`` = storage data + offset x the element size of the
    wire dtype ``codes``); None: check through the shim."""
    rec = np.empty((len(tensors), RAW_WORDS), np.int64)
    if native.raw_words(tensors, rec) >= 0:  # type: ignore[attr-defined]
        return None
    read = rec[:, 4] >= 0
    if not np.array_equal(rec[read, 0] + rec[read, 3] * _SIZE_BY_UINT8[codes[read]], ptrs[read]):
        return None
    return rec


def first_changed(native: object, tensors: list, rec: np.ndarray, ndims: np.ndarray, sizes: np.ndarray, strides: np.ndarray,
                  dim_starts: np.ndarray, exact: Callable[[int], bool]) -> int:
    """-1, or the first tensor not as recorded: raw reads, and for a tensor
    whose words differ, ``exact(i)`` (the shim's reading: whether it
    changed); one that did not change has its words recorded again."""
    n, start = len(tensors), 0
    while start < n:
        i = native.raw_differs(tensors, rec, ndims, sizes, strides, start, int(dim_starts[start]))  # type: ignore[attr-defined]
        if i < 0 or exact(i):
            return i
        native.raw_words(tensors[i:i + 1], rec[i:i + 1])  # type: ignore[attr-defined]
        start = i + 1
    return -1
