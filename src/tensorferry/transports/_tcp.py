"""``tcp``: transfers between any hosts over one TCP connection per receiver.

The sender's background thread serves the control protocol; a Fetch of an
acquired piece is answered with a DATA header and the raw block bytes, sent
with scatter-gather ``sendmsg`` straight from pool memory. The receiver reads
them with ``recv_into`` straight into its destination memory: no
intermediate ``bytes``. A shared-secret token authenticates receivers; it is
required when the sender binds to anything but loopback.
"""

from __future__ import annotations

import ipaddress
import socket
import time

from .. import _protocol as P
from ..errors import PeerGoneError, ProtocolError, TransferError
from ._base import Channel, Connection, ControlServer

__all__ = ["TcpServer", "TcpChannel", "is_loopback", "parse_address"]

# Large socket buffers keep a 2-core machine's loopback near memory speed.
_SOCK_BUF = 4 << 20


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


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


class TcpServer(ControlServer):
    transport = "tcp"

    def __init__(self, ledger, *, token: bytes = b"", host: str = "127.0.0.1", port: int = 0) -> None:
        self._host, self._port = host, port
        super().__init__(ledger, token=token)

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        sock.listen(64)
        self._port = sock.getsockname()[1]
        return sock

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    def _serve(self, conn: Connection) -> None:
        _tune(conn.sock)
        super()._serve(conn)

    def _handle_extra(self, conn: Connection, msg) -> bool:
        if not isinstance(msg, P.Fetch):
            return False
        blocks = self.ledger.held_blocks(conn, msg.ticket_id, msg.piece)
        if blocks is None:
            P.send_msg(conn.sock, P.Failure(kind="not-held", message=f"ticket {msg.ticket_id} piece {msg.piece} is not acquired on this connection"))
            return True
        pool = self.ledger.pool
        host = pool.buffer.numpy()
        P.send_data_header(conn.sock, sum(n for _, n in blocks))
        # The frame timeout stays on: a receiver that stops reading for that
        # long (hung, stopped) must not pin the piece's blocks forever.
        P.send_all_views(conn.sock, [memoryview(host[off : off + n]) for off, n in blocks])
        return True


class TcpChannel(Channel):
    transport = "tcp"
    supports_scatter = True

    def _connect(self, address: str, timeout: float) -> socket.socket:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerGoneError(f"cannot connect to the sender at {address} ({exc})") from exc
        _tune(sock)
        return sock

    def _fetch(self, ticket_id: int, piece: int, blocks, deadline: float) -> int:
        """Ask for the acquired blocks' bytes; returns how many follow."""
        self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
        P.send_msg(self.sock, P.Fetch(ticket_id=ticket_id, piece=piece))
        reply = P.recv_msg(self.sock)
        if isinstance(reply, P.Failure):
            raise TransferError(f"sender at {self.address}: {reply.message}")
        if not (isinstance(reply, tuple) and reply[0] == "DATA"):
            raise ProtocolError(f"sender answered a Fetch with {type(reply).__name__}")
        want = sum(n for _, n in blocks)
        if reply[1] != want:
            raise ProtocolError(f"sender announced {reply[1]:,} bytes, the blocks hold {want:,}")
        return want

    def _stream_filler(self, ticket_id, piece, blocks, deadline):
        # One Fetch; then the bytes arrive in order, a chunk per call.
        self._fetch(ticket_id, piece, blocks, deadline)

        def fill(pos: int, k: int, buf) -> None:
            P.recv_exact_into(self.sock, memoryview(buf.numpy())[:k], deadline=deadline)

        return fill

    def read_into(self, ticket_id, piece, blocks, dests, *, deadline):
        want = self._fetch(ticket_id, piece, blocks, deadline)
        if sum(d.numel() for d in dests) != want:
            raise ProtocolError(f"destination segments hold {sum(d.numel() for d in dests):,} bytes, the blocks {want:,}")
        P.recv_scatter_into(self.sock, [memoryview(d.numpy()) for d in dests], deadline=deadline)
