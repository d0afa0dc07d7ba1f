"""Sender side of the tensors adapter: flatten nested objects into leaf
tensors and nesting tokens, and inspect the leaves in bulk into columns.

Flattening walks lists, tuples and dicts (a ``state_dict``) in order and
records the nesting as (op, count) tokens; consecutive tensors collapse into
one token, so a list of 100k tensors is two tokens. Every offending leaf is
collected before anything is allocated (or copied), and the error names each one.
"""

from __future__ import annotations

import itertools
from operator import attrgetter
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from ..errors import UnsupportedTensorError
from ..shards import Box, is_shard, local_box
from ..wire import NO_ALIASES, Layout, TreeOp
from ._meta import NOT_SENDABLE, all_plain, read_columns
from ._types import _CODE_BY_TORCH, _PLAIN_TENSOR_TYPES, _get_dtype, _get_shape, _path, listed

try:
    from . import _ptrs as _native
except ImportError:  # installed without a C++ compiler: data_ptrs maps Python's data_ptr
    _native = None

__all__ = ["flatten", "inspect_leaves", "LeafInfo", "data_ptrs", "first_replaced"]

# Nesting beyond this depth is almost certainly a cycle or hostile input.
_MAX_DEPTH = 256
# Integer keys travel as decimal text of at most 32 characters (layout.py).
_MAX_INT_KEY = 10**31


def _leaf_problem(t: torch.Tensor) -> str | None:
    if t.layout != torch.strided:
        return f"is a {t.layout} tensor; call .to_dense() first"
    if t.is_quantized:
        return "is a quantized tensor; call .dequantize() or send its int_repr() and scales"
    if t.device.type == "meta":
        return "is a meta tensor and has no data; materialize it first (e.g. .to_empty(device=...))"
    if t.is_nested:
        return "is a nested tensor; send its .unbind() components"
    if t.dtype not in _CODE_BY_TORCH:
        return f"has dtype {t.dtype}, which tensorferry cannot send; convert it with .to(...)"
    if t.numel() and _address(t) == 0:
        # A copy by address would read address 0 (a segmentation fault).
        return f"is a {type(t).__name__} whose memory cannot be addressed (data_ptr() is 0); send a plain tensor of its values"
    return None


def _address(t: torch.Tensor) -> int:
    """``t.data_ptr()``, or -1 where it raises (no memory to read either way)."""
    try:
        return t.data_ptr()
    except (RuntimeError, TypeError):
        return -1

def flatten(obj: Any, boxes: list | None = None) -> tuple[list[torch.Tensor], list[int], list[int], list[Any], int]:
    """Flatten ``obj`` into leaf tensors and nesting tokens.

    numpy arrays become tensors sharing their memory (``torch.from_numpy``);
    an array torch cannot share (negative strides, read-only) is copied and
    counted in the returned ``copied`` number. A shard (a DTensor, a
    :class:`~tensorferry.shards.Box`) is its local tensor; ``boxes``, if
    given, gets ``(leaf index, global shape, offsets)`` of each.

    Returns:
        ``(leaves, ops, counts, keys, copied)``.

    Raises:
        UnsupportedTensorError: one or more leaves cannot be packed; the
            message lists each by path with its fix.
    """
    leaves: list[torch.Tensor] = []
    ops: list[int] = []
    counts: list[int] = []
    keys: list[Any] = []
    problems: list[str] = []
    copied = 0
    path: list[Any] = []
    # A leaf may join the previous LEAVES token only if no container opened
    # or closed in between: a run never crosses a container boundary.
    merge_ok = False

    def leaf(t: Any) -> None:
        nonlocal copied, merge_ok
        if type(t) not in _PLAIN_TENSOR_TYPES and is_shard(t):
            found = local_box(t)
            if isinstance(found, str):
                problems.append(f"{_path(path)} {found}")
                return
            t, shape, offsets = found
            if boxes is not None:
                boxes.append((len(leaves), shape, offsets))
        if isinstance(t, np.ndarray):
            if t.dtype == object or t.dtype.kind not in "biufc":
                problems.append(f"{_path(path)} is a numpy array of dtype {t.dtype}; use a numeric dtype")
                return
            if not t.flags.writeable or any(s < 0 for s in t.strides):
                # One C-ordered, writable copy covers both cases (the old
                # ascontiguousarray().copy() copied a non-contiguous one twice).
                t = np.array(t, order="C")
                copied += 1
            try:
                t = torch.from_numpy(t)
            except (TypeError, ValueError) as exc:
                problems.append(f"{_path(path)} is a numpy array torch cannot read ({exc})")
                return
        leaves.append(t)
        if merge_ok:
            counts[-1] += 1
        else:
            ops.append(TreeOp.LEAVES)
            counts.append(1)
            merge_ok = True

    def walk(x: Any, depth: int) -> None:
        nonlocal merge_ok
        if depth > _MAX_DEPTH:
            raise UnsupportedTensorError(
                f"{_path(path)} is nested deeper than {_MAX_DEPTH} levels; is there a cycle?"
            )
        if isinstance(x, (torch.Tensor, np.ndarray, Box)):
            leaf(x)
            return
        merge_ok = False
        if isinstance(x, dict):
            ops.append(TreeOp.DICT)
            counts.append(len(x))
            # All of a dict's keys go out when it opens: unflatten takes them
            # there, before the keys of any dict nested in its values.
            keys.extend(x)
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    problems.append(f"{_path(path)} has key {k!r} of type {type(k).__name__}; keys must be str or int")
                elif isinstance(k, int) and not -_MAX_INT_KEY < k < _MAX_INT_KEY:
                    # Layout.from_bytes rejects longer integer keys as hostile;
                    # refuse them here rather than pack what no receiver can read.
                    problems.append(f"{_path(path)} has integer key {k} of more than 31 digits; use a str key")
                path.append(k)
                walk(v, depth + 1)
                path.pop()
            merge_ok = False
            return
        if isinstance(x, (list, tuple)):
            ops.append(TreeOp.TUPLE if isinstance(x, tuple) else TreeOp.LIST)
            counts.append(len(x))
            # Fast path: a flat sequence of plain tensors (model parameters).
            # Its leaves are checked in bulk by inspect_leaves.
            if x and all_plain(x):
                leaves.extend(x)
                ops.append(TreeOp.LEAVES)
                counts.append(len(x))
                merge_ok = False
                return
            for i, v in enumerate(x):
                path.append(i)
                walk(v, depth + 1)
                path.pop()
            merge_ok = False
            return
        problems.append(
            f"{_path(path)} is a {type(x).__name__}, not a tensor; tensorferry sends tensors "
            "in lists, tuples and dicts only (convert it with torch.as_tensor, or send it separately)"
        )

    walk(obj, 0)
    if problems:
        raise UnsupportedTensorError(f"cannot pack {len(problems)} leaves: {listed(problems, 10)}")
    return leaves, ops, counts, keys, copied

class LeafInfo(NamedTuple):
    """What the sender needs of each leaf, as arrays (one entry per leaf)."""

    layout: Layout
    data_ptrs: np.ndarray  # int64 address of each view's first byte
    storage_ptrs: np.ndarray | None  # int64 address of each view's storage (device leaves only)
    raw: np.ndarray  # bool: dense and plain, so its bytes are its values
    all_cpu: bool = True  # every leaf in host memory: copies may use addresses


def _reader_address() -> int:
    """The address of torch's C++ reader of a tensor object's data pointer
    (``_torchinductor_pyobject_tensor_data_ptr``, which torch exports for
    the code torch.compile generates), or 0 where this torch has none."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    address = getattr(guards, "_torchinductor_pyobject_tensor_data_ptr", 0)
    return address if isinstance(address, int) else 0


_READER = _reader_address() if _native is not None else 0


def data_ptrs(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """Every tensor's ``data_ptr()``, as int64 (the check a kept plan runs
    on every use). One C++ loop of torch's own reader where both are there:
    about 15 ns a tensor for views of one buffer and 30 for separately
    allocated ones, against 75 for the fastest Python pass (a ``map``),
    which is the fallback, and what raises for a tensor the reader refuses.

    Raises:
        RuntimeError: a tensor without a data pointer (sparse), as
            ``data_ptr()`` raises. TypeError: something not a tensor.
    """
    n = len(tensors)
    if _READER and n:
        out = np.empty(n, dtype=np.int64)
        if _native.data_ptrs(_READER, tensors if type(tensors) is list else list(tensors), out) < 0:
            return out
    return np.fromiter(map(torch.Tensor.data_ptr, tensors), dtype=np.int64, count=n)


def first_replaced(dicts: list[dict], names: list[Any], objects: list[Any]) -> int:
    """The first ``i`` for which ``dicts[i].get(names[i]) is not
    objects[i]``, or -1: whether a module's parameters and buffers are
    still the planned tensors (one C++ loop where built)."""
    if _native is not None:
        return _native.slots_hold(dicts, names, objects)
    return next((i for i, (d, k, o) in enumerate(zip(dicts, names, objects)) if d.get(k) is not o), -1)

_get_is_cpu = attrgetter("is_cpu")


def _find_problems(obj: Any) -> list[str]:
    """Slow path for the error message: every bad leaf with its path."""
    problems: list[str] = []

    def walk(x: Any, path: list[Any]) -> None:
        if is_shard(x):
            found = local_box(x)  # its local tensor is the leaf, or a str saying why none is
            if isinstance(found, str):
                problems.append(f"{_path(path)} {found}")
                return
            x = found[0]
        if isinstance(x, torch.Tensor):
            problem = _leaf_problem(x)
            if problem:
                problems.append(f"{_path(path)} {problem}")
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + [k])
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, path + [i])

    walk(obj, [])
    return problems


def inspect_leaves(obj: Any, leaves: Sequence[torch.Tensor], ops: list[int], counts: list[int], keys: list[Any]) -> LeafInfo:
    """Check every leaf in bulk and collect its metadata (sender side, no copies).

    One C-level pass per attribute (``map`` over the leaves), about 1 us per
    tensor in all: the floor for 100k views. Sparse and nested tensors are
    caught by the passes themselves (``data_ptr`` and ``shape`` raise on
    them) rather than by passes of their own.

    Raises:
        UnsupportedTensorError: a leaf is sparse, quantized, nested, meta or
            of an unsupported dtype; every such leaf is named with its fix.
    """
    n = len(leaves)
    # Plain tensors: every column in one C++ pass (a tenth of the Python
    # passes below, which stay for the rest and for what it cannot read).
    cols = read_columns(leaves, plain_only=True) if n else None
    if cols is not None and not (cols.codes == NOT_SENDABLE).any():
        lay = Layout.of_local(cols.codes, cols.ndims.astype(np.uint8), cols.sizes, np.asarray(ops, dtype=np.uint8),
                              np.asarray(counts, dtype=np.int64), tuple(keys), _find_aliases(leaves, cols.ptrs), numels=cols.numels)
        if not any(_leaf_problem(leaves[i]) for i in np.flatnonzero(cols.ptrs == 0).tolist()):
            return _leaf_info(leaves, lay, cols.ptrs, cols.contiguous.copy(), bool(cols.cpu.all()), bits=not cols.raw_bits)
    dtypes = list(map(_get_dtype, leaves))
    kinds = set(dtypes)
    bad = not kinds <= _CODE_BY_TORCH.keys()
    if not bad:
        try:
            ptrs = data_ptrs(leaves)
            ndims = np.fromiter(map(torch.Tensor.dim, leaves), dtype=np.uint8, count=n)
            # No list of shapes is kept: at 100k tensors it is most of the
            # memory a pack allocates outside the pool.
            dims = np.fromiter(
                itertools.chain.from_iterable(map(_get_shape, leaves)), dtype=np.int64, count=int(ndims.sum(dtype=np.int64))
            )
        except (RuntimeError, TypeError, ValueError):
            bad = True  # a sparse (no data_ptr) or nested (no shape) leaf
    if not bad:
        if len(kinds) == 1:
            codes = np.full(n, _CODE_BY_TORCH[dtypes[0]], dtype=np.uint8)
        else:
            codes = np.fromiter(map(_CODE_BY_TORCH.__getitem__, dtypes), dtype=np.uint8, count=n)
        aliases = _find_aliases(leaves, ptrs)
        lay = Layout(codes, ndims, dims, np.asarray(ops, dtype=np.uint8), np.asarray(counts, dtype=np.int64), tuple(keys), aliases)
        # A meta tensor has no memory: address 0. Ask the few address-0
        # leaves (empty tensors have it too) whether they are meta, nested
        # or not strided.
        zero = np.flatnonzero(ptrs == 0).tolist()
        bad = any(_leaf_problem(leaves[i]) for i in zero)
    if bad:
        problems = _find_problems(obj)
        raise UnsupportedTensorError(f"cannot pack {len(problems)} leaves: {listed(problems, 10)}")
    raw = np.fromiter(map(torch.Tensor.is_contiguous, leaves), dtype=bool, count=n)
    return _leaf_info(leaves, lay, ptrs, raw, all(map(_get_is_cpu, leaves)))


def _leaf_info(leaves: Sequence[torch.Tensor], lay: Layout, ptrs: np.ndarray, raw: np.ndarray, all_cpu: bool, *, bits: bool = True) -> LeafInfo:
    """The LeafInfo of inspected leaves; ``raw`` (contiguity) is narrowed
    in place by the conjugate and negative bits (``bits``: not yet read)."""
    n = len(leaves)
    # The conjugate and negative bits make a tensor's bytes differ from its
    # values; such a tensor is copied value by value instead.
    if bits:
        raw &= ~np.fromiter(map(torch.Tensor.is_neg, leaves), dtype=bool, count=n)
    if bits and np.isin(lay.dtype_codes, _COMPLEX_CODES).any():
        raw &= ~np.fromiter(map(torch.Tensor.is_conj, leaves), dtype=bool, count=n)
    storage_ptrs = None
    if not all_cpu:
        offsets = np.fromiter(map(torch.Tensor.storage_offset, leaves), dtype=np.int64, count=n)
        storage_ptrs = ptrs - offsets * lay.alignments
    return LeafInfo(lay, ptrs, storage_ptrs, raw, all_cpu)


_COMPLEX_CODES = np.array([code for dt, code in _CODE_BY_TORCH.items() if dt.is_complex], dtype=np.uint8)


def _find_aliases(leaves: Sequence[torch.Tensor], ptrs: np.ndarray) -> np.ndarray:
    """Pairs ``(i, j)``, ``j < i``: leaf ``i`` is the same view as leaf ``j``.

    Tied weights (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)
    or one tensor under two names: sent once, received as one tensor. Same
    view means same first byte, dtype, shape, strides, device and
    conjugate/negative bits; views that only overlap are sent apart.
    Addresses that only grow (a flat buffer's views) are told in one pass.
    """
    n = ptrs.size
    if n < 2 or bool((ptrs[1:] > ptrs[:-1]).all()):
        return NO_ALIASES
    order = np.argsort(ptrs, kind="stable")
    sorted_ptrs = ptrs[order]
    same = np.flatnonzero((sorted_ptrs[1:] == sorted_ptrs[:-1]) & (sorted_ptrs[1:] != 0))
    if not same.size:
        return NO_ALIASES
    # Groups of leaves sharing a first byte, each in leaf order (stable sort).
    groups: dict[int, list[int]] = {}
    for k in same.tolist():
        groups.setdefault(int(sorted_ptrs[k]), [int(order[k])]).append(int(order[k + 1]))
    pairs: list[tuple[int, int]] = []
    for members in groups.values():
        firsts: list[int] = []  # earlier leaves that are no alias, in order
        for i in members:
            t = leaves[i]
            if t.numel() == 0:
                continue
            for j in firsts:
                u = leaves[j]
                if (
                    t.dtype == u.dtype
                    and t.shape == u.shape
                    and t.stride() == u.stride()
                    and t.device == u.device
                    and t.is_conj() == u.is_conj()
                    and t.is_neg() == u.is_neg()
                ):
                    pairs.append((i, j))
                    break
            else:
                firsts.append(i)
    if not pairs:
        return NO_ALIASES
    pairs.sort()
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
