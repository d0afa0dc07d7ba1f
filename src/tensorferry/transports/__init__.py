"""Transports, picked by name: ``shm``, ``tcp``, ``nixl``.

Implementations are private modules behind the small contract of
:mod:`tensorferry.transports._base` (a :class:`Channel` declares what it can
do as class attributes); this module maps names to them and is what the
rest of the library imports: the receiver's plumbing (:class:`ChannelPool`,
:class:`ReceiveContext`, :class:`Releaser`) and the relays included.

May import: memory, copy, wire and :mod:`tensorferry.errors`. Plans,
execution and the user API import this package's public names, never a
transport's private module.
"""

from __future__ import annotations

import importlib.util
import time
import sys
from typing import Any

from ..errors import ConfigurationError

__all__ = [
    "TRANSPORTS", "TransportName", "make_server", "channel_class", "available",
    "Channel", "ChannelPool", "ReceiveContext", "Releaser", "is_loopback",
    "CHUNK_NBYTES", "chunk_nbytes_for", "half_chunk_nbytes", "pull", "stripe_bounds", "RelayBook", "RelayLinks", "RelayServer", "SameHostReads",
    "Held", "Holdings", "backend_available",
    "new_token", "resolve_token", "tls_context", "relay_tls_context", "open_control", "Session", "MIN_TOKEN_NBYTES",
]

from ..wire import TRANSPORTS, TransportName
from ._auth import MIN_TOKEN_NBYTES, Session, client_handshake, new_token, resolve_token
from ._base import Held, Holdings
from ._channel import Channel
from ._connections import ChannelPool, ReceiveContext, Releaser
from ._relay import CHUNK_NBYTES, RelayBook, RelayLinks, RelayServer, SameHostReads, chunk_nbytes_for, half_chunk_nbytes, pull, stripe_bounds
from ._tcp import connect, is_loopback
from ._tls import relay_tls_context, tls_context, wrap_client


def _check(name: str) -> None:
    if name not in TRANSPORTS:
        raise ConfigurationError(f"unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}")


def make_server(name: str, ledger: Any, *, token: bytes, host: str, port: int, advertise_host: str | None = None, tls: Any = None) -> Any:
    """Start the sender-side server of transport ``name``.

    ``advertise_host`` (tcp, nixl) is the host tickets name; see
    :func:`tensorferry.transports._tcp.advertised_host` for the default.
    ``tls`` (a server ``ssl.SSLContext``) secures tcp and nixl's control
    connection; shm never leaves the host and ignores it.
    """
    _check(name)
    if name in ("tcp", "nixl"):
        if not is_loopback(host) and not token:
            raise ConfigurationError(
                f"binding the {name} transport to {host!r} (not loopback) needs a token: "
                "pass token=... to the Sender and the same to each Receiver"
            )
    if name == "shm":
        from ._shm import ShmServer

        return ShmServer(ledger, token=token)
    if name == "tcp":
        from ._tcp import TcpServer

        return TcpServer(ledger, token=token, host=host, port=port, advertise_host=advertise_host, tls=tls)
    from ._nixl import NixlServer

    return NixlServer(ledger, token=token, host=host, port=port, advertise_host=advertise_host, tls=tls)


def open_control(address: str, *, transport: str = "tcp", token: bytes = b"", timeout: float = 10.0, tls: Any = None) -> tuple[Any, Any, Session]:
    """A raw control connection to a tcp (or nixl) sender or a relay, past
    the handshake: ``(socket, welcome, session)``; Acquires go out as
    ``session.sign(P.Acquire(...))``. For tools and tests that speak the
    protocol themselves.

    Raises:
        AuthenticationError, ProtocolError, PeerGoneError: as a channel's handshake.
    """
    sock = connect(address, timeout)
    try:
        deadline = time.monotonic() + timeout
        if tls is not None:
            sock = wrap_client(sock, tls, address.rpartition(":")[0].strip("[]"), deadline)
        welcome, session = client_handshake(sock, token=token, transport=transport, address=address, deadline=deadline)
    except BaseException:
        sock.close()
        raise
    return sock, welcome, session


def channel_class(name: str) -> type:
    """The receiver-side channel class of transport ``name``."""
    _check(name)
    if name == "shm":
        from ._shm import ShmChannel

        return ShmChannel
    if name == "tcp":
        from ._tcp import TcpChannel

        return TcpChannel
    from ._nixl import NixlChannel

    return NixlChannel


def available() -> list[str]:
    """The transports that work on this machine."""
    out = ["tcp"]
    if sys.platform.startswith("linux"):
        out.insert(0, "shm")
    if backend_available("nixl") and importlib.util.find_spec("tensorferry.transports._nixl") is not None:
        out.append("nixl")
    return out


def backend_available(name: str) -> bool:
    """True when an optional backend (``"nixl"``, ``"ray"``) can be imported, found without importing it."""
    if name == "nixl":
        try:
            return importlib.util.find_spec("nixl._api") is not None
        except (ImportError, ValueError):
            return False
    return importlib.util.find_spec(name) is not None
