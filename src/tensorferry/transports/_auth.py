"""Who may connect: the token, the challenge-response handshake that proves
it without sending it, the session key that signs each Acquire, and the
count of connections that fail before they authenticate.

The handshake (every transport's control connection, and a relay's
children), after TLS where the sides asked for it (:mod:`._tls`)::

    receiver -> sender   Hello(transport, nonce_r)          32 random bytes
    sender -> receiver   Challenge(nonce_s, token: bool)    32 random bytes
    receiver -> sender   Proof(HMAC(token, "client" | T))
    sender -> receiver   Welcome(..., proof=HMAC(token, "server" | T))

``T`` is the transcript: the protocol's label and version, the transport,
both nonces and whether the sender holds a token. The sender checks the
receiver's proof before it sends, allocates or serves anything; the
receiver checks the sender's before it trusts the Welcome. The token never
crosses the link: a recorded handshake replayed on a new connection meets a
new ``nonce_s`` and fails. Both derive the session key
``HMAC(token, "session" | T)``, which signs every Acquire (a relay's
child: every Pull, and its last Arrived) with the connection's count of
them (:class:`Session`): a request replayed on a live connection, or copied
from another, is refused before it takes a slot or is served a byte.

A sender without a token answers ``token=False`` and takes an empty proof
(loopback and shm only: off loopback a token is required). A receiver that
holds a token refuses such a sender: it cannot prove it holds the token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import threading
import time
from typing import Any, TypeVar, Union

import msgspec

from ..errors import AuthenticationError, ConfigurationError, PeerGoneError, ProtocolError, TransferError
from ..wire import protocol as P

__all__ = [
    "MIN_TOKEN_NBYTES", "HANDSHAKE_SECONDS", "PREAUTH_FRAME_NBYTES", "new_token", "resolve_token", "Session",
    "client_handshake", "server_handshake", "FailureCount",
]

log = logging.getLogger("tensorferry.transports")

# 16 bytes: 128 bits if random (new_token gives 256); shorter is guessable
# offline from one recorded handshake (an HMAC per guess).
MIN_TOKEN_NBYTES = 16
# SHA-256's output and block-size-independent: a nonce as long as a proof.
NONCE_NBYTES = 32
# The whole handshake of an unauthenticated connection (TLS included): a few
# round trips take milliseconds; a half-open connection holds a thread this long.
HANDSHAKE_SECONDS = 10.0
# Before a peer authenticated, a frame is at most this long: Hello, Proof and
# their headers take under 100 bytes.
PREAUTH_FRAME_NBYTES = 1024
# The signature of a request (Acquire, Pull, a child's Arrived): 128 bits of HMAC-SHA256.
_SIGNATURE_NBYTES = 16
_LABEL = b"tensorferry-handshake-v%d\0" % P.VERSION
TOKEN_ENV = "TENSORFERRY_TOKEN"
# The requests a session signs: each has ``seq`` and ``mac`` fields.
_Signed = Union[P.Acquire, P.Pull, P.Arrived]
_S = TypeVar("_S", P.Acquire, P.Pull, P.Arrived)


def new_token() -> str:
    """A strong random token (256 bits, URL-safe text: 43 characters) to give
    the Sender and every Receiver, e.g. through ``TENSORFERRY_TOKEN``."""
    return secrets.token_urlsafe(32)


def resolve_token(token: str | bytes | None, what: str) -> bytes:
    """The token as bytes: ``token`` if given (``""``: none), else
    ``TENSORFERRY_TOKEN`` if set, else none (b"").

    Raises:
        ConfigurationError: not text or bytes, or shorter than
            :data:`MIN_TOKEN_NBYTES` (the message never contains it).
    """
    source = what
    if token is None:
        token, source = os.environ.get(TOKEN_ENV, ""), f"{TOKEN_ENV} (read because {what} was not given)"
    if isinstance(token, str):
        token = token.encode()
    if not isinstance(token, (bytes, bytearray, memoryview)):
        raise ConfigurationError(f"{what}: a token is text or bytes, not {type(token).__name__}; make one with tensorferry.new_token()")
    token = bytes(token)
    if token and len(token) < MIN_TOKEN_NBYTES:
        raise ConfigurationError(
            f"{source}: the token has {len(token)} bytes, fewer than {MIN_TOKEN_NBYTES}: one recorded handshake would let anyone "
            "guess it offline; use tensorferry.new_token() (256 random bits) on one side and pass it to the others"
        )
    return token


def _mac(token: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(token, role + transcript, hashlib.sha256).digest()


def _transcript(transport: str, receiver_nonce: bytes, sender_nonce: bytes, token: bool) -> bytes:
    return b"".join((_LABEL, transport.encode(), b"\0", receiver_nonce, sender_nonce, b"\1" if token else b"\0"))


class Session:
    """One authenticated connection's key and count of signed requests
    (Acquires to a sender; Pulls and a child's last Arrived to a relay):
    both sides keep their own, :meth:`sign` on the receiver (a child),
    :meth:`check` on the sender (a relay)."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seq = 0
        self._lock = threading.Lock()

    def _signature(self, msg: _Signed) -> bytes:
        return hmac.new(self._key, P.encode(msgspec.structs.replace(msg, mac=b"")), hashlib.sha256).digest()[:_SIGNATURE_NBYTES]

    def sign(self, msg: _S) -> _S:
        """``msg`` with the next count and its signature."""
        with self._lock:
            self._seq += 1
            msg = msgspec.structs.replace(msg, seq=self._seq, mac=b"")
        return msgspec.structs.replace(msg, mac=self._signature(msg))

    def check(self, msg: _Signed) -> bool:
        """Whether ``msg`` is the next request of this session, signed with its key."""
        with self._lock:
            if msg.seq != self._seq + 1 or not hmac.compare_digest(msg.mac, self._signature(msg)):
                return False
            self._seq += 1
            return True


def server_handshake(sock: socket.socket, *, token: bytes, transport: str, peer: str, deadline: float) -> tuple[P.Hello, Session, bytes]:
    """Sender side: read the Hello, challenge, check the proof.

    Returns the Hello, the session and the sender's proof (for the Welcome).

    Raises:
        AuthenticationError: the receiver did not prove it holds the token
            (it was told so in a Failure).
        ProtocolError, PeerGoneError, TransferTimeoutError: anything else.
    """
    hello = P.recv_msg(sock, expect=(P.Hello,), deadline=deadline, max_nbytes=PREAUTH_FRAME_NBYTES)
    if not isinstance(hello, P.Hello):
        raise ProtocolError(f"receiver {peer} sent a Failure before its Hello")
    if hello.transport != transport:
        P.send_msg(sock, P.Failure(kind="transport", message=f"you speak {hello.transport!r}, this sender serves {transport!r}; "
                                   "redeem its tickets with a Receiver of that transport"))
        raise ProtocolError(f"receiver {peer} speaks {hello.transport!r}, this sender serves {transport!r}")
    if len(hello.nonce) != NONCE_NBYTES:
        raise ProtocolError(f"receiver {peer} sent a {len(hello.nonce)}-byte nonce, not {NONCE_NBYTES}")
    nonce = secrets.token_bytes(NONCE_NBYTES)
    P.send_msg(sock, P.Challenge(nonce=nonce, token=bool(token)))
    proof = P.recv_msg(sock, expect=(P.Proof,), deadline=deadline, max_nbytes=PREAUTH_FRAME_NBYTES)
    if not isinstance(proof, P.Proof):
        raise PeerGoneError(f"receiver {peer} gave up at the challenge: {proof.message}")
    transcript = _transcript(transport, hello.nonce, nonce, bool(token))
    if token and not hmac.compare_digest(proof.mac, _mac(token, b"client", transcript)):
        P.send_msg(sock, P.Failure(kind="auth", message="your proof of the token is wrong: you hold another token, or none"))
        raise AuthenticationError(f"receiver {peer} did not prove it holds the token")
    return hello, Session(_mac(token, b"session", transcript)), _mac(token, b"server", transcript) if token else b""


def client_handshake(
    sock: socket.socket, *, token: bytes, transport: str, address: str, deadline: float, fds: list[int] | None = None
) -> tuple[P.Welcome, Session]:
    """Receiver side (a channel, or a relay's child): Hello, proof, and the
    sender's proof checked before its Welcome is trusted.

    Raises:
        AuthenticationError: the sender refused our proof, wants a token we
            lack, holds none while we hold one, or did not prove it holds ours.
        ProtocolError: the sender speaks another protocol version (or refused
            our Hello before a word, as a version 1 sender does).
        TransferError: the sender refused us for another reason.
    """
    nonce = secrets.token_bytes(NONCE_NBYTES)
    try:
        P.send_msg(sock, P.Hello(transport=transport, nonce=nonce))
        challenge = P.recv_msg(sock, expect=(P.Challenge,), deadline=deadline)
    except PeerGoneError as exc:
        if isinstance(exc.__cause__, ssl.SSLError):
            raise AuthenticationError(
                f"the sender at {address} ended TLS ({exc.__cause__.reason or exc.__cause__}): it requires a client certificate "
                "that this side lacks or that it does not trust; load one into the Receiver's tls context"
            ) from exc
        raise ProtocolError(
            f"the sender at {address} closed the connection at our Hello ({exc}): it speaks another protocol version "
            f"(this tensorferry speaks version {P.VERSION}; releases before the handshake of issue 35 speak 1), it requires "
            "TLS (pass tls= too), or it is not a tensorferry sender; use the same tensorferry version and options on both sides"
        ) from exc
    _refused(challenge, address)
    if len(challenge.nonce) != NONCE_NBYTES:
        raise ProtocolError(f"the sender at {address} sent a {len(challenge.nonce)}-byte nonce, not {NONCE_NBYTES}")
    if challenge.token and not token:
        raise AuthenticationError(f"the sender at {address} requires a token; pass token=... or set {TOKEN_ENV} (the sender's)")
    if token and not challenge.token:
        raise AuthenticationError(
            f"the sender at {address} holds no token, so it cannot prove it holds ours; give it the same token, "
            "or give this side none"
        )
    transcript = _transcript(transport, nonce, challenge.nonce, challenge.token)
    P.send_msg(sock, P.Proof(mac=_mac(token, b"client", transcript) if token else b""))
    welcome = P.recv_msg(sock, expect=(P.Welcome,), fds=fds, deadline=deadline)
    _refused(welcome, address)
    if token and not hmac.compare_digest(welcome.proof, _mac(token, b"server", transcript)):
        raise AuthenticationError(
            f"the sender at {address} did not prove it holds the token (an impostor, or another token); check the address and the token"
        )
    return welcome, Session(_mac(token, b"session", transcript))


def _refused(reply: Any, address: str) -> None:
    if isinstance(reply, P.Failure):
        if reply.kind == "auth":
            raise AuthenticationError(f"the sender at {address} refused us: {reply.message}; pass the sender's token")
        if reply.kind == "version":
            raise ProtocolError(f"the sender at {address} refused us: {reply.message}")
        raise TransferError(f"the sender at {address} refused us: {reply.message}")


class FailureCount:
    """Connections that failed before they authenticated (garbage, a wrong
    proof, a half-open connection's deadline, one evicted by a flood):
    counted, and logged as one warning with the count at most every
    ``interval_seconds``, not a line each."""

    def __init__(self, what: str, interval_seconds: float = 60.0) -> None:
        self.what = what
        self.total = 0
        self._unlogged = 0
        self._interval = interval_seconds
        self._logged_at = -float("inf")
        self._lock = threading.Lock()

    def add(self, peer: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += 1
            self._unlogged += 1
            if now - self._logged_at < self._interval:
                return
            count, self._unlogged = self._unlogged, 0
            since, self._logged_at = self._logged_at, now
        span = f"in the last {now - since:.0f} s" if since > -float("inf") else "so far"
        log.warning(
            "%s: %d connection(s) failed before authenticating %s (the latest from %s: %s); authenticated receivers are not "
            "affected. Check who connects there, or that receivers hold this sender's token", self.what, count, span, peer, reason,
        )

