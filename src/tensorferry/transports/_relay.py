"""Relays: a receiver that passes on what it has received (tcp, nixl).

A broadcast ticket (``Sender.put(..., fanout=k)``) is pulled by most
receivers from another receiver rather than from the sender (see
``tensorferry._broadcast``). A receiver made with ``relay=True`` keeps a
:class:`RelayBook` of the tickets it receives: each one's stream (the
ticket's one block, as it arrives, chunk by chunk) and how much of it has
arrived. Its :class:`RelayServer` answers children's :class:`Pull`
requests from that stream while the rest still comes in (pipelined by
chunks), so a chain of relays moves the object about as fast as one link.

A child on the relay's own host (same boot, network and pid namespace:
:func:`host_identity`) does not take a stream: the relay lends it its
receive memory (:class:`~tensorferry._protocol.Lend`: pid and address,
and the memfd the memory is, passed over an abstract Unix socket), then
says how far the bytes have arrived, and the child copies each new range
itself, so a host's link carries the object once however many receivers
it has. It copies with ``process_vm_readv`` (one kernel copy, nothing to
map) where the kernel lets it; where not (Yama's ``ptrace_scope`` 1, the
default on Ubuntu, between sibling processes; a non-dumpable relay) it
maps the relay's memfd read-only and copies out of the mapping, which
needs no ptrace permission, only the same user. Only where neither works
does the child say why once and take the stream.

A nixl child on another host does not take a stream either: the relay
registers the ticket's receive memory with a NIXL agent of its own (the
exposer, which serves READs) and answers its Pull with
:class:`~tensorferry._protocol.Exposed` (the agent's metadata and the
address), then Arrived frames as for a lend; the child READs each new range
one-sided, as it READs the sender's pool.

:func:`pull` is the child's side. A relay that dies or stalls shows up in
the child as a broken or silent connection; the child then asks the sender
for another source and resumes from the bytes it has.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hmac
import logging
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from .. import _protocol as P
from ..errors import AuthenticationError, ConfigurationError, PeerGoneError, ProtocolError, TensorferryError, TransferError, TransferTimeoutError
from ._base import Connection
from ._shm import vm_readv
from ._tcp import TcpControlServer, connect

__all__ = ["CHUNK_NBYTES", "LEND_READ_NBYTES", "RelayBook", "RelayServer", "SameHostReads", "host_identity", "pull"]

log = logging.getLogger("tensorferry.transports")

# Bytes a relay receives before it passes them on: each hop of a chain
# adds one chunk's time (1 MiB: 8.4 ms at 1 Gbit/s; 4 MiB made a chain of 8
# 0.24 s slower), and a chunk still costs far more than its bookkeeping
# (a condition notify and a loop turn, tens of µs).
CHUNK_NBYTES = 1 << 20

_UCRED = struct.Struct("3i")  # pid, uid, gid

# The most bytes a child copies out of a same-host relay in one
# process_vm_readv: a relay that already holds everything lends it in one
# Arrived, and a child that relays too passes each piece on as it lands
# (8 MiB: about 1 ms at memory speed, far below a link's chunk time).
LEND_READ_NBYTES = 8 << 20


@functools.lru_cache(maxsize=1)
def host_identity() -> bytes:
    """What a relay and a child compare to know they can read each other's
    memory by pid: the boot (a pid means nothing on another machine or after
    a reboot), the pid namespace (a pid means nothing in another one) and
    the network namespace (a host as the broadcast tree sees it: test hosts
    made of namespaces stay apart, as containers with their own network do)."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            parts.append(f.read().strip())
        for ns in ("pid", "net"):
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino).encode())
    except OSError:
        return b""  # no /proc: every relay is read as a stream
    return b"/".join(parts)


class SameHostReads:
    """A child's choice and record of how it reads relays on its own host.

    Args:
        enabled: copy out of a same-host relay's memory (``False``: take
            the tcp stream from every relay).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.memory_nbytes = 0  # copied out of same-host relays' memory, either way
        self.file_nbytes = 0  # of which out of a mapping of the relay's memfd
        self.stream_nbytes = 0  # taken as tcp streams from relays
        self.nixl_nbytes = 0  # READ with NIXL out of relays' exposed memory
        self.refused = ""  # why the last refused memory read was refused, if one was
        self._refused_at: set[str] = set()  # relays read as streams
        self._no_vm_at: set[str] = set()  # relays read through their file
        self._lock = threading.Lock()

    def wanted(self, address: str) -> bool:
        return self.enabled and address not in self._refused_at

    def vm_allowed(self, address: str) -> bool:
        return address not in self._no_vm_at

    def refuse_vm(self, address: str, reason: str) -> None:
        """process_vm_readv of this relay was refused: read it through its file."""
        self._note(self._no_vm_at, address, reason, logging.INFO, "through its shared memory file")

    def refuse(self, address: str, reason: str) -> None:
        """Neither memory read of this relay works: take its stream."""
        self._note(self._refused_at, address, reason, logging.WARNING, "over tcp")

    def _note(self, where: set[str], address: str, reason: str, level: int, how: str) -> None:
        """Record (and log, once per relay) why ``address`` is read ``how``."""
        with self._lock:
            if address not in where:
                where.add(address)
                self.refused = reason
                log.log(level, "reading the relay at %s %s: %s", address, how, reason)

    def count(self, memory: int = 0, stream: int = 0, file: int = 0, nixl: int = 0) -> None:
        with self._lock:
            self.memory_nbytes += memory
            self.file_nbytes += file
            self.stream_nbytes += stream
            self.nixl_nbytes += nixl


class _Held:
    """One ticket's stream in a relay, and how much of it has arrived."""

    def __init__(self, book: "RelayBook", ticket_id: int, digest: bytes, buf: memoryview, fd: int) -> None:
        self.book, self.ticket_id, self.digest, self.buf = book, ticket_id, digest, buf
        # The memfd whose bytes from 0 on are ``buf`` (-1: none), open as
        # long as ``buf`` is alive (ReceiveCache.take_shared).
        self.fd = fd
        self.total = len(buf)
        # Where same-host children read it: ``buf`` (held here) keeps it there.
        self.address = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if self.total else 0
        self.arrived = 0
        self.state = "receiving"  # then "complete" or "failed"
        self.pulls = 0
        self.idle_since = time.monotonic()
        self.dropped = False  # let go by the book: no new pull may start on it
        # Its memory registered with the relay's NIXL exposer, while it is
        # (a tensor over ``buf``; RelayServer._expose, let go on drop).
        self.exposed: Any = None

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

    def __init__(self, linger_seconds: float, on_drop: Callable[[_Held], None] | None = None) -> None:
        self.cond = threading.Condition()
        self.linger_seconds = linger_seconds
        # Called (outside the lock, perhaps twice: it must not mind) with
        # each ticket let go, once no child pulls it.
        self.on_drop = on_drop
        self._held: dict[int, _Held] = {}
        self._timer: threading.Timer | None = None
        self._closed = False

    def add(self, ticket_id: int, digest: bytes, buf: memoryview, fd: int = -1) -> _Held:
        """A ticket this receiver starts to receive (into ``buf``, which is
        bytes 0 on of the memfd ``fd`` if not -1). Tickets it finished
        that no child is pulling are let go now: a weight sync sends a new
        version every few seconds, and a child that still wants an old one
        is sent elsewhere by the sender (its pull here fails)."""
        held = _Held(self, ticket_id, digest, buf, fd)
        with self.cond:
            gone = [h for h in self._held.values() if h.state != "receiving" and not h.pulls]
            self._drop(gone)
            self._held[ticket_id] = held
            self.cond.notify_all()
        self._dropped(gone)
        return held

    def _drop(self, gone: list[_Held]) -> None:
        """Under the lock: forget these tickets (no pull starts on them)."""
        for h in gone:
            h.dropped = True
            if self._held.get(h.ticket_id) is h:
                del self._held[h.ticket_id]

    def _dropped(self, gone: list[_Held]) -> None:
        """After :meth:`_drop`: ``on_drop`` for each ticket no child pulls
        (one that is pulled goes when its last pull ends)."""
        if self.on_drop is not None:
            for h in gone:
                if not h.pulls:
                    self.on_drop(h)

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
    :class:`Pull` byte ranges of a ticket, streamed as they arrive here,
    lent (children on this host) or exposed to NIXL READs (nixl children),
    and announced as they arrive.

    Its NIXL agent (the exposer) is made on the first nixl child; each
    ticket's memory is registered with it for as long as the book keeps the
    ticket (or a child still reads it)."""

    transport = "tcp"

    def __init__(self, book: RelayBook, *, token: bytes, host: str, port: int, advertise_host: str | None) -> None:
        self.book = book
        book.on_drop = self._unexpose
        self.bytes_sent = 0  # passed on to children, streamed, lent or exposed
        self.bytes_lent = 0  # of which children on this host copied out of our memory
        self.bytes_exposed = 0  # of which nixl children READ out of our memory
        self._exposer: Any = None  # NixlEndpoint, made on the first nixl child
        self._exposures = 0  # tickets registered with it now
        self._metadata = b""  # its metadata, taken after the last (de)registration
        self._expose_lock = threading.Lock()
        self._lending: set[Connection] = set()
        # Lends going on, by the key a child presents at the file socket.
        self._files: dict[bytes, _Held] = {}
        super().__init__(book, token=token, host=host, port=port, advertise_host=advertise_host)
        self._file_name = f"tensorferry-relay-{os.getpid()}-{secrets.token_hex(6)}"
        self._file_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._file_listener.bind("\0" + self._file_name)  # abstract: gone with the process, per network namespace
            self._file_listener.listen(64)
        except OSError:
            self._file_listener.close()
            super().close()
            raise
        self._file_thread = threading.Thread(target=self._pass_files, name="tensorferry-relay-files", daemon=True)
        self._file_thread.start()

    def _pass_files(self) -> None:
        """The file socket: a child on this host presents the key of its
        lend (a Hello) and gets a read-only fd of the lent memfd (SCM_RIGHTS)
        with the stream's size (a Welcome). The key exists only while that
        lend lasts, so the memory is ours to keep while the child reads it."""
        while True:
            try:
                conn, _ = self._file_listener.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._pass_file(conn)
                except (OSError, TransferError):
                    pass  # the child learns it from the closed socket and streams

    def _pass_file(self, conn: socket.socket) -> None:
        conn.settimeout(2.0)
        # The Hello first, also from a child we refuse: closing before it
        # arrived would fail the child's send, and it would never read why.
        hello = P.recv_msg(conn, expect=(P.Hello,), deadline=time.monotonic() + 2.0)
        pid, uid, _gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if uid != os.getuid() and uid != 0:
            P.send_msg(conn, P.Failure(kind="auth", message=f"process {pid} of user {uid} may not map this relay's memory"))
            return
        with self._lock:
            held = self._files.get(hello.token) if isinstance(hello, P.Hello) else None
            if held is None:
                P.send_msg(conn, P.Failure(kind="unknown", message="no lend of this relay has that key"))
                return
            # Read-only: the child can neither write our memory nor resize
            # the file (its size is sealed besides).
            ro = os.open(f"/proc/self/fd/{held.fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            P.send_msg(conn, P.Welcome(pool_nbytes=held.total, pool_generation=0), fds=[ro])
        finally:
            os.close(ro)

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
        if msg.host and held.total and msg.host == host_identity():
            self._lend(conn, held, msg.start, msg.start + msg.nbytes, nixl=False)
            return True
        if msg.nixl and held.total:
            self._lend(conn, held, msg.start, msg.start + msg.nbytes, nixl=True)
            return True
        if not self.book.begin_pull(held):
            P.send_msg(conn.sock, P.Failure(kind="unknown", message=f"this relay let ticket {msg.ticket_id} go"))
            return True
        P.send_data_header(conn.sock, msg.nbytes)
        try:
            pos, end = msg.start, msg.start + msg.nbytes
            while pos < end and not self._closed:
                arrived = held.wait_beyond(pos, timeout=1.0)
                stop = min(arrived, end)
                if stop > pos:
                    P.send_all_views(conn.sock, [held.buf[pos:stop]])
                    with self._lock:  # children's threads count side by side
                        self.bytes_sent += stop - pos
                    pos = stop
        finally:
            self.book.end_pull(held)
        return True

    def _expose(self, held: _Held) -> bytes:
        """Register ``held``'s memory with the exposer (made now if this is
        the first nixl child) and return the exposer's metadata for the
        child's add_remote. The caller holds a pull on ``held``, so it is
        not let go meanwhile."""
        import torch

        from ._nixl import serving_endpoint

        with self._expose_lock:
            if self._closed:
                raise PeerGoneError("this relay is closing")
            if self._exposer is None:
                self._exposer = serving_endpoint("relay")
            if held.exposed is None:
                tensor = torch.frombuffer(held.buf, dtype=torch.uint8)
                self._exposer.register(tensor)
                held.exposed = tensor
                self._exposures += 1
                self._metadata = self._exposer.metadata()
            return self._metadata

    def _unexpose(self, held: _Held) -> None:
        """The book let ``held`` go and no child reads it: deregister its
        memory (the exposer keeps it alive while registered). The last one
        after :meth:`close` closes the exposer."""
        with self._expose_lock:
            tensor, held.exposed = held.exposed, None
            if tensor is None:
                return
            self._exposures -= 1
            try:
                self._exposer.deregister(tensor)
                self._metadata = self._exposer.metadata() if not self._closed else b""
            except TransferError as exc:  # the endpoint is closed by its failure: nothing more to let go
                log.warning("the relay's NIXL agent failed to let a ticket's memory go: %s", exc)
            if self._closed and not self._exposures:
                self._exposer.close()

    def _lend(self, conn: Connection, held: _Held, pos: int, end: int, *, nixl: bool) -> None:
        """A child copies ``[pos, end)`` out of ``held``'s memory itself
        (on this host: ``nixl`` False; a nixl child: by READs of the memory
        registered with our exposer); this says where it is and how far it
        has arrived.

        The memory must stay where it is while the child may still read it:
        ``held`` (this frame) keeps it alive until the child says how far it
        read (an Arrived back, counted as lent) or closes the connection,
        also when this relay is closing (then it only stops announcing: see
        :meth:`close`) or its own receive failed. The file socket passes the
        memfd only while this lend lasts; a child's mapping would keep the
        pages alive after that, but the memory could hold the next ticket
        by then, so the child reads only what we announced while its
        connection is open, and unmaps when it closes.
        """
        sock, start = conn.sock, pos
        key = secrets.token_bytes(16) if held.fd >= 0 and not nixl else b""
        if not self.book.begin_pull(held):
            P.send_msg(sock, P.Failure(kind="unknown", message=f"this relay let ticket {held.ticket_id} go"))
            return
        with self._lock:
            self._lending.add(conn)
            if key:
                self._files[key] = held
        read = start
        try:
            if nixl:
                try:
                    first: Any = P.Exposed(metadata=self._expose(held), address=held.address, nbytes=held.total)
                except TensorferryError as exc:
                    P.send_msg(sock, P.Failure(kind="nixl", message=f"this relay could not expose its memory to NIXL ({exc})"))
                    return
            else:
                first = P.Lend(pid=os.getpid(), address=held.address, nbytes=held.total, file="@" + self._file_name if key else "", key=key)
            P.send_msg(sock, first)
            try:
                while pos < end and not self._closed:
                    stop = min(held.wait_beyond(pos, timeout=1.0), end)
                    if stop > pos:
                        P.send_msg(sock, P.Arrived(end=stop))
                        pos = stop
                    elif select.select([sock], [], [], 0)[0]:
                        break  # the child ended early (it gave us up, or failed): its last word below
            except PeerGoneError:
                # Our own receive failed, or the child went: no more from us.
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            sock.settimeout(None)
            try:
                while True:  # the child's one frame (how far it read), then its close
                    msg = P.recv_msg(sock, expect=(P.Arrived,))
                    if isinstance(msg, P.Arrived) and read < msg.end <= pos:
                        # Counted before the answer: the child's get returns
                        # after it, with our counters up to date.
                        with self._lock:
                            self.bytes_sent += msg.end - read
                            if nixl:
                                self.bytes_exposed += msg.end - read
                            else:
                                self.bytes_lent += msg.end - read
                        read = msg.end
                        if read == end:
                            P.send_msg(sock, P.Released(valid=True))
            except (PeerGoneError, ProtocolError, TransferTimeoutError):
                pass
        finally:
            with self._lock:
                self._lending.discard(conn)
                self._files.pop(key, None)
            self.book.end_pull(held)

    def close(self) -> None:
        """Stop serving. A child copying out of our memory is told so (end
        of its stream) but not cut off: its connection, and so the memory
        it reads, stays until it closes it (the exposer, until the last
        ticket registered with it is let go)."""
        with self._lock:
            lending = set(self._lending)
            self._conns -= lending
        for c in lending:
            try:
                c.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        try:
            self._file_listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._file_listener.close()
        super().close()
        with self._expose_lock:
            if self._exposer is not None and not self._exposures:
                self._exposer.close()


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
    reads: SameHostReads | None = None,
    nixl: Any = None,
) -> None:
    """Child side: bytes ``[start, len(buf))`` of a ticket's stream from the
    relay at ``address`` into ``buf``, ``progress(end)`` after each chunk.

    A relay on this host (``reads`` enabled) lends its memory and the child
    copies out of it (process_vm_readv); else, or where the kernel refuses
    that copy (recorded in ``reads``, logged once per relay), a nixl child
    (``nixl``: its NixlEndpoint, with ``buf`` registered) READs the relay's
    exposed memory, and any other child takes the relay's tcp stream.

    Raises:
        PeerGoneError: the relay is gone, or does not hold the ticket.
        TransferTimeoutError: no chunk arrived within ``stall_seconds`` (a
            stalled relay), or the get's deadline passed.
        AuthenticationError: the relay refused the token.
    """
    reached = [start]

    def advance(end: int) -> None:
        reached[0] = end
        progress(end)

    session = functools.partial(_pull_session, address, token=token, ticket_id=ticket_id, digest=digest, buf=buf, progress=advance,
                                stall_seconds=stall_seconds, deadline=deadline, chunk_nbytes=chunk_nbytes, reads=reads, nixl=nixl)
    if reads is not None and reads.wanted(address):
        try:
            session(start, host_identity())
            return
        except _VmReadRefused as exc:
            reads.refuse(address, str(exc))
    session(reached[0], b"")


class _VmReadRefused(Exception):
    """The kernel would not let us read a same-host relay's memory."""


def _pull_session(
    address: str, start: int, host: bytes, *, token: bytes, ticket_id: int, digest: bytes, buf: memoryview,
    progress: Callable[[int], None], stall_seconds: float, deadline: float, chunk_nbytes: int, reads: SameHostReads | None,
    nixl: Any,
) -> None:
    """One connection to the relay: a Pull from ``start`` (naming this
    ``host`` when not b"", asking for NIXL READs with ``nixl``), then the
    bytes as a stream or by reads of its memory, whichever it answers."""
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
        P.send_msg(sock, P.Pull(ticket_id=ticket_id, digest=digest, start=start, nbytes=total - start, host=host, nixl=nixl is not None))
        reply = P.recv_msg(sock, deadline=time.monotonic() + stall_seconds + 10.0)
        if isinstance(reply, P.Failure):
            raise PeerGoneError(f"relay at {address}: {reply.message}")
        if isinstance(reply, P.Lend) and host:
            if reply.nbytes != total:
                raise ProtocolError(f"relay at {address} lends a {reply.nbytes:,}-byte stream, the ticket has {total:,}")
            _read_lent(sock, address, _LentReader(address, reply, buf, reads, min(stall_seconds, 2.0)), start, total, progress, stall_seconds, deadline, reads)
            return
        if isinstance(reply, P.Exposed) and nixl is not None:
            if reply.nbytes != total:
                raise ProtocolError(f"relay at {address} exposes a {reply.nbytes:,}-byte stream, the ticket has {total:,}")
            _read_lent(sock, address, _NixlReader(nixl, address, reply, buf, reads, stall_seconds), start, total, progress, stall_seconds, deadline, reads)
            return
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
            if reads is not None:
                reads.count(stream=k)
            progress(pos)
    except (OSError, socket.timeout) as exc:
        if isinstance(exc, TransferError):
            raise
        raise PeerGoneError(f"lost the relay at {address} ({exc})") from exc
    finally:
        # Closing is what tells a lending relay it may let its memory go.
        sock.close()


def _read_lent(
    sock: socket.socket, address: str, reader: Any, pos: int, total: int,
    progress: Callable[[int], None], stall_seconds: float, deadline: float, reads: SameHostReads | None,
) -> None:
    """Copy ``buf[pos:total]`` out of a relay's memory (``reader``: a
    same-host lend's, or a nixl relay's exposed memory) as its Arrived
    frames say the bytes are there. Every range is read while our
    connection is open, so the relay still holds that memory.

    Raises:
        _VmReadRefused: neither process_vm_readv nor the relay's file
            could be had (the reason in the message): take the stream.
    """
    at, refused = [pos], False
    follow = _copy_exposed if isinstance(reader, _NixlReader) else _copy_lent
    try:
        follow(sock, address, reader, at, total, progress, stall_seconds, deadline, reads)
    except _VmReadRefused:
        refused = True
        raise
    finally:
        reader.close()
        if not refused:
            # How far we read, which the relay counts; when complete, its
            # answer (after which it may let the memory go) lets the
            # relay's counters include us before our get returns.
            try:
                P.send_msg(sock, P.Arrived(end=at[0]))
                if at[0] == total:
                    P.recv_msg(sock, expect=(P.Released,), deadline=time.monotonic() + min(stall_seconds, 1.0))
            except TransferError:
                pass


class _NixlReader:
    """Where a nixl relay's exposed stream is (its agent, loaded here, and
    the address) and where it goes (``buf``, registered with ``endpoint``).
    The relay's metadata is loaded on construction and forgotten on close
    (a relay's next ticket comes with new metadata)."""

    def __init__(self, endpoint: Any, address: str, exposed: P.Exposed, buf: memoryview, reads: SameHostReads | None, stall_seconds: float) -> None:
        self.endpoint, self.exposed = endpoint, exposed
        self.here = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
        try:
            self.remote = endpoint.add_remote(exposed.metadata)
        except TensorferryError as exc:
            raise ProtocolError(f"relay at {address} exposed NIXL metadata we cannot load ({exc})") from exc

    def close(self) -> None:
        self.endpoint.remove_remote(self.remote)


class _LentReader:
    """Copies ranges of a lent stream into ``buf``: by process_vm_readv
    while the kernel allows it (one copy, nothing to map or fault in), else
    out of a read-only mapping of the relay's memfd (no ptrace permission
    needed), fetched from its file socket on the first refusal."""

    def __init__(self, address: str, lend: P.Lend, buf: memoryview, reads: SameHostReads | None, timeout: float) -> None:
        self.address, self.lend, self.reads, self.timeout = address, lend, reads, timeout
        self.here = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
        self.vm = reads is None or reads.vm_allowed(address)
        self.mapping: mmap.mmap | None = None
        self.base = 0

    def copy(self, pos: int, k: int) -> None:
        if self.vm:
            try:
                vm_readv(self.lend.pid, np.array([self.here + pos]), np.array([self.lend.address + pos]), np.array([k]),
                         peer="relay", fix="reading it through its shared memory file instead")
                if self.reads is not None:
                    self.reads.count(memory=k)
                return
            except AuthenticationError as exc:
                self.vm = False
                if self.reads is not None:
                    self.reads.refuse_vm(self.address, str(exc))
                vm_refused = str(exc)
        else:
            vm_refused = "process_vm_readv was refused before"
        if self.mapping is None:
            self._map(vm_refused)
        ctypes.memmove(self.here + pos, self.base + pos, k)  # within the sealed size: checked in _map
        if self.reads is not None:
            self.reads.count(memory=k, file=k)

    def _map(self, vm_refused: str) -> None:
        """Fetch the relay's memfd and map it read-only, checked: sealed
        against shrinking (a read below its size can never fault) and at
        least the stream's size."""
        lend, where = self.lend, f"relay at {self.address}"
        if not lend.file.startswith("@") or not lend.key:
            raise _VmReadRefused(f"{vm_refused}; the {where} lends no shared memory file")
        fds: list[int] = []
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as us:
                us.settimeout(self.timeout)
                us.connect("\0" + lend.file[1:])
                P.send_msg(us, P.Hello(token=lend.key, transport="tcp"))
                reply = P.recv_msg(us, expect=(P.Welcome,), fds=fds, deadline=time.monotonic() + self.timeout)
        except (OSError, TransferError) as exc:
            for fd in fds:
                os.close(fd)
            raise _VmReadRefused(f"{vm_refused}; the {where} did not pass its memory file ({exc})") from exc
        if isinstance(reply, P.Failure) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            why = reply.message if isinstance(reply, P.Failure) else f"{len(fds)} file descriptors instead of 1"
            raise _VmReadRefused(f"{vm_refused}; the {where} did not pass its memory file ({why})")
        fd = fds[0]
        try:
            size = os.fstat(fd).st_size
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & fcntl.F_SEAL_SHRINK == 0:
                raise _VmReadRefused(f"{vm_refused}; the {where} passed a file that can shrink (it could fault our reads)")
            if size < lend.nbytes or reply.pool_nbytes != lend.nbytes:
                raise ProtocolError(f"{where} lends a {lend.nbytes:,}-byte stream in a {size:,}-byte file (it said {reply.pool_nbytes:,})")
            if lend.nbytes:
                self.mapping = mmap.mmap(fd, lend.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                view = np.frombuffer(self.mapping, dtype=np.uint8)
                self.base = int(view.ctypes.data)
                del view  # the address stays valid until the mapping is closed
        except OSError as exc:
            raise _VmReadRefused(f"{vm_refused}; could not map the {where}'s memory file ({exc})") from exc
        finally:
            os.close(fd)  # the mapping holds its own reference to the file

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None


# A nixl child READs a relay's announced bytes this much at a time, two
# READs in flight (see NixlEndpoint.post_read), as the relay READs its own
# source (transports._nixl.RELAY_CHUNK_NBYTES).
EXPOSED_READ_NBYTES = 2 << 20


def _copy_exposed(
    sock: socket.socket, address: str, reader: _NixlReader, at: list[int], total: int,
    progress: Callable[[int], None], stall_seconds: float, deadline: float, reads: SameHostReads | None,
) -> None:
    """As :func:`_copy_lent`, for a nixl relay: READs of the announced
    ranges, two in flight, each published (``progress``) once in place. The
    ranges are checked against the regions the relay's metadata names
    before NIXL moves a byte. ``at[0]``: how far it has read."""
    from ._nixl_agent import ReadPipeline

    pipe = ReadPipeline(reader.endpoint, reader.remote)
    known = posted = at[0]  # announced by the relay; READ or being READ
    last_news = time.monotonic()  # the last Arrived, or READ done
    pause = 50e-6
    try:
        while at[0] < total:
            if pipe.inflight and (end := pipe.poll()) is not None:
                if reads is not None:
                    reads.count(nixl=end - at[0])
                at[0] = end
                progress(end)
                pause, last_news = 50e-6, time.monotonic()  # progress: the stall clock starts again
                continue
            while posted < known and not pipe.full:
                k = min(EXPOSED_READ_NBYTES, known - posted)
                try:
                    pipe.post(reader.exposed.address + posted, reader.here + posted, k, posted + k, timeout=stall_seconds)
                except ConfigurationError as exc:  # a range outside what the relay registered
                    raise ProtocolError(f"the relay at {address}'s exposed stream does not hold bytes {posted:,}+{k:,}: {exc}") from exc
                posted += k
            # Wait for news from the relay: while a READ is in flight only a
            # moment (then poll it again), else until the stall limit.
            idle = not pipe.inflight
            limit = min(deadline, last_news + stall_seconds)
            if not select.select([sock], [], [], max(limit - time.monotonic(), 0.0) if idle else pause)[0]:
                if not idle:
                    pause = min(pause * 2, 1e-3)
                    continue
                raise _stalled(address, at[0], total, deadline, stall_seconds)
            known, last_news = _next_arrived(sock, address, known, at[0], total, limit, deadline, stall_seconds), time.monotonic()
    finally:
        pipe.close()


def _stalled(address: str, pos: int, total: int, deadline: float, stall_seconds: float) -> TransferTimeoutError:
    if time.monotonic() > deadline:
        return TransferTimeoutError(f"the get ran out of time after {pos:,} of {total:,} bytes from the relay at {address}")
    return TransferTimeoutError(f"the relay at {address} stalled: no bytes arrived there within {stall_seconds} s")


def _next_arrived(sock: socket.socket, address: str, known: int, pos: int, total: int, limit: float, deadline: float, stall_seconds: float) -> int:
    """Where the relay's next Arrived frame (waited for until ``limit``)
    says its bytes end: past ``known`` (what it announced before), at most
    ``total``. ``pos``: how far we have read, for the messages."""
    try:
        msg = P.recv_msg(sock, expect=(P.Arrived,), deadline=limit)
    except TransferTimeoutError as exc:
        raise _stalled(address, pos, total, deadline, stall_seconds) from exc
    if isinstance(msg, P.Failure):
        raise PeerGoneError(f"relay at {address}: {msg.message}")
    if not known < msg.end <= total:
        raise ProtocolError(f"relay at {address} says bytes up to {msg.end:,} arrived; it announced {known:,}, we hold {pos:,} of {total:,}")
    return msg.end


def _copy_lent(
    sock: socket.socket, address: str, reader: _LentReader, at: list[int], total: int,
    progress: Callable[[int], None], stall_seconds: float, deadline: float, reads: SameHostReads | None,
) -> None:
    """The Arrived frames and the copies; ``at[0]``: how far it has read."""
    pos = at[0]
    while pos < total:
        end = _next_arrived(sock, address, pos, pos, total, min(deadline, time.monotonic() + stall_seconds), deadline, stall_seconds)
        while pos < end:
            k = min(LEND_READ_NBYTES, end - pos)
            reader.copy(pos, k)
            pos += k
            at[0] = pos
            progress(pos)
