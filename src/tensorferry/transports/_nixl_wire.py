"""What crosses the NIXL boundary: metadata, regions, descriptors, errors.

:func:`encode` wraps NIXL's opaque agent metadata in a small, versioned,
bounded envelope listing the agent's registered regions (plain data, never
pickle); :func:`decode` checks every length before it is used. With the
peer's regions known, :class:`Regions` checks each range of a READ against
them before NIXL sees it, so a wrong range fails with the numbers;
:func:`merged_descs` turns ranges into NIXL's descriptor rows (merged through
:func:`packing.merge_runs`); NIXL's own exceptions become tensorferry errors
here. NIXL itself is imported by :mod:`._nixl_load`, on first use only.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any, Callable, Iterator, Literal, NamedTuple, Sequence

import numpy as np

from ..errors import (
    ConfigurationError,
    PeerGoneError,
    ProtocolError,
    TensorferryError,
    TransferError,
)
from ..wire import packing

__all__ = ["Region", "Regions", "as_ranges", "encode", "decode", "merged_descs", "nixl_errors"]

# Envelope around NIXL's agent metadata:
#   magic, version, name length, region count, NIXL metadata length
# then the UTF-8 name, the regions, and NIXL's bytes.
_MAGIC = b"TFNX"
_VERSION = 1
_HEADER = struct.Struct("<4sHHII")
# One region: address, nbytes, memory kind (_DRAM / _VRAM), device index.
_REGION_DTYPE = np.dtype([("addr", "<u8"), ("nbytes", "<u8"), ("mem", "<u4"), ("dev", "<u4")])
# Bounds a decoder enforces before it allocates anything sized by the peer.
# A transport registers one pool (a few buffers at most); 4096 regions is
# far beyond that and still only 96 KiB of region records.
_MAX_REGIONS = 4096
_MAX_NAME_NBYTES = 256
# NIXL's own metadata is ~0.5 KiB plus ~0.1 KiB per registration; 16 MiB
# leaves room for any sane agent and stops a hostile length field.
_MAX_NIXL_METADATA_NBYTES = 16 << 20

_DRAM, _VRAM = 0, 1
_MEM_NAMES = {_DRAM: "DRAM", _VRAM: "VRAM"}


class Region(NamedTuple):
    """One registered memory region, as both sides see it."""

    addr: int
    nbytes: int
    mem: Literal["DRAM", "VRAM"]
    device: int


class Regions:
    """Sorted, non-overlapping regions, for vectorized containment lookups."""

    def __init__(self, regions: Sequence[Region]) -> None:
        order = sorted(range(len(regions)), key=lambda i: regions[i].addr)
        self.regions = [regions[i] for i in order]
        self.starts = np.array([r.addr for r in self.regions], dtype=np.uint64)
        self.ends = np.array([r.addr + r.nbytes for r in self.regions], dtype=np.uint64)
        self.devices = np.array([r.device for r in self.regions], dtype=np.uint64)
        self.mems = [r.mem for r in self.regions]

    def locate(self, addr: np.ndarray, nbytes: np.ndarray, *, side: str, owner: str) -> np.ndarray:
        """Index of the region holding each range; raises naming the first that none holds."""
        if not self.regions:
            raise ConfigurationError(
                f"{side} ranges cannot be read: {owner} has no registered memory; "
                "register the buffer (NixlEndpoint.register) before sending its metadata"
            )
        idx = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        safe = np.maximum(idx, 0)
        end = self.ends[safe]
        # room = end - addr without wrapping when addr is past the region.
        room = np.where(end >= addr, end - np.minimum(addr, end), np.uint64(0))
        bad = (idx < 0) | (nbytes > room)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            a, n = int(addr[i]), int(nbytes[i])
            near = ", ".join(f"[{r.addr:#x}, {r.addr + r.nbytes:#x})" for r in self.regions[:4])
            more = f" and {len(self.regions) - 4} more" if len(self.regions) > 4 else ""
            raise ConfigurationError(
                f"{side} range {i} [{a:#x}, {a + n:#x}) ({n:,} bytes) is not inside one region {owner} "
                f"registered ({int(bad.sum()):,} of {len(addr):,} ranges are outside); registered: {near}{more}; "
                "ranges are absolute addresses (base address + offset) and must not cross a region's end"
            )
        return idx


def as_ranges(ranges: Sequence[tuple[int, int]] | np.ndarray, side: str) -> np.ndarray:
    """``(address, nbytes)`` pairs as an (N, 2) uint64 array, checked."""
    arr = np.asarray(ranges)
    if arr.size == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ConfigurationError(f"{side}_ranges must be (address, nbytes) pairs, an (N, 2) array; got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ConfigurationError(f"{side}_ranges must hold integers (addresses and byte counts); got dtype {arr.dtype}")
    if arr.dtype.kind == "i":
        neg = arr < 0
        if neg.any():
            i = int(np.flatnonzero(neg.any(axis=1))[0])
            raise ConfigurationError(f"{side} range {i} is ({int(arr[i, 0])}, {int(arr[i, 1])}): addresses and byte counts cannot be negative")
    return arr.astype(np.uint64, copy=False)


def encode(name: str, regions: Sequence[Region], nixl_md: bytes) -> bytes:
    raw_name = name.encode()
    table = np.zeros(len(regions), dtype=_REGION_DTYPE)
    for i, r in enumerate(regions):
        table[i] = (r.addr, r.nbytes, _VRAM if r.mem == "VRAM" else _DRAM, r.device)
    head = _HEADER.pack(_MAGIC, _VERSION, len(raw_name), len(regions), len(nixl_md))
    return b"".join((head, raw_name, table.tobytes(), nixl_md))


def decode(data: bytes) -> tuple[str, list[Region], bytes]:
    """Parse an envelope from a peer; every length is checked before it is used."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"peer metadata must be bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise ProtocolError(f"peer metadata is {len(data)} bytes, shorter than its {_HEADER.size}-byte header")
    magic, version, name_n, region_n, md_n = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ProtocolError(
            f"peer metadata starts with {magic!r}, not {_MAGIC!r}: pass the bytes of NixlEndpoint.metadata(), "
            "not NIXL's raw agent metadata"
        )
    if version != _VERSION:
        raise ProtocolError(f"peer metadata has version {version}; this tensorferry reads version {_VERSION}: use one tensorferry version on both sides")
    if not 0 < name_n <= _MAX_NAME_NBYTES or region_n > _MAX_REGIONS or not 0 < md_n <= _MAX_NIXL_METADATA_NBYTES:
        raise ProtocolError(
            f"peer metadata declares a {name_n}-byte name, {region_n} regions and {md_n:,} bytes of NIXL metadata; "
            f"the bounds are 1..{_MAX_NAME_NBYTES}, 0..{_MAX_REGIONS} and 1..{_MAX_NIXL_METADATA_NBYTES:,}"
        )
    expected = _HEADER.size + name_n + region_n * _REGION_DTYPE.itemsize + md_n
    if len(data) != expected:
        raise ProtocolError(f"peer metadata is {len(data):,} bytes; its header declares {expected:,} (truncated or padded)")
    at = _HEADER.size
    try:
        name = data[at : at + name_n].decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError("peer metadata's agent name is not UTF-8") from exc
    at += name_n
    table = np.frombuffer(data, dtype=_REGION_DTYPE, count=region_n, offset=at)
    at += region_n * _REGION_DTYPE.itemsize
    regions: list[Region] = []
    for i, (addr, nbytes, mem, dev) in enumerate(table.tolist()):
        if mem not in _MEM_NAMES or nbytes == 0 or addr + nbytes > 1 << 64:
            raise ProtocolError(f"peer metadata region {i} (addr {addr:#x}, {nbytes:,} bytes, memory kind {mem}) is invalid")
        regions.append(Region(addr, nbytes, _MEM_NAMES[mem], dev))  # type: ignore[arg-type]
    ordered = sorted(regions)
    for a, b in zip(ordered, ordered[1:]):
        if a.addr + a.nbytes > b.addr:
            raise ProtocolError(f"peer metadata regions overlap: [{a.addr:#x}, +{a.nbytes:,}) and [{b.addr:#x}, +{b.nbytes:,})")
    return name, regions, data[at:]


def merged_descs(
    l_addr: np.ndarray, r_addr: np.ndarray, nbytes: np.ndarray, l_idx: np.ndarray, r_idx: np.ndarray, local: "Regions", remote: "Regions"
) -> tuple[np.ndarray, np.ndarray]:
    """NIXL (address, nbytes, device) rows, merging pairs adjacent on both sides within one region."""
    if len(nbytes) > 1:
        other_region = np.zeros(len(nbytes), dtype=bool)
        other_region[1:] = (l_idx[1:] != l_idx[:-1]) | (r_idx[1:] != r_idx[:-1])
        runs = packing.merge_runs(l_addr, r_addr, nbytes, other_region)
        l_addr, r_addr, nbytes = runs.dst, runs.src, runs.nbytes
        l_idx, r_idx = l_idx[runs.heads], r_idx[runs.heads]
    local_descs = np.empty((len(nbytes), 3), dtype=np.uint64)
    local_descs[:, 0], local_descs[:, 1], local_descs[:, 2] = l_addr, nbytes, local.devices[l_idx]
    remote_descs = np.empty((len(nbytes), 3), dtype=np.uint64)
    remote_descs[:, 0], remote_descs[:, 1], remote_descs[:, 2] = r_addr, nbytes, remote.devices[r_idx]
    return local_descs, remote_descs


def _nixl_error(exc: BaseException) -> bool:
    """True for the exceptions NIXL's bindings raise (nixlNotFoundError, ...)."""
    return type(exc).__name__.startswith("nixl")


def _translate(exc: BaseException, what: str, peer: str | None = None) -> TransferError:
    kind = type(exc).__name__
    if kind == "nixlRemoteDisconnectError":
        return PeerGoneError(
            f"{what}: peer {peer!r} is disconnected ({exc}); it died or closed its endpoint. "
            "This endpoint stays usable: remove_remote() the peer and add_remote() fresh metadata from a live one"
        )
    if kind == "nixlNotFoundError":
        return TransferError(
            f"{what}: NIXL found no registration covering the ranges ({exc}): the peer deregistered them, "
            "or sent metadata taken before registering; ask the peer for fresh metadata"
        )
    return TransferError(f"{what}: NIXL raised {kind}: {exc}")


@contextlib.contextmanager
def nixl_errors(what: str = "", peer: str | None = None, *, error: Callable[[Exception], TensorferryError | None] | None = None) -> Iterator[None]:
    """Raise what NIXL's bindings raise in the block as a tensorferry error,
    chained ``from`` it (:func:`_translate` of ``what`` and ``peer``, or
    ``error(exc)`` where the caller words it itself); other exceptions pass
    through. ``error`` returning None means the caller dealt with it (a
    failure it only logs): the block's exception is then swallowed."""
    try:
        yield
    except Exception as exc:
        if not _nixl_error(exc):
            raise
        out = _translate(exc, what, peer) if error is None else error(exc)
        if out is not None:
            raise out from exc
