"""Receiver side of the tensors adapter: rebuild a nested object around
received leaves, and match ``into=`` targets to the sent tensors."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import LayoutMismatchError
from ..wire import Layout, TreeOp
from ._types import _CODE_BY_TORCH, _PLAIN_TENSOR_TYPES, _get_dtype, _get_shape, _path, gc_paused, listed

__all__ = ["unflatten", "match_into"]


def unflatten(layout: Layout, leaves: Sequence[torch.Tensor]) -> Any:
    """Rebuild the nested object of ``layout`` around ``leaves`` (in order)."""
    ops = layout.tree_ops.tolist()
    counts = layout.tree_counts.tolist()
    keys = layout.keys
    pos = 0  # next leaf
    kpos = 0  # next key
    tok = 0

    # Iterative build: each frame is [kind, remaining, items, keys].
    root: list[Any] = []
    stack: list[list[Any]] = [[TreeOp.LIST, 1, root, None]]
    while tok < len(ops):
        op, c = ops[tok], counts[tok]
        tok += 1
        frame = stack[-1]
        if op == TreeOp.LEAVES:
            frame[2].extend(leaves[pos : pos + c])
            pos += c
            frame[1] -= c
        else:
            items: list[Any] = []
            ks = None
            if op == TreeOp.DICT:
                ks = keys[kpos : kpos + c]
                kpos += c
            frame[1] -= 1
            stack.append([op, c, items, ks])
        while len(stack) > 1 and stack[-1][1] == 0:
            kind, _, items, ks = stack.pop()
            if kind == TreeOp.DICT:
                value: Any = dict(zip(ks, items))
            elif kind == TreeOp.TUPLE:
                value = tuple(items)
            else:
                value = items
            stack[-1][2].append(value)
    return root[0]


# How many offending entries an into= mismatch lists.
_SHOWN_PROBLEMS = 5


def match_into(layout: Layout, into: Any) -> list[torch.Tensor]:
    """The caller's tensors for each sent tensor, in the sender's order (receiver side).

    Mappings are matched by key at every level, whatever the order of the
    target's keys (a state dict built or loaded in another order gets the
    right weights); lists and tuples by position. Every key must be on both
    sides, with a tensor of the same dtype and shape. Checked before any
    byte is written; about 0.5 us a tensor.

    Raises:
        LayoutMismatchError: the structure, a key, a dtype or a shape
            differs; lists the first few offences with what each side has.
    """
    n = layout.num_tensors
    # The shapes read below are 100k tuples: with the collector on, they
    # set off collections over everything alive (200 ms of a 230 ms match).
    with gc_paused():
        targets = _match_tokens(layout, into)
        problems: list[str] = []
        skeleton = None
        if targets is None:
            # Something differs (or a leaf is a numpy array or a tensor
            # subclass): walk again, slowly, naming every place.
            skeleton = unflatten(layout, range(n))
            targets = [None] * n
            _match(skeleton, into, [], targets, problems, layout)
        if not problems:
            problems = _type_problems(layout, targets, skeleton)
    if problems:
        raise LayoutMismatchError(
            f"into= does not match what was sent: {listed(problems, _SHOWN_PROBLEMS)}. Pass tensors nested as the sender put them "
            "(dicts with the same keys, lists and tuples of the same lengths), of the same dtypes and shapes"
        )
    return targets


def _match_tokens(layout: Layout, into: Any) -> list[torch.Tensor] | None:
    """The fast walk of ``match_into``: the layout's nesting tokens against
    ``into``, a run of tensors at a time (one ``map`` over a dict's keys).
    Returns None at the first difference of any kind."""
    ops = layout.tree_ops.tolist()
    counts = layout.tree_counts.tolist()
    keys = layout.keys
    out: list[Any] = []
    kpos = 0
    # Open containers: [target, its keys (a dict) or None, next position].
    stack: list[list[Any]] = [[[into], None, 0]]
    for op, c in zip(ops, counts):
        frame = stack[-1]
        tgt, ks, pos = frame
        try:
            if op == TreeOp.LEAVES:
                if ks is None:
                    out.extend(tgt[pos : pos + c])
                else:
                    out.extend(map(tgt.__getitem__, ks[pos : pos + c]))
                frame[2] = pos + c
            else:
                child = tgt[pos] if ks is None else tgt[ks[pos]]
                frame[2] = pos + 1
                if op == TreeOp.DICT:
                    child_keys = keys[kpos : kpos + c]
                    kpos += c
                    # Same size and every sent key found: the same key set
                    # (the sent keys of one dict are distinct: checked).
                    if not isinstance(child, Mapping) or len(child) != c or len(set(child_keys)) != c:
                        return None
                    stack.append([child, child_keys, 0])
                else:
                    if not isinstance(child, (list, tuple)) or len(child) != c:
                        return None
                    stack.append([child, None, 0])
        except (KeyError, IndexError, TypeError):
            return None
        while len(stack) > 1 and stack[-1][2] == len(stack[-1][0]):
            stack.pop()
    if len(out) != layout.num_tensors or not set(map(type, out)) <= _PLAIN_TENSOR_TYPES:
        return None
    return out


def _sent(layout: Layout, skel: Any) -> str:
    """What the sender sent at one place of the skeleton, for messages."""
    if isinstance(skel, int):
        shape = layout.shapes()[skel]
        return f"torch.{layout.dtype_names()[skel]}{list(shape)}"
    return f"a {type(skel).__name__} of {len(skel)}"


def _has(x: Any) -> str:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        ro = " (read-only)" if isinstance(x, np.ndarray) and not x.flags.writeable else ""
        return f"{x.dtype}{list(x.shape)}{ro}"
    if isinstance(x, (Mapping, list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"


def _match(skel: Any, target: Any, path: list[Any], out: list[Any], problems: list[str], layout: Layout) -> None:
    if isinstance(skel, int):
        if isinstance(target, np.ndarray) and target.dtype.kind in "biufc" and target.flags.writeable:
            target = torch.from_numpy(target)
        if isinstance(target, torch.Tensor):
            out[skel] = target
        else:
            problems.append(f"{_path(path)}: sent {_sent(layout, skel)}, into= has {_has(target)}")
        return
    if isinstance(skel, dict):
        if not isinstance(target, Mapping):
            problems.append(f"{_path(path)}: sent a dict of {len(skel)} keys, into= has {_has(target)}")
            return
        missing = False
        for k, v in skel.items():
            try:
                t = target[k]
            except KeyError:
                missing = True
                problems.append(f"{_path(path + [k])}: sent {_sent(layout, v)}, into= has no such key")
                continue
            if type(v) is int and type(t) in _PLAIN_TENSOR_TYPES:
                out[v] = t  # the common case, inline
            else:
                path.append(k)
                _match(v, t, path, out, problems, layout)
                path.pop()
        if missing or len(target) != len(skel):
            for k in target:
                if k not in skel:
                    problems.append(f"{_path(path + [k])}: into= has {_has(target[k])}, the sender sent no such key")
        return
    if not isinstance(target, (list, tuple)) or len(target) != len(skel):
        problems.append(f"{_path(path)}: sent {_sent(layout, skel)}, into= has {_has(target)}")
        return
    for i, (v, t) in enumerate(zip(skel, target)):
        if type(v) is int and type(t) in _PLAIN_TENSOR_TYPES:
            out[v] = t
        else:
            path.append(i)
            _match(v, t, path, out, problems, layout)
            path.pop()


# The wire code of a target's dtype, or -1 for one tensorferry cannot send.
_CODE_OR_NONE: dict[torch.dtype, int] = collections.defaultdict(lambda: -1, _CODE_BY_TORCH)


def _type_problems(layout: Layout, targets: list[torch.Tensor], skeleton: Any) -> list[str]:
    """Targets whose dtype or shape differs from the sent tensor's (vectorised)."""
    n = len(targets)
    if not n:
        return []
    dtypes = list(map(_get_dtype, targets))
    if len(set(dtypes)) == 1:
        codes = np.full(n, _CODE_OR_NONE[dtypes[0]], dtype=np.int64)
    else:
        codes = np.fromiter(map(_CODE_OR_NONE.__getitem__, dtypes), dtype=np.int64, count=n)
    sizes = list(map(_get_shape, targets))
    ndims = np.fromiter(map(len, sizes), dtype=np.int64, count=n)
    if np.array_equal(codes, layout.dtype_codes) and np.array_equal(ndims, layout.ndims):
        dims = np.fromiter(itertools.chain.from_iterable(sizes), dtype=np.int64, count=int(ndims.sum()))
        if np.array_equal(dims, layout.dims):
            return []
    shapes = layout.shapes()
    names = layout.dtype_names()
    if skeleton is None:
        skeleton = unflatten(layout, range(n))
    paths = _leaf_paths(skeleton, n)
    problems = []
    for i, t in enumerate(targets):
        if _CODE_BY_TORCH.get(t.dtype) != int(layout.dtype_codes[i]) or tuple(t.shape) != shapes[i]:
            problems.append(f"{paths[i]}: sent torch.{names[i]}{list(shapes[i])}, into= has {_has(t)}")
    return problems


def _leaf_paths(skeleton: Any, n: int) -> list[str]:
    """The path of every leaf of a skeleton (leaf index -> "obj['a'][0]")."""
    paths = [""] * n

    def walk(x: Any, path: list[Any]) -> None:
        if isinstance(x, int):
            paths[x] = _path(path)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + [k])
        else:
            for i, v in enumerate(x):
                walk(v, path + [i])

    walk(skeleton, [])
    return paths
