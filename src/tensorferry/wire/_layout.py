"""``Layout``: what a receiver needs to rebuild a packed object, as bytes.

A layout is columnar: one small integer array per field (dtype code, number of
dimensions, the dimensions), the nesting as a short token list, and the dict
keys as one blob. 100k tensors encode to a few hundred KB; a list of 100k
same-shaped tensors to a few KB, since the body is zlib-compressed when large.

Decoding trusts nothing: the header's counts are bounded, the body's size is
computed from them and checked before anything is decompressed or allocated,
and every field is range-checked. No pickle, nothing executed.

Imports numpy only (dtypes are names here; the torch adapter maps them).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from ..errors import LayoutMismatchError, TicketError
from . import _boxes
from ._tree import Key, TreeOp, check_tree, decode_keys, encode_keys

__all__ = [
    "DTYPES",
    "ELEMENT_SIZE_BY_CODE",
    "Layout",
    "TreeOp",
    "MAX_TENSORS",
    "MAX_NDIM",
    "MAX_LAYOUT_NBYTES",
]

# Wire codes of dtypes: name -> (code, element size). Codes are part of the
# wire format and never change; new dtypes take new codes.
DTYPES: dict[str, tuple[int, int]] = {
    "bool": (0, 1),
    "uint8": (1, 1),
    "int8": (2, 1),
    "int16": (3, 2),
    "int32": (4, 4),
    "int64": (5, 8),
    "float16": (6, 2),
    "bfloat16": (7, 2),
    "float32": (8, 4),
    "float64": (9, 8),
    "complex64": (10, 8),
    "complex128": (11, 16),
    "float8_e4m3fn": (12, 1),
    "float8_e5m2": (13, 1),
    "float8_e4m3fnuz": (14, 1),
    "float8_e5m2fnuz": (15, 1),
    "uint16": (16, 2),
    "uint32": (17, 4),
    "uint64": (18, 8),
    "complex32": (19, 4),
    "float8_e8m0fnu": (20, 1),
}
_NAMES_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}
# Element size by wire code (int64; 0 for a code no dtype has).
ELEMENT_SIZE_BY_CODE = np.zeros(max(_NAMES_BY_CODE) + 1, dtype=np.int64)
for _code, _name in _NAMES_BY_CODE.items():
    ELEMENT_SIZE_BY_CODE[_code] = DTYPES[_name][1]

# Bounds a decoder enforces before it allocates anything sized by the header.
MAX_TENSORS = 1 << 24  # 16M tensors: far above any model's parameter count
MAX_NDIM = 64  # torch's own limit on dimensions
MAX_TREE_TOKENS = 1 << 25
MAX_DIM = 1 << 48  # a dimension above 2^48 elements cannot exist in memory
MAX_NUMEL = 1 << 62  # keeps numel * element_size inside int64
MAX_LAYOUT_NBYTES = 64 << 20  # 64 MiB: ~100x a 100k-tensor state dict's layout

_MAGIC = b"TFLY"
_VERSION = 1
_FLAG_ZLIB = 1
_FLAG_DIMS32 = 2
# Some tensors are the same view as an earlier one (tied weights): a u32
# count of such pairs follows the header, and the body ends with the pairs.
_FLAG_ALIASES = 4
_ALIAS_COUNT = struct.Struct("<I")
# Some tensors are boxes of larger global tensors (shards, _boxes.py): two
# u32 counts follow (after the alias count), and the body ends with them.
_FLAG_BOXES = 8
# magic, version, flags, tensors, dims, tree tokens, keys, key blob bytes,
# body bytes (uncompressed), crc32 of the uncompressed body
_HEADER = struct.Struct("<4sHHIQIIQQI")
# Bodies smaller than this are sent raw: compressing them saves nothing.
_COMPRESS_ABOVE = 4096
@dataclass(frozen=True, eq=False)
class Layout:
    """Per-tensor dtype and shape, plus the nesting, of one packed object.

    Sender and receiver derive every byte offset from this with
    [``packing.packed_offsets``][tensorferry.wire.packing.packed_offsets];
    nothing else is needed.

    Attributes:
        dtype_codes: uint8 wire code of each tensor's dtype (see ``DTYPES``).
        ndims: uint8 number of dimensions of each tensor.
        dims: int64 dimensions of all tensors, concatenated.
        tree_ops: uint8 opcode of each nesting token (``TreeOp``).
        tree_counts: int64 count of each nesting token.
        keys: the dict keys, in the order the DICT tokens consume them.
        aliases: int64 ``(k, 2)`` pairs ``(tensor, earlier)``: ``tensor`` is
            the same view of the same memory as ``earlier`` (tied weights).
            Its bytes are not packed (``nbytes`` is 0 for it); the receiver
            gives both positions one tensor.
        boxes: which tensors are shards (boxes of a larger global tensor),
            with their global shapes and offsets; None for whole tensors.
        nbytes: bytes each tensor occupies in the packing (0 for an alias).
    """

    dtype_codes: np.ndarray
    ndims: np.ndarray
    dims: np.ndarray
    tree_ops: np.ndarray
    tree_counts: np.ndarray
    keys: tuple[Key, ...] = ()
    aliases: np.ndarray = field(default_factory=lambda: NO_ALIASES)
    boxes: "_boxes.Boxes | None" = None
    nbytes: np.ndarray = field(init=False, repr=False)
    alignments: np.ndarray = field(init=False, repr=False)
    numels: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._derive(_numels(self.ndims, self.dims))

    @classmethod
    def of_local(cls, dtype_codes: np.ndarray, ndims: np.ndarray, dims: np.ndarray, tree_ops: np.ndarray, tree_counts: np.ndarray,
                 keys: tuple[Key, ...], aliases: np.ndarray, *, numels: np.ndarray | None) -> "Layout":
        """The layout of tensors that live in this process, whose element
        counts the caller read along with their sizes (``numels``, int64, one
        a tensor; None: computed here): products of live tensors' sizes are in range, so they are
        taken as given instead of recomputed and range-checked (2-3 ms of a
        fresh pack of 100k views). A layout from the network always goes
        through the constructor."""
        self = object.__new__(cls)
        for name, value in (("dtype_codes", dtype_codes), ("ndims", ndims), ("dims", dims), ("tree_ops", tree_ops),
                            ("tree_counts", tree_counts), ("keys", keys), ("aliases", aliases), ("boxes", None)):
            object.__setattr__(self, name, value)
        self._derive(_numels(ndims, dims) if numels is None else numels)
        return self

    def _derive(self, numels: np.ndarray) -> None:
        alignments = ELEMENT_SIZE_BY_CODE[self.dtype_codes]
        object.__setattr__(self, "numels", numels)
        object.__setattr__(self, "alignments", alignments)
        nbytes = numels * alignments
        if self.aliases.size:
            nbytes[self.aliases[:, 0]] = 0
        object.__setattr__(self, "nbytes", nbytes)

    # -- views ---------------------------------------------------------------

    @property
    def num_tensors(self) -> int:
        return int(self.dtype_codes.size)

    @property
    def total_nbytes(self) -> int:
        """Bytes of tensor data (without padding; an alias's bytes once)."""
        return int(self.nbytes.sum())

    def dtype_names(self) -> list[str]:
        return [_NAMES_BY_CODE[c] for c in self.dtype_codes.tolist()]

    def shapes(self) -> list[tuple[int, ...]]:
        n = self.ndims.size
        if n and self.dims.size == n * int(self.ndims[0]) and (self.ndims == self.ndims[0]).all():
            # Every tensor has the same number of dims (the common case): one
            # reshape instead of a slice per tensor.
            k = int(self.ndims[0])
            return list(map(tuple, self.dims.reshape(n, k).tolist())) if k else [()] * n
        dims = self.dims.tolist()
        out: list[tuple[int, ...]] = []
        pos = 0
        for nd in self.ndims.tolist():
            out.append(tuple(dims[pos : pos + nd]))
            pos += nd
        return out

    def __repr__(self) -> str:
        return (
            f"Layout(num_tensors={self.num_tensors}, total_nbytes={self.total_nbytes:,}, "
            f"tree_tokens={self.tree_ops.size}, keys={len(self.keys)})"
        )

    def same_as(self, other: "Layout") -> bool:
        """True when both describe the same tensors in the same structure."""
        return (
            np.array_equal(self.dtype_codes, other.dtype_codes)
            and np.array_equal(self.ndims, other.ndims)
            and np.array_equal(self.dims, other.dims)
            and np.array_equal(self.tree_ops, other.tree_ops)
            and np.array_equal(self.tree_counts, other.tree_counts)
            and self.keys == other.keys
            and np.array_equal(self.aliases, other.aliases)
            and (self.boxes is None) == (other.boxes is None)
            and (self.boxes is None or self.boxes.same_as(other.boxes))
        )

    # -- encoding ------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Encode as versioned, checksummed bytes (zlib when large)."""
        dims32 = not self.dims.size or int(self.dims.max()) < (1 << 32)
        key_kinds, key_lens, key_blob = encode_keys(self.keys)
        box_head, box_body = self.boxes.encode() if self.boxes is not None else (b"", b"")
        body = b"".join(
            (
                self.dtype_codes.astype(np.uint8).tobytes(),
                self.ndims.astype(np.uint8).tobytes(),
                self.dims.astype("<u4" if dims32 else "<i8").tobytes(),
                self.tree_ops.astype(np.uint8).tobytes(),
                self.tree_counts.astype("<u4").tobytes(),
                key_kinds.tobytes(),
                key_lens.tobytes(),
                key_blob,
                self.aliases.astype("<u4").tobytes(),
                box_body,
            )
        )
        flags = _FLAG_DIMS32 if dims32 else 0
        if self.aliases.size:
            flags |= _FLAG_ALIASES
        if self.boxes is not None:
            flags |= _FLAG_BOXES
        payload = body
        if len(body) > _COMPRESS_ABOVE:
            packed = zlib.compress(body, 1)
            if len(packed) < len(body):
                payload, flags = packed, flags | _FLAG_ZLIB
        header = _HEADER.pack(
            _MAGIC,
            _VERSION,
            flags,
            self.num_tensors,
            int(self.dims.size),
            int(self.tree_ops.size),
            len(self.keys),
            len(key_blob),
            len(body),
            zlib.crc32(body),
        )
        if self.aliases.size:
            header += _ALIAS_COUNT.pack(len(self.aliases))
        return header + box_head + payload

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, max_nbytes: int = MAX_LAYOUT_NBYTES) -> "Layout":
        """Decode and validate bytes made by
        [``to_bytes``][tensorferry.wire.Layout.to_bytes].

        Runs on the receiver, on bytes from the network: every count is
        bounded and the body size is checked before anything sized by the
        header is allocated.

        Raises:
            TicketError: truncated, corrupted, oversized or hostile bytes.
            LayoutMismatchError: fields that cannot describe real tensors.
        """
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        if len(view) < _HEADER.size:
            raise TicketError(
                f"layout is truncated: {len(view)} bytes, the header alone has {_HEADER.size}"
            )
        magic, version, flags, n, ndims_total, ntok, nkeys, key_blob_n, body_n, crc = _HEADER.unpack_from(view, 0)
        if magic != _MAGIC:
            raise TicketError(f"not a tensorferry layout: magic {bytes(magic)!r}, expected {_MAGIC!r}")
        if version != _VERSION:
            raise TicketError(
                f"layout version {version} is not supported (this tensorferry reads "
                f"version {_VERSION}); use the same tensorferry version on both sides"
            )
        if flags & ~(_FLAG_ZLIB | _FLAG_DIMS32 | _FLAG_ALIASES | _FLAG_BOXES):
            raise TicketError(f"layout has unknown flags {flags:#x}")
        head = _HEADER.size
        naliases = 0
        if flags & _FLAG_ALIASES:
            if len(view) < head + _ALIAS_COUNT.size:
                raise TicketError("layout is truncated: its alias count is missing")
            (naliases,) = _ALIAS_COUNT.unpack_from(view, head)
            head += _ALIAS_COUNT.size
            if not 0 < naliases < max(n, 1):
                raise TicketError(f"layout claims {naliases:,} aliases among {n:,} tensors")
        nboxed = nboxdims = 0
        if flags & _FLAG_BOXES:
            nboxed, nboxdims, head = _boxes.decode(view, head)
            if not 0 < nboxed <= n or nboxdims > nboxed * MAX_NDIM:
                raise TicketError(f"layout claims {nboxed:,} boxes of {nboxdims:,} dimensions among {n:,} tensors")
        if n > MAX_TENSORS or ntok > MAX_TREE_TOKENS or nkeys > MAX_TENSORS or ndims_total > n * MAX_NDIM:
            raise TicketError(
                f"layout header claims {n:,} tensors, {ndims_total:,} dims, {ntok:,} tree "
                f"tokens, {nkeys:,} keys: beyond the bounds ({MAX_TENSORS:,} tensors, "
                f"{MAX_NDIM} dims each)"
            )
        dim_width = 4 if flags & _FLAG_DIMS32 else 8
        expected = 2 * n + dim_width * ndims_total + 5 * ntok + 5 * nkeys + key_blob_n + 8 * naliases + 4 * nboxed + 16 * nboxdims
        if expected != body_n or expected > max_nbytes:
            raise TicketError(
                f"layout body size {body_n:,} does not match its counts ({expected:,}) "
                f"or exceeds the limit of {max_nbytes:,} bytes"
            )
        payload = view[head:]
        if flags & _FLAG_ZLIB:
            dec = zlib.decompressobj()
            try:
                # max_length 0 means "no limit" to zlib: ask for one byte when
                # the body should be empty, so a bomb still stops at once.
                body = dec.decompress(payload, max(expected, 1))
            except zlib.error as exc:
                raise TicketError(f"layout body is corrupted: {exc}") from exc
            # Bytes after the end of the stream (unused_data) are padding a
            # raw body would be rejected for too.
            if len(body) != expected or dec.unconsumed_tail or dec.unused_data or not dec.eof:
                raise TicketError(
                    f"layout body decompresses to {len(body):,}+ bytes, expected exactly {expected:,}"
                )
        else:
            if len(payload) != expected:
                raise TicketError(
                    f"layout body has {len(payload):,} bytes, expected {expected:,} (truncated or padded)"
                )
            body = bytes(payload)
        if zlib.crc32(body) != crc:
            raise TicketError("layout body fails its checksum: corrupted in transit")

        pos = 0

        def take(count: int, dtype: str) -> np.ndarray:
            nonlocal pos
            width = np.dtype(dtype).itemsize
            if pos % width:
                # Unaligned: numpy's unaligned cast path is ~100x slower than
                # copying the bytes to an aligned buffer first.
                arr = np.frombuffer(bytearray(body[pos : pos + count * width]), dtype=dtype, count=count)
            else:
                arr = np.frombuffer(body, dtype=dtype, count=count, offset=pos)
            pos += count * width
            return arr

        codes = take(n, "u1")
        ndims = take(n, "u1")
        dims = take(ndims_total, "<u4" if dim_width == 4 else "<i8").astype(np.int64)
        ops = take(ntok, "u1")
        counts = take(ntok, "<u4").astype(np.int64)
        key_kinds = take(nkeys, "u1")
        key_lens = take(nkeys, "<u4").astype(np.int64)
        key_blob = body[pos : pos + key_blob_n]
        pos += key_blob_n
        aliases = take(2 * naliases, "<u4").astype(np.int64).reshape(naliases, 2)
        box_arrays = (take(nboxed, "<u4").astype(np.int64), take(nboxdims, "<i8").astype(np.int64), take(nboxdims, "<i8").astype(np.int64))

        if n and int(codes.max()) >= ELEMENT_SIZE_BY_CODE.size or (n and not ELEMENT_SIZE_BY_CODE[codes].all()):
            raise LayoutMismatchError("layout names a dtype code this tensorferry does not know")
        if n and int(ndims.max()) > MAX_NDIM:
            raise LayoutMismatchError(f"layout has a tensor of {int(ndims.max())} dims (max {MAX_NDIM})")
        if int(ndims.sum()) != ndims_total:
            raise LayoutMismatchError(
                f"layout dims count {ndims_total} does not match the tensors' ndims sum {int(ndims.sum())}"
            )
        if dims.size and (int(dims.min()) < 0 or int(dims.max()) > MAX_DIM):
            raise LayoutMismatchError("layout has a dimension out of range")
        keys = decode_keys(key_kinds, key_lens, key_blob)
        check_tree(ops, counts, n, nkeys)
        if naliases:
            _check_aliases(aliases, codes, ndims, dims)
        boxes = _boxes.check(*box_arrays, ndims, dims, MAX_DIM) if nboxed else None
        layout = cls(codes.copy(), ndims.copy(), dims, ops.copy(), counts, keys, aliases if naliases else NO_ALIASES, boxes)
        # numel <= MAX_NUMEL alone still lets numel * 16 wrap around int64
        # (2^62 complex128 elements "are" 0 bytes); bound the bytes in floats.
        if n and float(layout.numels.astype(np.float64) @ layout.alignments) > MAX_NUMEL:
            raise LayoutMismatchError("layout has more bytes of tensor data than can exist")
        return layout


NO_ALIASES = np.zeros((0, 2), dtype=np.int64)
NO_ALIASES.flags.writeable = False


def _check_aliases(aliases: np.ndarray, codes: np.ndarray, ndims: np.ndarray, dims: np.ndarray) -> None:
    """Each pair names a later tensor and an earlier, non-alias one of the
    same dtype and shape; each tensor is an alias at most once."""
    dup, orig = aliases[:, 0], aliases[:, 1]
    n = codes.size
    if int(dup.max()) >= n or not (orig < dup).all() or (np.diff(dup) <= 0).any():
        raise LayoutMismatchError("layout aliases must name a later tensor and an earlier one, in increasing order")
    if np.isin(orig, dup).any():
        raise LayoutMismatchError("layout aliases an alias; each must name the tensor itself")
    if not (codes[dup] == codes[orig]).all() or not (ndims[dup] == ndims[orig]).all():
        raise LayoutMismatchError("layout aliases tensors of different dtypes or ranks")
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(ndims, out=starts[1:])
    for d, o in aliases.tolist():
        if not np.array_equal(dims[starts[d] : starts[d + 1]], dims[starts[o] : starts[o + 1]]):
            raise LayoutMismatchError(f"layout aliases tensor {d} to tensor {o} of another shape")


def _numels(ndims: np.ndarray, dims: np.ndarray) -> np.ndarray:
    n = ndims.size
    numels = np.ones(n, dtype=np.int64)
    if not dims.size:
        return numels
    has = ndims > 0
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(ndims[:-1], out=starts[1:])
    idx = starts[has]
    # Float products first: a product above MAX_NUMEL is rejected before the
    # integer product could wrap around.
    fprod = np.multiply.reduceat(dims.astype(np.float64), idx)
    if fprod.size and float(fprod.max()) > MAX_NUMEL:
        raise LayoutMismatchError("layout has a tensor with more elements than can exist")
    numels[has] = np.multiply.reduceat(dims, idx)
    return numels
