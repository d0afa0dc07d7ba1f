"""The pull: a child's side of a relay, the ticket's bytes as a stream,
by same-host reads of the relay's memory, or by NIXL READs of what it
exposes. See :mod:`tensorferry.transports._relay`."""

from __future__ import annotations

import functools
import select
import socket
import ssl
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from ...errors import (
    AuthenticationError,
    ConfigurationError,
    PeerGoneError,
    ProtocolError,
    TensorferryError,
    TransferError,
    TransferTimeoutError,
)
from ...wire import protocol as P
from .._auth import Session, client_handshake
from .._tcp import connect
from .._tls import wrap_client
from ._book import CHUNK_NBYTES
from ._links import RelayLinks
from ._same_host import LEND_READ_NBYTES, SameHostReads, _LentReader, _VmReadRefused, host_identity

__all__ = ["pull"]

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
    links: RelayLinks | None = None,
    tls: ssl.SSLContext | None = None,
    stop: int | None = None,
) -> None:
    """Child side: bytes ``[start, stop)`` (``stop`` None: ``len(buf)``, the
    stream's end; less: a two-tree broadcast's half) of a ticket's stream
    from the relay at ``address`` into ``buf``, ``progress(end)`` after each chunk.

    A relay on this host (``reads`` enabled) lends its memory and the child
    copies out of it (process_vm_readv); else, or where the kernel refuses
    that copy (recorded in ``reads``, logged once per relay), a nixl child
    (``nixl``: its NixlEndpoint, with ``buf`` registered) READs the relay's
    exposed memory, and any other child takes the relay's tcp stream.
    ``links``: the child's kept connections, one of which a Pull takes
    first, and which keep a connection whose stream ended whole.
    ``tls``: the child's client context; the relay's certificate is
    checked with it, as a sender's is. Every Pull (and the last Arrived of
    a lend) is signed with the connection's session key.

    Raises:
        PeerGoneError: the relay is gone, or does not hold the ticket.
        TransferTimeoutError: no chunk arrived within ``stall_seconds`` (a
            stalled relay), or the get's deadline passed.
        AuthenticationError: the relay refused our proof of the token, or
            did not prove it holds it, or its TLS certificate (or ours)
            failed verification, or it refused a Pull as not signed.
    """
    reached = [start]

    def advance(end: int) -> None:
        reached[0] = end
        progress(end)

    session = functools.partial(_pull_session, address, token=token, ticket_id=ticket_id, digest=digest, buf=buf, progress=advance,
                                stall_seconds=stall_seconds, deadline=deadline, chunk_nbytes=chunk_nbytes, reads=reads, nixl=nixl, links=links,
                                tls=tls, stop=len(buf) if stop is None else stop)
    if reads is not None and reads.wanted(address):
        try:
            session(start, host_identity())
            return
        except _VmReadRefused as exc:
            reads.refuse(address, str(exc))
    session(reached[0], b"")


def _pull_session(
    address: str, start: int, host: bytes, *, token: bytes, ticket_id: int, digest: bytes, buf: memoryview,
    progress: Callable[[int], None], stall_seconds: float, deadline: float, chunk_nbytes: int, reads: SameHostReads | None,
    nixl: Any, links: RelayLinks | None, tls: ssl.SSLContext | None, stop: int,
) -> None:
    """One connection to the relay: a Pull of ``[start, stop)`` (naming this
    ``host`` when not b"", asking for NIXL READs with ``nixl``), then the
    bytes as a stream or by reads of its memory, whichever it answers."""
    whole, total = len(buf), stop
    if not 0 <= start <= stop <= whole:
        raise ConfigurationError(f"a pull of bytes {start:,} to {stop:,} of a {whole:,}-byte stream")
    pull_msg = P.Pull(ticket_id=ticket_id, digest=digest, start=start, nbytes=total - start, host=host, nixl=nixl is not None)
    sock, session, kept = None, None, False
    try:
        sock, session, reply = _open(address, pull_msg, token, stall_seconds, deadline, links, tls)
        if isinstance(reply, P.Failure):
            if reply.kind == "auth":
                raise AuthenticationError(f"the relay at {address} refused our Pull as not signed for this connection: {reply.message}")
            raise PeerGoneError(f"relay at {address}: {reply.message}")
        if isinstance(reply, P.Lend) and host:
            if reply.nbytes != whole:
                raise ProtocolError(f"relay at {address} lends a {reply.nbytes:,}-byte stream, the ticket has {whole:,}")
            _read_lent(sock, session, address, _LentReader(address, reply, buf, reads, min(stall_seconds, 2.0)), start, total, progress,
                       stall_seconds, deadline, reads)
            return
        if isinstance(reply, P.Exposed) and nixl is not None:
            if reply.nbytes != whole:
                raise ProtocolError(f"relay at {address} exposes a {reply.nbytes:,}-byte stream, the ticket has {whole:,}")
            _read_lent(sock, session, address, _NixlReader(nixl, address, reply, buf, deadline), start, total, progress, stall_seconds,
                       deadline, reads)
            return
        if not (isinstance(reply, tuple) and reply[0] == "DATA") or reply[1] != total - start:
            raise ProtocolError(f"relay at {address} answered a Pull of {total - start:,} bytes with {reply!r:.80}")
        pos = start
        while pos < total:
            k = min(chunk_nbytes, total - pos)
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"the get ran out of time after {pos:,} of {total:,} bytes from the relay at {address}")
            try:
                # A chunk, and what more has arrived (a backlog in one call).
                k = P.recv_some_into(sock, buf[pos:total], k, deadline=min(deadline, time.monotonic() + stall_seconds), done=pos,
                                     total=total, relay=address)
            except TransferTimeoutError as exc:
                raise TransferTimeoutError(f"the relay at {address} stalled: no {k:,}-byte chunk within {stall_seconds} s ({exc})") from exc
            pos += k
            if reads is not None:
                reads.count(stream=k)
            progress(pos)
        kept = links is not None  # the stream ended whole: the next Pull of this relay may take the connection
    except (OSError, socket.timeout) as exc:
        if isinstance(exc, TransferError):
            raise
        raise PeerGoneError(f"lost the relay at {address} ({exc})") from exc
    finally:
        if sock is None:
            pass  # _open closed what it opened
        elif kept and links is not None and session is not None:
            links.keep(address, sock, session)
        else:
            # Closing is what tells a lending relay it may let its memory go.
            sock.close()


def _open(address: str, msg: P.Pull, token: bytes, stall_seconds: float, deadline: float, links: RelayLinks | None,
          tls: ssl.SSLContext | None) -> tuple[socket.socket, Session, Any]:
    """A connection to the relay at ``address`` that has sent ``msg``
    (signed with its session), its session, and the relay's reply. A kept
    connection (``links``) first: one the relay closed meanwhile fails
    before any reply, and a new one (connect, TLS with ``tls``, the token's
    handshake) is made then, so a relay is never given up for a connection
    it let go."""
    kept = links.take(address) if links is not None else None
    if kept is not None:
        sock, session = kept
        try:
            sock.settimeout(stall_seconds)
            P.send_msg(sock, session.sign(msg))
            return sock, session, P.recv_msg(sock, deadline=time.monotonic() + stall_seconds + 10.0)
        except TimeoutError:  # TransferTimeoutError too: a stalled relay, as on a new connection
            sock.close()
            raise
        except (OSError, TransferError):
            sock.close()  # let go by the relay: a new connection below
        except BaseException:
            sock.close()
            raise
    sock = connect(address, min(stall_seconds, max(deadline - time.monotonic(), 0.001)))
    try:
        sock.settimeout(stall_seconds)
        try:
            shake_by = time.monotonic() + stall_seconds
            if tls is not None:
                sock = wrap_client(sock, tls, address.rpartition(":")[0].strip("[]"), shake_by, who="relay")
            _, session = client_handshake(sock, token=token, transport="tcp", address=f"relay {address}", deadline=shake_by)
        except AuthenticationError:
            raise
        except TransferError as exc:
            if isinstance(exc, TransferTimeoutError):
                raise
            raise PeerGoneError(f"relay at {address} refused us ({exc})") from exc
        P.send_msg(sock, session.sign(msg))
        return sock, session, P.recv_msg(sock, deadline=time.monotonic() + stall_seconds + 10.0)
    except BaseException:
        sock.close()
        raise


def _read_lent(
    sock: socket.socket, session: Session, address: str, reader: Any, pos: int, total: int,
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
                P.send_msg(sock, session.sign(P.Arrived(end=at[0])))
                if at[0] == total:
                    P.recv_msg(sock, expect=(P.Released,), deadline=time.monotonic() + min(stall_seconds, 1.0))
            except TransferError:
                pass


class _NixlReader:
    """Where a nixl relay's exposed stream is (its agent, loaded here, and
    the address) and where it goes (``buf``, registered with ``endpoint``).
    The relay's metadata is loaded on construction and forgotten on close
    (a relay's next ticket comes with new metadata).

    One relay's agent is loaded by one reader of an endpoint at a time: a
    sharded get pulls several streams from one relay at once (one a
    source), each exposed with the relay's metadata of that moment, and
    loading a peer's metadata again, or forgetting it, ends the READs in
    flight from it. The others wait (until ``deadline``) and load theirs
    after."""

    def __init__(self, endpoint: Any, address: str, exposed: P.Exposed, buf: memoryview, deadline: float) -> None:
        self.endpoint, self.exposed = endpoint, exposed
        self.here = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
        self._turn = _exposer_turn(endpoint, address)
        if not self._turn.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise TransferTimeoutError(f"the get ran out of time waiting for its other reads from the nixl relay at {address}")
        try:
            self.remote = endpoint.add_remote(exposed.metadata)
        except TensorferryError as exc:
            self._turn.release()
            raise ProtocolError(f"relay at {address} exposed NIXL metadata we cannot load ({exc})") from exc

    def close(self) -> None:
        try:
            self.endpoint.remove_remote(self.remote)
        finally:
            self._turn.release()


_TURNS: "weakref.WeakKeyDictionary[Any, dict[str, threading.Lock]]" = weakref.WeakKeyDictionary()
_TURNS_LOCK = threading.Lock()


def _exposer_turn(endpoint: Any, address: str) -> threading.Lock:
    """The lock that one reader of ``endpoint`` holds while it has the
    relay at ``address`` loaded (made once a pair, gone with the endpoint)."""
    with _TURNS_LOCK:
        return _TURNS.setdefault(endpoint, {}).setdefault(address, threading.Lock())


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
    from .._nixl_reads import ReadPipeline

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
            if not _readable(sock, max(limit - time.monotonic(), 0.0) if idle else pause):
                if not idle:
                    pause = min(pause * 2, 1e-3)
                    continue
                raise _stalled(address, at[0], total, deadline, stall_seconds)
            known, last_news = _next_arrived(sock, address, known, at[0], total, limit, deadline, stall_seconds), time.monotonic()
    finally:
        pipe.close()


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether the relay's next frame can be read (waiting up to
    ``timeout``): bytes TLS already decrypted count, which select cannot see."""
    return bool((P.is_tls(sock) and sock.pending()) or select.select([sock], [], [], timeout)[0])


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
