"""Every tensor's address, dtype, sizes, strides and flags in one C++ pass.

What the sender reads of each leaf (:func:`read_columns`, for
``inspect_leaves``) and what a kept plan checks before each use
(:class:`Recorded`: the same addresses, dtypes, sizes and strides as when
the plan was made). From Python each of these is a call per tensor and
attribute (``dim``, ``shape``, ``stride()``, ``is_contiguous()``, ...,
40-100 ns each; 10k tensors took 16 ms to inspect and 5 ms to match); the
loop in ``_ptrs.cpp`` reads them through torch's C shim (the
``aoti_torch_get_*`` functions libtorch exports, an ABI-stable C interface)
at a few ns each. Without the extension or the shim, the same columns come
from Python passes.
"""

from __future__ import annotations

import ctypes
import operator
import os
import warnings
from itertools import chain
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ..errors import UnsupportedTensorError
from . import _raw
from ._types import _CODE_BY_TORCH, _PLAIN_TENSOR_TYPES, _TORCH_BY_CODE

try:
    from . import _ptrs as _native
except ImportError:  # installed without a C++ compiler: Python passes
    _native = None

__all__ = ["TensorColumns", "read_columns", "Recorded", "native", "NOT_SENDABLE", "all_plain", "mark_written"]

# The code of a dtype that has none on the wire (complex32, quantized, ...).
NOT_SENDABLE = 255

# The shim's readers _ptrs.bind takes, in its order.
_SHIM = ("aoti_torch_get_data_ptr", "aoti_torch_get_dtype", "aoti_torch_get_dim", "aoti_torch_get_sizes",
         "aoti_torch_get_strides", "aoti_torch_is_contiguous", "aoti_torch_get_device_type")


class TensorColumns(NamedTuple):
    """Per tensor (arrays of one entry a tensor), and all sizes and strides
    back to back (``ndims[i]`` of each, tensor after tensor)."""

    ptrs: np.ndarray  # int64 data_ptr()
    codes: np.ndarray  # uint8 wire dtype code (layout.DTYPES), NOT_SENDABLE for any other dtype
    ndims: np.ndarray  # int64
    sizes: np.ndarray  # int64, sum(ndims)
    strides: np.ndarray  # int64, sum(ndims)
    contiguous: np.ndarray  # bool: contiguous (raw_bits: and neither a negative nor a conjugate view)
    cpu: np.ndarray  # bool
    numbers: np.ndarray | None = None  # int32 dtype as the shim gives it (C++ readings only)
    raw_bits: bool = False  # contiguous says whether the bytes are the values
    numels: np.ndarray | None = None  # int64 elements of each tensor (C++ readings only)

    def dtype(self, i: int) -> torch.dtype | None:
        """Tensor ``i``'s dtype (None: one tensorferry does not send)."""
        return _TORCH_BY_CODE.get(int(self.codes[i]))


def _addresses(names: Sequence[str]) -> tuple[int, ...]:
    """Addresses of libtorch's exported functions (0 where one is missing);
    libtorch is loaded already (by ``import torch``), never again here.

    Raises:
        OSError: libtorch_cpu is not where torch keeps it.
    """
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    return tuple((ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0) if hasattr(lib, name) else 0 for name in names)


def _bind() -> bool:
    """Hand the shim's functions to the extension: whether columns come from C++."""
    if _native is None or not hasattr(_native, "bind"):
        return False
    try:
        addresses = _addresses(_SHIM)
        getter = torch._C.TensorBase.__dict__["_cdata"]
        sample = torch.empty(1)
        _native.bind(addresses, torch._C.TensorBase, getter, sample, getter.__get__(sample))
    except (OSError, AttributeError, KeyError, ValueError, TypeError):
        return False
    return True


native = _bind()

# C++ functions libtorch exports that read the negative and conjugate bits,
# the first pair found: the kernels (at::native::is_neg, is_conj: a bit of
# the key set, ~1 ns), else the operator entry points (at::_ops::is_neg::call,
# is_conj::call: through the dispatcher, ~20 ns a tensor and call). The
# kernels are what the dispatcher reaches for a plain tensor (is_neg and
# is_conj are CompositeImplicitAutograd; the Negative and Conjugate keys
# fall through for them).
_BITS_SYMBOLS = (("_ZN2at6native6is_negERKNS_6TensorE", "_ZN2at6native7is_conjERKNS_6TensorE"),
                 ("_ZN2at4_ops6is_neg4callERKNS_6TensorE", "_ZN2at4_ops7is_conj4callERKNS_6TensorE"))


def _bind_bits() -> bool:
    if not native:
        return False
    for symbols in _BITS_SYMBOLS:
        try:
            neg, conj = _addresses(symbols)
            if not _native.bind_bits(neg, conj):
                continue
            # Told right on both kinds of view, or not used.
            x = torch.zeros(2, dtype=torch.complex64)
            probe = [x, x.conj(), x.conj().imag, torch.zeros(2), torch._neg_view(torch.zeros(2)), torch.nn.Parameter(x).conj()]
            raw = np.empty(len(probe), np.uint8)
            k = len(probe)
            if _native.columns(probe, np.empty(k, np.int64), np.empty(k, np.int32), np.empty(k, np.int64), raw, np.empty(k, np.int32))[0] < 0 \
                    and raw.tolist() == [1, 0, 0, 1, 0, 0]:
                return True
        except (OSError, AttributeError, ValueError, TypeError):
            pass
    _native.bind_bits(0, 0)
    return False


def _bind_plain() -> bool:
    """Tell the extension the exact types a fast walk takes as plain
    tensors (:func:`all_plain`, and no subtype walk a tensor in columns)."""
    if not native or not hasattr(_native, "bind_plain"):
        return False
    try:
        _native.bind_plain(tuple(_PLAIN_TENSOR_TYPES))
    except (TypeError, ValueError):
        return False
    return True


_PLAIN = _bind_plain()

def _impl_words(t: torch.Tensor) -> list[int]:
    """The first 24 pointer-size words of ``t``'s TensorImpl (every
    TensorImpl is larger), read in place."""
    return [ctypes.c_uint64.from_address(t._cdata + 8 * k).value for k in range(24)]


def _bind_prefetch() -> tuple[int, int]:
    """Where a TensorImpl keeps its StorageImpl pointer (the word that is
    each sample's ``untyped_storage()._cdata``) and its version counter
    (the one other nonzero word a view shares with its base and no
    unrelated tensor has), found on sample tensors and handed to the
    loops, which prefetch through them; -1 where not exactly one word
    fits. Prefetches never fault, so a wrong word costs speed only."""
    if not native or not hasattr(_native, "bind_prefetch"):
        return -1, -1
    try:
        bases = [torch.zeros(16), torch.ones(8, dtype=torch.float64), torch.empty(4, 4)]
        views = [b.view(-1)[1:] for b in bases]
        words = [_impl_words(t) for t in bases + views]
        storages = [b.untyped_storage()._cdata for b in bases]
        n = len(bases)
        storage = [k for k in range(24) if all(words[j][k] == storages[j] for j in range(n))]
        version = [k for k in range(24) if k not in storage and all(
            words[j][k] != 0 and words[j][k] == words[n + j][k] and words[j][k] != words[(j + 1) % n][k] for j in range(n))]
        at = (8 * storage[0] if len(storage) == 1 else -1, 8 * version[0] if len(version) == 1 else -1)
        _native.bind_prefetch(*at)
        return at
    except (AttributeError, ValueError, TypeError, RuntimeError):
        return -1, -1


_PREFETCH = _bind_prefetch()
# A kept plan's check by raw reads (_raw.py), where they could be learned.
_RAW = native and _raw.bind(_native, _PREFETCH[0])

_BUMP_SYMBOL = "_ZN5torch8autograd4impl12bump_versionERKN2at6TensorE"


def _bind_bump() -> bool:
    """Hand the extension torch's own version-counter bump, and check it
    on a base and its view (one counter: bumped once, seen by both) and an
    inference tensor (no counter: refused, left to torch)."""
    if not native or not hasattr(_native, "bind_bump"):
        return False
    try:
        (address,) = _addresses((_BUMP_SYMBOL,))
        if address:
            _native.bind_bump(address)
            base = torch.zeros(4)
            view, before = base[1:], base._version
            with torch.inference_mode():
                frozen = torch.zeros(1)
            if _native.bump_versions([base, view]) < 0 and base._version == view._version == before + 2 \
                    and _native.bump_versions([frozen]) == 0:
                return True
    except (OSError, AttributeError, ValueError, TypeError, RuntimeError):
        pass
    _native.bind_bump(0)
    return False


_BUMP = _bind_bump()


def mark_written(tensors: list[torch.Tensor]) -> None:
    """``torch.autograd.graph.increment_version(tensors)``: each tensor's
    autograd version counter bumped (a view's is its base's), tensors made
    under ``inference_mode`` skipped. One C++ loop over torch's own bump
    where bound, ~20 ns a tensor against ~190 through torch's binding (a
    worker's 75k separately allocated weights: 14 ms a sync)."""
    if _BUMP:
        first = _native.bump_versions(tensors)
        if first < 0:
            return
        tensors = tensors[first:]  # from the one the loop did not bump: torch says why, or skips it
    torch.autograd.graph.increment_version(tensors)


def all_plain(items: Sequence[object]) -> bool:
    """Whether every item's exact type is a plain tensor type (torch.Tensor,
    nn.Parameter): one C loop over a list where built (100k: ~0.1 ms,
    against 1 ms for ``set(map(type, items))``)."""
    if _PLAIN and type(items) is list:
        return _native.first_not_plain(items) < 0
    return set(map(type, items)) <= _PLAIN_TENSOR_TYPES


_BITS = _bind_bits()


def _dtype_table() -> tuple[dict[int, torch.dtype], int]:
    """The shim's dtype numbers (torch's ScalarType) of the dtypes
    tensorferry sends, read from one empty tensor of each; and torch's CPU
    device number. Other dtypes are no reading (the caller says why)."""
    by_number: dict[int, torch.dtype] = {}
    cpu = 0
    if native:
        for dt in _CODE_BY_TORCH:
            with warnings.catch_warnings():  # complex32: "experimental"
                warnings.simplefilter("ignore")
                t = torch.empty(0, dtype=dt)
            dtypes, devices = np.empty(1, np.int32), np.empty(1, np.int32)
            if _native.columns([t], np.empty(1, np.int64), dtypes, np.empty(1, np.int64), np.empty(1, np.uint8), devices)[0] < 0:
                by_number[int(dtypes[0])] = dt
                cpu = int(devices[0])
    return by_number, cpu


_DTYPE_BY_NUMBER, _CPU = _dtype_table()
# Wire code by the shim's dtype number.
_CODE_BY_NUMBER = np.full(max(_DTYPE_BY_NUMBER, default=0) + 1, NOT_SENDABLE, dtype=np.uint8)
for _number, _dt in _DTYPE_BY_NUMBER.items():
    _CODE_BY_NUMBER[_number] = _CODE_BY_TORCH[_dt]


def read_columns(tensors: Sequence[torch.Tensor], *, plain_only: bool = False) -> TensorColumns | None:
    """Every tensor's columns, in one C++ pass where built (about 50 ns a
    tensor), else in Python passes. None where a tensor has no such reading
    (not a tensor, no storage, sizes the shim cannot give; with
    ``plain_only``, a tensor subclass other than ``nn.Parameter``): the
    caller's slow path says why."""
    tensors = tensors if type(tensors) is list else list(tensors)
    n = len(tensors)
    if plain_only and not (native and _PLAIN) and not all_plain(tensors):
        return None  # the C++ pass tells plain tensors only where bind_plain bound them
    if not native:
        return _python_columns(tensors)
    ptrs, dtypes, ndims = np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.int64)
    contiguous, devices, numels = np.empty(n, np.uint8), np.empty(n, np.int32), np.empty(n, np.int64)
    bad, sizes, strides = _native.columns(tensors, ptrs, dtypes, ndims, contiguous, devices, numels, plain_only and _PLAIN)
    if bad >= 0:
        return None
    if n and 0 <= int(dtypes.min()) and int(dtypes.max()) < _CODE_BY_NUMBER.size:
        codes = _CODE_BY_NUMBER[dtypes]  # one gather; the masked one below costs 4x at 100k
    else:
        known = (dtypes >= 0) & (dtypes < _CODE_BY_NUMBER.size)
        codes = np.full(n, NOT_SENDABLE, dtype=np.uint8)
        codes[known] = _CODE_BY_NUMBER[dtypes[known]]
    return TensorColumns(ptrs, codes, ndims, np.frombuffer(sizes, np.int64), np.frombuffer(strides, np.int64),
                         contiguous.view(bool), devices == _CPU, dtypes, _BITS, numels)


def _python_columns(tensors: list) -> TensorColumns | None:
    n = len(tensors)
    try:
        ptrs = np.fromiter(map(torch.Tensor.data_ptr, tensors), dtype=np.int64, count=n)
        sizes = [tuple(t.shape) for t in tensors]
        strides = [t.stride() for t in tensors]
    except (RuntimeError, TypeError, AttributeError):
        return None
    ndims = np.fromiter(map(len, sizes), dtype=np.int64, count=n)
    return TensorColumns(
        ptrs, np.fromiter((_CODE_BY_TORCH.get(t.dtype, NOT_SENDABLE) for t in tensors), dtype=np.uint8, count=n), ndims,
        np.fromiter((d for s in sizes for d in s), dtype=np.int64, count=int(ndims.sum())),
        np.fromiter((d for s in strides for d in s), dtype=np.int64, count=int(ndims.sum())),
        np.fromiter(map(torch.Tensor.is_contiguous, tensors), dtype=bool, count=n),
        np.fromiter((t.is_cpu for t in tensors), dtype=bool, count=n),
    )


def _unreadable(t: object) -> bool:
    try:
        t.data_ptr(), t.shape, t.stride(), t.dtype  # type: ignore[attr-defined]
    except (RuntimeError, TypeError, AttributeError):
        return True
    return False


_get_dtype = operator.attrgetter("dtype")
_get_shape = operator.attrgetter("shape")


class Recorded:
    """Tensors' addresses, dtypes, sizes and strides as found now, to tell
    later whether tensors (the same objects, or others) are as recorded:
    what a kept plan checks before each use. ``first_changed`` is one C++
    pass where built (about 0.05 us a tensor).

    Raises (constructor):
        RuntimeError, TypeError: a tensor has no address (sparse), or is
            no tensor, as ``data_ptr()`` raises.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        tensors = tensors if type(tensors) is list else list(tensors)
        cols = read_columns(tensors)
        self._native = cols is not None and native
        if cols is None:
            cols = _python_columns(tensors)
        if cols is None:
            for t in tensors:  # raises what data_ptr() or shape raises
                t.data_ptr(), t.shape, t.stride()
            raise UnsupportedTensorError(f"one of these {len(tensors)} tensors has no address, sizes or strides to record; "
                                         "a plan needs strided tensors (not sparse, nested or meta)")
        self.columns = cols
        self._dtypes = None if self._native else [t.dtype for t in tensors]
        # Raw records, where bound and they agree with the columns (_raw.py).
        self._raw = _raw.records(_native, tensors, cols.ptrs, cols.codes) if self._native and _RAW else None
        self._dim_starts = np.cumsum(cols.ndims) - cols.ndims if self._raw is not None else None

    def numels(self) -> np.ndarray:
        """Each recorded tensor's element count (int64)."""
        c = self.columns
        out = np.ones(c.ndims.size, dtype=np.int64)
        some = np.flatnonzero(c.ndims > 0)
        if some.size:
            starts = (np.cumsum(c.ndims) - c.ndims)[some]
            out[some] = np.multiply.reduceat(c.sizes, starts)
        return out

    @property
    def ptrs(self) -> np.ndarray:
        return self.columns.ptrs

    def first_changed(self, tensors: Sequence[torch.Tensor]) -> int:
        """-1 if ``tensors`` (as many as recorded) have the recorded
        addresses, dtypes, sizes and strides, else the first that has not
        (or has no reading at all)."""
        c = self.columns
        tensors = tensors if type(tensors) is list else list(tensors)
        if len(tensors) != c.ptrs.size:
            return min(len(tensors), c.ptrs.size)
        if self._raw is not None:
            return _raw.first_changed(_native, tensors, self._raw, c.ndims, c.sizes, c.strides, self._dim_starts,
                                      lambda i: self._one_changed(tensors, i))
        if self._native:
            return _native.differs(tensors, c.ptrs, c.numbers, c.ndims, c.sizes, c.strides)
        return self._python_first_changed(tensors)

    def _one_changed(self, tensors: list, i: int) -> bool:
        """Whether tensor ``i`` is not as recorded, read through the shim."""
        c, at = self.columns, int(self._dim_starts[i])  # type: ignore[index]
        k = int(c.ndims[i])
        return _native.differs(tensors[i:i + 1], c.ptrs[i:i + 1], c.numbers[i:i + 1], c.ndims[i:i + 1], c.sizes[at:at + k],
                               c.strides[at:at + k]) >= 0

    def _python_first_changed(self, tensors: list) -> int:
        """first_changed by Python passes (a pass per attribute, compared as arrays)."""
        c, n = self.columns, len(tensors)
        try:
            ptrs = np.fromiter(map(torch.Tensor.data_ptr, tensors), dtype=np.int64, count=n)
            ndims = np.fromiter(map(torch.Tensor.dim, tensors), dtype=np.int64, count=n)
            same = np.fromiter(map(operator.is_, map(_get_dtype, tensors), self._dtypes), dtype=bool, count=n)
            same &= (ptrs == c.ptrs) & (ndims == c.ndims)
            # Dims before the first tensor that differs line up with the
            # recorded ones: a size or stride that differs there comes first.
            first = int(np.flatnonzero(~same)[0]) if not same.all() else n
            k = int(c.ndims[:first].sum())
            flat = np.fromiter(chain.from_iterable(map(_get_shape, tensors[:first])), dtype=np.int64, count=k)
            flat_strides = np.fromiter(chain.from_iterable(map(torch.Tensor.stride, tensors[:first])), dtype=np.int64, count=k)
        except (RuntimeError, TypeError, AttributeError):
            return next(i for i, t in enumerate(tensors) if _unreadable(t))
        diff = np.flatnonzero((flat != c.sizes[:k]) | (flat_strides != c.strides[:k]))
        if diff.size:
            return int(np.searchsorted(np.cumsum(c.ndims), diff[0], side="right"))
        return first if first < n else -1

    def dtype(self, i: int) -> torch.dtype | None:
        """The recorded dtype of tensor ``i``."""
        return self._dtypes[i] if self._dtypes is not None else self.columns.dtype(i)

    def shape_of(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The recorded sizes and strides of tensor ``i``."""
        c = self.columns
        at = int(c.ndims[:i].sum())
        k = int(c.ndims[i])
        return tuple(c.sizes[at : at + k].tolist()), tuple(c.strides[at : at + k].tolist())

