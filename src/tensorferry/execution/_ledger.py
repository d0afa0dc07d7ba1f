"""``Ledger``: the sender's book of tickets, pieces and reader slots.

Sender side, shared by every transport's server: a server thread calls
:meth:`Ledger.acquire` / :meth:`Ledger.release` for its receivers, the
Sender adds and discards tickets. A piece's blocks are freed when every
reader released them, when a reader's connection drops (it died
mid-read), or when the lease of slots nobody acquired expires. Pieces of
streamed objects are packed by the ledger's packer thread as space frees
up (backpressure).
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..errors import PlanBusyError, PoolExhaustedError
from ..memory import MemoryPool, Packed
from ..transports import Holdings
from ..wire import protocol as P
from ._broadcast import SENDER, Tree
from ._trees import Trees, relay_tree

if TYPE_CHECKING:
    from ..transports import Held
    from ..wire import Ticket

__all__ = ["Ledger", "Entry", "Piece", "delta_entry"]

# How long an acquiring relay waits for the source it had in its group's
# last broadcast to join this one (the others of its group acquire about
# when it does; a relay gone since costs its children this once).
PLACE_WAIT_SECONDS = 1.0
# Relays whose groups a sender remembers (a few bytes each; the oldest go).
MAX_REMEMBERED_RELAYS = 4096


@dataclass(eq=False)
class Piece:
    voffset: int
    nbytes: int
    readers: int
    packed: "Held | None" = None  # a pool block group, or a sourced piece; None until packed
    unclaimed: int = 0  # reader slots not yet acquired
    holding: int = 0  # acquired, not yet released
    finished: int = 0  # released, dropped or expired

    def __post_init__(self) -> None:
        self.unclaimed = self.readers


@dataclass(eq=False)
class Entry:
    ticket_id: int
    readers: int
    lease_seconds: float
    deadline: float
    pieces: list[Piece]
    streamed: bool
    # Only for streamed objects: pack(voffset, nbytes) -> Packed packs a
    # later piece (its plan, and so its tensors, kept alive through it).
    pack: Callable[[int, int], Packed] | None = None
    digest: bytes = b""  # Ticket.digest of the ticket put() returned
    # Served from the tensors' own memory (a plan put with snapshot=False):
    # only a server that serves_source_memory may serve it. ``source`` is
    # the plan: one such ticket of a plan is read at a time.
    sourced: bool = False
    source: object = None
    # A broadcast ticket (put with fanout=): who pulls from whom; the
    # readers of the same byte ranges (sharded gets), a tree for each range set.
    tree: Tree | Trees | None = None
    ranged: dict[bytes, Tree] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)


class Ledger(Holdings):
    """The sender's book of tickets and reader slots. Thread-safe.

    The :class:`~tensorferry.transports._base.Holdings` a sender's servers
    serve from: they call :meth:`acquire`, :meth:`release`, :meth:`held`,
    :meth:`drop_connection` and :meth:`count_sent` from their connection
    threads.
    """

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        self._cond = threading.Condition()
        self._entries: dict[int, Entry] = {}
        # Each relay's group in the last broadcast it was in, and that
        # broadcast's readers (see _remember).
        self._groups: dict[str, tuple[tuple[str, ...], int]] = {}
        self._closed = False
        self.transfers = 0
        self.bytes_served = 0
        self.bytes_sent = 0  # bytes a server sent itself (tcp Fetch); relays send the rest of a broadcast
        self._sent_lock = threading.Lock()  # connection threads add to bytes_sent at once
        self._reaper = threading.Thread(target=self._reap_loop, name="tensorferry-lease-reaper", daemon=True)
        self._reaper.start()
        self._packer = threading.Thread(target=self._pack_loop, name="tensorferry-stream-packer", daemon=True)
        self._packer.start()

    # -- sender side -------------------------------------------------------------

    def add(self, entry: Entry) -> None:
        """Serve ``entry`` from now on.

        Raises:
            PlanBusyError: a ``snapshot=False`` entry whose plan's previous
                such ticket is still being read (its bytes are the same
                tensors); nothing added.
        """
        with self._cond:
            if entry.sourced:
                busy = next((e.ticket_id for e in self._entries.values() if e.sourced and e.source is entry.source), None)
                if busy is not None:
                    raise PlanBusyError(
                        f"put(plan, snapshot=False): ticket {busy} of this plan is still being read, and its bytes are the "
                        "tensors this put would send; call sender.wait_released(ticket) first (or use snapshot=True)"
                    )
            self._entries[entry.ticket_id] = entry
            self._cond.notify_all()

    def count_sent(self, nbytes: int) -> None:
        """A server sent ``nbytes`` itself (tcp's Fetch); any connection thread."""
        with self._sent_lock:
            self.bytes_sent += nbytes

    def wait_released(self, ticket_id: int, timeout: float | None) -> bool:
        with self._cond:
            entry = self._entries.get(ticket_id)
        if entry is None:
            return True
        return entry.done.wait(timeout)

    def discard(self, ticket_id: int) -> None:
        """Give up every slot nobody holds; free each piece once its holders
        release (used for tickets put with ``readers=None``). A get in
        progress finishes: every reader acquires the pieces in order, so
        each one that took the first piece keeps its slot in the later
        pieces of a streamed ticket (the rest are packed for it as room
        frees)."""
        with self._cond:
            entry = self._entries.get(ticket_id)
            if entry is None:
                return
            first = entry.pieces[0] if entry.pieces else None
            started = first.finished + first.holding if first is not None else 0
            for piece in entry.pieces:
                piece.readers = max(started, piece.finished + piece.holding)
                piece.unclaimed = piece.readers - piece.finished - piece.holding
                self._settle(entry, piece)
            self._cond.notify_all()  # the packer: later pieces may have lost readers

    def is_done(self, ticket_id: int) -> bool:
        """Every reader of the ticket released it (or it expired, or was never put)."""
        with self._cond:
            return ticket_id not in self._entries

    def live_entries(self) -> int:
        with self._cond:
            return len(self._entries)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for entry in list(self._entries.values()):
                for piece in entry.pieces:
                    if piece.packed is not None:
                        piece.packed.release()
                entry.done.set()
            self._entries.clear()
            self._cond.notify_all()
        self._reaper.join(timeout=2.0)
        self._packer.join(timeout=2.0)

    # -- receiver requests -----------------------------------------------------------

    def acquire(self, conn: Any, msg: P.Acquire) -> P.Located | P.Failure:
        deadline = time.monotonic() + max(0.0, min(msg.timeout_seconds, 3600.0))
        with self._cond:
            entry = self._entries.get(msg.ticket_id)
            if entry is None:
                return P.Failure(kind="unknown", message=f"ticket {msg.ticket_id} is unknown here: already released by all its readers, expired, or from another sender")
            if not 0 <= msg.piece < len(entry.pieces):
                return P.Failure(kind="bad-piece", message=f"ticket {msg.ticket_id} has {len(entry.pieces)} pieces, not piece {msg.piece}")
            if not hmac.compare_digest(msg.digest, entry.digest):
                # Checked before a slot is taken: an altered ticket (or one
                # rebuilt by hand) costs the real readers nothing.
                return P.Failure(kind="altered", message=(
                    f"this ticket {msg.ticket_id} does not match what the sender put (its layout, blocks or sizes "
                    "were altered on the way); nothing was taken: redeem the ticket's original bytes"))
            if entry.sourced and not conn.server.serves_source_memory:
                return P.Failure(kind="unsupported", message=(
                    f"ticket {msg.ticket_id} was put with snapshot=False: its bytes are the sender's tensors, "
                    f"which the {conn.transport} transport does not serve (tcp and shm do); redeem it over those, or put it with snapshot=True"))
            piece = entry.pieces[msg.piece]
            key = (msg.ticket_id, msg.piece)
            if msg.failed_source:
                # A receiver that holds its slot lost the relay it pulled
                # from: another source, the same slot.
                tree = _tree(entry, msg.ranges, make=False)
                if tree is None or not conn.holds.get(key) or piece.packed is None:
                    return P.Failure(kind="not-held", message=f"ticket {msg.ticket_id} piece {msg.piece} is not held on this connection, or is no broadcast")
                source = tree.reassign(msg.relay, msg.failed_source, msg.stripe)
                return P.Located(blocks=[(b.offset, b.nbytes) for b in piece.packed.blocks], virtual_offset=piece.voffset, source=source, sourced=entry.sourced)
            if piece.unclaimed == 0:
                return P.Failure(kind="consumed", message=f"all {entry.readers} reader slots of ticket {msg.ticket_id} piece {msg.piece} are taken; put it with more readers")
            while piece.packed is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return P.Failure(kind="timeout", message=f"piece {msg.piece} of ticket {msg.ticket_id} was not packed in time (the pool is full: other readers hold it)")
                self._cond.wait(min(left, 0.5))
                if self._entries.get(msg.ticket_id) is not entry:
                    return P.Failure(kind="unknown", message=f"ticket {msg.ticket_id} expired while we waited")
            piece.unclaimed -= 1
            piece.holding += 1
            entry.deadline = max(entry.deadline, time.monotonic() + entry.lease_seconds)
            conn.holds[key] = conn.holds.get(key, 0) + 1
            # Only readers of a broadcasting server join the tree: shm
            # readers on the sender's host map its pool.
            tree = _tree(entry, msg.ranges)
            stripes: list[str] = []
            if tree is None or not conn.server.broadcasts:
                source = SENDER
            elif isinstance(tree, Trees):
                stripes = self._place_halves(tree, msg, conn.remote_host, deadline, entry)
                source = stripes[0]
            else:
                # Only a group of a broadcast to as many readers: a sync like this one.
                group, readers = self._groups.get(msg.relay, ((), 0))
                planned = tree.planned(msg.relay, group) if readers == entry.readers else None
                # A relay's place from the last broadcast of its group: wait
                # a moment for its source there to join (its replicas ask
                # at about the same time), then take any source with room.
                wait_until = min(deadline, time.monotonic() + PLACE_WAIT_SECONDS)
                while planned is not None and not tree.joined(planned) and planned not in tree.failed and not self._closed:
                    left = wait_until - time.monotonic()
                    if left <= 0 or self._entries.get(msg.ticket_id) is not entry:
                        break
                    self._cond.wait(left)
                source = tree.join(msg.relay, conn.remote_host, planned=planned)
                self._cond.notify_all()  # relays waiting for this one to join
            return P.Located(blocks=[(b.offset, b.nbytes) for b in piece.packed.blocks], virtual_offset=piece.voffset, source=source,
                             sourced=entry.sourced, stripes=stripes)

    def _place_halves(self, trees: Trees, msg: P.Acquire, host: str, deadline: float, entry: Entry) -> list[str]:
        """Under the condition: a two-tree broadcast's reader's source of
        each half. Its parent in a tree may be a relay yet to join: waited
        for a moment (the relays of a broadcast acquire at about the same
        time), then any source with room in that tree."""
        place = trees.join(msg.relay, host)
        self._cond.notify_all()  # relays waiting for this one to join
        wait_until = min(deadline, time.monotonic() + PLACE_WAIT_SECONDS)
        while None in place and not self._closed and self._entries.get(msg.ticket_id) is entry:
            left = wait_until - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)
            trees.resolve(msg.relay, place)
        return trees.settle(msg.relay, place)

    def held(self, conn: Any, ticket_id: int, piece_idx: int) -> Any:
        """What holds the bytes of a piece ``conn`` acquired (a ``Held``): a
        ``Packed`` (its pool blocks) or, for a snapshot=False plan, a
        ``SourcedPiece`` (the tensors themselves); None if ``conn`` does
        not hold it."""
        with self._cond:
            if not conn.holds.get((ticket_id, piece_idx)):
                return None
            return self._entries[ticket_id].pieces[piece_idx].packed

    def release(self, conn: Any, ticket_id: int, piece_idx: int, send: Callable[[Any], None] | None = None) -> P.Released | P.Failure:
        """A reader is done with a piece. ``send(reply)`` (the server's
        answer to the reader) runs before the piece is settled: a sender
        waiting in ``wait_released`` (and closing right after) cannot cut
        the reader's answer off. The piece is settled even if the send fails."""
        with self._cond:
            key = (ticket_id, piece_idx)
            if not conn.holds.get(key):
                reply: P.Released | P.Failure = P.Failure(kind="not-held", message=f"ticket {ticket_id} piece {piece_idx} is not held on this connection")
                entry = None
            else:
                conn.holds[key] -= 1
                if not conn.holds[key]:
                    del conn.holds[key]
                entry = self._entries[ticket_id]
                piece = entry.pieces[piece_idx]
                piece.holding -= 1
                piece.finished += 1
                self.bytes_served += piece.nbytes
                reply = P.Released(valid=True)
        try:
            if send is not None:
                send(reply)
        finally:
            if entry is not None:
                with self._cond:
                    if self._entries.get(ticket_id) is entry:
                        self._settle(entry, piece)
        return reply

    def drop_connection(self, conn: Any) -> None:
        """A receiver went away: every slot it held is finished."""
        with self._cond:
            for (ticket_id, piece_idx), count in list(conn.holds.items()):
                entry = self._entries.get(ticket_id)
                if entry is None:
                    continue
                piece = entry.pieces[piece_idx]
                piece.holding -= count
                piece.finished += count
                self._settle(entry, piece)
            conn.holds.clear()

    # -- internals (condition held) -------------------------------------------------------

    def _settle(self, entry: Entry, piece: Piece) -> None:
        if piece.finished >= piece.readers and piece.packed is not None:
            piece.packed.release()
            piece.packed = None
            piece.unclaimed = 0
            piece.voffset = -1 if entry.streamed else piece.voffset
        if all(p.finished >= p.readers for p in entry.pieces):
            if self._entries.pop(entry.ticket_id, None) is entry:
                self._remember(entry)
            self.transfers += 1
            entry.pack = None
            entry.done.set()
        self._cond.notify_all()

    def _remember(self, entry: Entry) -> None:
        """The relay groups of a finished broadcast (its tree's, each range
        set's), for the next broadcasts' places (:meth:`Tree.planned`)."""
        for tree in ([entry.tree] if entry.tree is not None else []) + list(entry.ranged.values()):
            group = tree.members()
            if len(group) < 2:
                continue
            for relay in group:
                self._groups.pop(relay, None)  # to the end: the oldest go first past the limit
                self._groups[relay] = (group, entry.readers)
        while len(self._groups) > MAX_REMEMBERED_RELAYS:
            del self._groups[next(iter(self._groups))]

    def _reap_loop(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                next_deadline = now + 1.0
                for entry in list(self._entries.values()):
                    if entry.deadline <= now:
                        # Slots nobody acquired in time are given up; held
                        # slots stay until their connection releases or drops.
                        for piece in entry.pieces:
                            if piece.unclaimed:
                                piece.finished += piece.unclaimed
                                piece.unclaimed = 0
                            self._settle(entry, piece)
                    else:
                        next_deadline = min(next_deadline, entry.deadline)
                self._cond.wait(max(0.01, next_deadline - time.monotonic()))

    def _pack_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                job = self._next_piece()
                if job is None:
                    self._cond.wait(0.5)
                    continue
            entry, piece = job
            # Copy outside the lock: receivers keep acquiring and releasing.
            try:
                packed = entry.pack(piece.voffset, piece.nbytes)
            except PoolExhaustedError:
                with self._cond:
                    self._cond.wait(0.05)  # woken early by the next release
                continue
            with self._cond:
                if self._entries.get(entry.ticket_id) is entry and not self._closed:
                    piece.packed = packed
                else:
                    packed.release()  # expired or closed while we copied
                self._cond.notify_all()

    def _next_piece(self) -> tuple[Entry, Piece] | None:
        for entry in self._entries.values():
            if not entry.streamed:
                continue
            for piece in entry.pieces:
                if piece.packed is None and piece.finished < piece.readers:
                    return entry, piece  # pieces of one entry go in order
        return None


def _tree(entry: Entry, ranges: bytes, make: bool = True) -> Tree | Trees | None:
    """The relay tree a reader joins: the broadcast's own (the whole piece),
    or, for a sharded get's reader, the tree of its range set (made, if
    ``make``, as the first of them acquires: at most one a reader slot).
    None: no broadcast, or no such range set. The range sets of a
    two-tree broadcast are plain binary trees (their streams are not split)."""
    if entry.tree is None or not ranges:
        return entry.tree
    tree = entry.ranged.get(ranges)
    if tree is None and make:
        tree = entry.ranged[ranges] = Tree(entry.tree.fanout)
    return tree


def delta_entry(ticket: "Ticket", packed: Packed, readers: int, deadline: float, fanout: int | None, trees: bool = False) -> Entry:
    """The ledger entry of a delta plan's delta bytes (``plans/_delta_put.py``
    offers them): the ticket's readers and lease (a receiver reading the
    whole object gives its delta slot back, and one reading the delta its
    slots of the whole); a broadcast's (``fanout``, ``trees``) has a tree
    (or two) of its own, so relays pass the delta on. Sender side."""
    sub = ticket.delta_ticket()
    piece = Piece(voffset=0, nbytes=packed.blocks[0].nbytes, readers=readers, packed=packed)
    return Entry(sub.id, readers, ticket.lease_seconds, deadline, [piece], streamed=False, digest=sub.digest,
                 tree=relay_tree(fanout, trees, readers))
