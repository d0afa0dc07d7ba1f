"""``RecvPlan``: a receiver's plan for one layout, kept or one-shot.

Every get executes one: ``get(t, into=plan)`` a kept plan
(``Receiver.plan``), any other get a one-shot plan made from its ticket,
which skips what only a kept plan needs (the watch over its targets, the
deduplicated version counters, a destination allocated before any byte
is known to come).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..copy import (
    CopyPlan,
    copy_staged,
    dense_host_mask,
    executor,
    fill_aliases,
    finish,
    many_small_runs,
    stage_rest,
    target_addresses,
)
from ..errors import ConfigurationError, LayoutMismatchError
from ..memory import build_views
from ..tensors import flatten, gc_paused, mark_written, match_into, unflatten
from ..wire import Layout, packing
from ._buffers import BufferList
from ._watch import Watch

if TYPE_CHECKING:
    from ..wire import Ticket

__all__ = ["RecvPlan"]

# A receive plan with this many separately versioned targets bumps their
# counters on a copy thread while the bytes land.
_MARK_ON_THREAD_MIN = 4096

# A result made of views not yet nested as the sender put them.
_UNNESTED = object()

# Destination blocks for these block sizes, and whether they are fresh
# (new memory, not yet faulted in).
Allocate = Callable[[list[int]], tuple[list[torch.Tensor], bool]]


class RecvPlan:
    """A receiver's plan for one layout; receiver side.

    ``Receiver.get(ticket, into=plan)`` writes every ticket of that layout into
    the same destinations and returns
    [``result``][tensorferry.plans.RecvPlan.result]: the caller's ``into=``
    object, or the tensors the plan allocated. Not for concurrent gets (they
    would write the same tensors): gets of one plan take turns.

    Made by ``Receiver.plan`` (kept) or, for any other get, by
    ``one_shot``.

    Attributes:
        layout: the planned layout.
        layout_bytes: its encoding; a ticket must carry exactly these bytes.
        result: what every get returns (the same objects each time).
        total_nbytes: bytes one get moves (packed, one block).
        kept: made to be replayed (``Receiver.plan``), not for one get.
    """

    def __init__(self, owner: object, ticket: "Ticket", into: Any, allocate: Allocate) -> None:
        with gc_paused():  # as SendPlan's
            self._make(owner, ticket.layout, ticket.layout_bytes, into, allocate, kept=True)

    @classmethod
    def one_shot(cls, owner: object, layout: Layout, layout_bytes: bytes, into: Any, allocate: Allocate) -> "RecvPlan":
        """The plan of one get (``into=`` tensors or a module, or ``None``:
        destination blocks from ``allocate`` once the sender has located
        the bytes, in the ticket's own block sizes)."""
        plan = cls.__new__(cls)
        plan._make(owner, layout, layout_bytes, into, allocate, kept=False)
        return plan

    def _make(self, owner: object, layout: Layout, layout_bytes: bytes, into: Any, allocate: Allocate, *, kept: bool) -> None:
        self._owner = owner
        self.kept = kept
        self.layout = layout
        self.layout_bytes = layout_bytes
        self.offsets, self.total_nbytes = packing.packed_offsets(layout.nbytes, layout.alignments)
        self.lock = threading.Lock()
        self._allocate = allocate
        self._own: list[torch.Tensor] | None = None
        self._own_sizes: tuple[int, ...] = ()
        self._fresh = False
        self._watch: Watch | None = None
        self._result: Any = None
        self._into = into is not None
        # The delta version (plans/_delta.py) the targets hold: the id from
        # the ticket of the last get that completed into them; 0: none.
        self.version = 0
        targets: list[torch.Tensor] = []
        if into is None:
            if kept:
                # Destination tensors of our own: one buffer in the one-block
                # layout, so a planned sender's stream lands in it as it is.
                blocks, _ = allocate([max(self.total_nbytes, 1)])
                self._own, self._own_sizes = [blocks[0][: self.total_nbytes]], (self.total_nbytes,)
                self.adopt(self._own if self.total_nbytes else [])
                targets = self._targets
        else:
            module = into if isinstance(into, torch.nn.Module) else None
            src = into.state_dict(keep_vars=True) if module is not None else into
            targets = match_into(layout, src)
            self._result = into
            if kept:
                leaves, ops, counts, keys, _ = flatten(src)
                names = list(src.keys()) if isinstance(src, dict) else None
                self._watch = Watch(leaves, names, module, ops, counts, keys)
        self._targets = targets
        if kept:
            # Views share their base's version counter: bumping the bases (and
            # the tensors that are no view) marks every target written. Tensors
            # made under torch.inference_mode() have no counter: torch skips
            # them, but only after ~140 ns each of its own loop, so they are
            # left out here, once (a worker's weights made that way cost no
            # marking at all).
            bases = {id(b): b for b in (t if t._base is None else t._base for t in targets)}
            self._versioned = [b for b in bases.values() if not b.is_inference()]
        else:
            self._versioned = targets
        # Targets that cannot be written by address (strided, conjugated,
        # on a device) get a buffer each when a run must land somewhere: a
        # kept plan's up front, kept; a one-shot plan's only if its route
        # needs them (a whole object in memory here is copied into them by
        # torch straight from its blocks). A plan that allocates has no
        # targets before its get: its bytes land in its own memory as they
        # are, never by runs.
        self._ok = dense_host_mask(targets) if targets else np.zeros(0, dtype=bool)
        self._dst = target_addresses(targets, self._ok)
        self._fixups: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if not targets or bool(self._ok.all()):
            self._fixups = []
        elif kept:
            self._fixups = stage_rest(targets, layout.nbytes, self._ok, self._dst)
        self._coords: dict[tuple[int, ...], _Coords] = {}
        self._direct: dict[tuple[int, ...], CopyPlan] = {}
        self._aliased = bool(layout.aliases.size) and bool(targets)

    def __repr__(self) -> str:
        kind = "into=" if self._into else "own tensors"
        return f"RecvPlan(num_tensors={self.layout.num_tensors:,}, total_nbytes={self.total_nbytes:,}, {kind}{'' if self.kept else ', one-shot'})"

    @property
    def result(self) -> Any:
        """What a get of this plan returns: the ``into=`` object, or the
        plan's own tensors, nested as the sender put them."""
        if self._result is _UNNESTED:
            self._result = unflatten(self.layout, self._targets)
        return self._result

    def matches(self, into: Any) -> bool:
        """Whether ``into`` is made of this plan's targets' memory, nested
        the same way (a fresh ``state_dict()`` of the same model is), so
        this plan writes where ``get(into=into)`` would."""
        return self._watch is not None and self._watch.matches(into)

    @property
    def targets(self) -> list[torch.Tensor]:
        """The destination tensor of each sent tensor, in layout order
        (a one-shot plan of its own: once the bytes have a destination)."""
        return self._targets

    def mark_written(self) -> None:
        """Bump the targets' autograd version counters (the bytes land by
        address, which autograd cannot see): a backward that saved one of
        them raises instead of using the new values."""
        if self._versioned:
            mark_written(self._versioned)

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """:meth:`mark_written` around a get's bytes landing: done when the
        block exits (even by an error: a failed get may have written).
        Many separate targets are marked on a copy thread while the bytes
        move (75k counters: about 2 ms of C++ that need not wait)."""
        if len(self._versioned) < _MARK_ON_THREAD_MIN:
            self.mark_written()
            yield
            return
        future = executor().submit(self.mark_written)
        try:
            yield
        finally:
            finish(future, self.mark_written)

    # -- destinations ------------------------------------------------------------------

    @property
    def allocates(self) -> bool:
        """A one-shot plan without ``into=``: its destination is allocated
        by the get, in the ticket's block sizes, and its result is views
        of whatever memory the bytes land in."""
        return not self.kept and not self._into

    def owns(self, block_nbytes: tuple[int, ...]) -> bool:
        """Whether a stream of blocks of these sizes lands in the plan's own
        memory as it is: a one-shot plan without ``into=`` allocates in the
        ticket's sizes; a kept one holds the one-block layout."""
        if self._into:
            return False
        return not self.kept or len(block_nbytes) <= 1

    def own_dests(self, block_nbytes: tuple[int, ...], lo: int, blocks: list[tuple[int, int]]) -> tuple[list[torch.Tensor], bool]:
        """Destinations of acquired ``blocks`` (stream bytes from ``lo`` on)
        in the plan's own memory (see :meth:`owns`), and whether that memory
        is fresh. A one-shot plan allocates it here, at its first piece:
        only once the sender located the bytes, so a forged size never
        sizes an allocation on its own."""
        if self._own is None:
            self._own, self._fresh = self._allocate(list(block_nbytes))
            self._own_sizes = block_nbytes
        if len(self._own_sizes) > 1:
            return self._own, self._fresh  # the whole ticket, block by block
        whole, dests, at = self._own[0], [], lo
        for _, n in blocks:
            dests.append(whole[at : at + n])
            at += n
        return dests, self._fresh

    def adopt(self, blocks: list[torch.Tensor]) -> None:
        """Make the result views of ``blocks`` (the plan's own memory, a
        relay's stream, the sender's mapped pool): no copy."""
        layout = self.layout
        groups = packing.group_by_block(layout.nbytes, layout.alignments, [b.numel() for b in blocks])
        with gc_paused():
            self._targets = build_views(blocks, layout, groups)
        # Nested when first asked for: not while a receive loop that needs
        # the GIL is still filling the blocks.
        self._result = _UNNESTED

    def adopt_own(self) -> None:
        """:meth:`adopt` the memory :meth:`own_dests` allocated."""
        self.adopt(self._own or [])

    def _positions(self, block_nbytes: tuple[int, ...]) -> np.ndarray:
        """Each tensor's position in a stream of blocks of these sizes."""
        if len(block_nbytes) <= 1:
            return self.offsets
        layout = self.layout
        groups = packing.group_by_block(layout.nbytes, layout.alignments, list(block_nbytes))
        start = np.zeros(len(block_nbytes), dtype=np.int64)
        start[1:] = np.cumsum(np.asarray(block_nbytes, dtype=np.int64))[:-1]
        block_of = np.repeat(np.arange(len(block_nbytes)), np.diff(groups.bounds))
        return start[block_of] + groups.offsets

    def coords(self, block_nbytes: tuple[int, ...]) -> "_Coords":
        """The copy runs from a stream of blocks of these sizes (cached),
        every target written by address (or its staged buffer)."""
        c = self._coords.get(block_nbytes)
        if c is None:
            if self._fixups is None:
                self._fixups = stage_rest(self._targets, self.layout.nbytes, self._ok, self._dst)
            c = _Coords(CopyPlan.build(self._dst, self._positions(block_nbytes), self.layout.nbytes), sum(block_nbytes))
            self._coords[block_nbytes] = c
        return c

    def copy_from(self, blocks: list[torch.Tensor], block_nbytes: tuple[int, ...]) -> None:
        """The whole stream, held here in ``blocks`` (host memory, one 1-D
        uint8 tensor a block: the mapped pool's, a relay's stream), into
        the targets: by the runs where a target is written by address; a
        one-shot plan's other targets by torch straight from the blocks,
        no staged buffer."""
        if self._fixups is not None:
            coords, pos = self.coords(block_nbytes), 0
            for b, n in zip(blocks, block_nbytes):
                coords.execute_window(pos, pos + n, b.data_ptr() - pos)
                pos += n
            return
        plan = self._direct.get(block_nbytes)
        positions = self._positions(block_nbytes)
        if plan is None:
            plan = self._direct[block_nbytes] = CopyPlan.build(self._dst, positions, self.layout.nbytes, raw=self._ok)
        pos = 0
        for b, n in zip(blocks, block_nbytes):
            plan.execute_window(pos, pos + n, 0, b.data_ptr() - pos)
            pos += n
        rest = plan.elementwise
        if rest.size:
            starts = np.cumsum(np.asarray(block_nbytes, dtype=np.int64)) - np.asarray(block_nbytes, dtype=np.int64)
            at = positions[rest]
            which = np.searchsorted(starts, at, side="right") - 1
            nbytes = self.layout.nbytes
            copy_staged([(blocks[b][p - starts[b] : p - starts[b] + nbytes[i]], self._targets[i])
                         for i, b, p in zip(rest.tolist(), which.tolist(), at.tolist())])

    def finish(self) -> None:
        """After the bytes landed: targets that are not dense host memory
        get their staged bytes; untied aliases get a copy."""
        if self._fixups:
            copy_staged(self._fixups)
        if self._aliased:
            fill_aliases(self.layout, self._targets)

    def check(self, owner: object, ticket: "Ticket") -> None:
        """Raise unless ``ticket`` carries this plan's layout (bytes compared,
        nothing decoded) and the plan belongs to ``owner`` (its receiver's
        token).

        Raises:
            ConfigurationError: another receiver's plan.
            LayoutMismatchError: another layout; names what differs.
        """
        if owner is not self._owner:
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
        self._segments: BufferList | None = None

    def execute_window(self, lo: int, hi: int, src_base: int) -> None:
        """Copy stream bytes ``[lo, hi)``, found at address ``src_base + lo``, to their targets."""
        self.copy.execute_window(lo, hi, 0, src_base)

    def segments(self, lo: int, hi: int) -> list[memoryview]:
        """Buffers that receive stream bytes ``[lo, hi)`` in order: the
        targets' memory, and a scratch for the gaps between them."""
        if self._segments is None:
            c = self.copy
            order = np.argsort(c.src, kind="stable")
            self._segments = BufferList(c.src[order], c.dst[order], c.nbytes[order], self.total)
        return self._segments.window(lo, hi)



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
