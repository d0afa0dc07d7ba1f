"""``SendPlan``: a sender's kept (or one-shot) plan of one object."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..copy import (
    PARALLEL_MIN_NBYTES as _PARALLEL_GATHER_NBYTES,
)
from ..copy import (
    CopyPlan,
    copy_converting,
    copy_threads,
    copy_values,
    leaf_runs,
    many_small_runs,
    pack_leaves,
    run_parts,
)
from ..errors import ConfigurationError, PoolExhaustedError, UnsupportedTensorError
from ..memory import Block
from ..tensors import flatten, gc_paused, inspect_leaves
from ..wire import Boxes, Layout, packing
from ._buffers import BufferList, buffer_at
from ._cast import conversion_runs, converted_layout
from ._delta import BF16, RAW, DeltaVersion, Values, bf16_nan
from ._watch import PUT, Watch

if TYPE_CHECKING:
    from ..memory import MemoryPool, Packed

__all__ = ["SendPlan", "SourcedPiece"]


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
    """A sender's plan of one object, kept (``Sender.plan``) or one-shot
    (``Sender.put(obj)``); sender side.

    Every put executes a plan. A kept plan holds the planned tensors (they
    stay alive as long as the plan does) and replays their copy into the
    pool on every ``Sender.put(plan)``; it watches them (a put checks they
    did not move), and where they are views of a few storages it holds
    those storages too: memory a tensor leaves (``.data =``,
    ``module.to()``) stays allocated until the plan is dropped or a put
    finds it stale. A one-shot plan (``kept=False``) is made by a fresh put
    and used once: it inspects the object once and skips the watch and the
    held storages; its copy runs are built for the placement it gets (a
    fragmented pool may take it in several blocks), or once over its
    one-block layout when it is streamed.

    Args:
        pool: the pool the plan fills (the plan never reaches the sender).
        obj: a tensor, any nesting of lists, tuples and dicts of them, or
            an ``nn.Module`` (planned over its ``state_dict()``).
        dtype: send floating-point tensors as this dtype (see ``Sender.plan``).
        kept: a kept plan (watched, replayed) or a one-shot one.
        owner: what a put checks the plan against (the sender's ledger): a
            plan serves only the sender that made it.
        delta: a kept plan that keeps the version it last sent and offers
            receivers holding it the changes only (``plans/_delta.py``).

    Attributes:
        source: the object planned (an ``nn.Module``, or the tensors' nesting).
        layout: what receivers get: the tensors' dtypes (after ``dtype=``),
            shapes and nesting.
        layout_bytes: the encoded layout, reused by every ticket.
        total_nbytes: the packed size of one put.
        num_tensors: planned tensors (tied names counted once each).
        delta: the kept version of a delta plan (None for any other).
    """

    def __init__(self, pool: "MemoryPool", obj: Any, *, dtype: torch.dtype | None = None, kept: bool = True, owner: object = None,
                 delta: bool = False) -> None:
        # Planning makes Python objects per tensor (shapes, storages): with
        # the collector paused, 100k of them set off no collections over
        # everything alive.
        with gc_paused():
            self._make(pool, obj, dtype, kept, owner)
        self.delta = DeltaVersion(pool, self.layout, self.offsets, self.total_nbytes) if delta and kept else None

    def _make(self, pool: "MemoryPool", obj: Any, dtype: torch.dtype | None, kept: bool, owner: object) -> None:
        self.pool = pool
        self.owner = owner
        self.kept = kept
        self.source = obj  # what was planned (a module, or the object itself)
        module = obj if isinstance(obj, torch.nn.Module) else None
        src = module.state_dict(keep_vars=True) if module is not None else obj
        boxes: list = []  # shards (DTensors, Box): their local tensors are the leaves
        leaves, ops, counts, keys, staged = flatten(src, boxes)
        info = inspect_leaves(src, leaves, ops, counts, keys)
        if boxes:
            info = info._replace(layout=dataclasses.replace(info.layout, boxes=Boxes.of(boxes)))
        if staged and kept:
            raise UnsupportedTensorError(
                f"{staged} numpy arrays are read-only or have negative strides, so torch cannot share their memory; "
                "a plan would send the copy made now on every put: pass writable, C-ordered arrays (np.ascontiguousarray(a).copy())"
            )
        self._staged = staged  # numpy arrays flatten copied (a one-shot plan sends the copy)
        sent, convert = converted_layout(info.layout, dtype)
        self.layout: Layout = sent
        self.layout_bytes: bytes = sent.to_bytes()
        self.offsets, self.total_nbytes = packing.packed_offsets(sent.nbytes, sent.alignments)
        self.num_tensors = len(leaves)
        self.dtype = dtype
        self._convert = convert
        self._converting = bool(convert.any())
        self._leaves = leaves
        keys_of = list(src.keys()) if isinstance(src, dict) else None
        # The copy sees converted leaves as values (not raw bytes) and the
        # layout's dtype as their destination type.
        self._info = info._replace(layout=sent, raw=info.raw & ~convert)
        self._inspected = info  # as found: what the conversions read
        self._host = info.all_cpu and pool.device.type == "cpu"
        # A sharded module's slots hold DTensors, not the local leaves: the
        # watch checks the DTensors there (FSDP2's, while sharded).
        slotted = list(src.values()) if boxes and module is not None and keys_of is not None and len(keys_of) == len(leaves) else None
        module = module if slotted is not None or not boxes else None
        self._watch = Watch(leaves, keys_of, module, ops, counts, keys, hold=self._host, slotted=slotted) if kept else None
        self.puts = 0  # puts of a kept plan: the version its tickets carry
        self._copy: CopyPlan | None = None
        self._sources: BufferList | None = None
        self._gather: list[list[tuple[int, int, list[torch.Tensor]]]] | None = None
        self._vectored = False
        if kept:
            self._runs()  # a kept plan pays for its runs once, when made

    def _runs(self) -> CopyPlan:
        """The copy runs over the one-block layout (built once): by address
        on the host (with the conversions and value copies apart), by
        storage on a device."""
        if self._copy is None:
            if not self._host:
                self._copy = leaf_runs(self._leaves, self._info, self.offsets, host=False)
                return self._copy
            copy = CopyPlan.build(self.offsets, self._info.data_ptrs, self.layout.nbytes, raw=self._info.raw)
            self._conversions, converted = conversion_runs(self._leaves, self._inspected, self.layout, self.offsets, self._convert)
            self._values = np.setdiff1d(copy.elementwise, converted)
            # Vectored writes pay for a buffer per run once: only a kept plan gains.
            self._vectored = self.kept and many_small_runs(copy.nbytes)
            self._copy = copy
        return self._copy

    def __repr__(self) -> str:
        kind = "kept" if self.kept else "one-shot"
        runs = self.copy_runs if self._host and self._copy is not None else "device" if not self._host else "unbuilt"
        return f"SendPlan({kind}, num_tensors={self.num_tensors:,}, total_nbytes={self.total_nbytes:,}, dtype={self.dtype}, copy_runs={runs})"

    @property
    def copy_runs(self) -> int:
        """Copies one snapshot put issues (merged runs, conversion runs, value copies)."""
        if not self._host:
            return self.num_tensors
        copy = self._runs()
        return copy.num_runs + len(self._conversions) + int(self._values.size)

    # -- what put() calls ------------------------------------------------------------------

    def check(self, owner: object, *, tensors: bool = True) -> None:
        """Raise unless this plan belongs to ``owner`` (the putting sender's
        ledger) and (``tensors``, kept plans) its tensors are still where it
        found them: the same objects in the module (if one was planned), at
        the same addresses, of the same sizes. A few C-level passes over the
        tensors, no Python per tensor but for a module's slots. A snapshot
        put leaves the tensors to :meth:`fill_checked`, which checks them
        while the bytes move.

        Raises:
            ConfigurationError: another sender's plan.
            PlanStaleError: a tensor moved, was replaced or resized.
        """
        if owner is not self.owner:
            raise ConfigurationError("put(plan): this plan was made by another Sender; make one with this sender's plan()")
        if tensors and self._watch is not None:
            self._watch.check(*PUT)

    def place(self, *, one_block: bool) -> "Packed":
        """The whole object in the pool now (sender side). A kept plan, or
        ``one_block`` (a broadcast: relays pass on one stream), takes one
        block of the one-block layout, filled from the kept runs; a one-shot
        plan takes as few blocks as the free space allows (the pool places
        it and copies it by the runs of that placement).

        Raises:
            PoolExhaustedError: it does not fit now; nothing held (a kept
                plan checks its tensors first: a stale plan says so).
            PlanStaleError: a kept plan's tensor moved (the block is free again).
        """
        if self.delta is not None:
            # A delta plan compares its values with its kept version and
            # serves that (one block: a broadcast's too), where it can
            # (plans/_delta.py).
            served = self.delta.place(self.value_runs(), lambda: self.check(self.owner), self.layout,
                                      lambda out: self.fill(out, 0, self.total_nbytes))
            if served is not None:
                return served  # type: ignore[return-value]
        try:
            if self.kept or one_block or self._converting:
                return self.pool.pack_with(self.layout, self.total_nbytes, self.fill_checked, num_tensors=self.num_tensors)
            return self.pool.place(self._leaves, self._info, staged=self._staged)
        except PoolExhaustedError:
            # No block, so fill_checked never ran: a stale plan says so (not
            # that the pool is full), before its pieces are streamed.
            self.check(self.owner)
            raise

    def piece_packer(self) -> Callable[[int, int], "Packed"]:
        """``pack(voffset, nbytes) -> Packed``: one piece of a streamed put,
        a block of the pool filled with the window of the plan's runs that
        falls in ``[voffset, voffset + nbytes)`` (no per-piece rebuild)."""
        nbytes, offsets = self.layout.nbytes, self.offsets
        self._runs()
        # Starts and ends both ascend (packed offsets): a piece's tensors
        # are counted by two binary searches, not a pass over all of them.
        ends = offsets + nbytes
        nonempty = np.concatenate([[0], np.cumsum(nbytes > 0)])

        def pack(voffset: int, size: int) -> "Packed":
            first = int(np.searchsorted(ends, voffset, side="right"))
            last = int(np.searchsorted(offsets, voffset + size, side="left"))
            count = int(nonempty[max(last, first)] - nonempty[first])
            return self.pool.pack_with(self.layout, size, lambda out: self.fill(out, voffset, voffset + size), num_tensors=count)

        return pack

    def fill_checked(self, out: torch.Tensor) -> tuple[int, int]:
        """:meth:`fill` of the whole object into ``out``, with the check of
        :meth:`check` (kept plans): before the copy, or, when the tensors
        live in a few storages (views of flat buffers), while it runs. Those
        storages are checked first (the plan holds them, so every byte the
        copy reads by the planned addresses is theirs, whatever the tensors
        show; tensors copied value by value are read through the tensors as
        they are), then the tensors one by one on another thread as the
        bytes move: the pass over 100k tensors (10 to 25 ms, most of it
        cache misses after a training step touched GiBs) takes no time of
        its own where a core is free for it (on 2 cores, both copying, it
        gains nothing measurable). A stale tensor raises after the copy;
        the caller frees the block, nothing was sent.

        Raises:
            PlanStaleError: a tensor moved, was replaced or resized.
        """
        if self._watch is None:
            return self.fill(out, 0, self.total_nbytes)
        return self._watch.guarded(lambda: self.fill(out, 0, self.total_nbytes), *PUT, overlap=self._host)

    def matches(self, obj: Any) -> bool:
        """Whether ``obj`` is made of the planned tensors' memory, nested
        the same way (a fresh ``state_dict()`` of the same model is): its
        tensors may then be sent by this plan. One flatten of ``obj`` and a
        few C-level passes. A one-shot plan matches nothing (it keeps no watch)."""
        return self._watch is not None and self._watch.matches(obj)

    def fill(self, out: torch.Tensor, lo: int, hi: int) -> tuple[int, int]:
        """Write bytes ``[lo, hi)`` of the packed object into ``out`` (a pool
        block of ``hi - lo`` bytes): the runs by address, conversions a run
        at a time, the rest value by value. Returns ``(copies, value copies)``."""
        copy = self._runs()
        if not self._host:
            return pack_leaves(self._leaves, self._info, self.offsets, out, lo, hi, runs=copy)
        whole = lo == 0 and hi >= self.total_nbytes
        if self._vectored and whole:
            # Many small runs, the whole object: torch.cat of the runs (a
            # C++ loop of memcpy; 100k runs of 10 KiB: 102 ms here against
            # 193 ms for a memmove a run and 143 ms for pwritev, and 78 ms
            # for one memcpy), a part per copy thread (cat runs without the GIL).
            run_parts(_cat_into, [(out, part) for part in self._gathers()])
            runs = copy.num_runs
        elif self._vectored and self.pool.fd is not None:
            # A piece of a streamed put: the window of the runs by pwritev.
            # Gaps (and the places of converted or value-copied tensors,
            # written below) get zeros: every byte of [lo, hi) is written.
            self.pool.write_buffers(out.data_ptr() - self.pool.data_ptr, self._run_buffers().window(lo, hi))
            runs = copy.num_runs
        elif whole:
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

    def value_runs(self) -> "Values | None":
        """The packed object's current values as runs by address (raw, or
        float32 cast to bfloat16 on the way), for a delta plan's compare;
        None where some bytes are not readable so (a device, a value-by-value
        copy, another cast, no C conversion that matches torch)."""
        if not self._host:
            return None
        c = self._runs()
        if self._values.size:
            return None
        pos, addr, n, kinds = [c.dst], [c.src], [c.nbytes], [np.full(c.num_runs, RAW, dtype=np.int64)]
        nan = bf16_nan() if self._conversions else 0x7FC0
        for start, nbytes, dt, src in self._conversions:
            if dt != torch.bfloat16 or src.dtype != torch.float32 or nan is None:
                return None
            pos.append(np.array([start])), addr.append(np.array([src.data_ptr()])), n.append(np.array([nbytes])), kinds.append(np.array([BF16]))
        p = np.concatenate(pos).astype(np.int64)
        order = np.argsort(p, kind="stable")
        return Values(p[order], np.concatenate(addr).astype(np.int64)[order], np.concatenate(n).astype(np.int64)[order],
                      np.concatenate(kinds)[order], nan)

    def sourced_pieces(self, piece_nbytes: int) -> list["SourcedPiece"]:
        """The object in pieces of ``piece_nbytes`` served from the tensors'
        own memory (a ``snapshot=False`` put); the buffers are built now, so
        a plan that cannot be served so is refused here, not mid-transfer.

        Raises:
            ConfigurationError: as :meth:`source_buffers`.
        """
        self.source_buffers(0, 0)
        total = self.total_nbytes
        return [SourcedPiece(self, s, min(s + piece_nbytes, total)) for s in range(0, total, piece_nbytes)]

    def source_buffers(self, lo: int, hi: int) -> list[memoryview]:
        """Bytes ``[lo, hi)`` of the packed object as buffers of the
        tensors' own memory (and zeros for alignment gaps): what a
        ``snapshot=False`` put serves. Built once per plan.

        Raises:
            ConfigurationError: the plan converts dtypes, or has tensors
                that are not dense host memory (their bytes are not their values).
        """
        if not self._host or self._converting or self._runs().elementwise.size:
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
        d, s, n, _ = self._runs().window(lo, hi, by_dst=True)
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
            c = self._runs()
            stretches: list[tuple[int, int, list[torch.Tensor]]] = []
            zeros = torch.zeros(_BRIDGE_NBYTES, dtype=torch.uint8)
            for d, s, n in zip(c.dst.tolist(), c.src.tolist(), c.nbytes.tolist()):
                part = torch.frombuffer(buffer_at(s, n), dtype=torch.uint8)
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

    def _run_buffers(self) -> "BufferList":
        """The packed object as buffers of the raw runs' memory, zeros between (made once)."""
        if self._sources is None:
            c = self._runs()
            self._sources = BufferList(c.dst, c.src, c.nbytes, self.total_nbytes)
        return self._sources


class SourcedPiece:
    """A piece of a ``snapshot=False`` put: served from the tensors' own
    memory, so it holds no pool block. What a server serves, as a pool
    :class:`~tensorferry.pool.Packed` is (the ``Held`` protocol of
    :mod:`tensorferry.transports._base`: ``blocks``, ``buffers()``,
    ``runs()``, ``release()``)."""

    def __init__(self, plan: SendPlan, lo: int, hi: int) -> None:
        self.plan, self.lo, self.hi = plan, lo, hi
        # Offsets relative to the piece: the receiver checks them against
        # the sender's pool size, which a piece never exceeds.
        self.blocks: tuple[Block, ...] = (Block(0, hi - lo),)

    def buffers(self) -> list[memoryview]:
        return self.plan.source_buffers(self.lo, self.hi)

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(position in the piece, address, length) of the piece's runs in
        this process's memory (shm readers copy them out themselves)."""
        pos, addr, n = self.plan.source_runs(self.lo, self.hi)
        return pos - self.lo, addr, n

    def release(self) -> None:
        """Nothing to free: the bytes are the caller's tensors."""
