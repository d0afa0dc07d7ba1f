"""``Receiver``: redeem tickets into tensors, in new memory or in place.

The receiver side of a transfer. ``get`` acquires a reader slot from the
sender, moves the bytes (shm: one copy per block out of the mapped pool;
tcp: ``recv_into`` straight into the destination; nixl: a one-sided READ),
releases the slot, and rebuilds the object as views of the destination.

* By default the destination is new memory (or the receiver's own pool,
  if it has one: the views then keep their blocks until the last of them is
  collected).
* ``into=`` copies into the caller's existing tensors (weight updates in
  place), matched by key for dicts and by position for lists and tuples.
* ``zero_copy=True`` (shm only) returns views of the sender's pool itself;
  the sender's slot is held until the last view's storage is collected.

Which of these a get does, and how its bytes move, is decided in one place
(:func:`_strategy`); the channels (one per sender and concurrent get) and
the releaser of zero-copy holds live in :mod:`.transports._connections`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch

from . import packing
from ._args import positive_seconds
from ._copy import StagedCopy, copy_from_blocks, copy_staged, executor, fill_aliases, finish, scatter_segments
from ._recv_cache import DEFAULT_IDLE_SECONDS, ReceiveCache, cap_nbytes, idle_seconds
from ._tensors import gc_paused, match_into, unflatten
from ._views import build_views
from .errors import (
    ConfigurationError,
    PeerGoneError,
    PoolExhaustedError,
    ProtocolError,
    TicketError,
    TransferError,
    TransferTimeoutError,
)
from .layout import Layout
from .plans import RecvPlan
from .pool import DEFAULT_CAPACITY_NBYTES, MemoryPool
from .ticket import Ticket, TransportName

__all__ = ["Receiver"]

DEFAULT_TIMEOUT_SECONDS = 60.0
# Below this many tensors, views cost less than handing the copy to a thread.
_OVERLAP_MIN_TENSORS = 2048
# into= over tcp scatters straight into the caller's tensors (one recvmsg
# buffer and one view each, tens of us a tensor) up to this many tensors,
# or while they average at least _SCATTER_MIN_MEAN_NBYTES (then a tensor's
# overhead costs less than copying its bytes once more); otherwise, and
# over nixl, the bytes go through a staging buffer of at most _STAGE_NBYTES
# and are copied out by address. Receive-pool room smaller than
# _STAGE_MIN_NBYTES is not worth using as that buffer.
_SCATTER_MAX_TENSORS = 256
_SCATTER_MIN_MEAN_NBYTES = 256 << 10
_STAGE_NBYTES = 64 << 20
_STAGE_MIN_NBYTES = 4 << 20


def _strategy(ch: Any, layout: Layout, *, into: bool, zero_copy: bool, streamed: bool) -> str:
    """How one get moves its bytes; the one decision of the receiver.

    ``zero-copy`` (shm: views of the sender's pool), ``streamed`` (pieces,
    larger than the sender's free pool), ``into-mapped`` (shm: one copy from
    the mapped pool into the targets), ``into-scatter`` (tcp, few or large
    tensors: received straight into the targets), ``into-staged`` (through a
    bounded staging buffer, copied out by address), ``new`` (new memory or
    the receive pool, then views).
    """
    if zero_copy:
        return "zero-copy"
    if streamed:
        return "streamed"
    if not into:
        return "new"
    if ch.supports_zero_copy:
        return "into-mapped"
    if ch.supports_scatter and layout.num_tensors <= max(_SCATTER_MAX_TENSORS, layout.total_nbytes // _SCATTER_MIN_MEAN_NBYTES):
        return "into-scatter"
    return "into-staged"


class Receiver:
    """Redeem tickets from any sender of one transport.

    A context manager. Thread-safe: concurrent gets use separate connections.

    Args:
        transport: the transport of the tickets it redeems (``None``: any).
        pool: optional receive pool; copies land in it, and the returned
            views keep their blocks until collected. The nixl transport makes
            one of ``capacity_nbytes`` if none is given (it reads into
            registered memory).
        token: the sender's shared secret, if it has one.
        timeout: default seconds for every wait of a get.
        capacity_nbytes: size of the receive pool nixl makes.
        cache_nbytes: the most bytes of collected results kept for the next
            gets (the receive cache: new memory costs a page fault a page,
            memory of a result collected earlier does not). ``None``:
            ``TENSORFERRY_RECEIVE_CACHE_BYTES`` if set, else 2 GiB (at most
            an eighth of the host's memory); 0 turns the cache off.
        cache_idle_seconds: memory the cache kept and no get used for this
            long goes back to the system (``float("inf")``: never).
        relay: tcp or nixl: pass on broadcast tickets (``Sender.put(fanout=)``)
            to the receivers the sender places below this one, while still
            receiving them; listens on ``host``:``port`` (advertised as
            ``advertise_host``, as for a Sender; a non-loopback address
            needs the ``token``, which children present). tcp children on
            other hosts take a stream; nixl children READ the ticket's
            memory, which a relay registers with a NIXL agent of its own.
        stall_seconds: a relay this receiver pulls from that sends no chunk
            for this long is given up: the sender names another source and
            the get resumes from the bytes it has.
        relay_linger_seconds: a relay keeps a ticket's bytes this long after
            it arrived (or after a child's last pull), for late children.
        relay_reads: how this receiver reads a relay on its own host (same
            boot, network and pid namespace): ``"memory"`` copies straight
            out of the relay's receive memory (process_vm_readv: one kernel
            copy, no socket; where the kernel refuses, ptrace restricted,
            out of a read-only mapping of the relay's memfd, passed over a
            Unix socket; where neither works, another user, it logs why and
            streams), ``"tcp"`` reads it as a relay on another host (a tcp
            stream; NIXL READs for a nixl receiver).
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
    ) -> None:
        from ._memory import _huge_pages_off
        from .transports import channel_class
        from .transports._connections import ChannelPool, ReceiveContext, Releaser
        from .transports._relay import SameHostReads

        if relay_reads not in ("memory", "tcp"):
            raise ConfigurationError(f"Receiver(relay_reads={relay_reads!r}): pass \"memory\" (copy out of a same-host relay) or \"tcp\"")
        self._same_host_reads = SameHostReads(enabled=relay_reads == "memory")
        self.transport = transport
        if transport is not None:
            channel_class(transport)  # fail early on an unknown name
        _huge_pages_off()  # a bad TENSORFERRY_HUGE_PAGES fails here, not mid-get
        cache_cap, cache_idle = cap_nbytes(cache_nbytes), idle_seconds(cache_idle_seconds)
        self.token = token.encode() if isinstance(token, str) else (token or b"")
        self.timeout = positive_seconds("Receiver(timeout)", timeout)
        self._context = ReceiveContext(pool, capacity_nbytes=capacity_nbytes)
        if transport == "nixl":
            self._context.ensure_pool()
        self._channels = ChannelPool(channel_class, token=self.token, context=self._context)
        self._releaser = Releaser()
        self.bytes_received = 0
        self.gets = 0
        self._closed = False
        self.stall_seconds = positive_seconds("Receiver(stall_seconds)", stall_seconds)
        self._book, self._relay_server, self.relay_address = None, None, ""
        if relay:
            self._start_relay(host, port, advertise_host, positive_seconds("Receiver(relay_linger_seconds)", relay_linger_seconds))
        # Last: nothing after it can fail and leave it registered with the monitor.
        # A relay's memory is memfds, which its same-host children map.
        self._cache = ReceiveCache(cache_cap, cache_idle, shared=relay)

    def _start_relay(self, host: str, port: int, advertise_host: str | None, linger: float) -> None:
        from .transports._relay import RelayBook, RelayServer
        from .transports._tcp import is_loopback

        if self.transport not in (None, "tcp", "nixl"):
            self.close()
            raise ConfigurationError(f"Receiver(relay=True) relays over tcp or nixl; this receiver speaks {self.transport}")
        if not is_loopback(host) and not self.token:
            self.close()
            raise ConfigurationError(
                f"Receiver(relay=True, host={host!r}) listens off loopback: pass token=... (the sender's), which children present"
            )
        self._book = RelayBook(linger)
        try:
            self._relay_server = RelayServer(self._book, token=self.token, host=host, port=port, advertise_host=advertise_host)
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
            ticket: a :class:`Ticket` or its bytes.
            timeout: seconds for the whole get (default: the receiver's).
            into: existing tensors to write into, nested as the sender put
                them (dicts matched by key, in any order; lists and tuples
                by position); returned as given, updated in place.
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
        """
        if isinstance(ticket, (bytes, bytearray, memoryview)):
            ticket = Ticket.from_bytes(ticket)
        if self.transport is not None and ticket.transport != self.transport:
            raise TicketError(f"ticket is for the {ticket.transport} transport, this receiver speaks {self.transport}")
        timeout = self.timeout if timeout is None else positive_seconds("get(timeout)", timeout)
        deadline = time.monotonic() + timeout
        if isinstance(into, RecvPlan):
            if zero_copy:
                raise TransferError("zero_copy cannot be combined with a plan (the plan's tensors are the destination)")
            return self._get_planned(ticket, into, timeout, deadline)
        layout = ticket.layout
        self._check_size(ticket, layout)
        if zero_copy and (into is not None or ticket.streamed):
            raise TransferError("zero_copy cannot be combined with into=, or with a streamed object (larger than the sender's free pool)")
        targets = match_into(layout, into) if into is not None else None
        if not ticket.blocks and not ticket.streamed:
            # No bytes (an empty object, zero-size tensors): the sender keeps
            # no slot for it, so there is nothing to fetch or release.
            self.gets += 1
            return into if into is not None else unflatten(layout, self._views([], layout))
        with self._channel(ticket, timeout) as ch:
            if targets is not None:
                # The bytes land by address (memcpy, recv_into, NIXL), which
                # autograd cannot see: mark every target modified in place,
                # so a backward that saved one of them raises instead of
                # using the new values. A failed get may have written too.
                torch.autograd.graph.increment_version(targets)
            how = _strategy(ch, layout, into=targets is not None, zero_copy=zero_copy, streamed=ticket.streamed)
            if how == "zero-copy":
                result = self._get_zero_copy(ch, ticket, layout, deadline)
            elif how == "streamed":
                result = self._get_streamed(ch, ticket, layout, targets, deadline)
            else:
                result = self._get_resident(ch, ticket, layout, targets, how, deadline)
        if targets is not None and layout.aliases.size:
            fill_aliases(layout, targets)
        self.gets += 1
        self.bytes_received += layout.total_nbytes
        return into if into is not None else result

    def plan(self, ticket: Ticket | bytes, *, into: Any = None) -> RecvPlan:
        """Check ``ticket``'s layout once and keep what every later get of
        that layout needs (receiver side; nothing is fetched).

        ``get(t, into=plan)`` then moves the bytes of any ticket ``t`` of
        the same layout straight into the planned destinations and returns
        :attr:`RecvPlan.result`, the same objects every time.

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
            TransferError: the receiver is closed.
        """
        self._check_open()
        if isinstance(ticket, (bytes, bytearray, memoryview)):
            ticket = Ticket.from_bytes(ticket)
        self._check_size(ticket, ticket.layout)
        # Its own destination comes from where a get's would (the receive
        # pool where it has room, registered for NIXL; else the cache).
        return RecvPlan(self, ticket, into, allocate=lambda n: self._destination([n])[0][0])

    def _get_planned(self, ticket: Ticket, plan: RecvPlan, timeout: float, deadline: float) -> Any:
        """``get(ticket, into=plan)``: the bytes straight into the plan's
        destinations; no layout decoded, no Python work per tensor."""
        self._check_open()
        plan.check(self, ticket)
        if not ticket.blocks and not ticket.streamed:
            self.gets += 1  # nothing to fetch (an empty object, zero-size tensors)
            return plan.result
        with plan.lock:
            # Targets are marked written (as get(into=) does) while the
            # bytes land: after the acquire, whose Python work the marking
            # thread would only slow down.
            with self._channel(ticket, timeout) as ch:
                if ticket.streamed:
                    with plan.writing():
                        for piece in range(ticket.num_pieces):
                            blocks, voff = self._acquire_piece(ch, ticket, piece, deadline)
                            try:
                                self._receive_planned(ch, ticket.id, piece, blocks, voff, plan, (ticket.total_nbytes,), deadline)
                            finally:
                                ch.release(ticket.id, piece, timeout=max(deadline - time.monotonic(), 5.0))
                else:
                    blocks, source = self._acquire_resident(ch, ticket, deadline)
                    try:
                        with plan.writing():
                            if self._through_relays(ch, blocks, source):
                                stream = self._receive_broadcast(ch, ticket, blocks, source, deadline)
                                plan.coords((blocks[0][1],)).execute_window(0, blocks[0][1], stream.data_ptr())
                            else:
                                self._receive_planned(ch, ticket.id, 0, blocks, 0, plan, tuple(n for _, n in blocks), deadline)
                    finally:
                        ch.release(ticket.id, 0, timeout=max(deadline - time.monotonic(), 5.0))
            plan.finish()
        self.gets += 1
        self.bytes_received += plan.layout.total_nbytes
        return plan.result

    def _receive_planned(self, ch: Any, ticket_id: int, piece: int, blocks: list, lo: int, plan: RecvPlan, geometry: tuple[int, ...], deadline: float) -> None:
        """Move acquired ``blocks`` (stream bytes from ``lo`` on, in order)
        into the plan's destinations: straight into the plan's own buffer
        where the stream is its layout; else by the kept runs, from the
        mapped pool (shm; many small runs: preadv of the pool's file into
        the kept segment list), into the kept segment list (tcp), or
        through a staging buffer (nixl)."""
        hi = lo + sum(n for _, n in blocks)
        own = plan.own_window(lo, hi) if len(geometry) == 1 else None
        if own is not None:
            dests, at = [], 0
            for _, n in blocks:
                dests.append(own[at : at + n])
                at += n
            ch.read_into(ticket_id, piece, blocks, dests, deadline=deadline)
            return
        coords = plan.coords(geometry)
        if ch.is_sourced(ticket_id, piece):
            # The sender's tensors themselves (snapshot=False over shm): the
            # kept runs in the piece's positions, copied out of the sender.
            d, s, n, _ = coords.copy.window(lo, hi, by_dst=False)
            ch.read_runs(ticket_id, piece, s - lo, d, n, deadline=deadline)
        elif ch.supports_zero_copy and not (coords.small and ch.reads_buffers):
            pos = lo
            for (_, n), view in zip(blocks, ch.remote_views(blocks)):
                coords.execute_window(pos, pos + n, view.data_ptr() - pos)
                pos += n
        elif ch.reads_buffers:
            ch.read_buffers(ticket_id, piece, blocks, coords.segments(lo, hi), deadline=deadline)
        else:
            self._stream(ch, ticket_id, piece, blocks, lambda pos, k, base: coords.execute_window(lo + pos, lo + pos + k, base - lo - pos), deadline)

    def _acquire_resident(self, ch: Any, ticket: Ticket, deadline: float) -> tuple[list[tuple[int, int]], str]:
        """Take a reader slot: the blocks, and where to pull them from
        (``""``: the sender; a broadcast may name a relay)."""
        located = ch.acquire(ticket.id, 0, timeout=self._left(deadline), digest=ticket.digest, relay=self.relay_address)
        blocks = [tuple(b) for b in located.blocks]
        if blocks != [tuple(b) for b in ticket.blocks]:
            ch.release(ticket.id, 0, timeout=self._left(deadline))
            raise TicketError(f"sender locates ticket {ticket.id} at {blocks}, the ticket says {ticket.blocks}")
        return blocks, located.source

    def _acquire_piece(self, ch: Any, ticket: Ticket, piece: int, deadline: float) -> tuple[list[tuple[int, int]], int]:
        located = ch.acquire(ticket.id, piece, timeout=self._left(deadline), digest=ticket.digest)
        blocks = [tuple(b) for b in located.blocks]
        voff = located.virtual_offset
        want = min(ticket.piece_nbytes, ticket.total_nbytes - piece * ticket.piece_nbytes)
        if len(blocks) != 1 or blocks[0][1] != want or voff != piece * ticket.piece_nbytes:
            ch.release(ticket.id, piece, timeout=5.0)
            raise TicketError(f"sender located piece {piece} as {blocks} at {voff}, expected {want:,} bytes at {piece * ticket.piece_nbytes:,}")
        return blocks, voff

    @contextlib.contextmanager
    def _channel(self, ticket: Ticket, timeout: float) -> Iterator[Any]:
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

    def _through_relays(self, ch: Any, blocks: list, source: str) -> bool:
        """A broadcast get: the sender named a relay, or this receiver
        relays (what it receives over tcp or nixl, its children may ask for)."""
        return bool(source) or (self._book is not None and ch.transport in ("tcp", "nixl") and len(blocks) == 1)

    def _receive_broadcast(self, ch: Any, ticket: Ticket, blocks: list, source: str, deadline: float) -> torch.Tensor:
        """The one block of a ticket, chunk by chunk, from ``source`` (a
        relay, or ``""``: the sender), into memory of its own; published to
        this receiver's children as it arrives if it relays. A relay that
        fails or stalls is reported to the sender, which names another
        source; the receive resumes from the bytes it has."""
        if len(blocks) != 1:
            raise TicketError(f"a broadcast ticket has one block; this one has {len(blocks)}")
        total = blocks[0][1]
        if self._book is not None:
            # Shareable: children on this host map its file (the receive
            # pool, if any, is left to other gets).
            stream, _, fd = self._cache.take_shared(total)
        else:
            stream, fd = self._destination([total])[0][0], -1
        buf = memoryview(stream.numpy())
        nixl = ch.endpoint if ch.transport == "nixl" else None
        held = self._book.add(ticket.id, ticket.digest, buf, fd) if self._book is not None else None
        got = [0]

        def progress(end: int) -> None:
            got[0] = end
            if held is not None:
                held.progress(end)

        ok = False
        try:
            # nixl READs land in registered memory only.
            with ch.registered(stream) if nixl is not None else contextlib.nullcontext():
                self._pull_broadcast(ch, ticket, blocks, source, buf, got, progress, nixl, deadline)
            ok = True
        finally:
            if held is not None:
                held.finish(ok)
        return stream

    def _pull_broadcast(self, ch: Any, ticket: Ticket, blocks: list, source: str, buf: memoryview, got: list[int],
                        progress: Any, nixl: Any, deadline: float) -> None:
        """Fill ``buf`` from ``got[0]`` on: from the sender (``source``
        ""), else from relays, as the sender names them."""
        from .transports._relay import CHUNK_NBYTES, pull

        while got[0] < len(buf):
            try:
                if not source:
                    ch.receive_range(ticket.id, 0, blocks, buf, got[0], progress, deadline=deadline, chunk_nbytes=CHUNK_NBYTES)
                else:
                    pull(source, token=self.token, ticket_id=ticket.id, digest=ticket.digest, buf=buf, start=got[0],
                         progress=progress, stall_seconds=self.stall_seconds, deadline=deadline, reads=self._same_host_reads, nixl=nixl)
            except (PeerGoneError, TransferTimeoutError, ProtocolError):
                if not source or time.monotonic() > deadline:
                    raise
                # The relay died or stalled: the sender names another
                # source (or itself); resume from what has arrived.
                located = ch.acquire(ticket.id, 0, timeout=self._left(deadline), digest=ticket.digest,
                                     relay=self.relay_address, failed_source=source)
                source = located.source

    def _check_open(self) -> None:
        if self._closed:
            # As a plain get on a closed receiver raises (its channel pool is closed).
            raise TransferError("this Receiver is closed; make a new one (and new plans: a plan belongs to its receiver)")

    @staticmethod
    def _check_size(ticket: Ticket, layout: Layout) -> None:
        packed_nbytes = packing.packed_offsets(layout.nbytes, layout.alignments)[1]
        if ticket.total_nbytes != packed_nbytes:
            raise TicketError(f"ticket says {ticket.total_nbytes:,} bytes, its layout packs into {packed_nbytes:,}")

    @staticmethod
    def _left(deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError("the get ran out of time")
        return left

    def _get_resident(self, ch: Any, ticket: Ticket, layout: Layout, targets: Any, how: str, deadline: float) -> Any:
        blocks, source = self._acquire_resident(ch, ticket, deadline)
        sizes = [n for _, n in blocks]
        try:
            if self._through_relays(ch, blocks, source):
                stream = self._receive_broadcast(ch, ticket, blocks, source, deadline)
                if targets is not None:
                    _copy_out([stream], layout, targets)
                    return None
                return unflatten(layout, self._views([stream], layout))
            if how == "into-mapped":
                _copy_out(ch.remote_views(blocks), layout, targets)
            elif how == "into-scatter":
                segments, fixups = scatter_segments(layout, sizes, targets)
                ch.read_into(ticket.id, 0, blocks, segments, deadline=deadline)
                copy_staged(fixups)
            elif how == "into-staged":
                groups = packing.group_by_block(layout.nbytes, layout.alignments, sizes)
                sink = StagedCopy(sizes, groups.bounds, groups.offsets, layout.nbytes, targets)
                self._stream(ch, ticket.id, 0, blocks, sink, deadline)
                sink.finish()
            else:
                dests, fresh = self._destination(sizes)
                return unflatten(layout, self._read_and_view(ch, ticket.id, blocks, dests, layout, deadline, fresh=fresh))
            return None
        finally:
            ch.release(ticket.id, 0, timeout=max(deadline - time.monotonic(), 5.0))

    def _stream(self, ch: Any, ticket_id: int, piece: int, blocks: list, sink: Any, deadline: float) -> None:
        """``ch.read_stream`` through a scratch of at most ``_STAGE_NBYTES``:
        the receive pool's when it has room (registered for NIXL, already
        faulted in), new memory otherwise."""
        want = min(sum(n for _, n in blocks), _STAGE_NBYTES)
        pool = self.pool
        lease = None
        if pool is not None and pool.device.type == "cpu":
            lease = pool.reserve_up_to(want, min_nbytes=min(want, _STAGE_MIN_NBYTES))
        scratch = lease.view() if lease is not None else self._cache.take(want)[0]
        try:
            ch.read_stream(ticket_id, piece, blocks, scratch, sink, deadline=deadline)
        finally:
            if lease is not None:
                lease.release()

    def _read_and_view(self, ch: Any, ticket_id: int, blocks: list, dests: list, layout: Layout, deadline: float, *, fresh: bool) -> list[torch.Tensor]:
        """Move the bytes and build the views; for many tensors, at once.

        The views depend only on where the destination is, not on its
        bytes, and the copy (memcpy, recv_into, NIXL) runs without the GIL:
        building 100k views while the bytes move hides their cost.

        ``fresh`` destinations (new memory, not yet faulted in) of tcp are
        filled through a staging buffer when many views are built meanwhile:
        a receive loop that shares the GIL with them runs at half speed, one
        that only fills a staging buffer keeps up while a thread copies it
        out. (nixl stages every destination outside its registered pool
        itself, the same way.)
        """
        many = layout.num_tensors >= _OVERLAP_MIN_TENSORS
        if fresh and many and ch.supports_scatter and sum(n for _, n in blocks) > _STAGE_NBYTES:
            move = functools.partial(self._stream, ch, ticket_id, 0, blocks, StagedCopy.into_blocks(dests), deadline)
        else:
            move = functools.partial(ch.read_into, ticket_id, 0, blocks, dests, deadline=deadline)
        if not many:
            move()
            return self._views(dests, layout)
        future = executor().submit(move)
        try:
            return self._views(dests, layout)
        finally:
            finish(future, move)  # always wait: the slot is released after

    def _get_streamed(self, ch: Any, ticket: Ticket, layout: Layout, targets: Any, deadline: float) -> Any:
        whole = None
        for piece in range(ticket.num_pieces):
            blocks, voff = self._acquire_piece(ch, ticket, piece, deadline)
            want = blocks[0][1]
            try:
                if whole is None:
                    # Only once the sender knows the ticket: a forged or
                    # corrupted size never sizes an allocation on its own.
                    whole = self._destination([ticket.total_nbytes])[0][0]
                ch.read_into(ticket.id, piece, blocks, [whole[voff : voff + want]], deadline=deadline)
            finally:
                ch.release(ticket.id, piece, timeout=max(deadline - time.monotonic(), 5.0))
        if targets is not None:
            _copy_out([whole], layout, targets)
            return None
        return unflatten(layout, self._views([whole], layout))

    def _get_zero_copy(self, ch: Any, ticket: Ticket, layout: Layout, deadline: float) -> Any:
        if not ch.supports_zero_copy:
            raise TransferError(f"zero_copy needs the shm transport; this ticket is {ticket.transport}")
        located = ch.acquire(ticket.id, 0, timeout=self._left(deadline), digest=ticket.digest)
        blocks = [tuple(b) for b in located.blocks]
        # The hold is released when the last block view's storage dies: every
        # returned tensor is a view of one of these, so the release follows
        # the storage, not any one tensor object.
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

        views = ch.remote_views(blocks, one_gone)
        return unflatten(layout, self._views(views, layout))

    @staticmethod
    def _views(blocks: list[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
        groups = packing.group_by_block(layout.nbytes, layout.alignments, [b.numel() for b in blocks])
        with gc_paused():
            return build_views(blocks, layout, groups)

    def _destination(self, sizes: list[int]) -> tuple[list[torch.Tensor], bool]:
        """Destination blocks (16-aligned), from the receive pool if it has
        room, else from the receive cache (either way the memory returns
        when the last view of it is collected); and whether they are fresh
        (new memory, not yet faulted in)."""
        total = sum(packing.align_up(n, packing.BLOCK_ALIGNMENT) for n in sizes)
        pool = self.pool
        if pool is not None and pool.device.type == "cpu":
            try:
                return _split(pool.reserve(total).owned_view(), sizes), False
            except PoolExhaustedError:
                pass  # receive pool full: the cache's memory
        buffer, reused = self._cache.take(total)
        return _split(buffer, sizes), not reused

    def stats(self) -> dict[str, int]:
        """This receiver's counters and its receive cache's figures.

        ``gets`` and ``bytes_received`` (tensor bytes of completed gets);
        ``cache_capacity_nbytes`` (the cap, 0: off), ``cache_cached_nbytes``
        and ``cache_cached_buffers`` (idle memory kept, already faulted in),
        ``cache_live_nbytes`` (the cache's memory held by results alive now),
        ``cache_hits`` (gets that reused memory), ``cache_misses`` (gets that
        mapped new memory the cache will keep), ``cache_bypassed`` (new memory
        it will not keep: under 1 MiB, over the cap, or the cache off),
        ``cache_taken_nbytes``, ``cache_trimmed_nbytes`` (unmapped after
        sitting idle, or at close) and ``cache_evicted_nbytes`` (unmapped to
        stay within the cap). ``relay_memory_read_nbytes`` and
        ``relay_stream_nbytes``: bytes this receiver copied out of same-host
        relays' memory and took from relays as tcp streams;
        ``relay_file_read_nbytes``: of the memory reads, those out of a
        mapping of the relay's memfd (where process_vm_readv was refused);
        ``relay_nixl_read_nbytes``: bytes it READ out of nixl relays. A
        relaying receiver adds ``relay_bytes_sent`` (passed on to its
        children, any way), ``relay_bytes_lent`` (of which same-host children
        copied out of its memory), ``relay_bytes_exposed`` (of which nixl
        children READ) and ``relay_held_nbytes`` (tickets kept for them).
        """
        cache = self._cache.stats()
        reads = self._same_host_reads
        relay = {"relay_memory_read_nbytes": reads.memory_nbytes, "relay_file_read_nbytes": reads.file_nbytes,
                 "relay_stream_nbytes": reads.stream_nbytes, "relay_nixl_read_nbytes": reads.nixl_nbytes}
        if self._relay_server is not None:
            server = self._relay_server
            relay.update(relay_bytes_sent=server.bytes_sent, relay_bytes_lent=server.bytes_lent, relay_bytes_exposed=server.bytes_exposed,
                         relay_held_nbytes=self._book.held_nbytes())
        return {"gets": self.gets, "bytes_received": self.bytes_received, **relay, **{f"cache_{k}": v for k, v in cache._asdict().items()}}

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
        self._releaser.stop()
        self._context.close()
        cache = getattr(self, "_cache", None)  # absent if the constructor failed before it
        if cache is not None:
            cache.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split(base: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    out, pos = [], 0
    for n in sizes:
        out.append(base[pos : pos + n])
        pos += packing.align_up(n, packing.BLOCK_ALIGNMENT)
    return out


def _copy_out(blocks: list[torch.Tensor], layout: Layout, targets: list[torch.Tensor]) -> None:
    """Copy a received object from its blocks into ``into=`` targets (matched by ``match_into``)."""
    groups = packing.group_by_block(layout.nbytes, layout.alignments, [b.numel() for b in blocks])
    copy_from_blocks(blocks, groups.bounds, groups.offsets, layout.nbytes, targets)
