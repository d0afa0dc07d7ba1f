"""``tcp``: transfers between any hosts over one TCP connection per receiver.

The sender's background thread serves the control protocol; a Fetch of an
acquired piece is answered with a DATA header and the raw block bytes, sent
with scatter-gather ``sendmsg`` straight from pool memory. The receiver reads
them with ``recv_into`` straight into its destination memory: no
intermediate ``bytes``. A Fetch of ranges (a sharded get's reads: a run
per row of a column slice) moves them by address on both ends, ``IOV_MAX``
runs a system call, no Python object a run. A shared-secret token authenticates both sides
without crossing the link (:mod:`._auth`); it is required when the sender
binds to anything but loopback. With ``tls=`` the connection is TLS
(:mod:`._tls`): its bytes go one buffer at a time, encrypted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..copy import CopyPlan
from ..errors import ConfigurationError, PeerGoneError, ProtocolError, TransferError
from ..wire import packing
from ..wire import protocol as P
from ._base import Connection, ControlServer
from ._channel import Channel
from ._ranges import block_ranges
from ._tls import wrap_server

__all__ = ["TcpControlServer", "TcpServer", "TcpChannel", "connect", "is_loopback", "is_wildcard", "advertised_host", "parse_address"]

# Large socket buffers keep a 2-core machine's loopback near memory speed.
_SOCK_BUF = 4 << 20

# Documentation addresses (RFC 5737, RFC 3849): a UDP connect() to one only
# asks the routing table which source address would be used; no packet is
# sent, and nothing answers there anyway.
_ROUTE_PROBES = {socket.AF_INET: "192.0.2.1", socket.AF_INET6: "2001:db8::1"}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def is_wildcard(host: str) -> bool:
    """True for the addresses that bind every interface: "", 0.0.0.0, ::."""
    if host == "":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _route_source(family: socket.AddressFamily) -> str | None:
    """The source address of this host's default route, without sending anything."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((_ROUTE_PROBES[family], 9))
            addr = probe.getsockname()[0]
    except OSError:
        return None  # no route of that family (an isolated host or container)
    return None if is_wildcard(addr) else addr


def _name_address(family: socket.AddressFamily) -> str | None:
    """What this host's name resolves to, if it is not loopback."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)
    except OSError:
        return None
    for info in infos:
        addr = str(info[4][0])
        if not is_loopback(addr) and not is_wildcard(addr):
            return addr
    return None


def advertised_host(host: str, advertise_host: str | None, *, dual_stack: bool = False) -> str:
    """The host a ticket names for a server bound to ``host``.

    ``advertise_host`` if given; else ``host`` unless it is a wildcard; else
    the host's primary address: the source address of its default route (of
    the bind's family, then IPv4 when an IPv6 wildcard also accepts IPv4),
    else what the host name resolves to, else loopback (the host has no
    other address, so only local peers could connect anyway).

    Raises:
        ConfigurationError: ``advertise_host`` is empty, a wildcard, or not a str.
    """
    if advertise_host is not None:
        if not isinstance(advertise_host, str) or is_wildcard(advertise_host):
            raise ConfigurationError(
                f"Sender(advertise_host={advertise_host!r}): tickets need an address peers can connect to, "
                "not a wildcard; pass this host's name or IP as peers reach it, or leave it unset"
            )
        return advertise_host.strip("[]")
    if not is_wildcard(host):
        return host
    families = [socket.AF_INET6, socket.AF_INET] if ":" in host and dual_stack else [socket.AF_INET6] if ":" in host else [socket.AF_INET]
    for family in families:
        addr = _route_source(family) or _name_address(family)
        if addr is not None:
            return addr
    return "::1" if families[0] == socket.AF_INET6 else "127.0.0.1"


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ProtocolError(f"tcp address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
        except OSError:
            pass


def connect(address: str, timeout: float) -> socket.socket:
    """A tuned TCP connection to a sender's control server (tcp and nixl)."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise PeerGoneError(f"cannot connect to the sender at {address} ({exc})") from exc
    _tune(sock)
    return sock


class TcpControlServer(ControlServer):
    """A control server listening on TCP (the base of tcp's and nixl's):
    binds, advertises an address peers can reach, tunes each connection."""

    def __init__(
        self, ledger, *, token: bytes = b"", host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._host, self._port = host, port
        self._advertise = advertise_host
        self.tls = tls
        super().__init__(ledger, token=token)

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(64)
            dual_stack = family == socket.AF_INET6 and not sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
            self._advertise = advertised_host(self._host, self._advertise, dual_stack=dual_stack)
        except (OSError, OverflowError, TypeError) as exc:
            sock.close()
            raise ConfigurationError(
                f"Sender(host={self._host!r}, port={self._port!r}) cannot listen there ({exc}); "
                "pass an address of this host and a free port from 1 to 65535, or port=0 for any free one"
            ) from exc
        except BaseException:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        return sock

    @property
    def address(self) -> str:
        """``host:port`` as tickets carry it: the advertised host, the bound port."""
        host = self._advertise or self._host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self._port}"

    def _serve(self, conn: Connection) -> None:
        _tune(conn.sock)
        super()._serve(conn)

    def _secure(self, conn: Connection, deadline: float) -> socket.socket:
        return conn.sock if self.tls is None else wrap_server(conn.sock, self.tls, conn.peer, deadline)


class TcpServer(TcpControlServer):
    """tcp: answers a Fetch of acquired blocks with their bytes."""

    transport = "tcp"
    serves_source_memory = True  # sendmsg sends from any address
    broadcasts = True

    def _handle_extra(self, conn: Connection, msg) -> bool:
        if not isinstance(msg, P.Fetch):
            return False
        held = self._held(conn, msg)
        if held is None:
            return True
        buffers = held.buffers()
        if msg.ranges:
            runs = _ranges_of(buffers, msg.ranges)
            if runs is None:
                P.send_msg(conn.sock, P.Failure(kind="ranges", message="the ranges asked for are malformed or lie outside the piece"))
                return True
            total = int(runs[1].sum())
            P.send_data_header(conn.sock, total)
            # The frame timeout stays on (below too): a receiver that stops
            # reading for that long must not pin the piece's blocks forever.
            P.send_runs(conn.sock, *runs)
        else:
            if msg.start:
                buffers = skip_bytes(buffers, msg.start)
            total = sum(b.nbytes for b in buffers)
            P.send_data_header(conn.sock, total)
            P.send_all_views(conn.sock, buffers)
        self.ledger.count_sent(total)
        return True


def _ranges_of(buffers: list[memoryview], ranges: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """The parts of ``buffers`` (a piece, back to back) that ``ranges``
    (a Fetch's int64 pairs) name, as (address, nbytes) in this process's
    memory, joined where one continues the last there (a sender's side:
    no Python object a range); None if they are malformed."""
    if len(ranges) % 16:
        return None
    pairs = np.frombuffer(ranges, dtype="<i8").reshape(-1, 2)
    pos, n = pairs[:, 0], pairs[:, 1]
    sizes = np.fromiter(map(len, buffers), dtype=np.int64, count=len(buffers))
    total = int(sizes.sum())
    # Each bounded first: a position and a length near 2**63 add up past
    # int64's range to a negative end that would pass the last check.
    if (n <= 0).any() or (pos < 0).any() or (n > total).any() or (pos > total).any() or int((pos + n).max()) > total \
            or (pos[1:] < pos[:-1]).any():
        return None
    # The buffers as blocks at their stream positions: each range cut at their seams.
    starts = np.cumsum(sizes) - sizes
    bases = np.fromiter((np.frombuffer(b, dtype=np.uint8).ctypes.data for b in buffers), dtype=np.int64, count=len(buffers))
    off, _, ln = block_ranges(list(zip(starts.tolist(), sizes.tolist())), pos, pos, n)
    which = np.searchsorted(starts, off, side="right") - 1
    address = bases[which] + off - starts[which]
    merged = packing.merge_runs(address, address, ln)
    return merged.dst, merged.nbytes


def skip_bytes(buffers: list[memoryview], start: int) -> list[memoryview]:
    """``buffers`` without their first ``start`` bytes (all of them if fewer)."""
    at = 0
    for i, b in enumerate(buffers):
        if start < at + b.nbytes:
            return [b[start - at :], *buffers[i + 1 :]]
        at += b.nbytes
    return []


# 16 bytes a range: 64k ranges make a 1 MiB Fetch, far inside a frame.
_RANGES_PER_FETCH = 1 << 16
# Beyond this many ranges averaging under this size, a range read over TLS
# (one recv a buffer) goes through a scratch buffer (the same bounds as a
# one-shot get's scatter).
_SCATTER_MAX_RANGES = 256
_SCATTER_MIN_MEAN_NBYTES = 256 << 10
_STAGE_NBYTES = 16 << 20
# Scratch buffers of that size, kept for the next range read of any channel
# (a new one each read cost 4096 page faults, and each get of a sharded
# worker makes a read per source): at most this many (a thread each).
_SCRATCH_KEPT = 4
_scratch_free: list[torch.Tensor] = []
_scratch_lock = threading.Lock()


@contextlib.contextmanager
def _scratch() -> Iterator[torch.Tensor]:
    """A ``_STAGE_NBYTES`` scratch buffer for the duration (one kept from
    an earlier read where one is free, already faulted in)."""
    with _scratch_lock:
        buf = _scratch_free.pop() if _scratch_free else None
    if buf is None:
        buf = torch.empty(_STAGE_NBYTES, dtype=torch.uint8)
    try:
        yield buf
    finally:
        with _scratch_lock:
            if len(_scratch_free) < _SCRATCH_KEPT:
                _scratch_free.append(buf)


class TcpChannel(Channel):
    transport = "tcp"
    secured_by_tls = True
    receives_into_buffers = True
    reads_ranges = True
    receives_by_loop = True
    relays = True

    def _connect(self, address: str, timeout: float) -> socket.socket:
        return connect(address, timeout)

    def _fetch(self, ticket_id: int, piece: int, blocks, deadline: float, start: int = 0, ranges: np.ndarray | None = None) -> int:
        """Ask for the acquired blocks' bytes from byte ``start`` on (or only
        ``ranges``: (position, nbytes) rows); returns how many follow."""
        self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        wire = b"" if ranges is None else ranges.astype("<i8").tobytes()
        P.send_msg(self.sock, P.Fetch(ticket_id=ticket_id, piece=piece, start=start, ranges=wire))
        reply = P.recv_msg(self.sock)
        if isinstance(reply, P.Failure):
            raise TransferError(f"sender at {self.address}: {reply.message}")
        if not (isinstance(reply, tuple) and reply[0] == "DATA"):
            raise ProtocolError(f"sender answered a Fetch with {type(reply).__name__}")
        want = max(0, sum(n for _, n in blocks) - start) if ranges is None else int(ranges[:, 1].sum())
        if reply[1] != want:
            raise ProtocolError(f"sender announced {reply[1]:,} bytes, the blocks hold {want:,}")
        return want

    def _stream_filler(self, ticket_id, piece, blocks, deadline):
        # One Fetch; then the bytes arrive in order, a chunk per call.
        self._fetch(ticket_id, piece, blocks, deadline)

        def fill(pos: int, k: int, buf) -> None:
            P.recv_exact_into(self.sock, memoryview(buf.numpy())[:k], deadline=deadline)

        return fill

    def receive_range(self, ticket_id: int, piece: int, blocks, buf: memoryview, start: int, progress: Any, *, deadline: float, chunk_nbytes: int) -> None:
        """One Fetch from byte ``start`` on, read ``chunk_nbytes`` at a time (see :meth:`Channel.receive_range`)."""
        total = len(buf)
        self._fetch(ticket_id, piece, blocks, deadline, start)
        pos = start
        while pos < total:
            # A chunk, and what more has arrived (a backlog in one call).
            pos += P.recv_some_into(self.sock, buf[pos:total], chunk_nbytes, deadline=deadline)
            progress(pos)

    def read_ranges(self, ticket_id, piece, blocks, pos, address, nbytes, *, deadline):
        """Fetches of only these ranges (at most ``_RANGES_PER_FETCH`` a
        frame), received straight into their local memory, ``IOV_MAX`` runs
        a system call and no Python object a run (see
        :func:`~tensorferry.wire.protocol.recv_runs`); with TLS, many small
        ones (a row-parallel slice of a row-sharded tensor: a run per row)
        through a scratch buffer, copied out by address."""
        for lo in range(0, pos.size, _RANGES_PER_FETCH):
            part = slice(lo, lo + _RANGES_PER_FETCH)
            self._fetch(ticket_id, piece, blocks, deadline, ranges=np.stack([pos[part], nbytes[part]], axis=1))
            a, n = address[part], nbytes[part]
            # The reply's runs come back to back: one that continues the
            # last in memory here is received with it (a column slice of
            # row-sharded sources: a target row a run, the rows adjacent).
            merged = packing.merge_runs(a, np.cumsum(n) - n, n)
            a, n = merged.dst, merged.nbytes
            if P.is_tls(self.sock) and n.size > _SCATTER_MAX_RANGES and int(n.mean()) < _SCATTER_MIN_MEAN_NBYTES:
                self._receive_staged(a, n, deadline)
            else:
                P.recv_runs(self.sock, a, n, deadline=deadline)

    def receive_ranges(self, ticket_id, piece, blocks, pos, nbytes, buf, start, progress, *, deadline, chunk_nbytes):
        """Fetches of the ranges from ``start`` on (at most
        ``_RANGES_PER_FETCH`` a frame), each reply received ``chunk_nbytes``
        at a time (see :meth:`Channel.receive_ranges`)."""
        at, p, n = packing.window((np.cumsum(nbytes) - nbytes, pos, nbytes), start, len(buf))
        at += start
        for lo in range(0, p.size, _RANGES_PER_FETCH):
            part = slice(lo, lo + _RANGES_PER_FETCH)
            self._fetch(ticket_id, piece, blocks, deadline, ranges=np.stack([p[part], n[part]], axis=1))
            at_, end = int(at[part][0]), int(at[part][-1] + n[part][-1])
            while at_ < end:
                at_ += P.recv_some_into(self.sock, buf[at_:end], chunk_nbytes, deadline=deadline)
                progress(at_)

    def _receive_staged(self, address: np.ndarray, nbytes: np.ndarray, deadline: float) -> None:
        """The Fetch's reply (the ranges back to back) a chunk at a time into
        a scratch buffer, each chunk's runs copied to ``address`` by the copy
        loop: one large recv a chunk instead of a buffer a run."""
        at = np.cumsum(nbytes) - nbytes
        copy = CopyPlan.build(address, at, nbytes)
        total = int(nbytes.sum())
        with _scratch() as scratch:
            view, base = memoryview(scratch.numpy()), scratch.data_ptr()
            for c in range(0, total, len(view)):
                k = min(len(view), total - c)
                P.recv_exact_into(self.sock, view[:k], deadline=deadline)
                copy.execute_window(c, c + k, 0, base - c)

    def read_into(self, ticket_id, piece, blocks, dests, *, deadline):
        self.read_buffers(ticket_id, piece, blocks, [memoryview(d.numpy()) for d in dests], deadline=deadline)

    def read_buffers(self, ticket_id: int, piece: int, blocks, buffers: list[memoryview], *, deadline: float) -> None:
        """One Fetch, received straight into the buffers (recvmsg_into):
        a plan's buffer list, no tensor or buffer object made per get."""
        want = self._fetch(ticket_id, piece, blocks, deadline)
        have = sum(map(len, buffers))
        if have != want:
            raise ProtocolError(f"destination segments hold {have:,} bytes, the blocks {want:,}")
        P.recv_scatter_into(self.sock, buffers, deadline=deadline)
