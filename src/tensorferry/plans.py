"""Kept plans: a transfer's per-tensor work done once, replayed on every sync.

RL weight sync sends the same state dict, changed in place, to the same
workers thousands of times. Without a plan every sync pays for every tensor
again: the sender inspects each one and encodes a layout, each receiver
decodes it, matches it to its targets and computes its copy runs.

* :class:`SendPlan` (``Sender.plan``): the tensors inspected once, the layout
  encoded once, the copy runs into a pool block computed once (dtype
  conversions included). ``Sender.put(plan)`` checks that the tensors still
  live where the plan found them (a few C-level passes) and moves bytes.
* :class:`RecvPlan` (``Receiver.plan``): the ticket's layout checked once
  against ``into=`` targets (or destination tensors allocated once), the
  runs from the received byte stream into them computed once.
  ``Receiver.get(ticket, into=plan)`` compares the ticket's layout bytes with
  the plan's, moves bytes, and returns the same tensor objects every time.

Coordinates: a ticket's bytes form one *stream*, its blocks (resident) or
its pieces (streamed) concatenated. A planned sender always puts one block,
or pieces of the one-block layout, so stream positions are the packed
offsets; a ticket with several blocks (a plain ``put`` into a fragmented
pool) gets its positions from the block sizes, vectorised, cached per sizes.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import packing
from ._copy import _PARALLEL_MIN_NBYTES as _PARALLEL_GATHER_NBYTES, CopyPlan, copy_converting, copy_threads, executor, finish, run_parts, copy_staged, copy_values, fill_aliases, dense_host_mask, many_small_runs, pack_leaves, target_addresses
from ._tensors import LeafInfo, data_ptrs, dtype_code, first_replaced, flatten, gc_paused, inspect_leaves, match_into, torch_dtype, unflatten
from ._views import build_views
from .errors import ConfigurationError, LayoutMismatchError, PlanStaleError, UnsupportedTensorError
from .layout import DTYPES, Layout

if TYPE_CHECKING:
    from .receiver import Receiver
    from .sender import Sender
    from .ticket import Ticket

__all__ = ["SendPlan", "RecvPlan"]

def _buffer_at(address: int, nbytes: int) -> memoryview:
    """A writable byte buffer over host memory someone else owns (no copy)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


# A gap between two runs of a gather up to this size is filled with zeros
# in the same torch.cat (cheaper than starting another cat); larger gaps
# (a big tensor converted or copied by value) start a new stretch.
_BRIDGE_NBYTES = 64 << 10


def _cat_into(out: torch.Tensor, stretches: list[tuple[int, int, list[torch.Tensor]]]) -> None:
    for start, end, parts in stretches:
        torch.cat(parts, out=out[start:end])


def _split_stretches(stretches: list[tuple[int, int, list[torch.Tensor]]], k: int, min_nbytes: int = _PARALLEL_GATHER_NBYTES) -> list[list[tuple[int, int, list[torch.Tensor]]]]:
    """Stretches cut into ``k`` lists of about equal bytes (a part's tensor
    cut in two where a seam falls in it), for ``k`` threads; one list if
    they hold less than ``min_nbytes``."""
    total = sum(end - start for start, end, _ in stretches)
    if k <= 1 or total < min_nbytes:
        return [stretches]
    step = -(-total // k)
    out: list[list[tuple[int, int, list[torch.Tensor]]]] = [[]]
    room = step  # bytes the current list still takes
    for start, _, parts in stretches:
        at, cur = start, []
        for part in parts:
            while len(out) < k and part.numel() >= room:
                if room:
                    cur.append(part[:room])
                    part = part[room:]
                if cur:
                    out[-1].append((start, at + room, cur))
                at += room
                start, cur, room = at, [], step
                out.append([])
            if part.numel():
                cur.append(part)
                at += part.numel()
                room -= part.numel()
        if cur:
            out[-1].append((start, at, cur))
    return [o for o in out if o]


class SendPlan:
    """A sender's kept plan of one object (``Sender.plan``); sender side.

    Holds the planned tensors (they stay alive as long as the plan does)
    and replays their copy into the pool on every ``Sender.put(plan)``.
    Where they are views of a few storages, it holds those storages too:
    memory a tensor leaves (``.data =``, ``module.to()``) stays allocated
    until the plan is dropped or a put finds it stale.

    Attributes:
        source: the object planned (an ``nn.Module``, or the tensors' nesting).
        layout: what receivers get: the tensors' dtypes (after ``dtype=``),
            shapes and nesting.
        layout_bytes: the encoded layout, reused by every ticket.
        total_nbytes: the packed size of one put.
        num_tensors: planned tensors (tied names counted once each).
    """

    def __init__(self, sender: "Sender", obj: Any, *, dtype: torch.dtype | None = None) -> None:
        # Planning makes Python objects per tensor (shapes, storages): with
        # the collector paused, 100k of them set off no collections over
        # everything alive.
        with gc_paused():
            self._make(sender, obj, dtype)

    def _make(self, sender: "Sender", obj: Any, dtype: torch.dtype | None) -> None:
        self._sender = sender
        self.source = obj  # what was planned (a module, or the object itself)
        module = obj if isinstance(obj, torch.nn.Module) else None
        src = module.state_dict(keep_vars=True) if module is not None else obj
        leaves, ops, counts, keys, staged = flatten(src)
        info = inspect_leaves(src, leaves, ops, counts, keys)
        if staged:
            raise UnsupportedTensorError(
                f"{staged} numpy arrays are read-only or have negative strides, so torch cannot share their memory; "
                "a plan would send the copy made now on every put: pass writable, C-ordered arrays (np.ascontiguousarray(a).copy())"
            )
        sent, convert = _converted(info.layout, dtype)
        self.layout: Layout = sent
        self.layout_bytes: bytes = sent.to_bytes()
        self.offsets, self.total_nbytes = packing.packed_offsets(sent.nbytes, sent.alignments)
        self.num_tensors = len(leaves)
        self.dtype = dtype
        self._converting = bool(convert.any())
        self._leaves = leaves
        self._keys = list(src.keys()) if isinstance(src, dict) else None
        # The copy sees converted leaves as values (not raw bytes) and the
        # layout's dtype as their destination type.
        self._info = info._replace(layout=sent, raw=info.raw & ~convert)
        self._host = info.all_cpu and sender.pool.device.type == "cpu"
        self._watch = _Watch(leaves, self._keys, module, ops, counts, keys, hold=self._host)
        self._sources: _BufferList | None = None
        self._gather: list[list[tuple[int, int, list[torch.Tensor]]]] | None = None
        self.last_unsnapshotted: int | None = None  # ticket id of the last snapshot=False put
        self.lock = threading.Lock()
        if self._host:
            self._copy = CopyPlan.build(self.offsets, info.data_ptrs, sent.nbytes, raw=self._info.raw)
            self._conversions, converted = _conversion_runs(leaves, info, sent, self.offsets, convert)
            self._values = np.setdiff1d(self._copy.elementwise, converted)
            self._vectored = many_small_runs(self._copy.nbytes)

    def __repr__(self) -> str:
        return (
            f"SendPlan(num_tensors={self.num_tensors:,}, total_nbytes={self.total_nbytes:,}, "
            f"dtype={self.dtype}, copy_runs={self.copy_runs if self._host else 'device'})"
        )

    @property
    def copy_runs(self) -> int:
        """Copies one snapshot put issues (merged runs, conversion runs, value copies)."""
        if not self._host:
            return self.num_tensors
        return self._copy.num_runs + len(self._conversions) + int(self._values.size)

    # -- what put() calls ------------------------------------------------------------------

    def check(self, sender: "Sender", *, tensors: bool = True) -> None:
        """Raise unless this plan belongs to ``sender`` and (``tensors``)
        its tensors are still where it found them: the same objects in the
        module (if one was planned), at the same addresses, of the same
        sizes. A few C-level passes over the tensors, no Python per tensor
        but for a module's slots. A snapshot put leaves the tensors to
        :meth:`fill_checked`, which checks them while the bytes move.

        Raises:
            ConfigurationError: another sender's plan.
            PlanStaleError: a tensor moved, was replaced or resized.
        """
        if sender is not self._sender:
            raise ConfigurationError("put(plan): this plan was made by another Sender; make one with this sender's plan()")
        if tensors:
            self._watch.check(*_PUT)

    def fill_checked(self, out: torch.Tensor) -> tuple[int, int]:
        """:meth:`fill` of the whole object into ``out``, with the check of
        :meth:`check`: before the copy, or, when the tensors live in a few
        storages (views of flat buffers), while it runs. Those storages are
        checked first (the plan holds them, so every byte the copy reads by
        the planned addresses is theirs, whatever the tensors show; tensors
        copied value by value are read through the tensors as they are),
        then the tensors one by one on
        another thread as the bytes move: the pass over 100k tensors (10 to
        25 ms, most of it cache misses after a training step touched GiBs)
        takes no time of its own where a core is free for it (on 2 cores,
        both copying, it gains nothing measurable). A stale tensor raises
        after the copy; the caller frees the block, nothing was sent.

        Raises:
            PlanStaleError: a tensor moved, was replaced or resized.
        """
        return self._watch.guarded(lambda: self.fill(out, 0, self.total_nbytes), *_PUT, overlap=self._host)

    def matches(self, obj: Any) -> bool:
        """Whether ``obj`` is made of the planned tensors' memory, nested
        the same way (a fresh ``state_dict()`` of the same model is): its
        tensors may then be sent by this plan. One flatten of ``obj`` and a
        few C-level passes."""
        return self._watch.matches(obj)

    def fill(self, out: torch.Tensor, lo: int, hi: int) -> tuple[int, int]:
        """Write bytes ``[lo, hi)`` of the packed object into ``out`` (a pool
        block of ``hi - lo`` bytes): the kept runs by address, conversions
        a run at a time, the rest value by value. Returns ``(copies, value copies)``."""
        if not self._host:
            return pack_leaves(self._leaves, self._info, self.offsets, out, lo, hi)
        copy = self._copy
        pool = self._sender.pool
        if self._vectored and lo == 0 and hi >= self.total_nbytes:
            # Many small runs, the whole object: torch.cat of the runs (a
            # C++ loop of memcpy; 100k runs of 10 KiB: 102 ms here against
            # 193 ms for a memmove a run and 143 ms for pwritev, and 78 ms
            # for one memcpy), a part per copy thread (cat runs without the GIL).
            run_parts(_cat_into, [(out, part) for part in self._gathers()])
            runs = copy.num_runs
        elif self._vectored and pool.fd is not None:
            # A piece of a streamed put: the window of the runs by pwritev.
            # Gaps (and the places of converted or value-copied tensors,
            # written below) get zeros: every byte of [lo, hi) is written.
            pool.write_buffers(out.data_ptr() - pool.data_ptr, self._run_buffers().window(lo, hi))
            runs = copy.num_runs
        elif lo == 0 and hi >= self.total_nbytes:
            runs = copy.execute(dst_base=out.data_ptr())
        else:
            runs = copy.execute_window(lo, hi, out.data_ptr() - lo, 0, by_dst=True)
        pairs = []
        for start, nbytes, dt, src in self._conversions:
            a, b = max(lo, start), min(hi, start + nbytes)
            if a < b:
                size = dt.itemsize
                pairs.append((out[a - lo : b - lo].view(dt), src[(a - start) // size : (b - start) // size]))
        if pairs:
            with torch.no_grad():
                copy_converting(pairs)
        values = copy_values(self._leaves, self.layout, self.offsets, out, lo, hi, self._values)
        return runs + len(self._conversions), values

    def fill_piece(self, pool: Any) -> Any:
        """``pack(voffset, nbytes) -> Packed``: one piece of a streamed put,
        packed into ``pool`` from the kept runs."""
        nbytes, offsets = self.layout.nbytes, self.offsets

        def pack(voffset: int, size: int) -> Any:
            count = int(((offsets < voffset + size) & (offsets + nbytes > voffset) & (nbytes > 0)).sum())
            return pool.pack_with(self.layout, size, lambda out: self.fill(out, voffset, voffset + size), num_tensors=count)

        return pack

    def source_buffers(self, lo: int, hi: int) -> list[memoryview]:
        """Bytes ``[lo, hi)`` of the packed object as buffers of the
        tensors' own memory (and zeros for alignment gaps): what a
        ``snapshot=False`` put serves. Built once per plan.

        Raises:
            ConfigurationError: the plan converts dtypes, or has tensors
                that are not dense host memory (their bytes are not their values).
        """
        if not self._host or self._converting or self._values.size:
            why = (
                "it converts dtypes (dtype=)" if self._converting else
                "some tensors are not dense host memory (strided, conjugated, negated or on a device)"
            )
            raise ConfigurationError(
                f"put(plan, snapshot=False) serves the tensors' own bytes, but {why}; "
                "use snapshot=True (the bytes are converted into the pool)"
            )
        return self._run_buffers().window(lo, hi)

    def source_runs(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs of bytes ``[lo, hi)`` of the packed object in the
        tensors' own memory: (position, address, length) int64 arrays, in
        order, alignment gaps left out (what a snapshot=False put tells shm
        readers, which copy them with process_vm_readv)."""
        self.source_buffers(0, 0)  # the same conditions as the buffers
        d, s, n, _ = self._copy.window(lo, hi, by_dst=True)
        return d, s, n

    def _gathers(self) -> list[list[tuple[int, int, list[torch.Tensor]]]]:
        """The raw runs as torch.cat jobs, made once per plan (a tensor per
        run: ~5 us each, once): per copy thread, its stretches ``(start,
        end, [uint8 tensors])`` of the packed object, each filled by one
        cat. Gaps of up to ``_BRIDGE_NBYTES`` between runs (alignment, the
        place of a tensor converted or copied by value, written after) are
        bridged with zeros, so a state dict of mixed dtypes is a few cats,
        not one per run (a cat costs ~10 us to start)."""
        if self._gather is None:
            c = self._copy
            stretches: list[tuple[int, int, list[torch.Tensor]]] = []
            zeros = torch.zeros(_BRIDGE_NBYTES, dtype=torch.uint8)
            for d, s, n in zip(c.dst.tolist(), c.src.tolist(), c.nbytes.tolist()):
                part = torch.frombuffer(_buffer_at(s, n), dtype=torch.uint8)
                gap = d - stretches[-1][1] if stretches else -1
                if 0 <= gap <= _BRIDGE_NBYTES:
                    start, _, parts = stretches[-1]
                    if gap:
                        parts.append(zeros[:gap])
                    parts.append(part)
                    stretches[-1] = (start, d + n, parts)
                else:
                    stretches.append((d, d + n, [part]))
            self._gather = _split_stretches(stretches, copy_threads())
        return self._gather

    def _run_buffers(self) -> "_BufferList":
        """The packed object as buffers of the raw runs' memory, zeros between (made once)."""
        if self._sources is None:
            c = self._copy
            self._sources = _BufferList(c.dst, c.src, c.nbytes, self.total_nbytes)
        return self._sources


class SourcedPiece:
    """A piece of a ``snapshot=False`` put: served from the tensors' own
    memory, so it holds no pool block. Stands where a :class:`Packed` does
    in the sender's ledger (``blocks``, ``buffers()``, ``release()``)."""

    def __init__(self, plan: SendPlan, lo: int, hi: int) -> None:
        from .pool import Block

        self.plan, self.lo, self.hi = plan, lo, hi
        # Offsets relative to the piece: the receiver checks them against
        # the sender's pool size, which a piece never exceeds.
        self.blocks: tuple[Block, ...] = (Block(0, hi - lo),)

    def buffers(self) -> list[memoryview]:
        return self.plan.source_buffers(self.lo, self.hi)

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(position in the piece, address, length) of the piece's runs."""
        pos, addr, n = self.plan.source_runs(self.lo, self.hi)
        return pos - self.lo, addr, n

    def release(self) -> None:
        """Nothing to free: the bytes are the caller's tensors."""


def _converted(layout: Layout, dtype: torch.dtype | None) -> tuple[Layout, np.ndarray]:
    """The layout with floating-point tensors as ``dtype``, and which changed."""
    if dtype is None:
        return layout, np.zeros(layout.num_tensors, dtype=bool)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigurationError(
            f"plan(dtype={dtype!r}): expected a floating-point torch dtype (torch.bfloat16, torch.float16, ...); "
            "integer and bool tensors are always sent as they are"
        )
    try:
        target = dtype_code(dtype)
    except KeyError as exc:
        raise ConfigurationError(f"plan(dtype={dtype}): tensorferry cannot send {dtype}; use torch.bfloat16 or torch.float16") from exc
    codes = layout.dtype_codes
    convert = _FLOATING[codes] & (codes != target) if codes.size else np.zeros(0, dtype=bool)
    if not convert.any():
        return layout, convert
    new_codes = codes.copy()
    new_codes[convert] = target
    return dataclasses.replace(layout, dtype_codes=new_codes), convert


def _floating_codes() -> np.ndarray:
    """bool per wire code: a floating-point dtype (what ``dtype=`` converts)."""
    out = np.zeros(max(code for code, _ in DTYPES.values()) + 1, dtype=bool)
    for code, _ in DTYPES.values():
        out[code] = torch_dtype(code).is_floating_point
    return out


_FLOATING = _floating_codes()


def _conversion_runs(leaves: Sequence[torch.Tensor], info: LeafInfo, sent: Layout, offsets: np.ndarray, convert: np.ndarray) -> tuple[list[tuple[int, int, torch.dtype, torch.Tensor]], np.ndarray]:
    """Dense host tensors converted on the way, merged into runs of one
    source dtype that touch on both sides (views of a flat buffer: one
    run), each with a tensor over its source memory made once.

    Returns ``(runs, converted)``: ``(destination offset, destination
    bytes, destination dtype, source tensor)`` per run, and the indices of
    the tensors the runs cover.
    """
    src_size = info.layout.alignments
    idx = np.flatnonzero(convert & info.raw & (sent.nbytes > 0))
    idx = idx[info.data_ptrs[idx] % src_size[idx] == 0]
    if not idx.size:
        return [], idx
    codes = info.layout.dtype_codes[idx]
    breaks = np.zeros(idx.size, dtype=bool)
    breaks[1:] = codes[1:] != codes[:-1]
    dst_size = sent.alignments[idx]
    # In elements: a run is adjacent on both sides in its own element size.
    runs = packing.merge_runs(offsets[idx] // dst_size, info.data_ptrs[idx] // src_size[idx], sent.numels[idx], breaks)
    out = []
    for de, se, n, h in zip(runs.dst.tolist(), runs.src.tolist(), runs.nbytes.tolist(), runs.heads.tolist()):
        i = int(idx[h])
        sdt, ddt = leaves[i].dtype, torch_dtype(int(sent.dtype_codes[i]))
        src = torch.frombuffer(_buffer_at(se * sdt.itemsize, n * sdt.itemsize), dtype=sdt)
        out.append((de * ddt.itemsize, n * ddt.itemsize, ddt, src))
    return out, idx


class _Watch:
    """What a kept plan checks before each use: that its tensors are still
    where it found them (same addresses and sizes) and, for a module, still
    the module's own (a parameter or buffer replaced is another tensor)."""

    def __init__(self, leaves: Sequence[torch.Tensor], names: list[Any] | None, module: torch.nn.Module | None, ops: Sequence[int], counts: Sequence[int], keys: Sequence[Any], *, hold: bool = False) -> None:
        n = len(leaves)
        self.leaves = leaves = leaves if type(leaves) is list else list(leaves)
        self.names = names
        self.ptrs = data_ptrs(leaves)
        self.numels = np.fromiter(map(torch.Tensor.numel, leaves), dtype=np.int64, count=n)
        self.dtypes = list(map(_get_dtype, leaves))
        self.tree = (list(ops), list(counts), list(keys))
        # Per tensor, the module dict it lives in and its name there.
        self.slots = _module_slots(module, names or [], leaves) if module is not None else None
        # Recorded with the addresses (never later: a copy trusts both).
        self.storages = _Storages.of(leaves, self.numels) if hold else None

    def check(self, what: str, fix: str) -> None:
        """Raises PlanStaleError naming the first tensor that changed."""
        leaves = self.leaves
        if self.slots is not None:
            i = first_replaced(*self.slots, leaves)
            if i >= 0:
                raise PlanStaleError(
                    f"{what}: the module's {self.name(i)} is no longer the tensor the plan was made with "
                    f"(reassigned, e.g. by load_state_dict(assign=True) or a new nn.Parameter); {_outcome(what)}: "
                    f"make a new plan with {fix}"
                )
        # One pass, the addresses only (0.015 to 0.03 us a tensor): what can
        # make the plan read or write memory that is no longer the tensor's
        # (`.data =`, set_, module.to(), a resize_ that grows) moves it. A
        # resize_ that shrinks keeps the address and the storage's bytes:
        # the plan still moves the planned bytes, safely; it is caught by
        # the size check below only when the address moved too.
        try:
            ptrs = data_ptrs(leaves)
        except (RuntimeError, TypeError):  # one has no memory now (swap_tensors)
            i = next(i for i, t in enumerate(leaves) if _no_address(t))
            raise PlanStaleError(
                f"{what}: {self.name(i)} has no memory of its own any more (a sparse or storage-less tensor was "
                f"swapped in, e.g. by torch.utils.swap_tensors); {_outcome(what)}: make a new plan with {fix}"
            ) from None
        bad = np.flatnonzero(ptrs != self.ptrs)
        if bad.size:
            i = int(bad[0])
            numel = leaves[i].numel()
            change = f"moved from address {self.ptrs[i]:#x} to {ptrs[i]:#x}" + (
                f" and was resized from {self.numels[i]:,} to {numel:,} elements" if numel != self.numels[i] else "")
            raise PlanStaleError(
                f"{what}: {self.name(i)} {change} since the plan was made ({bad.size:,} tensors changed; e.g. "
                f"`.data` reassigned, module.to(), resize_); {_outcome(what)}: make a new plan with {fix}"
            )

    def guarded(self, move: Callable[[], Any], what: str, fix: str, *, overlap: bool) -> Any:
        """``move()``, which reads or writes the planned tensors' memory by
        address, and :meth:`check`: first; or, with ``overlap`` and the
        tensors in few storages (held since the plan was made, checked
        first), on a copy thread while ``move()`` runs, raising after it."""
        storages = self.storages if overlap else None
        try:
            if storages is None:
                self.check(what, fix)
                return move()
            storages.check(self, what, fix)
            future = executor().submit(self.check, what, fix)
            try:
                result = move()
            except BaseException as exc:
                # A stale tensor explains what the move tripped on (a
                # value-copied leaf replaced by one of another size): that
                # error wins; else the move's own.
                stale = future.exception() if not future.cancel() else _stale(self.check, what, fix)
                if isinstance(stale, PlanStaleError):
                    raise stale from exc
                raise
            finish(future, self.check, what, fix)
            return result
        except PlanStaleError:
            # A stale plan raises on every use: it need not keep the memory
            # its tensors left (no copy is running any more).
            self.storages = None
            raise

    def matches(self, obj: Any) -> bool:
        src = obj.state_dict(keep_vars=True) if isinstance(obj, torch.nn.Module) else obj
        try:
            leaves, ops, counts, keys, staged = flatten(src)
        except UnsupportedTensorError:
            return False
        n = len(leaves)
        if staged or n != len(self.leaves) or (ops, counts, keys) != self.tree or list(map(_get_dtype, leaves)) != self.dtypes:
            return False
        try:
            ptrs = data_ptrs(leaves)
        except RuntimeError:  # a tensor without memory (meta, sparse)
            return False
        numels = np.fromiter(map(torch.Tensor.numel, leaves), dtype=np.int64, count=n)
        return bool((ptrs == self.ptrs).all() and (numels == self.numels).all())

    def name(self, i: int) -> str:
        if self.names is not None and i < len(self.names):
            return f"tensor {self.names[i]!r}"
        return f"tensor #{i}"


def _no_address(t: Any) -> bool:
    """Whether ``t.data_ptr()`` raises (a sparse tensor, not a tensor)."""
    try:
        t.data_ptr()
    except (RuntimeError, TypeError, AttributeError):
        return True
    return False


def _stale(check: Callable[[str, str], None], what: str, fix: str) -> BaseException | None:
    """The error ``check(what, fix)`` raises, or None."""
    try:
        check(what, fix)
    except BaseException as exc:  # returned, not raised: the caller chooses
        return exc
    return None


class _Storages:
    """The storages a plan's tensors live in, held, with where they were.

    A tensor moved by ``.data =``, ``set_`` or ``module.to()`` leaves its
    old storage, which is held here, so a copy by the planned addresses
    still reads memory that is alive (the plan keeps that memory until a
    use finds it stale). What frees a held storage's memory in place (a
    ``resize_`` that grows it, ``untyped_storage().resize_(0)``) changes its
    address or size, which :meth:`check` sees before any copy starts. Like
    the check it replaces, this assumes nothing changes the tensors while a
    put runs (another thread's ``resize_`` during the copy could still
    free what it reads), and it cannot see memory freed behind torch's back
    (numpy's ``resize(refcheck=False)`` under a ``from_numpy`` tensor)."""

    def __init__(self, storages: list[Any], ptrs: np.ndarray, nbytes: np.ndarray) -> None:
        self.storages, self.ptrs, self.nbytes = storages, ptrs, nbytes

    @classmethod
    def of(cls, leaves: Sequence[torch.Tensor], numels: np.ndarray) -> "_Storages | None":
        """Those of ``leaves`` if they are few (at most one per 8 tensors:
        views of flat buffers), else None."""
        live = np.flatnonzero(numels > 0)
        if not live.size:
            return None
        every = [leaves[i].untyped_storage() for i in live.tolist()]
        # Told apart by the storage itself, not its address: two storages
        # can share one (a tensor and its from_dlpack or from_numpy alias),
        # and either may be reallocated; every one is held and checked.
        ids = np.fromiter(map(_get_cdata, every), dtype=np.int64, count=len(every))
        _, first = np.unique(ids, return_index=True)
        if first.size * 8 > len(leaves):
            return None
        held = [every[i] for i in first.tolist()]
        ptrs = np.fromiter(map(torch.UntypedStorage.data_ptr, held), dtype=np.int64, count=len(held))
        return cls(held, ptrs, np.fromiter(map(torch.UntypedStorage.nbytes, held), dtype=np.int64, count=len(held)))

    def check(self, watch: "_Watch", what: str, fix: str) -> None:
        """Raises PlanStaleError if a held storage's memory moved or shrank."""
        now = np.fromiter(map(torch.UntypedStorage.data_ptr, self.storages), dtype=np.int64, count=len(self.storages))
        size = np.fromiter(map(torch.UntypedStorage.nbytes, self.storages), dtype=np.int64, count=len(self.storages))
        bad = np.flatnonzero((now != self.ptrs) | (size < self.nbytes))
        if bad.size:
            j = int(bad[0])
            lo, hi = int(self.ptrs[j]), int(self.ptrs[j] + self.nbytes[j])
            i = int(np.flatnonzero((watch.ptrs >= lo) & (watch.ptrs < hi))[0])
            raise PlanStaleError(
                f"{what}: the memory of {watch.name(i)} (a storage of {self.nbytes[j]:,} bytes at {lo:#x}) moved to {now[j]:#x} "
                f"and holds {size[j]:,} bytes since the plan was made (e.g. resize_); {_outcome(what)}: make a new plan with {fix}"
            )


_get_dtype = operator.attrgetter("dtype")
_get_cdata = operator.attrgetter("_cdata")

# A receive plan with this many separately versioned targets bumps their
# counters on a copy thread while the bytes land.
_MARK_ON_THREAD_MIN = 4096

def _outcome(what: str) -> str:
    """What a stale plan's error says became of the data."""
    return "nothing was sent" if what.startswith("put") else "nothing was written"


# What a stale sender plan's error says: the call, and the fix.
_PUT = ("put(plan)", "sender.plan(...)")


def _module_slots(module: torch.nn.Module, keys: list[Any], leaves: Sequence[torch.Tensor]) -> tuple[list[dict], list[Any]]:
    """Where each state-dict entry lives in the module: the owning module's
    _parameters or _buffers, and its name there (two lists), so a put can
    look each up again and see whether it was replaced. An entry a
    state_dict hook made has no such place: its slot holds the planned
    tensor (checked by address and size only)."""
    where: dict[str, tuple[dict, str]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                where[head + name] = (m._parameters, name)
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                where[head + name] = (m._buffers, name)
    slots = [where.get(k) or ({k: t}, k) for k, t in zip(keys, leaves)]
    return [d for d, _ in slots], [k for _, k in slots]


class RecvPlan:
    """A receiver's kept plan for one layout (``Receiver.plan``); receiver side.

    ``Receiver.get(ticket, into=plan)`` writes every ticket of that layout
    into the same destinations and returns :attr:`result`: the caller's
    ``into=`` object, or the tensors the plan allocated. Not for concurrent
    gets (they would write the same tensors): gets of one plan take turns.

    Attributes:
        layout: the planned layout.
        layout_bytes: its encoding; a ticket must carry exactly these bytes.
        result: what every get returns (the same objects each time).
        total_nbytes: bytes one get moves (packed, one block).
    """

    def __init__(self, receiver: "Receiver", ticket: "Ticket", into: Any, allocate: Callable[[int], torch.Tensor]) -> None:
        with gc_paused():  # as SendPlan's
            self._make(receiver, ticket, into, allocate)

    def _make(self, receiver: "Receiver", ticket: "Ticket", into: Any, allocate: Callable[[int], torch.Tensor]) -> None:
        self._receiver = receiver
        layout = ticket.layout
        self.layout = layout
        self.layout_bytes = ticket.layout_bytes
        self.offsets, self.total_nbytes = packing.packed_offsets(layout.nbytes, layout.alignments)
        self.lock = threading.Lock()
        self._own: torch.Tensor | None = None
        self._watch: _Watch | None = None
        if into is None:
            # Destination tensors of our own: one buffer in the one-block
            # layout, so a planned sender's stream lands in it as it is.
            self._own = allocate(max(self.total_nbytes, 1))
            blocks = [self._own[: self.total_nbytes]] if self.total_nbytes else []
            targets = build_views(blocks, layout, packing.group_by_block(layout.nbytes, layout.alignments, [b.numel() for b in blocks]))
            self.result = unflatten(layout, targets)
        else:
            src = into.state_dict(keep_vars=True) if isinstance(into, torch.nn.Module) else into
            targets = match_into(layout, src)
            self.result = into
            leaves, ops, counts, keys, _ = flatten(src)
            names = list(src.keys()) if isinstance(src, dict) else None
            self._watch = _Watch(leaves, names, into if isinstance(into, torch.nn.Module) else None, ops, counts, keys)
        self._targets = targets
        # Views share their base's version counter: bumping the bases (and
        # the tensors that are no view) marks every target written. Tensors
        # made under torch.inference_mode() have no counter: torch skips
        # them, but only after ~140 ns each of its own loop, so they are
        # left out here, once (a worker's weights made that way cost no
        # marking at all).
        bases = {id(b): b for b in (t if t._base is None else t._base for t in targets)}
        self._versioned = [b for b in bases.values() if not b.is_inference()]
        ok = dense_host_mask(targets) if targets else np.zeros(0, dtype=bool)
        self._dst = target_addresses(targets, ok)
        n = layout.nbytes
        # Targets that cannot be written by address get a buffer each, kept.
        self._fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in np.flatnonzero(~ok & (n > 0)).tolist():
            staged = torch.empty(int(n[i]), dtype=torch.uint8)
            self._dst[i] = staged.data_ptr()
            self._fixups.append((staged, targets[i]))
        self._coords: dict[tuple[int, ...], _Coords] = {}
        self._aliased = bool(layout.aliases.size)

    def __repr__(self) -> str:
        kind = "own tensors" if self._own is not None else "into="
        return f"RecvPlan(num_tensors={self.layout.num_tensors:,}, total_nbytes={self.total_nbytes:,}, {kind})"

    def matches(self, into: Any) -> bool:
        """Whether ``into`` is made of this plan's targets' memory, nested
        the same way (a fresh ``state_dict()`` of the same model is), so
        this plan writes where ``get(into=into)`` would."""
        return self._watch is not None and self._watch.matches(into)

    @property
    def targets(self) -> list[torch.Tensor]:
        """The destination tensor of each sent tensor, in layout order."""
        return self._targets

    def mark_written(self) -> None:
        """Bump the targets' autograd version counters (the bytes land by
        address, which autograd cannot see): a backward that saved one of
        them raises instead of using the new values."""
        torch.autograd.graph.increment_version(self._versioned)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """:meth:`mark_written` around a get's bytes landing: done when the
        block exits (even by an error: a failed get may have written).
        Many separate targets are marked on a copy thread while the bytes
        move (100k counters: about 20 ms of C++ that need not wait)."""
        if len(self._versioned) < _MARK_ON_THREAD_MIN:
            self.mark_written()
            yield
            return
        future = executor().submit(self.mark_written)
        try:
            yield
        finally:
            finish(future, self.mark_written)

    def coords(self, block_nbytes: tuple[int, ...]) -> "_Coords":
        """The copy runs from a stream of blocks of these sizes (cached)."""
        c = self._coords.get(block_nbytes)
        if c is None:
            if len(block_nbytes) <= 1:
                pos = self.offsets
            else:
                layout = self.layout
                groups = packing.group_by_block(layout.nbytes, layout.alignments, list(block_nbytes))
                start = np.zeros(len(block_nbytes), dtype=np.int64)
                start[1:] = np.cumsum(np.asarray(block_nbytes, dtype=np.int64))[:-1]
                block_of = np.repeat(np.arange(len(block_nbytes)), np.diff(groups.bounds))
                pos = start[block_of] + groups.offsets
            c = _Coords(CopyPlan.build(self._dst, pos, self.layout.nbytes), sum(block_nbytes))
            self._coords[block_nbytes] = c
        return c

    def own_window(self, lo: int, hi: int) -> torch.Tensor | None:
        """Our own buffer's bytes ``[lo, hi)`` of the one-block stream, if
        the plan owns its destination (the stream lands there as it is)."""
        return None if self._own is None else self._own[lo:hi]

    def finish(self) -> None:
        """After the bytes landed: targets that are not dense host memory
        get their staged bytes; untied aliases get a copy."""
        if self._fixups:
            copy_staged(self._fixups)
        if self._aliased:
            fill_aliases(self.layout, self._targets)

    def check(self, receiver: "Receiver", ticket: "Ticket") -> None:
        """Raise unless ``ticket`` carries this plan's layout (bytes compared,
        nothing decoded) and the plan belongs to ``receiver``.

        Raises:
            ConfigurationError: another receiver's plan.
            LayoutMismatchError: another layout; names what differs.
        """
        if receiver is not self._receiver:
            raise ConfigurationError("get(into=plan): this plan was made by another Receiver; make one with this receiver's plan()")
        if self._watch is not None:
            self._watch.check("get(into=plan)", "receiver.plan(ticket, into=...)")
        if ticket.layout_bytes != self.layout_bytes or ticket.total_nbytes != self.total_nbytes:
            raise LayoutMismatchError(
                f"get(into=plan): the ticket's layout is not the plan's: {_difference(self.layout, ticket)}; "
                "nothing was written: make a new plan for this layout (receiver.plan(ticket, into=...))"
            )


class _Coords:
    """A plan's runs from one stream geometry, and (lazily) the same runs
    as a list of buffers covering the whole stream (tcp's scatter list)."""

    def __init__(self, copy: CopyPlan, total: int) -> None:
        self.copy = copy
        self.total = total
        self.small = many_small_runs(copy.nbytes)  # moved faster by preadv than memmove
        self._segments: _BufferList | None = None

    def execute_window(self, lo: int, hi: int, src_base: int) -> None:
        """Copy stream bytes ``[lo, hi)``, found at address ``src_base + lo``, to their targets."""
        self.copy.execute_window(lo, hi, 0, src_base)

    def segments(self, lo: int, hi: int) -> list[memoryview]:
        """Buffers that receive stream bytes ``[lo, hi)`` in order: the
        targets' memory, and a scratch for the gaps between them."""
        if self._segments is None:
            c = self.copy
            order = np.argsort(c.src, kind="stable")
            self._segments = _BufferList(c.src[order], c.dst[order], c.nbytes[order], self.total)
        return self._segments.window(lo, hi)


class _BufferList:
    """A byte stream ``[0, total)`` as buffers over host memory, made once:
    run ``i`` (stream bytes from ``pos[i]``, ``nbytes[i]`` long, ascending
    and apart) is the memory at ``address[i]``; the gaps between runs (and
    after the last) share one scratch (zeros to send, or bytes to drop).
    :meth:`window` cuts the list to any range without touching the rest."""

    def __init__(self, pos: np.ndarray, address: np.ndarray, nbytes: np.ndarray, total: int) -> None:
        bufs: list[memoryview] = []
        starts: list[int] = []
        gaps: list[tuple[int, int]] = []
        at = 0
        for p, a, n in zip(pos.tolist(), address.tolist(), nbytes.tolist()):
            if p > at:
                gaps.append((len(bufs), p - at))
                bufs.append(memoryview(b""))
                starts.append(at)
            bufs.append(_buffer_at(a, n))
            starts.append(p)
            at = p + n
        if at < total:
            gaps.append((len(bufs), total - at))
            bufs.append(memoryview(b""))
            starts.append(at)
        self.scratch = bytearray(max((k for _, k in gaps), default=0))
        for i, k in gaps:
            bufs[i] = memoryview(self.scratch)[:k]
        self.bufs = bufs
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = self.starts + np.fromiter(map(len, bufs), dtype=np.int64, count=len(bufs))

    def window(self, lo: int, hi: int) -> list[memoryview]:
        """The buffers of stream bytes ``[lo, hi)``, the first and last cut to it."""
        first = int(np.searchsorted(self.ends, lo, side="right"))
        last = int(np.searchsorted(self.starts, hi, side="left"))
        out = self.bufs[first:last]
        if out:
            s0, s1, e1 = int(self.starts[first]), int(self.starts[last - 1]), int(self.ends[last - 1])
            if s0 < lo or e1 > hi:
                if len(out) == 1:
                    out[0] = out[0][max(lo, s0) - s0 : min(hi, e1) - s0]
                else:
                    out[0] = out[0][max(lo, s0) - s0 :]
                    out[-1] = out[-1][: min(hi, e1) - s1]
        return out


def _difference(layout: Layout, ticket: "Ticket") -> str:
    """What differs between the planned layout and a ticket's (decoded
    here, on the error path only)."""
    try:
        other = ticket.layout
    except Exception as exc:  # a ticket's layout that does not decode
        return f"its layout does not decode ({exc})"
    if other.num_tensors != layout.num_tensors:
        return f"{other.num_tensors:,} tensors sent, {layout.num_tensors:,} planned"
    if other.keys != layout.keys:
        for i, (a, b) in enumerate(zip(other.keys, layout.keys)):
            if a != b:
                return f"key #{i} is {a!r}, planned {b!r}"
        return f"{len(other.keys)} keys sent, {len(layout.keys)} planned"
    codes = np.flatnonzero(other.dtype_codes != layout.dtype_codes)
    if codes.size:
        i = int(codes[0])
        return f"tensor #{i} is {other.dtype_names()[i]}, planned {layout.dtype_names()[i]} ({codes.size:,} dtypes differ)"
    a, b = other.shapes(), layout.shapes()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"tensor #{i} has shape {tuple(x)}, planned {tuple(y)}"
    return "the nesting or the tied tensors differ"
