"""``Sender``: pack objects into a pool and serve them to receivers.

The sender side of a transfer. ``put`` packs the object and returns a
:class:`~tensorferry.wire.Ticket` at once; a background server (per
transport) lets receivers acquire a reader slot, fetch the bytes, and
release the slot. Blocks are freed when every reader released them, when a
reader's connection drops (it died mid-read), or when the lease of slots
nobody acquired expires.

Every put executes a plan: ``put(obj)`` a one-shot :class:`SendPlan` of
``obj`` (inspected once, nothing kept), ``put(plan)`` a kept one. How it
executes (resident in the pool, streamed, served from the tensors' own
memory, broadcast) is decided once, by :func:`._execution.choose`, from
the plan and what the servers declare they can do. An object larger than
the free space (or the whole pool) is streamed: it is cut into byte ranges
of its one-block layout ("pieces"), each packed when space frees up (the
window of the plan's runs in its range) and freed once every reader has
read it (backpressure).
"""

from __future__ import annotations

import secrets
import time
import weakref
from typing import Any

import msgspec
import torch

from .errors import ConfigurationError, TransferTimeoutError, positive_seconds, reader_count
from .execution import Entry, Ledger, PutOptions, choose, delta_entry
from .memory import DEFAULT_CAPACITY_NBYTES, MemoryPool
from .plans import SendPlan, max_delta_fraction, offer_delta
from .transports import TransportName, make_server, resolve_token, tls_context
from .wire import Ticket, packing

__all__ = ["Sender"]

# Reader count of a ticket put with readers=None: never reached.
_UNLIMITED = 1 << 62


class Sender:
    """Pack objects into a pool and serve them to receivers.

    A context manager. Runs on the sending process; its server threads run
    in the background until [``close``][tensorferry.sender.Sender.close].

    Args:
        transport: ``"shm"`` (same host), ``"tcp"`` (any host) or ``"nixl"``.
        pool: a pool to serve from; by default the sender makes one of
            ``capacity_nbytes``.
        capacity_nbytes: size of the pool the sender makes, in bytes
            (default 256 MiB).
        host: tcp/nixl: the address to bind (loopback by default).
        port: tcp/nixl: the port to bind (0: any free port).
        advertise_host: tcp/nixl: the address tickets tell receivers to
            connect to. Default: ``host``, unless it is a wildcard
            (``"0.0.0.0"``, ``"::"``, ``""``); then the host's primary
            address: the source address of its default route (a UDP socket
            ``connect`` to a documentation address, which sends nothing), else
            what the host name resolves to, else loopback. Set it when peers
            reach this host by another name (NAT, several interfaces).
        token: shared secret receivers must prove they hold (it never
            crosses the link; see ``docs/security.md``); required when
            binding to anything but loopback. ``None``: ``TENSORFERRY_TOKEN``
            if set; at least 16 bytes (``tensorferry.new_token()``).
        tls: a server ``ssl.SSLContext``: tcp, and nixl's control
            connection, run over TLS (mutual with ``CERT_REQUIRED``).
        lease_seconds: default time a ticket's unredeemed slots are kept.
        piece_nbytes: size of the pieces of streamed objects (default: half
            the pool, so one piece is read while the next is packed).
        prefault: touch the pool's pages now, not during the first puts.
        extra_transports: more transports to serve the same pool over (e.g.
            ``("tcp",)`` beside shm); see
            [``ticket_for``][tensorferry.sender.Sender.ticket_for].

    Raises:
        ConfigurationError: an unknown transport, a non-loopback bind without
            a token, a token under 16 bytes, a ``tls`` not a server SSLContext, an address or port that cannot be bound, a lease that is
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
        tls: Any = None,
    ) -> None:
        lease_seconds = positive_seconds("Sender(lease_seconds)", lease_seconds, allow_inf=True)
        token_b, tls = resolve_token(token, "Sender(token)"), tls_context(tls, server=True, what="Sender(tls)")
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
        self.ledger = Ledger(self.pool)
        self.servers: dict[str, Any] = {}
        try:
            for name in (transport, *extra_transports):
                if name not in self.servers:
                    self.servers[name] = make_server(
                        name, self.ledger, token=token_b, host=host, port=port if name == transport else 0,
                        advertise_host=advertise_host, tls=tls,
                    )
        except BaseException:
            for server in self.servers.values():
                server.close()
            self.ledger.close()
            if self._own_pool:
                self.pool.close()
            raise
        self.server = self.servers[transport]
        self._delta_plans: weakref.WeakSet = weakref.WeakSet()  # the kept versions of this sender's delta plans
        self._last_put = (0, 0, -1)  # the last put's whole bytes, delta bytes, elements changed (-1: not compared)
        self.address = self.server.address
        self._closed = False

    def plan(self, obj: Any, *, dtype: torch.dtype | None = None, delta: bool = False) -> SendPlan:
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
            delta: keep the version last sent (one copy of the sent bytes,
                in this sender's pool) and offer, in each ticket, the changes
                since it to receivers holding it; everyone else reads the
                whole object (see ``docs/delta.md``).

        Raises:
            UnsupportedTensorError: a leaf cannot be sent (named, with the fix).
            ConfigurationError: ``dtype`` is not a floating-point dtype; the
                sender is closed.
            PoolExhaustedError: ``delta`` and no room in the pool for the
                kept version.
        """
        self._check_open()
        plan = SendPlan(self.pool, obj, dtype=dtype, owner=self.ledger, delta=delta)
        if plan.delta is not None:
            plan.delta.max_fraction = max_delta_fraction(self.servers.values())
            self._delta_plans.add(plan.delta)
        return plan

    def put(
        self,
        obj: Any,
        *,
        readers: int | None = 1,
        lease_seconds: float | None = None,
        one_shot: bool = False,
        snapshot: bool = True,
        fanout: int | None = None,
        trees: bool = False,
    ) -> Ticket:
        """Execute a plan of ``obj`` (a one-shot plan of a fresh object, or
        the kept plan given) and return its ticket at once.

        Copies each view's bytes into the pool (only its own bytes). An object
        that does not fit in the free space is streamed in pieces, unless
        ``one_shot`` is set. The caller must not change the tensors of a
        streamed object until
        [``wait_released``][tensorferry.sender.Sender.wait_released] returns.
        ``readers=1`` by default, for a plan too.

        Args:
            obj: a tensor or any nesting of lists, tuples and dicts of tensors;
                or a [``SendPlan``][tensorferry.plans.SendPlan] of this sender
                (its tensors' current contents are sent).
            readers: number of receivers that will get it; ``None`` for any
                number, until [``discard``][tensorferry.sender.Sender.discard]
                (the lease does not apply).
            lease_seconds: how many seconds slots nobody acquired are kept
                (default: the sender's ``lease_seconds``).
            one_shot: raise instead of streaming when it does not fit.
            snapshot: plans only. ``True``: copy the tensors into the pool
                and return once the caller may change them. ``False``: copy
                nothing and serve the tensors' own memory (tcp); the caller
                must not change them until
                [``wait_released``][tensorferry.sender.Sender.wait_released]
                returns. tcp sends from them; shm readers copy them straight
                out of this process (``process_vm_readv``: same user, and where
                Yama restricts ptrace, this process must allow it).
            fanout: tcp or nixl: a broadcast. The sender serves at most this many
                receivers itself; the others pull from receivers made with
                ``relay=True`` (each serving at most ``fanout``): a chain
                for 1, a tree for more. The object must fit in one block of
                the free pool (it is not streamed). ``None``: every
                receiver pulls from the sender.
            trees: a broadcast in two complementary binary trees (tcp or
                nixl; ``fanout`` is 2, said or not): the object is split in
                two halves, each relaying receiver pulls one half from its
                parent in one tree and the other from its parent in the
                other at once, and passes each on as it arrives. Each relay
                is interior in at most one tree, so it sends about one
                object in all (as in a chain), the sender sends one, and
                the depth is about log2(readers) instead of a chain's
                readers. Needs a number of ``readers`` (the trees' places).

        Raises:
            UnsupportedTensorError: a leaf cannot be sent (named, with the fix).
            PoolExhaustedError: ``one_shot`` and it does not fit; nothing held.
            PlanStaleError: a planned tensor moved, was resized or replaced.
            PlanBusyError: ``snapshot=False`` while the previous such put of
                the plan is still being read.
            ConfigurationError: ``readers`` below 1, ``lease_seconds`` not a
                positive number of seconds, ``snapshot=False`` without a plan
                or on nixl, the sender closed; ``trees`` with a ``fanout``
                other than 2 or with ``readers=None``.
        """
        self._check_open()
        readers = reader_count(readers)
        lease = self.lease_seconds if lease_seconds is None else positive_seconds("put(lease_seconds)", lease_seconds, allow_inf=True)
        if not snapshot and not isinstance(obj, SendPlan):
            raise ConfigurationError("put(snapshot=False) needs a plan: put(sender.plan(obj), snapshot=False)")
        if fanout is not None and (isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1):
            raise ConfigurationError(f"put(fanout={fanout!r}): expected a whole number of receivers from 1 (a chain) up, or None")
        if not isinstance(trees, bool):
            raise ConfigurationError(f"put(trees={trees!r}): expected True (two complementary trees) or False")
        if trees:
            if fanout not in (None, 2):
                raise ConfigurationError(f"put(trees=True, fanout={fanout}): the two trees are binary (fanout 2); leave fanout out or pass 2, "
                                         "or drop trees for a tree of that fanout")
            if readers is None:
                raise ConfigurationError("put(trees=True, readers=None): the two trees lay out a known number of receivers; "
                                         "put with readers=N (every receiver that will get it)")
            fanout = 2
        ticket_id = secrets.randbits(63)
        deadline = time.monotonic() + lease
        if readers is None:
            # Any number of gets until discard(); the lease does not apply.
            readers, deadline = _UNLIMITED, float("inf")
        if isinstance(obj, SendPlan):
            plan = obj
            # A snapshot put of some bytes checks the tensors as they move
            # into the pool (SendPlan.fill_checked); any other, before.
            plan.check(self.ledger, tensors=not (snapshot and plan.total_nbytes))
        else:
            plan = SendPlan(self.pool, obj, kept=False, owner=self.ledger)
        opts = PutOptions(readers, one_shot, snapshot, fanout, trees, self.piece_nbytes)
        ex = choose(plan, opts, self.servers.values())
        offer, delta_packed = offer_delta(plan, ex, opts)
        last = plan.delta.last if plan.delta is not None else None
        # The object's tensor bytes, as Receiver.stats()["delivered_nbytes"]
        # counts them: not the packed size, whose alignment padding no tensor holds.
        whole = plan.layout.total_nbytes
        self._last_put = (whole, last.delta_nbytes, last.changed if last.compared else -1) if last else (whole, 0, -1)
        ticket = Ticket(
            id=ticket_id,
            transport=self.transport,
            address=self.address,
            pool_generation=self.pool.generation,
            layout_bytes=plan.layout_bytes,
            blocks=ex.blocks,
            total_nbytes=plan.total_nbytes,
            piece_nbytes=ex.piece_nbytes,
            num_pieces=ex.num_pieces,
            readers=0 if readers == _UNLIMITED else readers,
            lease_seconds=lease,
            version=plan.puts + 1 if plan.kept else 0,  # counted below, once the put stands
            delta=offer,
        )
        if ex.kind == "empty":
            plan.puts = ticket.version
            return ticket  # nothing to read: done already
        entry = Entry(
            ticket_id, readers, lease, deadline, ex.pieces, streamed=ex.kind != "resident", pack=ex.pack,
            digest=ticket.digest, sourced=ex.kind == "sourced", source=plan if ex.kind == "sourced" else None, tree=ex.tree,
        )
        try:
            self.ledger.add(entry)
            if delta_packed is not None:
                self.ledger.add(delta_entry(ticket, delta_packed, readers, deadline, fanout, trees))
        except BaseException:
            self.ledger.discard(ticket_id)
            for piece in ex.pieces:
                if piece.packed is not None:
                    piece.packed.release()
            if delta_packed is not None:
                delta_packed.release()
            raise
        plan.puts = ticket.version
        return ticket

    def discard(self, ticket: Ticket) -> None:
        """Stop serving ``ticket``: no new gets; blocks are freed as soon as
        the gets in progress (and zero-copy views) release them.

        Runs on the sender; copies nothing. It gives up every reader slot
        nobody acquired, whatever ``readers`` the ticket was put with (it
        is how a ``readers=None`` put ends): a later get of it fails with a
        ``TransferError``. A get in progress finishes: of a streamed
        ticket, a reader that took the first piece keeps its slot in each
        later piece, which is packed for it as room frees (a reader that
        went away mid-stream holds those until the ticket's lease ends), so,
        as for any streamed ticket, change its tensors only after
        [``wait_released``][tensorferry.sender.Sender.wait_released].

        Args:
            ticket: a ticket this sender put, or its copy from
                [``ticket_for``][tensorferry.sender.Sender.ticket_for] (the
                same ticket). A delta plan's ticket takes the slots of its
                delta with it. A ticket already released by all its
                readers, expired or unknown here, or a closed sender:
                nothing happens.
        """
        self.ledger.discard(ticket.id)
        if ticket.delta is not None and ticket.delta.ticket_id:
            self.ledger.discard(ticket.delta.ticket_id)

    def ticket_for(self, ticket: Ticket, transport: str) -> Ticket:
        """The same ticket, redeemable over another transport this sender serves.

        Runs on the sender; copies nothing. Only the ticket's transport and
        address change (they are not in its ``digest``): it is the same
        ticket, so gets over either transport take its one set of
        ``readers`` slots. Whether that transport can serve it is checked
        when a receiver redeems it (e.g. nixl refuses a ``snapshot=False``
        put, before taking a slot).

        Args:
            ticket: a ticket this sender put (not looked up: any ticket is
                rewritten).
            transport: a transport this sender serves: its ``transport`` or
                one of its ``extra_transports`` (e.g. ``"tcp"`` beside
                ``"shm"``).

        Returns:
            A copy of ``ticket`` with ``transport`` and that server's
                ``address``.

        Raises:
            ConfigurationError: this sender does not serve ``transport``
                (the message names those it serves).
        """
        server = self.servers.get(transport)
        if server is None:
            raise ConfigurationError(
                f"ticket_for(transport={transport!r}): this sender serves {', '.join(self.servers)}; "
                "create it with extra_transports=(...) to serve more"
            )
        return msgspec.structs.replace(ticket, transport=transport, address=server.address)

    def wait_released(self, ticket: Ticket, timeout: float | None = None) -> None:
        """Wait until every reader released the ticket (or its lease expired).

        Args:
            ticket: a ticket this sender put.
            timeout: the most seconds to wait (default None: as long as it
                takes).

        Raises:
            TransferTimeoutError: not released within ``timeout`` seconds.
        """
        end = None if timeout is None else time.monotonic() + timeout
        delta_id = ticket.delta.ticket_id if ticket.delta is not None else 0
        if not all(self.ledger.wait_released(i, None if end is None else max(0.0, end - time.monotonic())) for i in (ticket.id, delta_id) if i):
            raise TransferTimeoutError(
                f"ticket {ticket.id} was not released by its {ticket.readers} readers within {timeout} s; "
                f"its lease ends {ticket.lease_seconds} s after the last acquire"
            )

    def stats(self) -> dict[str, int]:
        """The pool's figures, the transfers served, and the last put's:
        ``last_put_nbytes`` (the whole object's tensor bytes; ``bytes_moved``
        counts pool bytes, alignment padding included), ``last_put_delta_nbytes`` (the
        delta a receiver holding its base read; 0 without one) and
        ``last_put_changed`` (elements a delta plan's compare found changed;
        -1 where no compare ran: not a delta plan, its first put, a refresh
        after deltas too dense to pay, or a compare stopped at the delta's
        size limit; receivers then read the whole object);
        ``delta_kept_nbytes``: the versions delta plans keep (pool bytes,
        counted in ``used_nbytes`` too)."""
        s = self.pool.stats()
        full, delta, changed = self._last_put
        return {
            "capacity_nbytes": s.capacity_nbytes,
            "used_nbytes": s.used_nbytes,
            "largest_free_nbytes": s.largest_free_nbytes,
            "live_tickets": self.ledger.live_entries(),
            "transfers": self.ledger.transfers,
            "bytes_moved": self.ledger.bytes_served,
            "bytes_sent": self.ledger.bytes_sent,
            "last_put_nbytes": full,
            "last_put_delta_nbytes": delta,
            "last_put_changed": changed,
            "delta_kept_nbytes": sum(k.kept_nbytes for k in list(self._delta_plans)),
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
