"""Receiver side: how one get's bytes move, decided once, and moving them.

Every get executes a :class:`RecvPlan` (kept, or one-shot). For each
acquired piece (the one resident block list, or each piece of a streamed
object) :func:`route` chooses, from the plan and from what the channel
declares it can do, how the bytes move:

* ``views``: the result is views of the sender's mapped pool (zero_copy);
* ``relay``: a broadcast: the block from the relays the sender names (or
  from the sender, passed on to this receiver's children as it arrives);
* ``own``: straight into the plan's own memory (a one-shot plan without
  ``into=`` allocates it in the ticket's block sizes; views are built while
  the bytes move);
* ``source``: a snapshot=False piece straight out of the sender's tensors,
  by the plan's runs;
* ``mapped``: by the plan's runs out of the mapped pool;
* ``buffers``: received into the plan's buffer list (its targets' memory,
  runs merged, a scratch for the gaps);
* ``staged``: through a bounded staging buffer, copied out by the plan's runs.

A streamed object is the same route applied per piece: each piece runs the
window of the plan's runs inside its byte range.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from ..copy import CopyPlan, StagedCopy, executor, finish
from ..errors import ConfigurationError, PoolExhaustedError, TicketError
from ..memory import ReceiveCache
from ..plans import RecvPlan, SourceDelta, reads_delta, receive_delta, settle, version_of
from ..transports import Channel, ReceiveContext, RelayBook, RelayLinks, Releaser, SameHostReads
from ..wire import Ticket, packing
from ._relayed import Relayed, _left
from ._stripes import Source

__all__ = ["Route", "Fetcher", "route"]

Route = str  # one of the names in the module docstring

# Below this many tensors, views cost less than handing the copy to a thread.
_OVERLAP_MIN_TENSORS = 2048
# A one-shot plan's into= scatters straight into the caller's tensors (one
# recvmsg buffer a run, tens of us each) up to this many merged runs, or
# while they average at least _SCATTER_MIN_MEAN_NBYTES (then a run's
# overhead costs less than copying its bytes once more); otherwise the
# bytes go through a staging buffer of at most _STAGE_NBYTES and are copied
# out by address. A kept plan builds its buffer list once and always
# scatters. Receive-pool room smaller than _STAGE_MIN_NBYTES is not worth
# using as that buffer.
_SCATTER_MAX_RUNS = 256
_SCATTER_MIN_MEAN_NBYTES = 256 << 10
_STAGE_NBYTES = 64 << 20
_STAGE_MIN_NBYTES = 4 << 20


def route(plan: RecvPlan, ch: Channel, block_nbytes: tuple[int, ...], *, zero_copy: bool, broadcast: bool, sourced: bool) -> Route:
    """How one acquired piece's bytes move; the one decision of a get.

    Args:
        plan: the get's plan (kept or one-shot).
        ch: the channel, by its declared capabilities.
        block_nbytes: the stream geometry of the plan's runs (the ticket's
            block sizes; a streamed object's one block).
        zero_copy: the caller asked for views of the sender's pool (the
            receiver checked the channel maps it).
        broadcast: the block comes from relays, or is passed on to this
            receiver's children (a relaying receiver of a relaying channel).
        sourced: the piece is the sender's tensors (snapshot=False).
    """
    if zero_copy:
        return "views"
    if broadcast:
        return "relay"
    if plan.owns(block_nbytes):
        return "own"
    if sourced:
        return "source"
    coords = plan.coords(block_nbytes)
    if ch.maps_sender_memory and not (plan.kept and coords.small and ch.receives_into_buffers):
        return "mapped"  # a kept plan's many small runs: preadv into its buffer list
    if ch.receives_into_buffers and (plan.kept or coords.copy.num_runs <= max(_SCATTER_MAX_RUNS, coords.total // _SCATTER_MIN_MEAN_NBYTES)):
        return "buffers"
    return "staged"


class Fetcher(Relayed):
    """A receiver's means of moving bytes: its destinations, its scratch,
    its relays. Executes plans over channels; holds no get's state.

    Args:
        context: the receive pool (given, or made for nixl).
        cache: memory of collected results, for destinations.
        releaser: sends the Release of zero-copy holds.
        token: presented to relays.
        stall_seconds: a relay silent this long is given up.
        reads: how this receiver reads relays on its own host.
        book: this receiver's relay book, if it relays.
        relay_address: where it relays ("" if not).
        tls: the receiver's client ``ssl.SSLContext``: relays are reached
            over TLS and their certificates checked with it, as senders' are.
    """

    def __init__(self, context: ReceiveContext, cache: ReceiveCache, releaser: Releaser, *, token: bytes, stall_seconds: float,
                 reads: SameHostReads, book: RelayBook | None, relay_address: str, tls: Any = None) -> None:
        self._context, self._cache, self._releaser = context, cache, releaser
        self._token, self._stall_seconds, self._reads, self._tls = token, stall_seconds, reads, tls
        self._book, self._relay_address = book, relay_address
        self._links = RelayLinks()  # connections to relays, kept between pulls

    def close(self) -> None:
        """Close the connections to relays it keeps."""
        self._links.close()

    # -- one get -------------------------------------------------------------------

    def get(self, ch: Channel, plan: RecvPlan, ticket: Ticket, *, zero_copy: bool, deadline: float) -> tuple[Any, int]:
        """Acquire, move and release every piece of ``ticket`` into ``plan``;
        the plan's result and the bytes read (a delta's, or the whole object's)."""
        moved = plan.layout.total_nbytes
        if zero_copy:
            return self._views(ch, plan, ticket, deadline), moved
        # Targets are marked written while the bytes land (a failed get may
        # have written too); for a resident object after the acquire, whose
        # Python work a marking thread would only slow down.
        with plan.lock:
            holds, plan.version = plan.version, 0  # a failed get leaves no version
            if reads_delta(plan, ticket, holds, ch):
                moved = receive_delta(ch, plan, ticket, self.destination, deadline, relay_address=self._relay_address,
                              broadcast=lambda sub, blocks, source: self._receive_broadcast(ch, sub, blocks, source, plan, deadline))
            elif ticket.streamed:
                geometry = (ticket.total_nbytes,)
                with plan.writing():
                    for piece in range(ticket.num_pieces):
                        blocks, lo = self._acquire_piece(ch, ticket, piece, deadline)
                        try:
                            self._move(ch, plan, ticket, piece, blocks, lo, geometry, None, deadline)
                        finally:
                            ch.release(ticket.id, piece, timeout=max(deadline - time.monotonic(), 5.0))
                if plan.allocates:
                    plan.adopt_own()
                settle(ch, ticket, deadline)
            else:
                blocks, source = self._acquire_resident(ch, ticket, deadline)
                try:
                    with plan.writing():
                        self._move(ch, plan, ticket, 0, blocks, 0, tuple(n for _, n in blocks), source, deadline)
                finally:
                    ch.release(ticket.id, 0, timeout=max(deadline - time.monotonic(), 5.0))
                settle(ch, ticket, deadline)
            plan.finish()
            plan.version = version_of(plan, ticket)
        return plan.result, moved

    def read_ranges(self, ch: Channel, ticket: Ticket, ranges: Callable[[tuple[int, ...], int, int], Any],
                    digest: Callable[[tuple[int, ...]], bytes], deadline: float, *, group: object = None,
                    delta: SourceDelta | None = None) -> None:
        """A sharded get's part from one source: every piece of ``ticket``
        acquired and released (this receiver is one of its readers), and of
        each only the ranges ``ranges(geometry, lo, hi)`` names read; the
        slot of a delta plan's delta is given back unread. With ``delta``
        (a kept plan's), the delta's records of those ranges instead where
        the targets hold its base (``plans/_delta_sharded.py``).

        Of a resident ticket over a relaying channel the acquire names the
        ranges (``digest(geometry)``): readers of the same ranges of a
        broadcast pull them from each other, as one stream
        (:meth:`_receive_ranges`; ``group``: the get, whose streams a
        relay keeps side by side)."""
        if not ch.reads_ranges:
            raise ConfigurationError(f"the {ch.transport} transport cannot read byte ranges; a sharded get needs shm, tcp or nixl")
        if delta is not None:

            def stream(sub: Ticket, blocks: list, source: str, pos: np.ndarray, n: np.ndarray, named: bytes) -> torch.Tensor:
                def from_sender(buf: memoryview, start: int, progress: Any) -> None:
                    ch.receive_ranges(sub.id, 0, blocks, pos, n, buf, start, progress, deadline=deadline, chunk_nbytes=ch.ranged_chunk_nbytes)

                return self._receive_stream(ch, sub, int(n.sum()), named, source, from_sender, deadline, group, chunk_nbytes=ch.ranged_chunk_nbytes)

            delta.read(ch, ticket, deadline, lambda: self._read_ranges(ch, ticket, ranges, digest, deadline, group),
                       relay=self._relay_address if self._book is not None else "", stream=stream)
        else:
            self._read_ranges(ch, ticket, ranges, digest, deadline, group)

    def _read_ranges(self, ch: Channel, ticket: Ticket, ranges: Callable[[tuple[int, ...], int, int], Any],
                     digest: Callable[[tuple[int, ...]], bytes], deadline: float, group: object) -> None:
        """:meth:`read_ranges` of the whole object."""
        if ticket.streamed:
            for piece in range(ticket.num_pieces):
                blocks, lo = self._acquire_piece(ch, ticket, piece, deadline)
                try:
                    pos, addr, n = ranges((ticket.total_nbytes,), lo, lo + sum(b for _, b in blocks))
                    if pos.size:
                        ch.read_ranges(ticket.id, piece, blocks, pos, addr, n, deadline=deadline)
                finally:
                    ch.release(ticket.id, piece, timeout=max(deadline - time.monotonic(), 5.0))
        else:
            geometry = tuple(n for _, n in ticket.blocks)
            pos, addr, n = ranges(geometry, 0, sum(geometry))
            # Every reader of a broadcast names its range set (one that needs
            # nothing of this source too: it stays out of the whole-piece tree).
            named = _stream_digest(ticket, digest(geometry)) if ch.relays else b""
            blocks, source = self._acquire_resident(ch, ticket, deadline, ranges=named)
            try:
                if pos.size and (source or (named and self._book is not None and len(blocks) == 1)):
                    self._receive_ranges(ch, ticket, blocks, source, (pos, addr, n), named, deadline, group)
                elif pos.size:
                    ch.read_ranges(ticket.id, 0, blocks, pos, addr, n, deadline=deadline)
            finally:
                ch.release(ticket.id, 0, timeout=max(deadline - time.monotonic(), 5.0))
        settle(ch, ticket, deadline)  # ranges of the whole object: a delta plan's delta slot goes back unread

    def _receive_ranges(self, ch: Channel, ticket: Ticket, blocks: list, source: str, runs: tuple, named: bytes, deadline: float,
                        group: object) -> None:
        """A sharded get's ranges of a broadcast as one stream (``named``:
        the ranges back to back), from ``source`` (a relay of the same
        ranges, or ``""``: the sender), passed on to this receiver's
        children if it relays, and copied out to the targets as it arrives
        (each chunk after it is passed on: the copy is off the get's end)."""
        pos, addr, n = runs
        copy = CopyPlan.build(addr, np.cumsum(n) - n, n)

        def from_sender(buf: memoryview, start: int, progress: Any) -> None:
            ch.receive_ranges(ticket.id, 0, blocks, pos, n, buf, start, progress, deadline=deadline, chunk_nbytes=ch.ranged_chunk_nbytes)

        def arrived(stream: torch.Tensor, lo: int, hi: int) -> None:
            copy.execute_window(lo, hi, 0, stream.data_ptr())

        self._receive_stream(ch, ticket, int(n.sum()), named, source, from_sender, deadline, group, arrived, chunk_nbytes=ch.ranged_chunk_nbytes)

    def _move(self, ch: Channel, plan: RecvPlan, ticket: Ticket, piece: int, blocks: list, lo: int, geometry: tuple[int, ...],
              source: str | None, deadline: float) -> None:
        """The acquired ``blocks`` (stream bytes from ``lo`` on; ``source``:
        whom a resident block comes from, None for a streamed piece) into
        the plan's destinations, as :func:`route` says."""
        broadcast = source is not None and (bool(source) or (self._book is not None and ch.relays and len(blocks) == 1))
        how = route(plan, ch, geometry, zero_copy=False, broadcast=broadcast, sourced=ch.is_sourced(ticket.id, piece))
        hi = lo + sum(n for _, n in blocks)
        tid = ticket.id
        if how == "relay":
            stream = self._receive_broadcast(ch, ticket, blocks, source or "", plan, deadline)
            if plan.allocates:
                plan.adopt([stream])
            else:
                plan.copy_from([stream], geometry)
        elif how == "own":
            dests, fresh = plan.own_dests(geometry, lo, blocks)
            self._read_own(ch, plan, tid, piece, blocks, dests, fresh=fresh, adopt=plan.allocates and source is not None, deadline=deadline)
        elif how == "source":
            d, s, n, _ = plan.coords(geometry).copy.window(lo, hi, by_dst=False)
            ch.read_runs(tid, piece, s - lo, d, n, deadline=deadline)
        elif how == "mapped" and source is not None:
            plan.copy_from(ch.remote_views(blocks), geometry)  # the whole object, mapped here
        elif how == "mapped":
            coords = plan.coords(geometry)
            coords.execute_window(lo, hi, ch.remote_views(blocks)[0].data_ptr() - lo)  # a piece: one block
        elif how == "buffers":
            ch.read_buffers(tid, piece, blocks, plan.coords(geometry).segments(lo, hi), deadline=deadline)
        else:
            coords = plan.coords(geometry)
            self._stream(ch, tid, piece, blocks, lambda pos, k, base: coords.execute_window(lo + pos, lo + pos + k, base - lo - pos), deadline)

    def _read_own(self, ch: Channel, plan: RecvPlan, ticket_id: int, piece: int, blocks: list, dests: list[torch.Tensor], *,
                  fresh: bool, adopt: bool, deadline: float) -> None:
        """Move the bytes into the plan's own memory; ``adopt``: build the
        plan's views of it meanwhile (a one-shot plan of a resident object).

        The views depend only on where the destination is, not on its
        bytes, and the copy (memcpy, recv_into, NIXL) runs without the GIL:
        building 100k views while the bytes move hides their cost. ``fresh``
        memory (not yet faulted in) of a channel that ``receives_by_loop`` is
        filled through a staging buffer when many views are built
        meanwhile: a receive loop that shares the GIL with them runs at half
        speed, one that only fills a staging buffer keeps up while a thread
        copies it out. (nixl stages destinations outside its registered
        pool itself, the same way.)
        """
        many = adopt and plan.layout.num_tensors >= _OVERLAP_MIN_TENSORS
        move: Callable[[], None]
        if fresh and many and ch.receives_by_loop and sum(n for _, n in blocks) > _STAGE_NBYTES:
            move = functools.partial(self._stream, ch, ticket_id, piece, blocks, StagedCopy.into_blocks(dests), deadline)
        else:
            move = functools.partial(ch.read_into, ticket_id, piece, blocks, dests, deadline=deadline)
        if not many:
            move()
            if adopt:
                plan.adopt(dests)
            return
        future = executor().submit(move)
        try:
            plan.adopt(dests)
        finally:
            finish(future, move)  # always wait: the slot is released after

    def _views(self, ch: Channel, plan: RecvPlan, ticket: Ticket, deadline: float) -> Any:
        """zero_copy: the result is views of the sender's mapped pool. The
        hold is released when the last block view's storage dies: every
        returned tensor is a view of one of these, so the release follows
        the storage, not any one tensor object."""
        located = ch.acquire(ticket.id, 0, timeout=_left(deadline), digest=ticket.digest)
        blocks = [tuple(b) for b in located.blocks]
        remaining = [len(blocks)]
        lock = threading.Lock()
        ch.holds += 1
        releaser = self._releaser

        def one_gone() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                releaser.submit(ch, ticket.id, 0)

        plan.adopt(ch.remote_views(blocks, one_gone))
        return plan.result

    # -- memory ------------------------------------------------------------------------

    def destination(self, sizes: list[int]) -> tuple[list[torch.Tensor], bool]:
        """Destination blocks (16-aligned), from the receive pool if it has
        room, else from the receive cache (either way the memory returns
        when the last view of it is collected); and whether they are fresh
        (new memory, not yet faulted in)."""
        total = sum(packing.align_up(n, packing.BLOCK_ALIGNMENT) for n in sizes)
        pool = self._context.pool
        if pool is not None and pool.device.type == "cpu":
            try:
                return _split(pool.reserve(total).owned_view(), sizes), False
            except PoolExhaustedError:
                pass  # receive pool full: the cache's memory
        buffer, reused = self._cache.take(total)
        return _split(buffer, sizes), not reused

    def _stream(self, ch: Channel, ticket_id: int, piece: int, blocks: list, sink: Any, deadline: float) -> None:
        """``ch.read_stream`` through a scratch of at most ``_STAGE_NBYTES``:
        the receive pool's when it has room (registered for NIXL, already
        faulted in), new memory otherwise."""
        want = min(sum(n for _, n in blocks), _STAGE_NBYTES)
        pool = self._context.pool
        lease = None
        if pool is not None and pool.device.type == "cpu":
            lease = pool.reserve_up_to(want, min_nbytes=min(want, _STAGE_MIN_NBYTES))
        scratch = lease.view() if lease is not None else self._cache.take(want)[0]
        try:
            ch.read_stream(ticket_id, piece, blocks, scratch, sink, deadline=deadline)
        finally:
            if lease is not None:
                lease.release()

    # -- reader slots ------------------------------------------------------------------

    def _acquire_resident(self, ch: Channel, ticket: Ticket, deadline: float, ranges: bytes = b"") -> tuple[list[tuple[int, int]], Source]:
        """Take a reader slot: the blocks, and where to pull them from
        (``""``: the sender; a broadcast may name a relay, of the same
        ``ranges`` for a sharded get's reader; a two-tree one, one a half)."""
        located = ch.acquire(ticket.id, 0, timeout=_left(deadline), digest=ticket.digest, relay=self._relay_address, ranges=ranges)
        blocks = [tuple(b) for b in located.blocks]
        if blocks != [tuple(b) for b in ticket.blocks]:
            ch.release(ticket.id, 0, timeout=_left(deadline))
            raise TicketError(f"sender locates ticket {ticket.id} at {blocks}, the ticket says {ticket.blocks}")
        return blocks, tuple(located.stripes) if located.stripes else located.source

    def _acquire_piece(self, ch: Channel, ticket: Ticket, piece: int, deadline: float) -> tuple[list[tuple[int, int]], int]:
        located = ch.acquire(ticket.id, piece, timeout=_left(deadline), digest=ticket.digest)
        blocks = [tuple(b) for b in located.blocks]
        voff = located.virtual_offset
        want = min(ticket.piece_nbytes, ticket.total_nbytes - piece * ticket.piece_nbytes)
        if len(blocks) != 1 or blocks[0][1] != want or voff != piece * ticket.piece_nbytes:
            ch.release(ticket.id, piece, timeout=5.0)
            raise TicketError(f"sender located piece {piece} as {blocks} at {voff}, expected {want:,} bytes at {piece * ticket.piece_nbytes:,}")
        return blocks, voff

def _stream_digest(ticket: Ticket, ranges: bytes) -> bytes:
    """What names a sharded get's ranges of ``ticket`` (``ranges``: their
    digest) to the sender and to relays: readers of the same ranges of the
    same ticket share it."""
    return hashlib.blake2b(ticket.digest + ranges, digest_size=16).digest()


def _split(base: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, pos = [], 0
    for n in sizes:
        out.append(base[pos : pos + n])
        pos += packing.align_up(n, packing.BLOCK_ALIGNMENT)
    return out
