"""A layout's nesting: the tree tokens (``TreeOp``), the dict keys' encoding,
and the checks a decoded nesting must pass before anything is rebuilt.

Both sides: the sender's flatten writes the tokens and keys, the layout
encodes them, a receiver's decode checks them (bounded depth, counts that
add up) and its rebuild reads them. Pure numpy.
"""

from __future__ import annotations

import re
from typing import Union

import numpy as np

from ..errors import LayoutMismatchError

__all__ = ["Key", "TreeOp", "encode_keys", "decode_keys", "check_tree"]

_MAX_DEPTH = 256  # nesting deeper than this is hostile, not a model
# What str(int(key)) can produce; an integer key on the wire must match it.
_INT_KEY = re.compile(r"-?[0-9]+")


Key = Union[str, int]


class TreeOp:
    """Opcodes of the nesting tokens: each token is (op, count)."""

    LEAVES = 0  # `count` consecutive tensors
    LIST = 1  # a list of the next `count` items
    TUPLE = 2  # a tuple of the next `count` items
    DICT = 3  # a dict of `count` items, keys taken in order from the key list


def encode_keys(keys: tuple[Key, ...]) -> tuple[np.ndarray, np.ndarray, bytes]:
    kinds = np.zeros(len(keys), dtype=np.uint8)
    parts: list[bytes] = []
    for i, k in enumerate(keys):
        if isinstance(k, str):
            parts.append(k.encode("utf-8", "surrogatepass"))
        else:
            kinds[i] = 1
            parts.append(str(int(k)).encode("ascii"))
    lens = np.fromiter((len(p) for p in parts), dtype="<u4", count=len(parts))
    return kinds, lens, b"".join(parts)


def decode_keys(kinds: np.ndarray, lens: np.ndarray, blob: bytes) -> tuple[Key, ...]:
    if int(lens.sum()) != len(blob):
        raise LayoutMismatchError("layout key lengths do not add up to the key blob")
    if kinds.size and int(kinds.max()) > 1:
        raise LayoutMismatchError("layout has a key of unknown kind")
    try:
        text = blob.decode("utf-8", "surrogatepass")
        if len(text) == len(blob):  # all ASCII: byte lengths are character lengths
            ends = np.cumsum(lens).tolist()
            starts = [0] + ends[:-1]
            strs = [text[s:e] for s, e in zip(starts, ends)]
        else:
            # Forged lengths may cut a character in two: decode each key alone.
            strs, pos = [], 0
            for ln in lens.tolist():
                strs.append(blob[pos : pos + ln].decode("utf-8", "surrogatepass"))
                pos += ln
    except UnicodeDecodeError as exc:
        raise LayoutMismatchError(f"layout keys are not valid UTF-8: {exc}") from exc
    if not kinds.any():
        return tuple(strs)
    out: list[Key] = []
    for kind, s in zip(kinds.tolist(), strs):
        if kind == 1:
            # ASCII digits only: str.isdigit() also accepts "²", and
            # lstrip("-") accepts "--5", both of which int() rejects.
            if len(s) > 32 or not _INT_KEY.fullmatch(s):
                raise LayoutMismatchError(f"layout has a malformed integer key {s[:40]!r}")
            out.append(int(s))
        else:
            out.append(s)
    return tuple(out)


def check_tree(ops: np.ndarray, counts: np.ndarray, num_tensors: int, num_keys: int) -> None:
    """Walk the tokens once, as unflatten will, without building anything."""
    if ops.size and int(ops.max()) > TreeOp.DICT:
        raise LayoutMismatchError("layout has an unknown nesting opcode")
    leaves = keys = 0
    # Stack of remaining item counts of the open containers.
    stack: list[int] = []
    tok = 0
    ntok = ops.size
    opl, cl = ops.tolist(), counts.tolist()
    roots = 0
    while tok < ntok:
        if not stack:
            roots += 1
            if roots > 1:
                raise LayoutMismatchError("layout nesting has more than one root")
        op, c = opl[tok], cl[tok]
        tok += 1
        if op == TreeOp.LEAVES:
            if c == 0:
                raise LayoutMismatchError("layout nesting has an empty leaf run")
            leaves += c
            consumed = c
        else:
            if op == TreeOp.DICT:
                keys += c
            consumed = 1
        # This token fills `consumed` slots of the innermost open container
        # (a leaf run may span several slots, never past the container's end).
        if stack:
            if consumed > stack[-1]:
                raise LayoutMismatchError("layout leaf run overflows its container")
            stack[-1] -= consumed
        elif op == TreeOp.LEAVES and c != 1:
            raise LayoutMismatchError("layout root is a run of several tensors")
        if op != TreeOp.LEAVES:
            if len(stack) >= _MAX_DEPTH:
                raise LayoutMismatchError(f"layout nesting is deeper than {_MAX_DEPTH}")
            stack.append(c)
        while stack and stack[-1] == 0:
            stack.pop()
    if stack or roots != 1:
        raise LayoutMismatchError("layout nesting is incomplete")
    if leaves != num_tensors or keys != num_keys:
        raise LayoutMismatchError(
            f"layout nesting holds {leaves} tensors and {keys} keys, the header says "
            f"{num_tensors} and {num_keys}"
        )
