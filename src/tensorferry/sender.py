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

import secrets
import time
from typing import Any

import msgspec

from . import packing
from ._args import positive_seconds, reader_count
from ._ledger import Ledger, _Entry, _Piece
from ._tensors import flatten, gc_paused, inspect_leaves
from .errors import ConfigurationError, PoolExhaustedError, TransferTimeoutError
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
