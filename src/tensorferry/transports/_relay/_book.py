"""What a relay holds: the tickets it receives (:class:`RelayBook`), each
one's stream as it arrives (:class:`_Held`), kept for late and resuming
children, then let go. See :mod:`tensorferry.transports._relay`."""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import numpy as np

from ...errors import ConfigurationError, PeerGoneError
from ...wire import protocol as P
from .._base import Holdings

__all__ = ["CHUNK_NBYTES", "MIN_CHUNK_NBYTES", "RelayBook", "chunk_nbytes_for", "half_chunk_nbytes", "stripe_bounds"]

# Bytes a relay receives before it passes them on: each hop of a chain
# adds one chunk's time (1 MiB: 8.4 ms at 1 Gbit/s; 4 MiB made a chain of 8
# 0.24 s slower). The most a broadcast's chunk is (chunk_nbytes_for): a
# larger one only delays the hops.
CHUNK_NBYTES = 1 << 20
# The least: a chunk costs a loop turn of Python on each side of a hop (a
# receive call's return, a condition notify, the serving thread's wake-up
# and send: tens of µs), which must stay a small part of the chunk's time
# on the wire (64 KiB: 0.5 ms at 1 Gbit/s, 2 ms at 250 Mbit/s).
MIN_CHUNK_NBYTES = 64 << 10
# A chain of h hops adds (h - 1) chunks to the transfer: a chunk of
# total / (h * _HOP_SHARE) keeps that under 1/_HOP_SHARE (3%) of it.
_HOP_SHARE = 32
# Chunks are whole pages (the receive's views start page-aligned).
_CHUNK_ALIGNMENT = 4096


def chunk_nbytes_for(total_nbytes: int, hops: int, *, most: int = CHUNK_NBYTES, least: int = MIN_CHUNK_NBYTES) -> int:
    """The chunk a broadcast's relays pass on: ``total_nbytes`` over
    ``hops`` times _HOP_SHARE, so a chain's hops add about 3% of the
    transfer whatever its length and the object's size, within ``[least,
    most]`` (a transport's limits; ``least`` wins). Receiver side (every
    relay of a ticket computes the same from the ticket).

    Args:
        total_nbytes: the stream's size.
        hops: the most hops a chain of it can have (the ticket's readers;
            0 or less: unknown, the most).
        most: the largest chunk (the transport's choice for one hop).
        least: the smallest (what a chunk's bookkeeping allows).
    """
    if hops <= 0:
        return max(most, least)
    fair = total_nbytes // (hops * _HOP_SHARE) // _CHUNK_ALIGNMENT * _CHUNK_ALIGNMENT
    return max(least, min(most, fair))


def half_chunk_nbytes(total_nbytes: int, readers: int, *, most: int = CHUNK_NBYTES, least: int = MIN_CHUNK_NBYTES) -> int:
    """The chunk a two-tree broadcast's relays pass on: as a chain's
    (:func:`chunk_nbytes_for`) for a half, over the trees' depth (about
    log2 of the readers) instead of a chain's length. Receiver side."""
    depth = max(1, math.ceil(math.log2(readers + 1))) if readers > 0 else 0
    return chunk_nbytes_for(total_nbytes // 2, depth, most=most, least=least)


def stripe_bounds(total_nbytes: int, stripes: int) -> list[tuple[int, int]]:
    """The byte ranges ``[lo, hi)`` of a stream's ``stripes`` parts (a
    two-tree broadcast's halves, each of which flows down a tree of its
    own): as equal as whole pages allow, the last one taking the rest.
    Every receiver of a ticket computes the same."""
    if stripes < 1:
        raise ConfigurationError(f"stripe_bounds(stripes={stripes}): expected 1 or more parts")
    step = total_nbytes // stripes // _CHUNK_ALIGNMENT * _CHUNK_ALIGNMENT
    cuts = [k * step for k in range(stripes)] + [total_nbytes]
    return list(zip(cuts[:-1], cuts[1:]))


class _Held:
    """One ticket's stream in a relay, and how much of it has arrived."""

    def __init__(self, book: "RelayBook", ticket_id: int, digest: bytes, buf: memoryview, fd: int, group: object) -> None:
        self.book, self.ticket_id, self.digest, self.buf = book, ticket_id, digest, buf
        self.key = (ticket_id, digest)
        self.group = group  # streams of one get (a sharded get's, one a source) do not let each other go
        # The memfd whose bytes from 0 on are ``buf`` (-1: none), open as
        # long as ``buf`` is alive (ReceiveCache.take_shared).
        self.fd = fd
        self.total = len(buf)
        # Where same-host children read it: ``buf`` (held here) keeps it there.
        self.address = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if self.total else 0
        # Where each run that arrives in order starts -> how far it has
        # arrived: one run from 0, or one a stripe (put(trees=True)).
        self.runs: dict[int, int] = {}
        self.state = "receiving"  # then "complete" or "failed"
        self.pulls = 0
        self.idle_since = time.monotonic()
        self.dropped = False  # let go by the book: no new pull may start on it
        # Its memory registered with the relay's NIXL exposer, while it is
        # (a tensor over ``buf``; RelayServer._expose, let go on drop).
        self.exposed: Any = None

    def progress(self, end: int, start: int = 0) -> None:
        """Bytes ``[start, end)`` have arrived (``start``: where the run
        that arrives in order, the stream or one of its stripes, begins)."""
        with self.book.cond:
            self.runs[start] = max(self.runs.get(start, start), end)
            self.book.cond.notify_all()

    def _reach(self, pos: int) -> int:
        """Under the lock: the end of the bytes arrived from ``pos`` on
        without a gap (``pos`` if byte ``pos`` has not arrived)."""
        reach, moved = pos, True
        while moved:
            moved = False
            for lo, hi in self.runs.items():
                if lo <= reach < hi:
                    reach, moved = hi, True
        return reach

    def finish(self, ok: bool) -> None:
        with self.book.cond:
            self.state = "complete" if ok else "failed"
            self.idle_since = time.monotonic()
            self.book.cond.notify_all()
        self.book.expire_later()

    def wait_beyond(self, pos: int, timeout: float) -> int:
        """Where the bytes arrived from ``pos`` on without a gap end, once
        byte ``pos`` has arrived (or ``pos`` after ``timeout``). Raises
        PeerGoneError if the relay's own receive failed before it did."""
        deadline = time.monotonic() + timeout
        with self.book.cond:
            while (reach := self._reach(pos)) <= pos and self.state == "receiving":
                left = deadline - time.monotonic()
                if left <= 0:
                    return pos
                self.book.cond.wait(left)
            if reach <= pos and self.state != "receiving":
                got = sum(hi - lo for lo, hi in self.runs.items())
                raise PeerGoneError(f"the relay lost ticket {self.ticket_id} after {got:,} of {self.total:,} bytes (byte {pos:,} never arrived)")
            return reach


class RelayBook(Holdings):
    """The tickets a relaying receiver can serve, each kept ``linger_seconds``
    after it arrived (or after its last child's pull) so that late children
    and children resuming after a fault find it, or until the next ticket
    starts; then its memory is let go.

    The :class:`~tensorferry.transports._base.Holdings` its server serves
    from: a relay keeps no reader slots (its children take theirs at the
    sender and Pull byte ranges here), so it refuses Acquire and Release
    and holds no piece for any connection."""

    def __init__(self, linger_seconds: float, on_drop: Callable[[_Held], None] | None = None) -> None:
        self.cond = threading.Condition()
        self.linger_seconds = linger_seconds
        # Called (outside the lock, perhaps twice: it must not mind) with
        # each ticket let go, once no child pulls it.
        self.on_drop = on_drop
        self._held: dict[tuple[int, bytes], _Held] = {}  # by (ticket id, digest)
        self._timer: threading.Timer | None = None
        self._closed = False

    def add(self, ticket_id: int, digest: bytes, buf: memoryview, fd: int = -1, group: object = None) -> _Held:
        """A stream this receiver starts to receive (into ``buf``, which is
        bytes 0 on of the memfd ``fd`` if not -1): a ticket's (``digest``:
        the ticket's), or the byte ranges of it a sharded get reads (a
        digest of the ticket's and the ranges). Streams it finished that no
        child is pulling are let go now, but for those of the same
        ``group`` (a sharded get's, one a source): a weight sync sends a
        new version every few seconds, and a child that still wants an old
        one is sent elsewhere by the sender (its pull here fails)."""
        held = _Held(self, ticket_id, digest, buf, fd, group)
        with self.cond:
            gone = self._done_with(group)
            self._drop(gone)
            self._held[held.key] = held
            self.cond.notify_all()
        self._dropped(gone)
        return held

    def make_room(self, group: object = None) -> None:
        """Let go now what :meth:`add` of a stream of ``group`` would: called
        before taking the new stream's memory, so it can be the memory of
        those let go (a sync's streams, each the size of the last sync's)."""
        with self.cond:
            gone = self._done_with(group)
            self._drop(gone)
        self._dropped(gone)

    def _done_with(self, group: object) -> list[_Held]:
        """Under the lock: the streams a new one of ``group`` lets go."""
        return [h for h in self._held.values() if h.state != "receiving" and not h.pulls and (group is None or h.group is not group)]

    def _drop(self, gone: list[_Held]) -> None:
        """Under the lock: forget these tickets (no pull starts on them)."""
        for h in gone:
            h.dropped = True
            if self._held.get(h.key) is h:
                del self._held[h.key]

    def _dropped(self, gone: list[_Held]) -> None:
        """After :meth:`_drop`: ``on_drop`` for each ticket no child pulls
        (one that is pulled goes when its last pull ends)."""
        if self.on_drop is not None:
            for h in gone:
                if not h.pulls:
                    self.on_drop(h)

    def find(self, ticket_id: int, digest: bytes, timeout: float) -> _Held | None:
        """The stream of this ticket and digest; waits up to ``timeout`` for
        a receive of the ticket to start (a child may ask a moment before
        its relay acquired), not for another digest once one has."""
        deadline = time.monotonic() + timeout
        key = (ticket_id, bytes(digest))
        with self.cond:
            while not any(t == ticket_id for t, _ in self._held) and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self._held.get(key)

    def begin_pull(self, held: _Held) -> bool:
        """Count a child's pull; False if the ticket was let go meanwhile."""
        with self.cond:
            if held.dropped:
                return False
            held.pulls += 1
            return True

    def end_pull(self, held: _Held) -> None:
        with self.cond:
            held.pulls -= 1
            held.idle_since = time.monotonic()
            last = held.dropped and not held.pulls
        if last and self.on_drop is not None:
            self.on_drop(held)
        self.expire_later()

    def expire_later(self) -> None:
        with self.cond:
            if self._timer is not None or self._closed:
                return
            self._timer = threading.Timer(self.linger_seconds, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        now = time.monotonic()
        with self.cond:
            self._timer = None
            gone = [h for h in self._held.values() if h.state != "receiving" and not h.pulls and now - h.idle_since >= self.linger_seconds]
            self._drop(gone)
            pending = any(h.state != "receiving" for h in self._held.values())
        self._dropped(gone)
        if pending:
            self.expire_later()

    def held_nbytes(self) -> int:
        with self.cond:
            return sum(h.total for h in self._held.values())

    def close(self) -> None:
        with self.cond:
            self._closed = True
            gone = list(self._held.values())
            self._drop(gone)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.cond.notify_all()
        self._dropped(gone)

    def acquire(self, conn: Any, msg: Any) -> P.Failure:
        return P.Failure(kind="relay", message="this is a relaying receiver: acquire slots from the sender")

    def held(self, conn: Any, ticket_id: int, piece: int) -> None:
        """None: no connection holds a slot here."""
        return None

    def release(self, conn: Any, ticket_id: int, piece: int, send: Any = None) -> P.Failure:
        reply = P.Failure(kind="relay", message="this is a relaying receiver: release slots at the sender")
        if send is not None:
            send(reply)
        return reply

    def drop_connection(self, conn: Any) -> None:
        """Nothing to give back: children hold their slots at the sender."""
