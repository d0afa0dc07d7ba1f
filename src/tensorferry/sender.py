"""``Sender``: pack objects into a pool and serve them to receivers.

The sender side of a transfer. ``put`` packs the object and returns a
:class:`~tensorferry.ticket.Ticket` at once; a background server (per
transport) lets receivers acquire a reader slot, fetch the bytes, and
release the slot. Blocks are freed when every reader released them, when a
reader's connection drops (it died mid-read), or when the lease of slots
nobody acquired expires.

An object larger than the free space (or the whole pool) is streamed: it is
cut into byte ranges of its one-block layout ("pieces"), each packed when
space frees up and freed once every reader has read it (backpressure).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import numpy as np
import torch

from . import _protocol as P
from . import packing
from ._args import positive_seconds, reader_count
from ._copy import copy_bytes
from ._tensors import LeafInfo, flatten, gc_paused, inspect_leaves
from .errors import ConfigurationError, PoolExhaustedError, TransferError, TransferTimeoutError
from .pool import Block, MemoryPool, Packed
from .ticket import Ticket

__all__ = ["Sender", "Ledger"]

TransportName = Literal["shm", "tcp", "nixl"]

# Reader count of a ticket put with readers=None: never reached.
_UNLIMITED = 1 << 62

# Default pool size of a Sender that creates its own pool.
DEFAULT_CAPACITY_NBYTES = 256 << 20


@dataclass(eq=False)
class _Piece:
    voffset: int
    nbytes: int
    readers: int
    packed: Packed | None = None
    unclaimed: int = 0  # reader slots not yet acquired
    holding: int = 0  # acquired, not yet released
    finished: int = 0  # released, dropped or expired

    def __post_init__(self) -> None:
        self.unclaimed = self.readers


@dataclass(eq=False)
class _Entry:
    ticket_id: int
    readers: int
    lease_seconds: float
    deadline: float
    pieces: list[_Piece]
    streamed: bool
    # Only for streamed objects: what the packer needs to pack later pieces.
    leaves: list[torch.Tensor] | None = None
    info: LeafInfo | None = None
    offsets: np.ndarray | None = None
    digest: bytes = b""  # Ticket.digest of the ticket put() returned
    done: threading.Event = field(default_factory=threading.Event)


class Ledger:
    """The sender's book of tickets and reader slots. Thread-safe.

    Transports call :meth:`acquire`, :meth:`release`, :meth:`held_blocks`
    and :meth:`drop_connection` from their connection threads.
    """

    def __init__(self, pool: MemoryPool) -> None:
        self.pool = pool
        self._cond = threading.Condition()
        self._entries: dict[int, _Entry] = {}
        self._closed = False
        self.transfers = 0
        self.bytes_served = 0
        self._reaper = threading.Thread(target=self._reap_loop, name="tensorferry-lease-reaper", daemon=True)
        self._reaper.start()
        self._packer = threading.Thread(target=self._pack_loop, name="tensorferry-stream-packer", daemon=True)
        self._packer.start()

    # -- sender side -------------------------------------------------------------

    def add(self, entry: _Entry) -> None:
        with self._cond:
            self._entries[entry.ticket_id] = entry
            self._cond.notify_all()

    def wait_released(self, ticket_id: int, timeout: float | None) -> bool:
        with self._cond:
            entry = self._entries.get(ticket_id)
        if entry is None:
            return True
        return entry.done.wait(timeout)

    def discard(self, ticket_id: int) -> None:
        """Give up every slot nobody holds; free each piece once its holders
        release (used for tickets put with ``readers=None``)."""
        with self._cond:
            entry = self._entries.get(ticket_id)
            if entry is None:
                return
            for piece in entry.pieces:
                piece.unclaimed = 0
                piece.readers = piece.finished + piece.holding
                self._settle(entry, piece)

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
            piece = entry.pieces[msg.piece]
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
            key = (msg.ticket_id, msg.piece)
            conn.holds[key] = conn.holds.get(key, 0) + 1
            return P.Located(blocks=[(b.offset, b.nbytes) for b in piece.packed.blocks], virtual_offset=piece.voffset)

    def held_blocks(self, conn: Any, ticket_id: int, piece_idx: int) -> list[tuple[int, int]] | None:
        with self._cond:
            if not conn.holds.get((ticket_id, piece_idx)):
                return None
            piece = self._entries[ticket_id].pieces[piece_idx]
            return [(b.offset, b.nbytes) for b in piece.packed.blocks]

    def release(self, conn: Any, ticket_id: int, piece_idx: int) -> P.Released | P.Failure:
        with self._cond:
            key = (ticket_id, piece_idx)
            if not conn.holds.get(key):
                return P.Failure(kind="not-held", message=f"ticket {ticket_id} piece {piece_idx} is not held on this connection")
            conn.holds[key] -= 1
            if not conn.holds[key]:
                del conn.holds[key]
            entry = self._entries[ticket_id]
            piece = entry.pieces[piece_idx]
            piece.holding -= 1
            piece.finished += 1
            self.bytes_served += piece.nbytes
            self._settle(entry, piece)
            return P.Released(valid=True)

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

    def _settle(self, entry: _Entry, piece: _Piece) -> None:
        if piece.finished >= piece.readers and piece.packed is not None:
            piece.packed.release()
            piece.packed = None
            piece.nbytes = piece.nbytes  # keep the size for stats
            piece.unclaimed = 0
            piece.voffset = -1 if entry.streamed else piece.voffset
        if all(p.finished >= p.readers for p in entry.pieces):
            self._entries.pop(entry.ticket_id, None)
            self.transfers += 1
            entry.leaves = None
            entry.done.set()
        self._cond.notify_all()

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
                packed = _pack_range(self.pool, entry, piece)
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

    def _next_piece(self) -> tuple[_Entry, _Piece] | None:
        for entry in self._entries.values():
            if not entry.streamed:
                continue
            for piece in entry.pieces:
                if piece.packed is None and piece.finished < piece.readers:
                    return entry, piece  # pieces of one entry go in order
        return None


def _pack_range(pool: MemoryPool, entry: _Entry, piece: _Piece) -> Packed:
    """Copy bytes [voffset, voffset + nbytes) of an object's one-block layout
    into one pool block. Runs of source bytes that touch are one copy each."""
    # Only streamed entries reach the packer, and put() sets these for them.
    leaves, info, offsets = entry.leaves or [], entry.info, entry.offsets
    if info is None or offsets is None:
        raise TransferError(f"ticket {entry.ticket_id} is not streamed, but its piece {piece.voffset:,} was queued to pack")
    start, stop = piece.voffset, piece.voffset + piece.nbytes
    ext = pool._allocator.allocate(piece.nbytes)
    try:
        n = info.layout.nbytes
        off = offsets
        hit = np.flatnonzero((off < stop) & (off + n > start) & (n > 0))
        buf = pool.buffer
        runs = staged = 0
        with torch.no_grad():
            for i in hit.tolist():
                t = leaves[i]
                lo = max(start, int(off[i])) - int(off[i])
                hi = min(stop, int(off[i] + n[i])) - int(off[i])
                if info.raw[i]:
                    src = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
                else:
                    src = t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
                    staged += 1
                d0 = ext.offset + int(off[i]) + lo - start
                copy_bytes(buf[d0 : d0 + hi - lo], src[lo:hi])
                runs += 1
    except BaseException:
        pool._allocator.free(ext.offset)
        raise
    packed = Packed(
        blocks=(Block(ext.offset, piece.nbytes),),
        layout=info.layout,
        nbytes=piece.nbytes,
        num_tensors=int(hit.size),
        copy_runs=runs,
        strided_copies=staged,
        pool=pool,
    )
    pool._adopt(packed)
    return packed


class Sender:
    """Pack objects into a pool and serve them to receivers.

    A context manager. Runs on the sending process; its server threads run
    in the background until :meth:`close`.

    Args:
        transport: ``"shm"`` (same host), ``"tcp"`` (any host) or ``"nixl"``.
        pool: a pool to serve from; by default the sender makes one of
            ``capacity_nbytes``.
        capacity_nbytes: size of the pool the sender makes.
        host: tcp/nixl: the address to bind (loopback by default).
        port: tcp/nixl: the port to bind (0: any free port).
        advertise_host: tcp/nixl: the address tickets tell receivers to
            connect to. Default: ``host``, unless it is a wildcard
            (``"0.0.0.0"``, ``"::"``, ``""``); then the host's primary
            address: the source address of its default route (a UDP socket
            ``connect`` to a documentation address, which sends nothing), else
            what the host name resolves to, else loopback. Set it when peers
            reach this host by another name (NAT, several interfaces).
        token: shared secret receivers must present; required when binding
            to anything but loopback.
        lease_seconds: default time a ticket's unredeemed slots are kept.
        piece_nbytes: size of the pieces of streamed objects (default: half
            the pool, so one piece is read while the next is packed).
        prefault: touch the pool's pages now, not during the first puts.
        extra_transports: more transports to serve the same pool over (e.g.
            ``("tcp",)`` beside shm); see :meth:`ticket_for`.

    Raises:
        ConfigurationError: an unknown transport, a non-loopback bind without
            a token, an address or port that cannot be bound, a lease that is
            not a positive number of seconds, pieces larger than the pool.
    """

    def __init__(
        self,
        transport: TransportName = "shm",
        pool: MemoryPool | None = None,
        *,
        capacity_nbytes: int = DEFAULT_CAPACITY_NBYTES,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        token: str | bytes | None = None,
        lease_seconds: float = 60.0,
        piece_nbytes: int | None = None,
        prefault: bool = False,
        extra_transports: tuple[str, ...] = (),
    ) -> None:
        from .transports import make_server

        lease_seconds = positive_seconds("Sender(lease_seconds)", lease_seconds, allow_inf=True)
        self.transport = transport
        self._own_pool = pool is None
        self.pool = pool if pool is not None else MemoryPool(capacity_nbytes, prefault=prefault)
        self.lease_seconds = float(lease_seconds)
        cap = self.pool.capacity_nbytes
        self.piece_nbytes = packing.align_up(int(piece_nbytes or max(16, cap // 2)), packing.BLOCK_ALIGNMENT)
        if self.piece_nbytes > cap:
            raise ConfigurationError(
                f"Sender(piece_nbytes={piece_nbytes!r}): pieces of {self.piece_nbytes:,} bytes exceed the pool's {cap:,}; "
                "pass at most the pool's capacity, or leave it unset (half the pool)"
            )
        token_b = token.encode() if isinstance(token, str) else (token or b"")
        self.ledger = Ledger(self.pool)
        self.servers: dict[str, Any] = {}
        try:
            for name in (transport, *extra_transports):
                if name not in self.servers:
                    self.servers[name] = make_server(
                        name, self.ledger, token=token_b, host=host, port=port if name == transport else 0,
                        advertise_host=advertise_host,
                    )
        except BaseException:
            for server in self.servers.values():
                server.close()
            self.ledger.close()
            if self._own_pool:
                self.pool.close()
            raise
        self.server = self.servers[transport]
        self.address = self.server.address

    def put(self, obj: Any, *, readers: int | None = 1, lease_seconds: float | None = None, one_shot: bool = False) -> Ticket:
        """Pack ``obj`` and return its ticket at once.

        Copies each view's bytes into the pool (only its own bytes). An object
        that does not fit in the free space is streamed in pieces, unless
        ``one_shot`` is set. The caller must not change the tensors of a
        streamed object until :meth:`wait_released` returns.

        Args:
            obj: a tensor or any nesting of lists, tuples and dicts of tensors.
            readers: number of receivers that will get it; ``None`` for any
                number, until :meth:`discard` (the lease does not apply).
            lease_seconds: how long slots nobody acquired are kept.
            one_shot: raise instead of streaming when it does not fit.

        Raises:
            UnsupportedTensorError: a leaf cannot be sent (named, with the fix).
            PoolExhaustedError: ``one_shot`` and it does not fit; nothing held.
            ConfigurationError: ``readers`` below 1, or ``lease_seconds`` not
                a positive number of seconds (as for the Sender's own).
        """
        readers = reader_count(readers)
        lease = self.lease_seconds if lease_seconds is None else positive_seconds("put(lease_seconds)", lease_seconds, allow_inf=True)
        ticket_id = secrets.randbits(63)
        deadline = time.monotonic() + lease
        if readers is None:
            # Any number of gets until discard(); the lease does not apply.
            readers, deadline = _UNLIMITED, float("inf")
        try:
            packed = self.pool.pack(obj)
        except PoolExhaustedError:
            if one_shot:
                raise
            return self._put_streamed(obj, ticket_id, readers, lease, deadline)
        piece = _Piece(voffset=0, nbytes=sum(b.nbytes for b in packed.blocks), readers=readers, packed=packed)
        entry = _Entry(ticket_id, readers, lease, deadline, [piece], streamed=False)
        ticket = Ticket(
            id=ticket_id,
            transport=self.transport,
            address=self.address,
            pool_generation=self.pool.generation,
            layout_bytes=packed.layout.to_bytes(),
            blocks=[(b.offset, b.nbytes) for b in packed.blocks],
            total_nbytes=packing.packed_offsets(packed.layout.nbytes, packed.layout.alignments)[1],
            piece_nbytes=0,
            num_pieces=1,
            readers=0 if readers == _UNLIMITED else readers,
            lease_seconds=lease,
        )
        entry.digest = ticket.digest
        if not packed.blocks:
            piece.finished = readers  # nothing to read: done already
            packed.release()  # no ledger entry will: drop it from the pool's live set
            entry.done.set()
            return ticket
        self.ledger.add(entry)
        return ticket

    def _put_streamed(self, obj: Any, ticket_id: int, readers: int, lease: float, deadline: float) -> Ticket:
        with gc_paused():
            leaves, ops, counts, keys, _ = flatten(obj)
            info = inspect_leaves(obj, leaves, ops, counts, keys)
        offsets, total = packing.packed_offsets(info.layout.nbytes, info.layout.alignments)
        size = self.piece_nbytes
        pieces = [
            _Piece(voffset=s, nbytes=min(size, total - s), readers=readers)
            for s in range(0, total, size)
        ]
        entry = _Entry(ticket_id, readers, lease, deadline, pieces, streamed=True, leaves=list(leaves), info=info, offsets=offsets)
        ticket = Ticket(
            id=ticket_id,
            transport=self.transport,
            address=self.address,
            pool_generation=self.pool.generation,
            layout_bytes=info.layout.to_bytes(),
            blocks=[],
            total_nbytes=total,
            piece_nbytes=size,
            num_pieces=len(pieces),
            readers=0 if readers == _UNLIMITED else readers,
            lease_seconds=lease,
        )
        entry.digest = ticket.digest
        self.ledger.add(entry)
        return ticket

    def discard(self, ticket: Ticket) -> None:
        """Stop serving ``ticket``: no new gets; blocks are freed as soon as
        the gets in progress (and zero-copy views) release them."""
        self.ledger.discard(ticket.id)

    def ticket_for(self, ticket: Ticket, transport: str) -> Ticket:
        """The same ticket, redeemable over another transport this sender serves."""
        server = self.servers.get(transport)
        if server is None:
            raise ConfigurationError(
                f"ticket_for(transport={transport!r}): this sender serves {', '.join(self.servers)}; "
                "create it with extra_transports=(...) to serve more"
            )
        return msgspec.structs.replace(ticket, transport=transport, address=server.address)

    def wait_released(self, ticket: Ticket, timeout: float | None = None) -> None:
        """Wait until every reader released the ticket (or its lease expired).

        Raises:
            TransferTimeoutError: not released within ``timeout`` seconds.
        """
        if not self.ledger.wait_released(ticket.id, timeout):
            raise TransferTimeoutError(
                f"ticket {ticket.id} was not released by its {ticket.readers} readers within {timeout} s; "
                f"its lease ends {ticket.lease_seconds} s after the last acquire"
            )

    def stats(self) -> dict[str, int]:
        s = self.pool.stats()
        return {
            "capacity_nbytes": s.capacity_nbytes,
            "used_nbytes": s.used_nbytes,
            "largest_free_nbytes": s.largest_free_nbytes,
            "live_tickets": self.ledger.live_entries(),
            "transfers": self.ledger.transfers,
            "bytes_moved": self.ledger.bytes_served,
        }

    def close(self) -> None:
        """Stop serving and free every block (receivers mid-read will fail)."""
        for server in self.servers.values():
            server.close()
        self.ledger.close()
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
