"""``Receiver``: redeem tickets into tensors, in new memory or in place.

The receiver side of a transfer. Every ``get`` executes a receive plan
(:class:`~tensorferry.plans.RecvPlan`): ``get(t, into=plan)`` a kept one
(``Receiver.plan``), any other get a one-shot plan made from the ticket.
The get acquires a reader slot from the sender, moves the bytes the way
:func:`._receive.route` chooses from the plan and the channel's declared
capabilities, releases the slot, and returns the plan's result.

* By default the destination is new memory (or the receiver's own pool,
  if it has one: the views then keep their blocks until the last of them is
  collected).
* ``into=`` writes into the caller's existing tensors or module (weight
  updates in place), matched by key for dicts and by position for lists
  and tuples.
* ``zero_copy=True`` (channels that map the sender's memory: shm) returns
  views of the sender's pool itself; the sender's slot is held until the
  last view's storage is collected.

The channels (one per sender and concurrent get) and the releaser of
zero-copy holds come from :mod:`tensorferry.transports`; moving the bytes
is :mod:`._receive`'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Literal

from .errors import ConfigurationError, PeerGoneError, TicketError, TransferError, positive_seconds
from .execution import Fetcher
from .memory import (
    DEFAULT_CAPACITY_NBYTES,
    DEFAULT_IDLE_SECONDS,
    MemoryPool,
    ReceiveCache,
    cap_nbytes,
    huge_pages_off,
    idle_seconds,
)
from .plans import RecvPlan, ShardedPlan
from .transports import (
    Channel,
    ChannelPool,
    ReceiveContext,
    RelayBook,
    RelayServer,
    Releaser,
    SameHostReads,
    channel_class,
    is_loopback,
    relay_tls_context,
    resolve_token,
    tls_context,
)
from .wire import Ticket, TransportName, packing

__all__ = ["Receiver"]

DEFAULT_TIMEOUT_SECONDS = 60.0


class Receiver:
    """Redeem tickets from any sender of one transport.

    A context manager. Thread-safe: concurrent gets use separate connections.

    Args:
        transport: the transport of the tickets it redeems (``None``: any).
        pool: optional receive pool; copies land in it, and the returned
            views keep their blocks until collected. The nixl transport makes
            one of ``capacity_nbytes`` if none is given (it reads into
            registered memory).
        token: the sender's shared secret, if any (proved, never sent; ``None``: ``TENSORFERRY_TOKEN`` if set).
        tls: a client ``ssl.SSLContext``: tcp and nixl's control over TLS.
        timeout: default seconds for every wait of a get (60; ``get(timeout=)`` overrides it).
        capacity_nbytes: size of the receive pool nixl makes, in bytes (default 256 MiB).
        cache_nbytes: the most bytes of collected results kept for the next
            gets (the receive cache: new memory costs a page fault a page,
            memory of a result collected earlier does not). ``None``:
            ``TENSORFERRY_RECEIVE_CACHE_BYTES`` if set, else 2 GiB (at most
            an eighth of the host's memory); 0 turns the cache off.
        cache_idle_seconds: memory the cache kept and no get used for this many seconds
            goes back to the system (default 60; ``float("inf")``: never).
        relay: tcp or nixl: pass on broadcast tickets (``Sender.put(fanout=)``) to the receivers
            the sender places below this one, while still receiving them; children present the
            ``token``. tcp children on other hosts take a stream; nixl children READ the ticket's
            memory, which a relay registers with a NIXL agent of its own. Of a two-tree broadcast
            (``Sender.put(trees=True)``) it pulls each half from its parent in that half's tree at
            once, and passes each on as it arrives.
        host: ``relay=True`` only: the address it listens on (default loopback; any other needs the ``token``).
        port: ``relay=True`` only: its port (default 0: any free one; ``relay_address`` says which).
        advertise_host: ``relay=True`` only: the address children are told to connect to (default
            ``host``, or the host's primary address where ``host`` is a wildcard, as for a Sender).
        stall_seconds: a relay this receiver pulls from that sends no chunk for this many seconds
            (default 5) is given up: the sender names another source and the get resumes from the bytes it has.
        relay_linger_seconds: a relay keeps a ticket's bytes this many seconds (default 60)
            after it arrived (or after a child's last pull), for late children.
        relay_reads: how this receiver reads a relay on its own host (same
            boot, network and pid namespace): ``"memory"`` copies straight
            out of the relay's receive memory (process_vm_readv: one kernel
            copy, no socket; where the kernel refuses, ptrace restricted,
            out of a read-only mapping of the relay's memfd, passed over a
            Unix socket; where neither works, another user, it logs why and
            streams), ``"tcp"`` reads it as a relay on another host (a tcp
            stream; NIXL READs for a nixl receiver).
        relay_tls: ``relay=True`` with ``tls``: a server ``ssl.SSLContext`` (this host's
            certificate) over which it serves its children, who check it with their ``tls``.
    """

    def __init__(
        self,
        transport: TransportName | None = None,
        pool: MemoryPool | None = None,
        *,
        token: str | bytes | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        capacity_nbytes: int = DEFAULT_CAPACITY_NBYTES,
        cache_nbytes: int | None = None,
        cache_idle_seconds: float = DEFAULT_IDLE_SECONDS,
        relay: bool = False,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        stall_seconds: float = 5.0,
        relay_linger_seconds: float = 60.0,
        relay_reads: Literal["memory", "tcp"] = "memory",
        tls: Any = None,
        relay_tls: Any = None,
    ) -> None:
        if relay_reads not in ("memory", "tcp"):
            raise ConfigurationError(f"Receiver(relay_reads={relay_reads!r}): pass \"memory\" (copy out of a same-host relay) or \"tcp\"")
        self._same_host_reads = SameHostReads(enabled=relay_reads == "memory")
        self.transport = transport
        if transport is not None:
            channel_class(transport)  # fail early on an unknown name
        huge_pages_off()  # a bad TENSORFERRY_HUGE_PAGES fails here, not mid-get
        cache_cap, cache_idle = cap_nbytes(cache_nbytes), idle_seconds(cache_idle_seconds)
        self.token = resolve_token(token, "Receiver(token)")
        tls = tls_context(tls, server=False, what="Receiver(tls)")
        relay_tls = relay_tls_context(tls, relay_tls, relay=relay)
        self.timeout = positive_seconds("Receiver(timeout)", timeout)
        self._context = ReceiveContext(pool, capacity_nbytes=capacity_nbytes)
        if transport is not None and channel_class(transport).reads_registered_only:
            self._context.ensure_pool()  # registered once, up front
        self._channels = ChannelPool(channel_class, token=self.token, context=self._context, tls=tls)
        self._releaser = Releaser()
        # Plans belong to the receiver that made them: this token says whose.
        self._owner = object()
        self.bytes_received = 0
        self.delivered_nbytes = 0
        self.gets = 0
        self._closed = False
        self.stall_seconds = positive_seconds("Receiver(stall_seconds)", stall_seconds)
        self._book: RelayBook | None = None
        self._relay_server: RelayServer | None = None
        self.relay_address = ""
        if relay:
            self._start_relay(host, port, advertise_host, positive_seconds("Receiver(relay_linger_seconds)", relay_linger_seconds), relay_tls)
        # Last: nothing after it can fail and leave it registered with the monitor.
        # A relay's memory is memfds, which its same-host children map.
        self._cache = ReceiveCache(cache_cap, cache_idle, shared=relay)
        self._fetcher = Fetcher(self._context, self._cache, self._releaser, token=self.token, stall_seconds=self.stall_seconds,
                                reads=self._same_host_reads, book=self._book, relay_address=self.relay_address, tls=self._channels.tls)

    def _start_relay(self, host: str, port: int, advertise_host: str | None, linger: float, relay_tls: Any) -> None:
        if self.transport is not None and not channel_class(self.transport).relays:
            self.close()
            raise ConfigurationError(f"Receiver(relay=True) relays over tcp or nixl; this receiver speaks {self.transport}")
        if not is_loopback(host) and not self.token:
            self.close()
            raise ConfigurationError(
                f"Receiver(relay=True, host={host!r}) listens off loopback: pass token=... (the sender's), which children present"
            )
        self._book = RelayBook(linger)
        try:
            self._relay_server = RelayServer(self._book, token=self.token, host=host, port=port, advertise_host=advertise_host, tls=relay_tls)
        except BaseException:
            self.close()
            raise
        self.relay_address = self._relay_server.address

    @property
    def pool(self) -> MemoryPool | None:
        """The receive pool (given, or made for nixl), if any."""
        return self._context.pool

    # -- get -------------------------------------------------------------------------

    def get(self, ticket: Ticket | bytes, *, timeout: float | None = None, into: Any = None, zero_copy: bool = False) -> Any:
        """Fetch the object of ``ticket``.

        Args:
            ticket: a [``Ticket``][tensorferry.wire.Ticket] or its bytes.
            timeout: seconds for the whole get (default: the receiver's).
            into: existing tensors to write into, nested as the sender put
                them (dicts matched by key, in any order; lists and tuples
                by position), or an ``nn.Module`` (its ``state_dict()``), or a
                [``RecvPlan``][tensorferry.plans.RecvPlan] of this receiver;
                returned as given (a plan: its ``result``), updated in place.
            zero_copy: shm only: return views of the sender's pool; the
                sender keeps the blocks until the views are collected.

        Returns:
            The object, nested as the sender put it (tensors that were the
                same view twice come back as one tensor).

        Raises:
            TicketError: a malformed or stale ticket.
            LayoutMismatchError: ``into`` does not match the sent tensors
                (named by key or position); nothing was written.
            PeerGoneError: the sender went away; the receiver stays usable.
            TransferTimeoutError: it took longer than ``timeout``.
            ConfigurationError: the receiver is closed; ``zero_copy`` with
                ``into=``, a streamed object or a transport that does not
                map the sender's memory; another receiver's plan.
        """
        self._check_open()
        if isinstance(ticket, (list, tuple)) or isinstance(into, ShardedPlan):
            if zero_copy:
                raise ConfigurationError("a sharded get writes into its targets; leave zero_copy off")
            return self._get_sharded(ticket, into, timeout)
        ticket = self._spoken(ticket)
        timeout = self.timeout if timeout is None else positive_seconds("get(timeout)", timeout)
        deadline = time.monotonic() + timeout
        if isinstance(into, RecvPlan):
            if zero_copy:
                raise ConfigurationError("get(into=plan, zero_copy=True): a plan's tensors are the destination; leave zero_copy off")
            plan = into
            plan.check(self._owner, ticket)
        else:
            if zero_copy and (into is not None or ticket.streamed):
                raise ConfigurationError(
                    "zero_copy cannot be combined with into=, or with a streamed object (larger than the sender's free pool): "
                    "leave zero_copy off, or give the sender a pool that holds the object"
                )
            plan = self._one_shot(ticket, into)
        if not ticket.blocks and not ticket.streamed:
            # No bytes (an empty object, zero-size tensors): the sender keeps
            # no slot for it, so there is nothing to fetch or release.
            if plan.allocates:
                plan.adopt([])
            result = plan.result
        else:
            with self._channel(ticket, timeout) as ch:
                if zero_copy and not ch.maps_sender_memory:
                    raise ConfigurationError(f"zero_copy needs a transport that maps the sender's memory (shm); this ticket is {ticket.transport}")
                result, moved = self._fetcher.get(ch, plan, ticket, zero_copy=zero_copy, deadline=deadline)
            self.bytes_received += moved
            self.delivered_nbytes += plan.layout.total_nbytes
        self.gets += 1
        return result

    def plan(self, ticket: Ticket | bytes, *, into: Any = None) -> RecvPlan:
        """Check ``ticket``'s layout once and keep what every later get of
        that layout needs (receiver side; nothing is fetched).

        ``get(t, into=plan)`` then moves the bytes of any ticket ``t`` of the
        same layout straight into the planned destinations and returns
        [``RecvPlan.result``][tensorferry.plans.RecvPlan.result], the same
        objects every time.

        Args:
            ticket: a ticket of the layout to plan for (or its bytes); it
                is not redeemed.
            into: existing tensors to write into, nested as the sender put
                them (matched as for ``get``), or an ``nn.Module`` (its
                ``state_dict()``; a get then also checks that no parameter
                or buffer was replaced); ``None``: the plan allocates
                destination tensors once (from the receive pool where it
                has room) and every get returns them.

        Raises:
            TicketError: a malformed ticket.
            LayoutMismatchError: ``into`` does not match the layout (named).
            ConfigurationError: the receiver is closed.
        """
        self._check_open()
        if isinstance(ticket, (list, tuple)):
            return ShardedPlan(self._owner, self._tickets(ticket), into)
        ticket = _decoded(ticket)
        layout = ticket.layout
        _check_size(ticket, packing.packed_offsets(layout.nbytes, layout.alignments)[1])
        # Its own destination comes from where a get's would (the receive
        # pool where it has room, registered for NIXL; else the cache).
        return RecvPlan(self._owner, ticket, into, allocate=self._fetcher.destination)

    def _get_sharded(self, tickets: Any, into: Any, timeout: float | None) -> Any:
        """``get(tickets, into=target or ShardedPlan)``: the plan's ranges
        from every source at once (see :class:`~tensorferry.plans.ShardedPlan`)."""
        if not isinstance(tickets, (list, tuple)):
            raise ConfigurationError("get(into=sharded plan) takes the list of every source rank's tickets")
        tickets = self._tickets(tickets)
        timeout = self.timeout if timeout is None else positive_seconds("get(timeout)", timeout)
        deadline = time.monotonic() + timeout
        plan = into if isinstance(into, ShardedPlan) else ShardedPlan(self._owner, tickets, into, kept=False)
        tickets = plan.order(self._owner, tickets)

        group = object()  # this get's streams, if it relays: kept side by side

        def read(k: int, t: Ticket) -> None:
            if t.blocks or t.streamed:
                with self._channel(t, timeout) as ch:
                    self._fetcher.read_ranges(ch, t, lambda g, lo, hi: plan.ranges(k, g, lo, hi), lambda g: plan.digest(k, g), deadline, group=group,
                                              delta=plan.delta(k))

        # Reads land only in registered memory on some channels: the targets
        # are registered once for all sources (through one channel).
        registers = channel_class(tickets[0].transport).reads_registered_only
        with self._channel(tickets[0], timeout) if registers else contextlib.nullcontext() as ch0, plan.registered(ch0):
            result = plan.execute(tickets, read)
        self.bytes_received += plan.last_nbytes
        self.delivered_nbytes += plan.nbytes
        self.gets += 1
        return result

    def _tickets(self, tickets: list | tuple) -> list[Ticket]:
        return [self._spoken(t) for t in tickets]

    def _spoken(self, ticket: Ticket | bytes | bytearray | memoryview) -> Ticket:
        """The ticket decoded, for a transport this receiver speaks."""
        ticket = _decoded(ticket)
        if self.transport is not None and ticket.transport != self.transport:
            raise TicketError(f"ticket is for the {ticket.transport} transport, this receiver speaks {self.transport}")
        return ticket

    def _one_shot(self, ticket: Ticket, into: Any) -> RecvPlan:
        """The plan of one get of ``ticket`` (its layout decoded once)."""
        plan = RecvPlan.one_shot(self._owner, ticket.layout, ticket.layout_bytes, into, self._fetcher.destination)
        _check_size(ticket, plan.total_nbytes)
        return plan

    @contextlib.contextmanager
    def _channel(self, ticket: Ticket, timeout: float) -> Iterator[Channel]:
        """A channel to the ticket's sender, held (locked) for one get; given
        back after, or discarded if the get failed (its stream may be
        mid-frame: never reuse it). An OSError is the sender lost."""
        ch = self._channels.checkout(ticket.transport, ticket.address, ticket.pool_generation, ticket.id, timeout)
        try:
            with ch.lock:
                yield ch
        except BaseException as exc:
            self._channels.discard(ch)
            if isinstance(exc, OSError) and not isinstance(exc, TransferError):
                raise PeerGoneError(f"lost the sender at {ticket.address} ({exc})") from exc
            raise
        self._channels.give_back(ch)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this Receiver is closed; make a new one (and new plans: a plan belongs to its receiver)")

    def stats(self) -> dict[str, int]:
        """This receiver's counters and its receive cache's figures, by key.

        ``gets``, ``bytes_received`` (what completed gets read from senders
        and relays: a delta get counts the delta, a sharded get its own
        slices), ``delivered_nbytes`` (tensor bytes of the objects they
        returned), ``cache_*`` (the receive cache), ``relay_*`` (reads of
        relays, and what a relaying receiver passed on). Every key, its unit
        and what it counts: ``docs/reference/stats.md``.
        """
        cache = self._cache.stats()
        reads = self._same_host_reads
        relay = {"relay_memory_read_nbytes": reads.memory_nbytes, "relay_file_read_nbytes": reads.file_nbytes,
                 "relay_stream_nbytes": reads.stream_nbytes, "relay_nixl_read_nbytes": reads.nixl_nbytes}
        if self._relay_server is not None:
            server = self._relay_server
            relay.update(relay_bytes_sent=server.bytes_sent, relay_bytes_lent=server.bytes_lent, relay_bytes_exposed=server.bytes_exposed,
                         relay_held_nbytes=self._book.held_nbytes())
        return {"gets": self.gets, "bytes_received": self.bytes_received, "delivered_nbytes": self.delivered_nbytes, **relay, **{f"cache_{k}": v for k, v in cache._asdict().items()}}

    def close(self) -> None:
        """Close the connections and unmap the receive cache's idle memory.

        Results still alive stay valid: their memory is unmapped when they
        are collected.
        """
        self._closed = True
        if self._relay_server is not None:
            self._relay_server.close()
        if self._book is not None:
            self._book.close()
        self._channels.close()
        fetcher = getattr(self, "_fetcher", None)  # absent if the constructor failed before it
        if fetcher is not None:
            fetcher.close()
        self._releaser.stop()
        self._context.close()
        cache = getattr(self, "_cache", None)  # absent if the constructor failed before it
        if cache is not None:
            cache.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decoded(ticket: Ticket | bytes | bytearray | memoryview) -> Ticket:
    # Anything else (None, a hex str) would fail later as an AttributeError.
    return ticket if isinstance(ticket, Ticket) else Ticket.from_bytes(ticket)


def _check_size(ticket: Ticket, packed_nbytes: int) -> None:
    if ticket.total_nbytes != packed_nbytes:
        raise TicketError(f"ticket says {ticket.total_nbytes:,} bytes, its layout packs into {packed_nbytes:,}")
