"""The transport contract: a sender-side server and a receiver-side channel.

A transport is a pair of small classes:

* a :class:`ControlServer` subclass, run by a Sender: it accepts receivers,
  shakes hands (token, pool identity, whatever the transport must pass), and
  answers Acquire / Release from what the sender holds (its
  :class:`Holdings`: the ledger, or a relay's book); a transport adds its
  own requests (tcp's Fetch) and handshake extras (shm's file descriptor,
  nixl's agent metadata), and declares what it can do as class attributes
  (:attr:`ControlServer.serves_source_memory`, :attr:`ControlServer.broadcasts`):
  the sender decides how a put executes from those, never from a name;
* a :class:`~tensorferry.transports._channel.Channel` subclass (in
  ``_channel``), used by a Receiver for one sender: it sends
  Acquire / Release, and moves the bytes of acquired blocks into destination
  memory with :meth:`Channel.read_into` (shm: one copy per block out of the
  mapped pool; tcp: ``recv_into`` straight into the destination; nixl: a
  one-sided READ). What more it can do it declares as class attributes
  (``maps_sender_memory``, ``receives_into_buffers``, ``receives_by_loop``,
  ``reads_registered_only``, ``relays``, ``reads_source_runs``,
  ``reads_ranges``): the
  receiver chooses how bytes move from those, never from the name.

Everything in and out is plain data: lists of ``(offset, nbytes)`` and 1-D
uint8 tensors. A broken or hostile peer gets its connection closed; the
server keeps serving everyone else.
"""

from __future__ import annotations

import abc
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

import msgspec

from ..errors import AuthenticationError, PeerGoneError, ProtocolError, TensorferryError, TransferTimeoutError
from ..wire import protocol as P
from ._auth import HANDSHAKE_SECONDS, FailureCount, Session, server_handshake

if TYPE_CHECKING:
    from ..memory import Block

__all__ = ["ControlServer", "Connection", "Held", "Holdings", "check_same_user"]

log = logging.getLogger("tensorferry.transports")

# A peer that starts a frame must finish it this fast; an idle connection
# may wait forever (a receiver between gets).
_FRAME_TIMEOUT_SECONDS = 30.0
# Connections still before their handshake (unauthenticated, each a thread
# for up to HANDSHAKE_SECONDS): beyond this many, the oldest is closed for
# each new one, so a flood of silent or dripping connections cannot pile up
# threads, nor keep a receiver out (its handshake takes milliseconds).
_MAX_HANDSHAKING = 128


class Held(Protocol):
    """What a server serves for one acquired piece: a pool block group
    (:class:`~tensorferry.pool.Packed`) or the sender's own tensors
    (:class:`~tensorferry.plans.SourcedPiece`, a ``snapshot=False`` put)."""

    blocks: "tuple[Block, ...]"

    def buffers(self) -> list[memoryview]:
        """The piece's bytes, in order, as buffers of this process's memory."""
        ...

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(position, address, length) of the piece's bytes in this
        process's memory for a reader that copies them out itself
        (process_vm_readv), or None when they are in the pool (map it)."""
        ...

    def release(self) -> None:
        """Give the bytes back (a pool block is freed); idempotent."""
        ...


class Holdings(abc.ABC):
    """What a :class:`ControlServer` serves from, written once: the
    sender's ``Ledger`` (tickets, pieces, reader slots) and a relay's
    ``RelayBook`` (the tickets it relays; its children take their slots at
    the sender) implement it. Called on the server's connection threads."""

    @abc.abstractmethod
    def acquire(self, conn: "Connection", msg: P.Acquire) -> P.Located | P.Failure:
        """Take a reader slot of a piece (waiting for a streamed piece to be packed)."""

    @abc.abstractmethod
    def held(self, conn: "Connection", ticket_id: int, piece: int) -> Held | None:
        """What holds a piece ``conn`` acquired, or None if it holds none."""

    @abc.abstractmethod
    def release(self, conn: "Connection", ticket_id: int, piece: int, send: Any = None) -> P.Released | P.Failure:
        """A reader is done with a piece; ``send(reply)`` answers it first."""

    @abc.abstractmethod
    def drop_connection(self, conn: "Connection") -> None:
        """``conn`` went away: every slot it held is finished."""


_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


def check_same_user(sock: socket.socket, what: str) -> None:
    """Refuse a Unix-socket peer of another user (root excepted): it may
    not read this process's memory (``what``, e.g. "map this sender's pool").

    Raises:
        AuthenticationError: the peer runs as another user.
    """
    pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    if uid != os.getuid() and uid != 0:
        raise AuthenticationError(f"process {pid} of user {uid} may not {what}")


class Connection:
    """One accepted receiver connection and the reader slots it holds.

    Args:
        sock: the accepted socket.
        peer: its address, as accept returned it.
        server: the server that accepted it: what it can do
            (``serves_source_memory``, ``broadcasts``) is what the
            holdings may offer this reader.
    """

    def __init__(self, sock: socket.socket, peer: Any, server: "ControlServer") -> None:
        self.sock = sock
        self.peer = str(peer)
        self.server = server
        self.transport = server.transport
        # A tcp receiver on another host than this server's: its address
        # (a broadcast places it below a relay of its own host); else "".
        self.remote_host = ""
        if isinstance(peer, tuple):
            try:
                here = sock.getsockname()[0]
            except OSError:
                here = peer[0]
            self.remote_host = peer[0] if peer[0] != here else ""
        self.holds: dict[tuple[int, int], int] = {}
        self.lock = threading.Lock()
        self.session: Session | None = None  # set once it authenticated


class ControlServer:
    """Sender side: accept receivers and serve holdings over the protocol.

    A subclass provides :meth:`_listen` and :attr:`address`, and may
    override :meth:`_authorize`, :meth:`_welcome` and :meth:`_handle_extra`.

    Args:
        ledger: what it serves from (:class:`Holdings`: the sender's
            ledger, whose ``pool`` the welcome describes, or a relay's book).
        token: shared secret every receiver must prove it holds (empty:
            none); see :mod:`tensorferry.transports._auth`.
    """

    transport: ClassVar[str] = ""
    # Serves a snapshot=False put: pieces that are the sender's tensors,
    # not its pool (tcp sends from any address; shm readers copy them out
    # with process_vm_readv).
    serves_source_memory: ClassVar[bool] = False
    # Its readers may join a broadcast tree and pull from relaying
    # receivers (put(fanout=)); readers that map the pool (shm) do not.
    broadcasts: ClassVar[bool] = False
    # Its readers are on this host (they map the pool): a byte they read
    # costs a memory copy, not a link's time (a delta plan sends a delta
    # only when it is much smaller than the whole object).
    same_host_only: ClassVar[bool] = False

    def __init__(self, ledger: Holdings, *, token: bytes = b"") -> None:
        self.ledger = ledger
        self.token = token
        self.listener = self._listen()
        self._closed = False
        self._conns: set[Connection] = set()
        # Before their handshake, oldest first; the value is a duplicate of
        # the socket's fd, closed by whoever takes the entry out, so that its
        # number cannot name another connection while it is here.
        self._shaking: dict[Connection, int] = {}
        self.evicted = 0  # closed before their handshake ended, for newer ones
        self.failed = FailureCount(f"{self.transport} sender at {self.address}")
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=f"tensorferry-{self.transport}-accept", daemon=True)
        self._thread.start()

    # -- what a transport provides ---------------------------------------------

    def _listen(self) -> socket.socket:
        raise NotImplementedError

    @property
    def address(self) -> str:
        raise NotImplementedError

    def _authorize(self, sock: socket.socket) -> None:
        """Check the peer before the handshake (shm: same user)."""

    def _secure(self, conn: Connection, deadline: float) -> socket.socket:
        """The connection's socket for the handshake on (tcp: TLS where asked)."""
        return conn.sock

    def _welcome(self, conn: Connection, hello: P.Hello) -> tuple[P.Welcome, list[int]]:
        pool = self.ledger.pool  # a sender's ledger; a relay's server welcomes otherwise
        return P.Welcome(pool_nbytes=pool.capacity_nbytes, pool_generation=pool.generation, pool_base_addr=pool.data_ptr), []

    def _handle_extra(self, conn: Connection, msg: Any) -> bool:
        """Handle a transport-specific request; False if it is not one."""
        return False

    def _held(self, conn: Connection, msg: Any) -> Held | None:
        """What holds the piece ``msg`` asks about (see ``Ledger.held``), or
        None after telling the receiver it does not hold it."""
        held = self.ledger.held(conn, msg.ticket_id, msg.piece)
        if held is None:
            P.send_msg(conn.sock, P.Failure(kind="not-held", message=f"ticket {msg.ticket_id} piece {msg.piece} is not acquired on this connection"))
        return held

    # -- the loop ----------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self.listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            conn = Connection(sock, addr, self)
            with self._lock:
                if len(self._shaking) >= _MAX_HANDSHAKING:
                    oldest = next(iter(self._shaking))
                    self.evicted += 1
                    _shutdown_fd(self._shaking.pop(oldest))
                self._shaking[conn] = os.dup(sock.fileno())
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="tensorferry-conn", daemon=True).start()

    def _handshake(self, conn: Connection) -> None:
        """Before it is authenticated: bounded in time and frame size, and
        nothing allocated or served until the receiver proved its token."""
        deadline = time.monotonic() + HANDSHAKE_SECONDS
        self._authorize(conn.sock)
        conn.sock = sock = self._secure(conn, deadline)
        hello, conn.session, proof = server_handshake(sock, token=self.token, transport=self.transport, peer=conn.peer, deadline=deadline)
        welcome, fds = self._welcome(conn, hello)
        P.send_msg(sock, msgspec.structs.replace(welcome, proof=proof), fds=fds)

    def _serve(self, conn: Connection) -> None:
        shaking = True
        try:
            try:
                self._handshake(conn)
            except ProtocolError as exc:
                peer_version = getattr(exc, "peer_version", None)
                if peer_version is not None:  # in our framing: the peer's decoder names both versions
                    P.send_msg(conn.sock, P.Failure(kind="version", message=f"this sender speaks protocol version {P.VERSION}, "
                                                    f"you speak {peer_version}; use the same tensorferry version on both sides"))
                raise
            with self._lock:
                fd = self._shaking.pop(conn, None)
            if fd is None:
                raise PeerGoneError("evicted by newer connections before its handshake ended")
            os.close(fd)
            shaking = False
            sock = conn.sock
            while not self._closed:
                # Idle between requests: wait for a first byte without a
                # timeout; once a frame starts, it must finish in time.
                _wait_readable(sock, conn.peer)
                sock.settimeout(_FRAME_TIMEOUT_SECONDS)
                msg = P.recv_msg(sock, deadline=time.monotonic() + _FRAME_TIMEOUT_SECONDS)
                if isinstance(msg, P.Acquire):
                    if not conn.session.check(msg):
                        P.send_msg(sock, P.Failure(kind="auth", message="this Acquire is not the next one signed with this connection's key"))
                        raise AuthenticationError(f"receiver {conn.peer} sent an Acquire not signed for this connection (replayed?)")
                    P.send_msg(sock, self.ledger.acquire(conn, msg))
                elif isinstance(msg, P.Release):
                    self.ledger.release(conn, msg.ticket_id, msg.piece, send=lambda reply: P.send_msg(sock, reply))
                elif not self._handle_extra(conn, msg):
                    raise ProtocolError(f"unexpected {type(msg).__name__} from a receiver")
        except Exception as exc:
            if shaking and isinstance(exc, (TensorferryError, OSError)):  # unauthenticated: counted, logged at most once a minute
                self.failed.add(conn.peer, f"{type(exc).__name__}: {exc}")
            elif isinstance(exc, (PeerGoneError, TransferTimeoutError)):
                pass  # the receiver went away: its holds are dropped below
            elif isinstance(exc, TensorferryError):
                log.warning("closing connection from %s: %s", conn.peer, exc)
            else:  # a bug must not kill the server for everyone
                log.exception("closing connection from %s after an internal error", conn.peer)
        finally:
            self.ledger.drop_connection(conn)
            with self._lock:
                self._conns.discard(conn)
                fd = self._shaking.pop(conn, None)
            if fd is not None:
                os.close(fd)
            try:
                conn.sock.close()
            except OSError:
                pass

    def stats(self) -> dict[str, int]:
        """Connections now, and those that never authenticated (failed their
        handshake, or evicted by newer ones while it lasted)."""
        with self._lock:
            return {"connections": len(self._conns), "handshaking": len(self._shaking), "failed_handshakes": self.failed.total,
                    "evicted_handshakes": self.evicted}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                # The TCP socket's own shutdown: SSLSocket.shutdown first drops
                # its TLS state, and a send of the connection's thread racing it
                # would go out in clear.
                socket.socket.shutdown(c.sock, socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=2.0)


def _shutdown_fd(fd: int) -> None:
    """Shut down the connection behind ``fd`` (its thread, blocked in a
    read, sees the end and closes it), and close ``fd``."""
    with socket.socket(fileno=fd) as dup:
        try:
            dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _wait_readable(sock: socket.socket, peer: str) -> None:
    """Wait, without a timeout, for the first byte of the next request."""
    if P.is_tls(sock):
        if not sock.pending():  # decrypted bytes already here need no wait
            poller = select.poll()  # not select(): fds past 1023 are common on a busy server
            poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            poller.poll()
        return
    sock.settimeout(None)
    try:
        started = sock.recv(1, socket.MSG_PEEK)
    except OSError as exc:
        raise PeerGoneError(f"receiver {peer} went away ({exc})") from exc
    if not started:
        raise PeerGoneError(f"receiver {peer} closed the connection")
