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

import functools
import secrets
import time
from typing import Any

import msgspec
import torch

from . import packing
from ._args import positive_seconds, reader_count
from ._broadcast import Tree
from ._ledger import Ledger, _Entry, _Piece
from ._tensors import flatten, gc_paused, inspect_leaves
from .errors import ConfigurationError, PlanBusyError, PoolExhaustedError, TransferTimeoutError
from .plans import SendPlan, SourcedPiece
from .pool import DEFAULT_CAPACITY_NBYTES, MemoryPool
from .transports import TransportName
from .ticket import Ticket

__all__ = ["Sender"]

# Reader count of a ticket put with readers=None: never reached.
_UNLIMITED = 1 << 62


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
            if self._own_pool:
                self.pool.close()  # refused: nothing stays open
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
        self._closed = False

    def plan(self, obj: Any, *, dtype: torch.dtype | None = None) -> SendPlan:
        """Inspect ``obj`` once and keep what every later put of it needs.

        Runs on the sender; copies nothing. The plan keeps the tensors (they
        live as long as the plan), the encoded layout and the copy runs;
        ``put(plan)`` then sends their current contents with no per-tensor
        work but a check that they did not move.

        Args:
            obj: a tensor, any nesting of lists, tuples and dicts of tensors,
                or an ``nn.Module`` (planned over its ``state_dict()``;
                ``put`` then also checks that no parameter or buffer was
                replaced).
            dtype: send floating-point tensors as this floating-point dtype
                (e.g. ``torch.bfloat16`` from an fp32 trainer: half the
                bytes); integer and bool tensors go as they are. The plan's
                layout says what receivers get.

        Raises:
            UnsupportedTensorError: a leaf cannot be sent (named, with the fix).
            ConfigurationError: ``dtype`` is not a floating-point dtype; the
                sender is closed.
        """
        self._check_open()
        return SendPlan(self, obj, dtype=dtype)

    def put(
        self,
        obj: Any,
        *,
        readers: int | None = 1,
        lease_seconds: float | None = None,
        one_shot: bool = False,
        snapshot: bool = True,
        fanout: int | None = None,
    ) -> Ticket:
        """Pack ``obj`` (or replay a plan's copy) and return its ticket at once.

        Copies each view's bytes into the pool (only its own bytes). An object
        that does not fit in the free space is streamed in pieces, unless
        ``one_shot`` is set. The caller must not change the tensors of a
        streamed object until :meth:`wait_released` returns.

        Args:
            obj: a tensor or any nesting of lists, tuples and dicts of tensors;
                or a :class:`SendPlan` of this sender (its tensors' current
                contents are sent).
            readers: number of receivers that will get it; ``None`` for any
                number, until :meth:`discard` (the lease does not apply).
            lease_seconds: how long slots nobody acquired are kept.
            one_shot: raise instead of streaming when it does not fit.
            snapshot: plans only. ``True``: copy the tensors into the pool
                and return once the caller may change them. ``False``: copy
                nothing and serve the tensors' own memory (tcp); the caller
                must not change them until :meth:`wait_released` returns.
                tcp sends from them; shm readers copy them straight out of
                this process (``process_vm_readv``: same user, and where
                Yama restricts ptrace, this process must allow it).
            fanout: tcp or nixl: a broadcast. The sender serves at most this many
                receivers itself; the others pull from receivers made with
                ``relay=True`` (each serving at most ``fanout``): a chain
                for 1, a tree for more. The object must fit in one block of
                the free pool (it is not streamed). ``None``: every
                receiver pulls from the sender.

        Raises:
            UnsupportedTensorError: a leaf cannot be sent (named, with the fix).
            PoolExhaustedError: ``one_shot`` and it does not fit; nothing held.
            PlanStaleError: a planned tensor moved, was resized or replaced.
            PlanBusyError: ``snapshot=False`` while the previous such put of
                the plan is still being read.
            ConfigurationError: ``readers`` below 1, ``lease_seconds`` not a
                positive number of seconds, ``snapshot=False`` without a plan
                or on nixl, the sender closed.
        """
        self._check_open()
        readers = reader_count(readers)
        lease = self.lease_seconds if lease_seconds is None else positive_seconds("put(lease_seconds)", lease_seconds, allow_inf=True)
        planned = obj if isinstance(obj, SendPlan) else None
        if not snapshot and planned is None:
            raise ConfigurationError("put(snapshot=False) needs a plan: put(sender.plan(obj), snapshot=False)")
        if fanout is not None:
            if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
                raise ConfigurationError(f"put(fanout={fanout!r}): expected a whole number of receivers from 1 (a chain) up, or None")
            if not {"tcp", "nixl"} & set(self.servers) or not snapshot:
                raise ConfigurationError(
                    f"put(fanout=...) broadcasts through relaying receivers over tcp or nixl; this sender serves {', '.join(self.servers)}"
                    + ("" if snapshot else " and snapshot=False serves the tensors themselves") + ": use a tcp or nixl Sender and snapshot=True"
                )
            if planned is None:
                planned = self.plan(obj)  # one block: a relay passes on one stream
            one_shot = True
        ticket_id = secrets.randbits(63)
        deadline = time.monotonic() + lease
        if readers is None:
            # Any number of gets until discard(); the lease does not apply.
            readers, deadline = _UNLIMITED, float("inf")
        if planned is not None:
            layout, layout_bytes, count = planned.layout, planned.layout_bytes, planned.num_tensors
            total = planned.total_nbytes
            # A snapshot put of some bytes checks the tensors as they move
            # into the pool (SendPlan.fill_checked); any other, before.
            planned.check(self, tensors=not (snapshot and total))
            if not snapshot:
                return self._put_sourced(planned, ticket_id, readers, lease, deadline)
        try:
            if planned is None:
                packed = self.pool.pack(obj)
                layout, layout_bytes = packed.layout, packed.layout.to_bytes()
            else:
                packed = self.pool.pack_with(layout, total, planned.fill_checked, num_tensors=count) if total else None
        except PoolExhaustedError as exc:
            if planned is not None:
                # No block, so fill_checked never ran: a stale plan says so
                # (not that the pool is full), and streamed pieces are packed later.
                planned.check(self)
            if fanout is not None:
                raise PoolExhaustedError(
                    exc.requested_nbytes, exc.free_nbytes, exc.largest_free_nbytes, exc.capacity_nbytes,
                    detail="put(fanout=...) sends the object as one block of the free pool (relays pass on one stream; "
                    "it is not streamed in pieces): wait for older tickets' readers (wait_released, discard), make the Sender "
                    f"with capacity_nbytes of at least {exc.requested_nbytes:,}, or put without fanout",
                ) from exc
            if one_shot:
                raise
            if planned is None:
                return self._put_streamed(obj, ticket_id, readers, lease, deadline)
            return self._add_streamed(planned.layout, planned.layout_bytes, total, planned.fill_piece(self.pool), ticket_id, readers, lease, deadline)
        blocks = list(packed.blocks) if packed is not None else []
        if planned is None:
            total = packing.packed_offsets(layout.nbytes, layout.alignments)[1]
        piece = _Piece(voffset=0, nbytes=sum(b.nbytes for b in blocks), readers=readers, packed=packed)
        entry = _Entry(ticket_id, readers, lease, deadline, [piece], streamed=False, tree=Tree(fanout) if fanout else None)
        ticket = self._ticket(ticket_id, layout_bytes, [(b.offset, b.nbytes) for b in blocks], total, 0, 1, readers, lease)
        entry.digest = ticket.digest
        if not blocks:
            piece.finished = readers  # nothing to read: done already
            if packed is not None:
                packed.release()  # no ledger entry will: drop it from the pool's live set
            entry.done.set()
            return ticket
        self.ledger.add(entry)
        return ticket

    def _ticket(self, ticket_id: int, layout_bytes: bytes, blocks: list[tuple[int, int]], total: int, piece_nbytes: int, num_pieces: int, readers: int, lease: float) -> Ticket:
        return Ticket(
            id=ticket_id,
            transport=self.transport,
            address=self.address,
            pool_generation=self.pool.generation,
            layout_bytes=layout_bytes,
            blocks=blocks,
            total_nbytes=total,
            piece_nbytes=piece_nbytes,
            num_pieces=num_pieces,
            readers=0 if readers == _UNLIMITED else readers,
            lease_seconds=lease,
        )

    def _put_streamed(self, obj: Any, ticket_id: int, readers: int, lease: float, deadline: float) -> Ticket:
        with gc_paused():
            leaves, ops, counts, keys, _ = flatten(obj)
            info = inspect_leaves(obj, leaves, ops, counts, keys)
        offsets, total = packing.packed_offsets(info.layout.nbytes, info.layout.alignments)
        pack = functools.partial(self.pool.pack_range, list(leaves), info, offsets)
        return self._add_streamed(info.layout, info.layout.to_bytes(), total, pack, ticket_id, readers, lease, deadline)

    def _add_streamed(self, layout: Any, layout_bytes: bytes, total: int, pack: Any, ticket_id: int, readers: int, lease: float, deadline: float) -> Ticket:
        """A ticket of pieces of the one-block layout, each packed by
        ``pack(voffset, nbytes)`` when the pool has room for it."""
        size = self.piece_nbytes
        pieces = [_Piece(voffset=s, nbytes=min(size, total - s), readers=readers) for s in range(0, total, size)]
        entry = _Entry(ticket_id, readers, lease, deadline, pieces, streamed=True, pack=pack)
        ticket = self._ticket(ticket_id, layout_bytes, [], total, size, len(pieces), readers, lease)
        entry.digest = ticket.digest
        self.ledger.add(entry)
        return ticket

    def _put_sourced(self, plan: SendPlan, ticket_id: int, readers: int, lease: float, deadline: float) -> Ticket:
        """A plan served from its tensors' own memory, in pieces (tcp sends
        from any address; the pool holds nothing of it)."""
        if self.transport not in ("tcp", "shm"):
            raise ConfigurationError(
                f"put(plan, snapshot=False) serves the tensors' own memory, which the tcp transport sends and shm "
                f"readers copy (process_vm_readv); this sender is {self.transport}: use snapshot=True"
            )
        with plan.lock:
            busy = plan.last_unsnapshotted
            if busy is not None and not self.ledger.is_done(busy):
                raise PlanBusyError(
                    f"put(plan, snapshot=False): ticket {busy} of this plan is still being read, and its bytes are the "
                    "tensors this put would send; call sender.wait_released(ticket) first (or use snapshot=True)"
                )
            plan.source_buffers(0, 0)  # built now: refused here, not mid-transfer, if it cannot be
            total = plan.total_nbytes
            size = self.piece_nbytes
            pieces = [
                _Piece(voffset=s, nbytes=min(size, total - s), readers=readers, packed=SourcedPiece(plan, s, min(s + size, total)))
                for s in range(0, total, size)
            ]
            entry = _Entry(ticket_id, readers, lease, deadline, pieces, streamed=True, sourced=True)
            ticket = self._ticket(ticket_id, plan.layout_bytes, [], total, size, max(1, len(pieces)), readers, lease)
            entry.digest = ticket.digest
            if not pieces:
                entry.done.set()
                return ticket
            self.ledger.add(entry)
            plan.last_unsnapshotted = ticket_id
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
            "bytes_sent": self.ledger.bytes_sent,
        }

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this Sender is closed; make a new one (and new plans: a plan belongs to its sender)")

    def close(self) -> None:
        """Stop serving and free every block (receivers mid-read will fail)."""
        self._closed = True
        for server in self.servers.values():
            server.close()
        self.ledger.close()
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
