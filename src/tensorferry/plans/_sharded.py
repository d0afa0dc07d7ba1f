"""``ShardedPlan``: a receiver's plan over the tickets of several source
ranks, each holding boxes (shards) of the same global tensors.

``Receiver.plan(tickets, into=target)`` makes one; ``Receiver.get(tickets,
into=plan)`` replays it. Made once: every target box (a DTensor's local
shard, a :class:`~tensorferry.Box`, or a plain tensor, which is its whole
global tensor) is cut by the edges of the source boxes of the same key;
each cut is taken from one source that holds it (where several hold it,
replicated placements, receivers spread over them), and becomes byte runs:
(tensor, byte within its packed bytes) on the source's side, an address in
the target's local tensor on this side. A get reads exactly those bytes
from each source (the channel's ``read_ranges``), all sources at once.

Everything that can disagree is found before any byte moves: a key on one
side only, global shapes or dtypes that differ, a target region no source
holds, tickets of different versions mixed.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import ConfigurationError, LayoutMismatchError, UnsupportedTensorError
from ..shards import Box
from ..tensors import dtype_code, flatten, gc_paused, listed, mark_written, unflatten
from ..wire import Boxes, Layout, box_runs, cover, packing, region
from ._delta_sharded import SourceDelta
from ._watch import Watch

if TYPE_CHECKING:
    from ..wire import Ticket

__all__ = ["ShardedPlan"]

_SHOWN_PROBLEMS = 8

Runs = tuple[np.ndarray, np.ndarray, np.ndarray]  # (stream position, address, nbytes)


class _Source:
    """One source rank's ticket as planned: its layout and, per byte run
    this receiver reads from it, the tensor, the byte within the tensor,
    the address here and the length."""

    def __init__(self, ticket: "Ticket") -> None:
        self.layout_bytes = ticket.layout_bytes
        self.address = ticket.address
        self.layout: Layout = ticket.layout
        lay = self.layout
        boxes = lay.boxes if lay.boxes is not None else Boxes(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        self.boxes = boxes.global_boxes(lay.ndims, lay.dims)
        self.codes = lay.dtype_codes.tolist()
        # Tensor indices as leaves: each path's index in the layout.
        self.index = dict(_paths(unflatten(lay, list(range(lay.num_tensors))), lambda x: type(x) is int))
        self.alias_of = dict(lay.aliases.tolist()) if lay.aliases.size else {}
        self.parts: list[Runs] = []  # (tensor, byte in tensor, address, nbytes) gathered while planning
        self._runs: dict[tuple[int, ...], Runs] = {}
        self._digests: dict[tuple[int, ...], bytes] = {}

    def add(self, tensor: int, within: np.ndarray, address: np.ndarray, nbytes: int) -> None:
        tensor = self.alias_of.get(tensor, tensor)  # a tied tensor's bytes are its original's
        self.parts.append((np.full(within.size, tensor, dtype=np.int64), within, address, np.full(within.size, nbytes, dtype=np.int64)))

    def seal(self) -> None:
        if self.parts:
            self.tensor, self.within, self.addr, self.nbytes = (np.concatenate(c) for c in zip(*self.parts))
        else:
            self.tensor = self.within = self.addr = self.nbytes = np.zeros(0, dtype=np.int64)
        self.parts = []

    def runs(self, geometry: tuple[int, ...]) -> Runs:
        """The runs in a stream of blocks of these sizes: ascending, merged
        where they continue each other on both sides (cached)."""
        r = self._runs.get(geometry)
        if r is None:
            lay = self.layout
            offsets, _ = packing.packed_offsets(lay.nbytes, lay.alignments)
            if len(geometry) > 1:
                groups = packing.group_by_block(lay.nbytes, lay.alignments, list(geometry))
                start = np.zeros(len(geometry), dtype=np.int64)
                start[1:] = np.cumsum(np.asarray(geometry, dtype=np.int64))[:-1]
                offsets = start[np.repeat(np.arange(len(geometry)), np.diff(groups.bounds))] + groups.offsets
            pos = offsets[self.tensor] + self.within
            order = np.argsort(pos, kind="stable")
            merged = packing.merge_runs(pos[order], self.addr[order], self.nbytes[order])
            r = self._runs[geometry] = (merged.dst, merged.src, merged.nbytes)
        return r

    def digest(self, geometry: tuple[int, ...]) -> bytes:
        """What names the ranges this receiver reads (positions and sizes,
        not where they land): receivers of the same boxes have the same
        one, and pull a broadcast's ranges from each other (cached)."""
        d = self._digests.get(geometry)
        if d is None:
            pos, _, n = self.runs(geometry)
            d = self._digests[geometry] = hashlib.blake2b(pos.astype("<i8").tobytes() + n.astype("<i8").tobytes(), digest_size=16).digest()
        return d


class ShardedPlan:
    """A receiver's plan from the tickets of every source rank into a
    sharded (or whole) target; receiver side.

    Args:
        owner: the receiver that made it (a get checks it).
        tickets: one ticket of every source rank, any order.
        into: the target: tensors nested as the sources put them, each a
            DTensor (its local shard is written), a
            [``Box``][tensorferry.shards.Box] or a plain tensor (the whole
            global tensor); contiguous host memory.
        kept: replayed by later gets (``Receiver.plan``) or used once.
        spread: where several sources hold the same bytes (replicated
            placements), which one this receiver reads a part from turns
            with this number (and with the tensor), so receivers spread
            over replicated sources. Default: the target's mesh coordinate,
            else a hash of its boxes: receivers of the same boxes read the
            same ranges, which they relay to each other from a broadcast.

    Attributes:
        result: the target, as given (what every get returns).
        nbytes: the bytes one get receives: exactly those of the target boxes.
        sources: how many source tickets a get takes.

    Raises:
        LayoutMismatchError: a key on one side only, a global shape or
            dtype that differs, a target region no source holds, tickets of
            different versions; every problem named, nothing moved.
        UnsupportedTensorError: a target that is not contiguous host memory.
    """

    def __init__(self, owner: object, tickets: list["Ticket"], into: Any, *, kept: bool = True, spread: int | None = None) -> None:
        if not tickets:
            raise ConfigurationError("a sharded plan or get takes the tickets of every source rank; the list is empty")
        if into is None:
            raise ConfigurationError("a sharded get writes into a target: pass into= (DTensors, Boxes or tensors nested as the sources put them)")
        _check_versions(tickets)
        self._owner = owner
        self.kept = kept
        self.result = into
        self.lock = threading.Lock()
        with gc_paused():
            self._make(tickets, into, spread)

    def _make(self, tickets: list["Ticket"], into: Any, spread: int | None) -> None:
        self._sources = [_Source(t) for t in tickets]
        found: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        src = into.state_dict(keep_vars=True) if isinstance(into, torch.nn.Module) else into
        leaves, ops, counts, keys, _ = flatten(src, found)
        bad = [i for i, t in enumerate(leaves) if t.device.type != "cpu" or not t.is_contiguous()]
        paths = [p for p, _ in _paths(src, lambda x: isinstance(x, (torch.Tensor, Box)))]
        if bad:
            raise UnsupportedTensorError(
                f"a sharded get writes its targets by address; {listed([_name(paths[i]) for i in bad], _SHOWN_PROBLEMS)} "
                "are not contiguous host tensors: pass .contiguous() CPU tensors (or DTensors of them)"
            )
        boxes = {i: (shape, offsets) for i, shape, offsets in found}
        if spread is None:
            spread = _mesh_coordinate(src) if found else None
        if spread is None:
            # Receivers of the same boxes (replicas of one tensor-parallel
            # rank) pick the same sources, so they read the same ranges and
            # can relay them to each other; other boxes pick others.
            spread = zlib.crc32(repr(sorted(boxes.items())).encode())
        problems: list[str] = []
        self.nbytes = 0
        self._targets = leaves
        sources = self._sources
        written: set[tuple] = set()  # a tied target (one tensor under two keys) is written once
        for j, (path, t) in enumerate(zip(paths, leaves)):
            shape, offsets = boxes.get(j, (tuple(t.shape), (0,) * t.dim()))
            have = [(k, s.index[path]) for k, s in enumerate(sources) if path in s.index]
            if not have:
                problems.append(f"{_name(path)} is in the target, in no source's tickets")
                continue
            code = dtype_code(t.dtype)
            other = [(k, i) for k, i in have if sources[k].codes[i] != code or sources[k].boxes[i][0] != shape]
            if other:
                k, i = other[0]
                s = sources[k]
                problems.append(
                    f"{_name(path)} is {s.layout.dtype_names()[i]} of global shape {s.boxes[i][0]} at source {k} ({s.address}), "
                    f"{t.dtype} of global shape {shape} in the target"
                )
                continue
            view = (t.data_ptr(), tuple(t.shape), t.dtype, offsets, shape)
            if view in written:
                continue
            written.add(view)
            boxes_here = [(sources[k].boxes[i][1], sources[k].boxes[i][2]) for k, i in have]
            cells, uncovered = cover(offsets, tuple(t.shape), boxes_here)
            if uncovered is not None:
                problems.append(f"{_name(path)}: no source holds region {region(uncovered)} of its global shape {shape}")
                continue
            item, base = t.element_size(), t.data_ptr()
            for c, cell in enumerate(cells):
                pick = cell.sources[(spread + j + c) % len(cell.sources)]
                k, i = have[pick]
                so, ss = boxes_here[pick]
                src_el, dst_el, run = box_runs(cell, (so, ss), (offsets, tuple(t.shape)))
                sources[k].add(i, src_el * item, base + dst_el * item, run * item)
                self.nbytes += src_el.size * run * item
        wanted = set(paths)
        for k, s in enumerate(sources):
            extra = [p for p in s.index if p not in wanted]
            if extra:
                problems.append(f"{listed([_name(p) for p in extra], 3)} sent by source {k} ({s.address}), not in the target")
        if problems:
            raise LayoutMismatchError(
                f"the sharded target does not match the sources: {listed(problems, _SHOWN_PROBLEMS)}; nothing was moved. "
                "Pass the tickets of every source rank and a target of the same keys, dtypes and global shapes"
            )
        for s in sources:
            s.seal()
        # Per source, once it offered a delta: what a kept plan reads of it.
        self._deltas: list[SourceDelta | None] = [None] * len(sources)
        self.last_nbytes = 0
        self._watch = Watch(leaves, None, None, ops, counts, keys) if self.kept else None
        bases = {id(b): b for b in (t if t._base is None else t._base for t in leaves)}
        self._versioned = [b for b in bases.values() if not b.is_inference()]

    def __repr__(self) -> str:
        return f"ShardedPlan(sources={len(self._sources)}, targets={len(self._targets):,}, nbytes={self.nbytes:,}{'' if self.kept else ', one-shot'})"

    @property
    def sources(self) -> int:
        return len(self._sources)

    def ranges(self, k: int, geometry: tuple[int, ...], lo: int, hi: int) -> Runs:
        """What this receiver reads of stream bytes ``[lo, hi)`` of source
        ``k`` (in the plan's order) whose ticket has blocks of these sizes:
        (position from ``lo``, address here, nbytes), ascending."""
        return packing.window(self._sources[k].runs(geometry), lo, hi)

    def delta(self, k: int) -> SourceDelta | None:
        """What this plan reads of source ``k``'s deltas, and the version of
        it the targets hold (``plans/_delta_sharded.py``); None for a
        one-shot plan, which reads whole ranges."""
        if not self.kept:
            return None
        d = self._deltas[k]
        if d is None:
            s = self._sources[k]
            _, total = packing.packed_offsets(s.layout.nbytes, s.layout.alignments)
            d = self._deltas[k] = SourceDelta(s.layout, s.runs((total,)))
        return d

    def digest(self, k: int, geometry: tuple[int, ...]) -> bytes:
        """What names the ranges this receiver reads of source ``k`` (see
        :meth:`ranges`): the same for every receiver of the same boxes."""
        return self._sources[k].digest(geometry)

    def order(self, owner: object, tickets: list["Ticket"]) -> list["Ticket"]:
        """The tickets in the plan's source order (each matched by its
        layout; sources with the same layout are interchangeable), after
        checking the plan's owner, targets and the tickets' versions.

        Raises:
            ConfigurationError: another receiver's plan.
            PlanStaleError: a target moved or was resized.
            LayoutMismatchError: tickets that are not the planned sources'.
        """
        if owner is not self._owner:
            raise ConfigurationError("get(into=plan): this plan was made by another Receiver; make one with this receiver's plan()")
        if self._watch is not None:
            self._watch.check("get(into=plan)", "receiver.plan(tickets, into=...)")
        _check_versions(tickets)
        free: dict[bytes, list[int]] = {}
        for k, s in enumerate(self._sources):
            free.setdefault(s.layout_bytes, []).append(k)
        out: list[Any] = [None] * len(self._sources)
        for t in tickets:
            slots = free.get(t.layout_bytes)
            if not slots:
                raise LayoutMismatchError(
                    f"get(into=plan): the ticket from {t.address} has a layout no planned source had (or one more source than "
                    f"planned: {len(tickets)} tickets, {len(self._sources)} planned); nothing was moved: make a new plan"
                )
            out[slots.pop(0)] = t
        if any(t is None for t in out):
            raise LayoutMismatchError(f"get(into=plan): {len(tickets)} tickets for {len(self._sources)} planned sources; pass one from every source rank")
        return out

    @contextlib.contextmanager
    def registered(self, ch: Any) -> Iterator[None]:
        """The targets readable into over ``ch`` for the duration (a
        channel that ``reads_registered_only`` registers them)."""
        with contextlib.ExitStack() as stack:
            if ch is not None:
                for t in {id(b): b for b in (t if t._base is None else t._base for t in self._targets)}.values():
                    stack.enter_context(ch.registered(t))
            yield

    def execute(self, tickets: list["Ticket"], read: Callable[[int, "Ticket"], None]) -> Any:
        """``read(k, ticket)`` for every source at once (a thread each),
        the targets marked written; the result. The first error is raised
        after every read has stopped. :attr:`last_nbytes`: the bytes the
        reads moved (a source's delta, else its ranges)."""
        with self.lock:
            self.last_nbytes = 0
            for d in self._deltas:
                if d is not None:
                    d.last_nbytes = 0
            try:
                if len(tickets) == 1:
                    read(0, tickets[0])
                else:
                    futures = [_readers().submit(read, k, t) for k, t in enumerate(tickets)]
                    errors = [f.exception() for f in futures]  # waits for every read
                    first = next((e for e in errors if e is not None), None)
                    if first is not None:
                        raise first
            finally:
                if self._versioned:
                    mark_written(self._versioned)
            self.last_nbytes = sum(int(s.nbytes.sum()) if d is None else d.last_nbytes for s, d in zip(self._sources, self._deltas))
        return self.result


_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()
# Reads of a sharded get, a thread per source; they only wait on sockets
# and READs (the copies run on the copy threads), so many may wait at once.
_MAX_READERS = 64


def _readers() -> ThreadPoolExecutor:
    """The threads every sharded get's reads run on (made once: starting a
    thread per source and get costs milliseconds on a loaded machine)."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(_MAX_READERS, thread_name_prefix="tensorferry-sharded"))
        return _POOL[0]


def _check_versions(tickets: list["Ticket"]) -> None:
    versions = {t.version for t in tickets}
    if len(versions) > 1:
        seen = ", ".join(f"{t.version} from {t.address}" for t in tickets[:_SHOWN_PROBLEMS])
        raise LayoutMismatchError(
            f"the tickets are of different versions ({seen}); nothing was moved: pass the tickets of the same put of every source rank"
        )


def _paths(obj: Any, is_leaf: Callable[[Any], bool]) -> list[tuple[tuple, Any]]:
    """``(path, leaf)`` of each leaf in order; a path is a tuple of keys and positions."""
    out: list[tuple[tuple, Any]] = []

    def walk(x: Any, path: tuple) -> None:
        if is_leaf(x):
            out.append((path, x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + (k,))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, path + (i,))

    walk(obj, ())
    return out


def _name(path: tuple) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the tensor"


def _mesh_coordinate(obj: Any) -> int | None:
    """This rank's place in the first DTensor's mesh, flattened (None: no DTensor)."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "device_mesh") and isinstance(x, torch.Tensor):
            coord = x.device_mesh.get_coordinate()
            if coord is None:
                return None
            return int(np.ravel_multi_index(coord, tuple(x.device_mesh.shape)))
    return None
