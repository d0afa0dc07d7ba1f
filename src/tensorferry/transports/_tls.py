"""TLS where the caller asks for it: ``Sender(tls=ssl.SSLContext)`` and
``Receiver(tls=...)`` wrap the tcp control and data connection, and nixl's
control connection, with the standard library's :mod:`ssl`; a relaying
receiver's ``relay_tls=`` (a server context) wraps its children's
connections (their streams, and the control of their lends and NIXL reads).

The contexts are the caller's (certificates, verification, mutual TLS with
``verify_mode=CERT_REQUIRED`` on the sender's side): tensorferry does not
change them. TLS runs before the token's handshake (:mod:`._auth`), so the
handshake and everything after it is private. A TLS socket has no
``sendmsg``/``recvmsg_into`` (the protocol sends and receives one buffer at
a time there, :func:`tensorferry.wire.protocol.is_tls`); without ``tls=``
nothing changes. shm never leaves the host and ignores it.
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Any

from ..errors import AuthenticationError, ConfigurationError, PeerGoneError, TransferTimeoutError

__all__ = ["tls_context", "relay_tls_context", "wrap_server", "wrap_client"]


def tls_context(tls: Any, *, server: bool, what: str) -> ssl.SSLContext | None:
    """``tls`` checked: None, or an :class:`ssl.SSLContext` for this side.

    Raises:
        ConfigurationError: not an SSLContext, or one made for the other
            side (``PROTOCOL_TLS_CLIENT`` given to a sender, or the reverse).
    """
    if tls is None:
        return None
    if not isinstance(tls, ssl.SSLContext):
        raise ConfigurationError(f"{what}: pass an ssl.SSLContext (or None for no TLS), not {type(tls).__name__}")
    wrong = ssl.PROTOCOL_TLS_CLIENT if server else ssl.PROTOCOL_TLS_SERVER
    if tls.protocol == wrong:
        want = "ssl.PROTOCOL_TLS_SERVER (the side that accepts)" if server else "ssl.PROTOCOL_TLS_CLIENT (the side that connects)"
        raise ConfigurationError(f"{what}: the context was made for the other side ({tls.protocol.name}); make it with {want}")
    return tls


def relay_tls_context(tls: ssl.SSLContext | None, relay_tls: Any, *, relay: bool) -> ssl.SSLContext | None:
    """The server context a relaying receiver serves its children over:
    ``relay_tls`` checked against the receiver's own client context ``tls``
    (both or neither: a relay between TLS links must not pass the bytes on
    in clear, nor one reached in clear pretend its children's are private).

    Raises:
        ConfigurationError: ``relay=True`` with ``tls`` but no ``relay_tls``
            (or the reverse), ``relay_tls`` without ``relay=True``, or not a
            server SSLContext.
    """
    if relay_tls is None:
        if relay and tls is not None:
            raise ConfigurationError(
                "Receiver(relay=True, tls=...): a relay serves its children over TLS as well, with a certificate of its own host; "
                "pass relay_tls=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER) with that certificate loaded (load_cert_chain), "
                "which children check with their tls= as they check a sender's"
            )
        return None
    if not relay:
        raise ConfigurationError("Receiver(relay_tls=...) is what a relay serves its children over: pass relay=True too, or leave relay_tls out")
    if tls is None:
        raise ConfigurationError(
            "Receiver(relay=True, relay_tls=...) without tls=: the relay would take the object in clear and pass it on over TLS; "
            "pass tls= (a client context that checks the sender's certificate) as well, or neither"
        )
    return tls_context(relay_tls, server=True, what="Receiver(relay_tls)")


def _handshake(sock: socket.socket, deadline: float, wrap: Any, peer: str) -> ssl.SSLSocket:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        return wrap(sock)
    except ssl.SSLError as exc:
        raise AuthenticationError(
            f"TLS handshake with {peer} failed ({exc.reason or exc}): check both sides' certificates, "
            "and that both or neither pass tls="
        ) from exc
    except socket.timeout as exc:
        raise TransferTimeoutError(f"TLS handshake with {peer} did not finish by its deadline") from exc
    except OSError as exc:
        raise PeerGoneError(f"TLS handshake with {peer} broke ({exc}); does it use TLS too?") from exc


def wrap_server(sock: socket.socket, tls: ssl.SSLContext, peer: str, deadline: float) -> ssl.SSLSocket:
    """Sender side: the TLS handshake on an accepted connection, by ``deadline``."""
    return _handshake(sock, deadline, lambda s: tls.wrap_socket(s, server_side=True), f"receiver {peer}")


def wrap_client(sock: socket.socket, tls: ssl.SSLContext, host: str, deadline: float, who: str = "sender") -> ssl.SSLSocket:
    """Receiver side: the TLS handshake with the ``who`` (a sender, or a
    relay: a child checks it as it checks a sender) at ``host`` (checked
    against its certificate where the context checks host names)."""
    return _handshake(sock, deadline, lambda s: tls.wrap_socket(s, server_hostname=host), f"the {who} at {host}")
