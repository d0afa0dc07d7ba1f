"""``Receiver``: redeem tickets into tensors, in new memory or in place.

The receiver side of a transfer. ``get`` acquires a reader slot from the
sender, moves the bytes (shm: one copy per block out of the mapped pool;
tcp: ``recv_into`` straight into the destination; nixl: a one-sided READ),
releases the slot, and rebuilds the object as views of the destination.

* By default the destination is new memory (or the receiver's own pool,
  if it has one: the views then keep their blocks until the last of them is
  collected).
* ``into=`` copies into the caller's existing tensors (weight updates in
  place); shapes and dtypes must match.
* ``zero_copy=True`` (shm only) returns views of the sender's pool itself;
  the sender's slot is held until the last view's storage is collected.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import select
import threading
import time
import weakref
from typing import Any, Literal

import torch

from . import packing
from ._args import positive_seconds
from ._copy import StagedCopy, copy_from_blocks, copy_staged, new_host_bytes
from ._tensors import gc_paused, match_into
from .errors import LayoutMismatchError, PeerGoneError, PoolExhaustedError, TicketError, TransferError, TransferTimeoutError
from .pool import MemoryPool, unpack
from .layout import Layout
from .ticket import Ticket

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


class _Releaser:
    """Sends the Release of zero-copy holds when their views are collected.

    Finalizers run wherever the GC runs; they only enqueue here, and one
    thread does the (blocking) socket work.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="tensorferry-releaser", daemon=True)
        self._thread.start()

    def submit(self, channel: Any, ticket_id: int, piece: int) -> None:
        self._queue.put((channel, ticket_id, piece))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            channel, ticket_id, piece = item
            with channel.lock:
                try:
                    channel.release(ticket_id, piece, timeout=10.0)
                except Exception:
                    pass  # the sender is gone; its pool went with it
                channel.holds -= 1
                if channel.holds == 0 and getattr(channel, "retired", False):
                    channel.close()

    def stop(self) -> None:
        self._queue.put(None)


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
    """

    def __init__(
        self,
        transport: Literal["shm", "tcp", "nixl"] | None = None,
        pool: MemoryPool | None = None,
        *,
        token: str | bytes | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        capacity_nbytes: int = 256 << 20,
    ) -> None:
        from ._copy import _huge_pages_off
        from .transports import channel_class

        self.transport = transport
        if transport is not None:
            channel_class(transport)  # fail early on an unknown name
        _huge_pages_off()  # a bad TENSORFERRY_HUGE_PAGES fails here, not mid-get
        self.token = token.encode() if isinstance(token, str) else (token or b"")
        self.timeout = positive_seconds("Receiver(timeout)", timeout)
        self._own_pool = False
        if pool is None and transport == "nixl":
            pool = MemoryPool(capacity_nbytes)
            self._own_pool = True
        self.pool = pool
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str], list[Any]] = {}
        self._all: list[Any] = []
        self._resources: list[Any] = []  # closed with the receiver (nixl endpoint)
        self._releaser = _Releaser()
        self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="tensorferry-copy")
        self._closed = False
        self.bytes_received = 0
        self.gets = 0

    # -- connections ---------------------------------------------------------------

    def _checkout(self, ticket: Ticket, timeout: float) -> Any:
        from .transports import channel_class

        key = (ticket.transport, ticket.address)
        with self._lock:
            if self._closed:
                raise TransferError("this Receiver is closed")
            idle = self._idle.get(key)
            hung: list[Any] = []
            while idle:
                ch = idle.pop()
                if not ch.closed and not _hung_up(ch.sock):
                    break
                hung.append(ch)
            else:
                ch = None
        for dead in hung:
            self._discard(dead)
        if ch is None:
            self._prune_idle()
            ch = channel_class(ticket.transport)(ticket.address, token=self.token, timeout=timeout, receiver=self)
            with self._lock:
                self._all.append(ch)
        if ch.welcome.pool_generation != ticket.pool_generation:
            self._return(key, ch)
            raise TicketError(
                f"ticket {ticket.id} is from an earlier pool of the sender at {ticket.address} "
                "(the sender restarted); ask for a new ticket"
            )
        return ch

    def _prune_idle(self) -> None:
        """Close idle connections whose sender hung up (it exited or closed).

        Each holds a socket and, for shm, a mapping of that sender's whole
        pool (which keeps the pool's memory alive); a long-lived receiver
        must not keep one per sender it ever talked to.
        """
        with self._lock:
            dead = []
            for key, chans in list(self._idle.items()):
                alive = [c for c in chans if not c.closed and not _hung_up(c.sock)]
                dead += [c for c in chans if not any(c is a for a in alive)]
                if alive:
                    self._idle[key] = alive
                else:
                    del self._idle[key]
        for ch in dead:
            self._discard(ch)
        with self._lock:
            self._all = [c for c in self._all if not c.closed]

    def _return(self, key: tuple[str, str], ch: Any) -> None:
        with self._lock:
            if self._closed or ch.closed:
                return
            self._idle.setdefault(key, []).append(ch)

    def _discard(self, ch: Any) -> None:
        with ch.lock:
            if ch.holds:
                ch.retired = True  # zero-copy views still need it; closed after them
            else:
                ch.close()

    # -- get -------------------------------------------------------------------------

    def get(self, ticket: Ticket | bytes, *, timeout: float | None = None, into: Any = None, zero_copy: bool = False) -> Any:
        """Fetch the object of ``ticket``.

        Args:
            ticket: a :class:`Ticket` or its bytes.
            timeout: seconds for the whole get (default: the receiver's).
            into: existing tensors (same nesting or same leaf order) to write
                into; returned as given, updated in place.
            zero_copy: shm only: return views of the sender's pool; the
                sender keeps the blocks until the views are collected.

        Returns:
            The object, nested as the sender put it.

        Raises:
            TicketError: a malformed or stale ticket.
            LayoutMismatchError: ``into`` does not match the sent tensors.
            PeerGoneError: the sender went away; the receiver stays usable.
            TransferTimeoutError: it took longer than ``timeout``.
        """
        if isinstance(ticket, (bytes, bytearray, memoryview)):
            ticket = Ticket.from_bytes(ticket)
        if self.transport is not None and ticket.transport != self.transport:
            raise TicketError(f"ticket is for the {ticket.transport} transport, this receiver speaks {self.transport}")
        timeout = self.timeout if timeout is None else positive_seconds("get(timeout)", timeout)
        deadline = time.monotonic() + timeout
        layout = ticket.layout
        packed_nbytes = packing.packed_offsets(layout.nbytes, layout.alignments)[1]
        if ticket.total_nbytes != packed_nbytes:
            raise TicketError(f"ticket says {ticket.total_nbytes:,} bytes, its layout packs into {packed_nbytes:,}")
        if zero_copy and (into is not None or ticket.streamed):
            raise TransferError("zero_copy cannot be combined with into=, or with a streamed object (larger than the sender's free pool)")
        targets = match_into(layout, into) if into is not None else None
        if not ticket.blocks and not ticket.streamed:
            # No bytes (an empty object, zero-size tensors): the sender keeps
            # no slot for it, so there is nothing to fetch or release.
            self.gets += 1
            return into if into is not None else _rebuild(layout, self._views([], layout))
        ch = self._checkout(ticket, timeout)
        key = (ticket.transport, ticket.address)
        try:
            if targets is not None:
                # The bytes land by address (memcpy, recv_into, NIXL), which
                # autograd cannot see: mark every target modified in place,
                # so a backward that saved one of them raises instead of
                # using the new values. A failed get may have written too.
                torch.autograd.graph.increment_version(targets)
            with ch.lock:
                if zero_copy:
                    result = self._get_zero_copy(ch, ticket, layout, deadline)
                elif ticket.streamed:
                    result = self._get_streamed(ch, ticket, layout, targets, deadline)
                else:
                    result = self._get_resident(ch, ticket, layout, targets, deadline)
        except (PeerGoneError, TransferTimeoutError, OSError) as exc:
            self._discard(ch)  # its stream may be mid-frame: never reuse it
            if isinstance(exc, OSError) and not isinstance(exc, TransferError):
                raise PeerGoneError(f"lost the sender at {ticket.address} ({exc})") from exc
            raise
        except BaseException:
            self._discard(ch)
            raise
        self._return(key, ch)
        if targets is not None and layout.aliases.size:
            _fill_aliases(layout, targets)
        self.gets += 1
        self.bytes_received += layout.total_nbytes
        return into if into is not None else result

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError("the get ran out of time")
        return left

    def _get_resident(self, ch, ticket: Ticket, layout: Layout, targets, deadline: float) -> Any:
        located = ch.acquire(ticket.id, 0, timeout=self._left(deadline), digest=ticket.digest)
        blocks = [tuple(b) for b in located.blocks]
        if blocks != [tuple(b) for b in ticket.blocks]:
            ch.release(ticket.id, 0, timeout=self._left(deadline))
            raise TicketError(f"sender locates ticket {ticket.id} at {blocks}, the ticket says {ticket.blocks}")
        try:
            if targets is not None and ch.supports_zero_copy:
                # shm: one copy, from the sender's pool into the caller's tensors.
                _copy_out(ch.remote_views(blocks), layout, targets)
                return None
            if targets is not None and ch.supports_scatter and _few_enough_to_scatter(layout):
                # tcp, few tensors: the bytes land straight in the caller's tensors.
                segments, fixups = _scatter_segments(layout, [n for _, n in blocks], targets)
                ch.read_into(ticket.id, 0, blocks, segments, deadline=deadline)
                copy_staged(fixups)
                return None
            if targets is not None:
                # tcp with many tensors, nixl: through a bounded staging
                # buffer, each chunk copied by address into the tensors.
                self._read_staged_into(ch, ticket.id, 0, blocks, layout, targets, deadline)
                return None
            dests, fresh = self._destination([n for _, n in blocks])
            obj_leaves = self._read_and_view(ch, ticket.id, 0, blocks, dests, layout, deadline, fresh=fresh)
        finally:
            ch.release(ticket.id, 0, timeout=max(self._left_or_zero(deadline), 5.0))
        return _rebuild(layout, obj_leaves)

    def _read_staged_into(self, ch, ticket_id: int, piece: int, blocks, layout: Layout, targets, deadline: float) -> None:
        """The stream of ``blocks`` through at most ``_STAGE_NBYTES`` of
        scratch (the receive pool's when it has room: registered for NIXL,
        already faulted in), into ``targets``. No view per tensor, no
        per-tensor receive call: with 100k tensors this was ~3x faster than
        scattering straight into them, for one extra memcpy of the bytes."""
        sizes = [n for _, n in blocks]
        groups = packing.group_by_block(layout.nbytes, layout.alignments, sizes)
        sink = StagedCopy(sizes, groups.bounds, groups.offsets, layout.nbytes, targets)
        self._stream(ch, ticket_id, piece, blocks, sink, deadline)
        sink.finish()

    def _stream(self, ch, ticket_id: int, piece: int, blocks, sink: Any, deadline: float) -> None:
        """``ch.read_stream`` through a scratch of at most ``_STAGE_NBYTES``."""
        want = min(sum(n for _, n in blocks), _STAGE_NBYTES)
        scratch, offset = None, None
        if self.pool is not None and self.pool.device.type == "cpu":
            size = min(want, self.pool._allocator.largest_free_nbytes())
            if size >= min(want, _STAGE_MIN_NBYTES):
                try:
                    offset = self.pool._allocator.allocate(size).offset
                    scratch = self.pool.buffer[offset : offset + size]
                except PoolExhaustedError:
                    offset = None  # taken meanwhile: new memory below
        if scratch is None:
            scratch = new_host_bytes(want)
        try:
            ch.read_stream(ticket_id, piece, blocks, scratch, sink, deadline=deadline)
        finally:
            if offset is not None:
                self.pool._allocator.free(offset)

    def _read_and_view(self, ch, ticket_id: int, piece: int, blocks, dests, layout: Layout, deadline: float, *, fresh: bool = False) -> list[torch.Tensor]:
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
            sink = StagedCopy.into_blocks(dests)
            move = functools.partial(self._stream, ch, ticket_id, piece, blocks, sink, deadline)
        else:
            move = functools.partial(ch.read_into, ticket_id, piece, blocks, dests, deadline=deadline)
        if layout.num_tensors < _OVERLAP_MIN_TENSORS:
            move()
            return self._views(dests, layout)
        future = self._copier.submit(move)
        try:
            leaves = self._views(dests, layout)
        finally:
            error = future.exception()  # always wait: the slot is released after
        if error is not None:
            raise error
        return leaves

    def _get_streamed(self, ch, ticket: Ticket, layout: Layout, targets, deadline: float) -> Any:
        whole = None
        digest = ticket.digest
        for piece in range(ticket.num_pieces):
            located = ch.acquire(ticket.id, piece, timeout=self._left(deadline), digest=digest)
            blocks = [tuple(b) for b in located.blocks]
            voff = located.virtual_offset
            want = min(ticket.piece_nbytes, ticket.total_nbytes - piece * ticket.piece_nbytes)
            if len(blocks) != 1 or blocks[0][1] != want or voff != piece * ticket.piece_nbytes:
                ch.release(ticket.id, piece, timeout=5.0)
                raise TicketError(f"sender located piece {piece} as {blocks} at {voff}, expected {want:,} bytes at {piece * ticket.piece_nbytes:,}")
            try:
                if whole is None:
                    # Only once the sender knows the ticket: a forged or
                    # corrupted size never sizes an allocation on its own.
                    whole = self._destination([ticket.total_nbytes])[0][0]
                ch.read_into(ticket.id, piece, blocks, [whole[voff : voff + want]], deadline=deadline)
            finally:
                ch.release(ticket.id, piece, timeout=max(self._left_or_zero(deadline), 5.0))
        if targets is not None:
            _copy_out([whole], layout, targets)
            return None
        return _rebuild(layout, self._views([whole], layout))

    def _get_zero_copy(self, ch, ticket: Ticket, layout: Layout, deadline: float) -> Any:
        if not ch.supports_zero_copy:
            raise TransferError(f"zero_copy needs the shm transport; this ticket is {ticket.transport}")
        located = ch.acquire(ticket.id, 0, timeout=self._left(deadline), digest=ticket.digest)
        blocks = [tuple(b) for b in located.blocks]
        views = ch.remote_views(blocks)
        # The hold is released when the last block view's storage dies: every
        # returned tensor is a view of one of these, so the release follows
        # the storage, not any one tensor object.
        remaining = [len(views)]
        lock = threading.Lock()
        ch.holds += 1
        releaser = self._releaser

        def one_gone() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                releaser.submit(ch, ticket.id, 0)

        for v in views:
            _finalize_storage(v, one_gone)
        leaves = self._views(views, layout)
        return _rebuild(layout, leaves)

    @staticmethod
    def _left_or_zero(deadline: float) -> float:
        return max(0.0, deadline - time.monotonic())

    def _views(self, blocks: list[torch.Tensor], layout: Layout) -> list[torch.Tensor]:
        from .pool import _views

        groups = packing.group_by_block(layout.nbytes, layout.alignments, [b.numel() for b in blocks])
        with gc_paused():
            return _views(blocks, layout, groups)

    def _destination(self, sizes: list[int]) -> tuple[list[torch.Tensor], bool]:
        """Destination blocks (16-aligned), from the receive pool if it has
        room; and whether they are new memory (not the pool's)."""
        total = sum(packing.align_up(n, packing.BLOCK_ALIGNMENT) for n in sizes)
        if self.pool is not None:
            try:
                ext = self.pool._allocator.allocate(total)
            except MemoryError:
                ext = None  # receive pool full: fall back to new memory
            if ext is not None:
                base = self.pool.lease_view(ext.offset, total)
                _finalize_storage(base, _PoolLease(self.pool, ext.offset))
                return _split(base, sizes), False
        base = new_host_bytes(total)
        return _split(base, sizes), True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            chans = list(self._all)
            self._idle.clear()
        for ch in chans:
            self._discard(ch)
        self._releaser.stop()
        for res in self._resources:
            res.close()
        self._copier.shutdown(wait=False)
        if self._own_pool and self.pool is not None:
            self.pool.close()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hung_up(sock: Any) -> bool:
    """Whether an idle connection was closed by its sender.

    Between requests a sender sends nothing, so anything to read (the end of
    the stream, an error) means the connection is unusable.
    """
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class _PoolLease:
    """Frees a receive-pool block when the views made from it are collected."""

    def __init__(self, pool: MemoryPool, offset: int) -> None:
        self.pool, self.offset = pool, offset

    def __call__(self) -> None:
        # A finalizer: it may run on a thread that is inside the allocator.
        self.pool._allocator.free_soon(self.offset)


def _finalize_storage(view: torch.Tensor, callback: Any) -> None:
    """Run ``callback`` when the storage of ``view`` is collected.

    ``view`` was made by ``torch.from_numpy``; its storage keeps that numpy
    array alive, so watching the array follows the storage: the callback
    fires when the last tensor sharing it is gone, whichever view that is.
    """
    weakref.finalize(view._tf_owner, callback)  # type: ignore[attr-defined]


def _scatter_segments(layout: Layout, block_nbytes: list[int], targets: list[torch.Tensor]):
    """The byte stream of the blocks as a list of destination segments:
    each target tensor's own memory where it is dense, a scratch buffer for
    alignment gaps and for targets that are not (copied after)."""
    groups = packing.group_by_block(layout.nbytes, layout.alignments, block_nbytes)
    nbytes = layout.nbytes.tolist()
    offsets = groups.offsets.tolist()
    bounds = groups.bounds.tolist()
    # Alignment gaps are < 16 bytes each: one small scratch covers them all.
    scratch = torch.empty(16 * (layout.num_tensors + len(block_nbytes)) + 16, dtype=torch.uint8)
    spos = 0
    segments: list[torch.Tensor] = []
    fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
    for b in range(len(block_nbytes)):
        cursor = 0
        for i in range(bounds[b], bounds[b + 1]):
            n = nbytes[i]
            if not n:
                continue
            gap = offsets[i] - cursor
            if gap:
                segments.append(scratch[spos : spos + gap])
                spos += gap
            t = targets[i]
            if t.is_contiguous() and t.device.type == "cpu" and not t.is_conj() and not t.is_neg():
                segments.append(t.detach().reshape(-1).view(torch.uint8))
            else:
                staged = torch.empty(n, dtype=torch.uint8)
                segments.append(staged)
                fixups.append((staged, t))
            cursor = offsets[i] + n
    return segments, fixups


def _fill_aliases(layout: Layout, targets: list[torch.Tensor]) -> None:
    """into= targets of tensors sent once under two names (tied weights):
    the bytes landed in the first target; a second one that is not the
    same view (untied on this side) gets a copy of it."""
    for dup, orig in layout.aliases.tolist():
        a, b = targets[dup], targets[orig]
        if a is b or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.device == b.device):
            continue
        with torch.no_grad():
            a.copy_(b)


def _few_enough_to_scatter(layout: Layout) -> bool:
    """Whether tcp into= receives straight into the targets (see _SCATTER_MAX_TENSORS)."""
    return layout.num_tensors <= max(_SCATTER_MAX_TENSORS, layout.total_nbytes // _SCATTER_MIN_MEAN_NBYTES)


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


def _rebuild(layout: Layout, leaves: list[torch.Tensor]) -> Any:
    from ._tensors import unflatten

    return unflatten(layout, leaves)
