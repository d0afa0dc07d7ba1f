"""A relay's server: children's connections, their Pulls answered with a
stream, a lend of this host's memory or an exposure to NIXL READs, and the
file socket that passes a lent memfd. See :mod:`tensorferry.transports._relay`."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import select
import socket
import threading
import time
from typing import Any

from ...errors import (
    AuthenticationError,
    PeerGoneError,
    ProtocolError,
    TensorferryError,
    TransferError,
    TransferTimeoutError,
)
from ...wire import protocol as P
from .._base import Connection, check_same_user
from .._tcp import TcpControlServer
from ._book import RelayBook, _Held
from ._same_host import host_identity

__all__ = ["RelayServer"]

log = logging.getLogger("tensorferry.transports")


class RelayServer(TcpControlServer):
    """A relaying receiver's server: children prove they hold the token
    (the same handshake as a sender's, inside TLS with ``tls``: a server
    ``ssl.SSLContext``), then
    :class:`Pull` byte ranges of a ticket, streamed as they arrive here,
    lent (children on this host) or exposed to NIXL READs (nixl children),
    and announced as they arrive. Every Pull, and a child's last Arrived,
    is signed with the connection's session key, as an Acquire to a sender
    is: one replayed or copied from another connection is refused, and
    that connection closed, before a byte is served.

    Its NIXL agent (the exposer) is made on the first nixl child; each
    ticket's memory is registered with it for as long as the book keeps the
    ticket (or a child still reads it)."""

    transport = "tcp"

    def __init__(self, book: RelayBook, *, token: bytes, host: str, port: int, advertise_host: str | None, tls: Any = None) -> None:
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
        super().__init__(book, token=token, host=host, port=port, advertise_host=advertise_host, tls=tls)
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
        lend (a Claim) and gets a read-only fd of the lent memfd (SCM_RIGHTS)
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
        # The Claim first, also from a child we refuse: closing before it
        # arrived would fail the child's send, and it would never read why.
        claim = P.recv_msg(conn, expect=(P.Claim,), deadline=time.monotonic() + 2.0, max_nbytes=256)
        try:
            check_same_user(conn, "map this relay's memory")
        except AuthenticationError as exc:
            P.send_msg(conn, P.Failure(kind="auth", message=str(exc)))
            return
        with self._lock:
            held = self._files.get(claim.key) if isinstance(claim, P.Claim) else None
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
        if not conn.session.check(msg):
            P.send_msg(conn.sock, P.Failure(kind="auth", message="this Pull is not the next one signed with this connection's key"))
            raise AuthenticationError(f"child {conn.peer} sent a Pull not signed for this connection (replayed?)")
        held = self.book.find(msg.ticket_id, msg.digest, timeout=10.0)
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

        from .._nixl import serving_endpoint

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
        also when this relay is closing (then it stops announcing and says
        so in a Failure: see :meth:`close`) or its own receive failed. The
        file socket passes the memfd only while this lend lasts; a child's
        mapping would keep the pages alive after that, but the memory could
        hold the next ticket by then, so the child reads only what we
        announced while its connection is open, and unmaps when it closes.
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
            ended = ""
            try:
                while pos < end and not self._closed:
                    stop = min(held.wait_beyond(pos, timeout=1.0), end)
                    if stop > pos:
                        P.send_msg(sock, P.Arrived(end=stop))
                        pos = stop
                    elif select.select([sock], [], [], 0)[0]:
                        break  # the child ended early (it gave us up, or failed): its last word below
                if pos < end and self._closed:
                    ended = f"this relay is closing; it announced {pos:,} of {end:,} bytes"
            except PeerGoneError as exc:
                ended = str(exc)  # our own receive failed (or the child went: the send below fails too)
            if ended:
                # Said in a frame, not by half-closing our side: over TLS the
                # child could not send its last Arrived after that end.
                try:
                    P.send_msg(sock, P.Failure(kind="gone", message=ended))
                except TransferError:
                    pass
            sock.settimeout(None)
            try:
                while True:  # the child's one frame (how far it read), then its close
                    msg = P.recv_msg(sock, expect=(P.Arrived,))
                    if isinstance(msg, P.Arrived) and not conn.session.check(msg):
                        break  # not the child's (replayed, or injected): counted nothing, closed below
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
        """Stop serving. A child copying out of our memory is told so (a
        Failure, within a second: its lend's thread sees this) but not cut
        off: its connection, and so the memory it reads, stays until it
        closes it (the exposer, until the last ticket registered with it is
        let go)."""
        with self._lock:
            self._conns -= self._lending
        try:
            self._file_listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._file_listener.close()
        super().close()
        with self._expose_lock:
            if self._exposer is not None and not self._exposures:
                self._exposer.close()

