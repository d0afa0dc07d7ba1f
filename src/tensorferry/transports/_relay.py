"""Relays: a receiver that passes on what it has received (tcp).

A broadcast ticket (``Sender.put(..., fanout=k)``) is pulled by most
receivers from another receiver rather than from the sender (see
``tensorferry._broadcast``). A receiver made with ``relay=True`` keeps a
:class:`RelayBook` of the tickets it receives: each one's stream (the
ticket's one block, as it arrives, chunk by chunk) and how much of it has
arrived. Its :class:`RelayServer` answers children's :class:`Pull`
requests from that stream while the rest still comes in (pipelined by
chunks), so a chain of relays moves the object about as fast as one link.

:func:`pull` is the child's side. A relay that dies or stalls shows up in
the child as a broken or silent connection; the child then asks the sender
for another source and resumes from the bytes it has.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from typing import Any, Callable

from .. import _protocol as P
from ..errors import AuthenticationError, PeerGoneError, ProtocolError, TransferError, TransferTimeoutError
from ._base import Connection
from ._tcp import TcpControlServer, connect

__all__ = ["CHUNK_NBYTES", "RelayBook", "RelayServer", "pull"]

# Bytes a relay receives before it passes them on: each hop of a chain
# adds one chunk's time (1 MiB: 8.4 ms at 1 Gbit/s; 4 MiB made a chain of 8
# 0.24 s slower), and a chunk still costs far more than its bookkeeping
# (a condition notify and a loop turn, tens of µs).
CHUNK_NBYTES = 1 << 20


class _Held:
    """One ticket's stream in a relay, and how much of it has arrived."""

    def __init__(self, book: "RelayBook", ticket_id: int, digest: bytes, buf: memoryview) -> None:
        self.book, self.ticket_id, self.digest, self.buf = book, ticket_id, digest, buf
        self.total = len(buf)
        self.arrived = 0
        self.state = "receiving"  # then "complete" or "failed"
        self.pulls = 0
        self.idle_since = time.monotonic()

    def progress(self, end: int) -> None:
        with self.book.cond:
            self.arrived = max(self.arrived, end)
            self.book.cond.notify_all()

    def finish(self, ok: bool) -> None:
        with self.book.cond:
            self.state = "complete" if ok else "failed"
            self.idle_since = time.monotonic()
            self.book.cond.notify_all()
        self.book.expire_later()

    def wait_beyond(self, pos: int, timeout: float) -> int:
        """Bytes arrived, once more than ``pos`` have (or ``pos`` after
        ``timeout``). Raises PeerGoneError if the relay's own receive failed."""
        deadline = time.monotonic() + timeout
        with self.book.cond:
            while self.arrived <= pos and self.state == "receiving":
                left = deadline - time.monotonic()
                if left <= 0:
                    return self.arrived
                self.book.cond.wait(left)
            if self.arrived <= pos and self.state == "failed":
                raise PeerGoneError(f"the relay lost ticket {self.ticket_id} after {self.arrived:,} of {self.total:,} bytes")
            return self.arrived


class RelayBook:
    """The tickets a relaying receiver can serve, each kept ``linger_seconds``
    after it arrived (or after its last child's pull) so that late children
    and children resuming after a fault find it, or until the next ticket
    starts; then its memory is let go."""

    def __init__(self, linger_seconds: float) -> None:
        self.cond = threading.Condition()
        self.linger_seconds = linger_seconds
        self._held: dict[int, _Held] = {}
        self._timer: threading.Timer | None = None
        self._closed = False

    def add(self, ticket_id: int, digest: bytes, buf: memoryview) -> _Held:
        """A ticket this receiver starts to receive. Tickets it finished
        that no child is pulling are let go now: a weight sync sends a new
        version every few seconds, and a child that still wants an old one
        is sent elsewhere by the sender (its pull here fails)."""
        held = _Held(self, ticket_id, digest, buf)
        with self.cond:
            for tid, h in list(self._held.items()):
                if h.state != "receiving" and not h.pulls:
                    del self._held[tid]
            self._held[ticket_id] = held
            self.cond.notify_all()
        return held

    def find(self, ticket_id: int, timeout: float) -> _Held | None:
        """The ticket's stream; waits up to ``timeout`` for the receive to
        start (a child may ask a moment before its relay acquired)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while ticket_id not in self._held and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self._held.get(ticket_id)

    def begin_pull(self, held: _Held) -> None:
        with self.cond:
            held.pulls += 1

    def end_pull(self, held: _Held) -> None:
        with self.cond:
            held.pulls -= 1
            held.idle_since = time.monotonic()
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
            for tid, h in list(self._held.items()):
                if h.state != "receiving" and not h.pulls and now - h.idle_since >= self.linger_seconds:
                    del self._held[tid]
            pending = any(h.state != "receiving" for h in self._held.values())
        if pending:
            self.expire_later()

    def held_nbytes(self) -> int:
        with self.cond:
            return sum(h.total for h in self._held.values())

    def close(self) -> None:
        with self.cond:
            self._closed = True
            self._held.clear()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.cond.notify_all()

    # What a control server asks of its "ledger": a relay keeps no slots.
    def acquire(self, conn: Any, msg: Any) -> P.Failure:
        return P.Failure(kind="relay", message="this is a relaying receiver: acquire slots from the sender")

    def release(self, conn: Any, ticket_id: int, piece: int, send: Any = None) -> P.Failure:
        reply = P.Failure(kind="relay", message="this is a relaying receiver: release slots at the sender")
        if send is not None:
            send(reply)
        return reply

    def drop_connection(self, conn: Any) -> None:
        """Nothing to give back: children hold their slots at the sender."""


class RelayServer(TcpControlServer):
    """A relaying receiver's server: children present the token, then
    :class:`Pull` byte ranges of a ticket, streamed as they arrive here."""

    transport = "tcp"

    def __init__(self, book: RelayBook, *, token: bytes, host: str, port: int, advertise_host: str | None) -> None:
        self.book = book
        self.bytes_sent = 0
        super().__init__(book, token=token, host=host, port=port, advertise_host=advertise_host)

    def _welcome(self, conn: Connection, hello: P.Hello) -> tuple[P.Welcome, list[int]]:
        return P.Welcome(pool_nbytes=0, pool_generation=0), []

    def _handle_extra(self, conn: Connection, msg: Any) -> bool:
        if not isinstance(msg, P.Pull):
            return False
        held = self.book.find(msg.ticket_id, timeout=10.0)
        if held is None or not hmac.compare_digest(held.digest, msg.digest):
            P.send_msg(conn.sock, P.Failure(kind="unknown", message=f"this relay holds no ticket {msg.ticket_id} with that digest"))
            return True
        if msg.start + msg.nbytes > held.total:
            P.send_msg(conn.sock, P.Failure(kind="bad-range", message=f"bytes {msg.start:,}+{msg.nbytes:,} of a {held.total:,}-byte ticket"))
            return True
        P.send_data_header(conn.sock, msg.nbytes)
        self.book.begin_pull(held)
        try:
            pos, end = msg.start, msg.start + msg.nbytes
            while pos < end and not self._closed:
                arrived = held.wait_beyond(pos, timeout=1.0)
                stop = min(arrived, end)
                if stop > pos:
                    P.send_all_views(conn.sock, [held.buf[pos:stop]])
                    self.bytes_sent += stop - pos
                    pos = stop
        finally:
            self.book.end_pull(held)
        return True


def pull(
    address: str,
    *,
    token: bytes,
    ticket_id: int,
    digest: bytes,
    buf: memoryview,
    start: int,
    progress: Callable[[int], None],
    stall_seconds: float,
    deadline: float,
    chunk_nbytes: int = CHUNK_NBYTES,
) -> None:
    """Child side: bytes ``[start, len(buf))`` of a ticket's stream from the
    relay at ``address`` into ``buf``, a chunk at a time, ``progress(end)``
    after each.

    Raises:
        PeerGoneError: the relay is gone, or does not hold the ticket.
        TransferTimeoutError: no chunk arrived within ``stall_seconds`` (a
            stalled relay), or the get's deadline passed.
        AuthenticationError: the relay refused the token.
    """
    total = len(buf)
    sock = connect(address, min(stall_seconds, max(deadline - time.monotonic(), 0.001)))
    try:
        sock.settimeout(stall_seconds)
        P.send_msg(sock, P.Hello(token=token, transport="tcp"))
        welcome = P.recv_msg(sock, expect=(P.Welcome,), deadline=time.monotonic() + stall_seconds)
        if isinstance(welcome, P.Failure):
            if welcome.kind == "auth":
                raise AuthenticationError(f"relay at {address} refused us: {welcome.message}; pass the sender's token")
            raise PeerGoneError(f"relay at {address} refused us: {welcome.message}")
        P.send_msg(sock, P.Pull(ticket_id=ticket_id, digest=digest, start=start, nbytes=total - start))
        reply = P.recv_msg(sock, deadline=time.monotonic() + stall_seconds + 10.0)
        if isinstance(reply, P.Failure):
            raise PeerGoneError(f"relay at {address}: {reply.message}")
        if not (isinstance(reply, tuple) and reply[0] == "DATA") or reply[1] != total - start:
            raise ProtocolError(f"relay at {address} answered a Pull of {total - start:,} bytes with {reply!r:.80}")
        pos = start
        while pos < total:
            k = min(chunk_nbytes, total - pos)
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"the get ran out of time after {pos:,} of {total:,} bytes from the relay at {address}")
            try:
                P.recv_exact_into(sock, buf[pos : pos + k], deadline=min(deadline, time.monotonic() + stall_seconds))
            except TransferTimeoutError as exc:
                raise TransferTimeoutError(f"the relay at {address} stalled: no {k:,}-byte chunk within {stall_seconds} s ({exc})") from exc
            pos += k
            progress(pos)
    except (OSError, socket.timeout) as exc:
        if isinstance(exc, TransferError):
            raise
        raise PeerGoneError(f"lost the relay at {address} ({exc})") from exc
    finally:
        sock.close()
