"""The control protocol between a Receiver and a Sender: framed, typed, bounded.

Every frame is a fixed header (magic, version, message type, payload length)
followed by a msgpack payload decoded by msgspec into one typed struct per
message type. Lengths are bounded before anything is read; unknown types,
bad magic, wrong versions and malformed payloads raise :class:`ProtocolError`
and the connection is closed. Nothing is unpickled.

Data never travels in control frames: the tcp transport streams raw block
bytes after a ``DATA`` header, read with ``recv_into`` straight into the
destination memory.
"""

from __future__ import annotations

import array
import socket
import struct
import time
from typing import Annotated, Any, Sequence

import msgspec

from ..errors import PeerGoneError, ProtocolError, TransferTimeoutError
from ._blocks import recv_exact_into, recv_scatter_into, send_all_views
from ._ticket import MAX_BLOCKS as _MAX_BLOCKS  # a Located names a ticket's blocks: the same limit
from ._iovec import IOV_MAX, is_tls, recv_runs, recv_some_into, send_runs, transfer_failure

__all__ = [
    "MAGIC", "VERSION", "MAX_FRAME_NBYTES", "MsgType", "Hello", "Challenge", "Proof", "Claim", "Welcome",
    "Acquire", "Located", "Fetch", "Pull", "Lend", "Exposed", "Arrived", "Sources", "SourceRuns", "Release",
    "Released", "Failure", "send_msg", "send_data_header", "recv_msg", "encode", "is_tls", "recv_exact_into",
    "recv_scatter_into", "send_all_views", "IOV_MAX", "recv_runs", "send_runs", "recv_some_into",
]

MAGIC = b"TFCP"
# 2: challenge-response handshake (Hello, Challenge, Proof, Welcome with the
# sender's proof; no token on the wire), Acquires signed with the session key.
VERSION = 2
_HEADER = struct.Struct("<4sHHI")
# A control frame carries ids, offsets and metadata: 16 MiB is far above
# what NIXL agent metadata (the largest) needs, and small enough to buffer.
MAX_FRAME_NBYTES = 16 << 20
# Bytes of a frame allocated before they arrived: a header may claim up to
# MAX_FRAME_NBYTES, but memory follows the bytes that came, not the claim.
_RECV_CHUNK_NBYTES = 1 << 20
# The fixes of a control frame's errors. Both sides send and read frames, so
# they name the peer, not a side.
_SAME_VERSION = "use the same tensorferry version on both sides"
_PEER_STOPPED = "its process exited, or it closed its Sender or Receiver or this connection (its log says why)"
_CHECK_PEER = "check that the peer's process runs (its log) and the link between you"


class MsgType:
    HELLO = 1
    WELCOME = 2
    ACQUIRE = 3
    LOCATED = 4
    FETCH = 5
    DATA = 6
    RELEASE = 7
    RELEASED = 8
    FAILURE = 9
    PULL = 10
    SOURCES = 11
    SOURCE_RUNS = 12
    LEND = 13
    ARRIVED = 14
    EXPOSED = 15
    CHALLENGE = 16
    PROOF = 17
    CLAIM = 18

# A nonce or a proof: 32 bytes (SHA-256's output); a field allows a little more
# so that a wrong size is the handshake's error, not the decoder's.
_NONCE = Annotated[bytes, msgspec.Meta(max_length=64)]


class Hello(msgspec.Struct, frozen=True):
    """Receiver -> sender, first frame: what I speak and my fresh nonce
    (see :mod:`tensorferry.transports._auth`; no secret in any form)."""

    transport: Annotated[str, msgspec.Meta(max_length=16)] = ""
    nonce: _NONCE = b""


class Challenge(msgspec.Struct, frozen=True):
    """Sender -> receiver, in reply to Hello: the sender's fresh nonce and
    whether it holds a token (then the receiver must prove it holds it too)."""

    nonce: _NONCE
    token: bool = False


class Proof(msgspec.Struct, frozen=True):
    """Receiver -> sender: HMAC-SHA256 of the handshake's transcript under
    the token (b"" when the sender holds none)."""

    mac: _NONCE = b""


class Claim(msgspec.Struct, frozen=True):
    """A child -> a relay's file socket (same host, same user): the one-time
    key of the lend whose memfd it wants."""

    key: Annotated[bytes, msgspec.Meta(max_length=32)]


class Welcome(msgspec.Struct, frozen=True):
    """Sender -> receiver: the pool behind this sender (shm also passes its fd)."""

    pool_nbytes: int
    pool_generation: int
    pool_base_addr: int = 0
    nixl_metadata: bytes = b""
    nixl_agent: str = ""
    # HMAC-SHA256 of the transcript under the token: the sender holds it too.
    proof: _NONCE = b""


class Acquire(msgspec.Struct, frozen=True):
    """Take one reader slot of a ticket's piece; waits until the piece is packed."""

    ticket_id: int
    piece: int = 0
    timeout_seconds: float = 60.0
    # Ticket.digest of the ticket being redeemed: the sender checks it
    # before it takes a slot, so an altered ticket consumes nothing.
    digest: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    # Broadcast tickets: where this receiver serves children ("" if it
    # does not relay), and, when asking again for a slot it holds, the
    # source that failed it.
    relay: Annotated[str, msgspec.Meta(max_length=512)] = ""
    failed_source: Annotated[str, msgspec.Meta(max_length=512)] = ""
    # A sharded get's reader: a digest of the byte ranges it reads (b"":
    # the whole piece). Of a broadcast ticket, the readers of the same
    # ranges pull from each other, in a relay tree of their own.
    ranges: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    # A two-tree broadcast (put(trees=True)), with failed_source: the half
    # (0 or 1) whose source failed; each half has a tree of its own.
    stripe: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0
    # This connection's count of Acquires and the session key's HMAC of this
    # message (with mac=b""): a copy replayed on any connection is refused.
    seq: Annotated[int, msgspec.Meta(ge=0)] = 0
    mac: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


class Located(msgspec.Struct, frozen=True):
    """Where a piece is in the sender's pool: (offset, nbytes) per block."""

    blocks: list[tuple[int, int]]
    virtual_offset: int = 0
    # Broadcast tickets: pull the bytes from this relay ("" = this sender).
    source: Annotated[str, msgspec.Meta(max_length=512)] = ""
    # The piece is the sender's tensors themselves (a plan put with
    # snapshot=False), not its pool: shm readers ask for SourceRuns.
    sourced: bool = False
    # A two-tree broadcast (put(trees=True)): the source of each half of
    # the block (transports._relay.stripe_bounds), its parent in each tree;
    # empty for any other ticket.
    stripes: Annotated[list[Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=2)] = []


class Fetch(msgspec.Struct, frozen=True):
    """tcp: send me the bytes of an acquired piece (its blocks back to
    back), from byte ``start`` on (a receiver resuming after a relay failed)."""

    ticket_id: int
    piece: int = 0
    start: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Only these ranges of the piece (a sharded get): little-endian int64
    # (position, nbytes) pairs, ascending (two may overlap: a tied tensor
    # read into two targets); empty: all of it.
    ranges: bytes = b""


class Pull(msgspec.Struct, frozen=True):
    """Child -> relay: stream me bytes ``[start, start + nbytes)`` of the
    ticket with this digest, as they arrive at the relay."""

    ticket_id: int
    digest: Annotated[bytes, msgspec.Meta(max_length=64)]
    start: Annotated[int, msgspec.Meta(ge=0)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    # The child's host (boot, network and pid namespace; see
    # transports._relay.host_identity), b"" for a stream: a relay on the
    # same one answers with Lend, and the child copies out of its memory.
    host: Annotated[bytes, msgspec.Meta(max_length=128)] = b""
    # True: the child reads with NIXL (a nixl receiver on another host); a
    # nixl relay answers with Exposed instead of a stream.
    nixl: bool = False
    # As an Acquire's: this connection's count of signed requests and the
    # session key's HMAC of this message (with mac=b""): a Pull replayed on
    # any connection is refused before the relay serves a byte.
    seq: Annotated[int, msgspec.Meta(ge=0)] = 0
    mac: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


class Lend(msgspec.Struct, frozen=True):
    """Relay -> a child on its host, in reply to Pull: the ticket's stream
    is ``nbytes`` bytes at ``address`` in process ``pid``, and bytes 0 on
    of the memfd that the relay's abstract Unix socket ``file`` passes (for
    a Hello with ``key`` as its token, while this lend lasts); Arrived
    frames follow, and the child copies each newly arrived range itself
    (process_vm_readv, or out of its mapping of the file). The memory stays
    there until the child says how far it read (an Arrived back; answered
    with Released once it read it all) or closes."""

    pid: Annotated[int, msgspec.Meta(gt=0)]
    address: Annotated[int, msgspec.Meta(gt=0)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    # "": no shared file (the child reads by process_vm_readv or streams).
    file: Annotated[str, msgspec.Meta(max_length=107)] = ""
    key: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


class Exposed(msgspec.Struct, frozen=True):
    """Relay -> a nixl child, in reply to Pull: the ticket's stream is
    ``nbytes`` bytes at ``address`` in memory registered with the relay's
    NIXL agent (``metadata``: its envelope, for the child's add_remote).
    Then as Lend: Arrived frames, the child READs each newly arrived range,
    and the memory stays registered until the child says how far it read
    or closes."""

    metadata: Annotated[bytes, msgspec.Meta(max_length=8 << 20)]
    address: Annotated[int, msgspec.Meta(gt=0)]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]


class Arrived(msgspec.Struct, frozen=True):
    """Relay -> a child it lends to: bytes ``[0, end)`` of the stream are
    in its memory now. Child -> relay, last: it copied up to ``end``
    (signed as a Pull is; the relay's announcements are not)."""

    end: Annotated[int, msgspec.Meta(ge=0)]
    seq: Annotated[int, msgspec.Meta(ge=0)] = 0
    mac: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


class Sources(msgspec.Struct, frozen=True):
    """shm: where the bytes of an acquired snapshot=False piece are in the
    sender's memory (it is read with process_vm_readv)."""

    ticket_id: int
    piece: int = 0


class SourceRuns(msgspec.Struct, frozen=True):
    """Reply to Sources: the sender's pid and, as little-endian int64 arrays,
    each run's position in the piece, its address there, and its length."""

    pid: int
    pos: bytes
    address: bytes
    nbytes: bytes


class Release(msgspec.Struct, frozen=True):
    """The reader is done with this piece (its slot is given back)."""

    ticket_id: int
    piece: int = 0


class Released(msgspec.Struct, frozen=True):
    """Reply to Release: whether the hold was still valid until now."""

    valid: bool


class Failure(msgspec.Struct, frozen=True):
    """Any request can be answered with a Failure: a kind and a message."""

    kind: str
    message: str


_TYPES: dict[int, type] = {
    MsgType.HELLO: Hello,
    MsgType.WELCOME: Welcome,
    MsgType.ACQUIRE: Acquire,
    MsgType.LOCATED: Located,
    MsgType.FETCH: Fetch,
    MsgType.RELEASE: Release,
    MsgType.RELEASED: Released,
    MsgType.FAILURE: Failure,
    MsgType.PULL: Pull,
    MsgType.SOURCES: Sources,
    MsgType.SOURCE_RUNS: SourceRuns,
    MsgType.LEND: Lend,
    MsgType.ARRIVED: Arrived,
    MsgType.EXPOSED: Exposed,
    MsgType.CHALLENGE: Challenge,
    MsgType.PROOF: Proof,
    MsgType.CLAIM: Claim,
}
_TYPE_OF: dict[type, int] = {cls: code for code, cls in _TYPES.items()}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {code: msgspec.msgpack.Decoder(cls) for code, cls in _TYPES.items()}


def send_msg(sock: socket.socket, msg: Any, *, fds: Sequence[int] = ()) -> None:
    """Send one control frame (optionally passing file descriptors)."""
    payload = _ENCODER.encode(msg)
    frame = _HEADER.pack(MAGIC, VERSION, _TYPE_OF[type(msg)], len(payload)) + payload
    try:
        if fds:
            # The descriptors go with the first bytes; a send may take only
            # part of the frame (a socket with a timeout does not block).
            sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            if sent < len(frame):
                sock.sendall(frame[sent:])
        else:
            sock.sendall(frame)
    except socket.timeout as exc:
        raise TransferTimeoutError(f"timed out sending a {len(frame):,}-byte {type(msg).__name__} frame to the peer: "
                                   f"it did not take it within {sock.gettimeout()} s; {_CHECK_PEER}") from exc
    except OSError as exc:
        raise PeerGoneError(f"the peer closed the connection while we were sending a {len(frame):,}-byte "
                            f"{type(msg).__name__} frame ({exc}): {_PEER_STOPPED}") from exc


def send_data_header(sock: socket.socket, nbytes: int) -> None:
    """tcp: announce ``nbytes`` of raw block bytes that follow (sender side)."""
    try:
        sock.sendall(_HEADER.pack(MAGIC, VERSION, MsgType.DATA, 0) + struct.pack("<Q", nbytes))
    except socket.timeout as exc:
        raise transfer_failure(False, 0, nbytes, wait_seconds=sock.gettimeout()) from exc
    except OSError as exc:
        raise transfer_failure(False, 0, nbytes, exc) from exc


def _recv_exact(sock: socket.socket, n: int, *, fds: list[int] | None = None, deadline: float | None = None) -> bytes:
    # Memory follows the bytes that arrived, a chunk at a time: a header
    # claiming 16 MiB followed by nothing costs a chunk, not 16 MiB.
    buf = bytearray()
    while len(buf) < n:
        got, want = len(buf), min(n - len(buf), _RECV_CHUNK_NBYTES)
        if deadline is not None:
            # One deadline for the whole frame, not a timeout per recv: a
            # peer dripping a byte at a time must not hold us for ever.
            left = deadline - time.monotonic()
            if left <= 0:
                raise _frame_failure(got, n)
            sock.settimeout(left)
        try:
            if fds is not None and not got and not is_tls(sock):
                data, ancdata, _flags, _addr = sock.recvmsg(want, socket.CMSG_SPACE(4 * 4))
                for level, kind, cmsg in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.extend(array.array("i", cmsg[: len(cmsg) - len(cmsg) % 4]))
            else:
                data = sock.recv(want)
        except socket.timeout as exc:
            raise _frame_failure(got, n) from exc
        except OSError as exc:
            raise _frame_failure(got, n, exc) from exc
        if not data:
            raise _frame_failure(got, n, hung_up=True)
        buf += data
    return bytes(buf)


def _frame_failure(got: int, n: int, exc: OSError | None = None, *, hung_up: bool = False) -> Exception:
    """The error of a control frame read stopped after ``got`` of ``n``
    bytes: timed out (no ``exc``), broken (``exc``) or hung up."""
    if hung_up:
        return PeerGoneError(f"the peer closed the connection after {got:,} of {n:,} bytes of a control frame: {_PEER_STOPPED}")
    if exc is None:
        return TransferTimeoutError(f"timed out after {got:,} of {n:,} bytes of a control frame from the peer: a receiver may "
                                    f"raise get(timeout=) or Receiver(timeout=); {_CHECK_PEER} moves bytes")
    return PeerGoneError(f"the connection to the peer broke after {got:,} of {n:,} bytes of a control frame ({exc}): "
                         f"{_CHECK_PEER}")


def recv_msg(
    sock: socket.socket, *, expect: tuple[type, ...] | None = None, fds: list[int] | None = None, deadline: float | None = None,
    max_nbytes: int = MAX_FRAME_NBYTES,
) -> Any:
    """Receive one control frame and decode it into its typed struct.

    ``deadline`` (``time.monotonic()``) bounds the whole frame; without it,
    the socket's own timeout bounds each receive. ``max_nbytes`` bounds its
    payload (small before a peer authenticated).

    Raises:
        ProtocolError: bad magic, version, type or length, or a malformed
            payload; also a valid message of a type not in ``expect``. A
            wrong version's error has ``peer_version``.
        PeerGoneError: the peer closed the connection.
        TransferTimeoutError: the socket's timeout passed.
    """
    header = _recv_exact(sock, _HEADER.size, fds=fds, deadline=deadline)
    magic, version, kind, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"peer sent bad magic {magic!r}; it does not speak tensorferry's protocol: {_not_ours(magic)}")
    if version != VERSION:
        err = ProtocolError(
            f"peer speaks protocol version {version}, we speak {VERSION}; {_SAME_VERSION}"
        )
        err.peer_version = version  # type: ignore[attr-defined]
        raise err
    if kind == MsgType.DATA:
        (nbytes,) = struct.unpack("<Q", _recv_exact(sock, 8, deadline=deadline))
        return ("DATA", nbytes)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise ProtocolError(f"peer sent unknown message type {kind}; {_SAME_VERSION}")
    if length > max_nbytes:
        raise ProtocolError(f"peer sent a {length:,}-byte control frame; the limit is {max_nbytes:,}: check that the peer is "
                            f"tensorferry, and {_SAME_VERSION}")
    payload = _recv_exact(sock, length, deadline=deadline) if length else b""
    try:
        msg = decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"peer sent a malformed {_TYPES[kind].__name__}: {exc}; {_SAME_VERSION}") from exc
    if isinstance(msg, Located) and len(msg.blocks) > _MAX_BLOCKS:
        raise ProtocolError(f"peer located {len(msg.blocks):,} blocks; the limit is {_MAX_BLOCKS:,}, as a ticket's: "
                            f"{_SAME_VERSION}")
    if expect is not None and not isinstance(msg, expect) and not isinstance(msg, Failure):
        expected = " or ".join(t.__name__ for t in expect)
        raise ProtocolError(f"peer sent {type(msg).__name__}, expected {expected}; {_SAME_VERSION}")
    return msg


def _not_ours(magic: bytes) -> str:
    """What to check when a peer's first bytes are not a tensorferry frame."""
    # A TLS record starts with its type (0x15 an alert, 0x16 a handshake)
    # and the major version 3.
    if magic[:1] in (b"\x15", b"\x16") and magic[1:2] == b"\x03":
        return "it speaks TLS and this side does not: give both sides tls= or neither"
    return "check that the receiver's address and port are a tensorferry Sender's (or relay's)"


def encode(msg: Any) -> bytes:
    """A message's payload bytes, as :func:`send_msg` sends them (what a
    signature covers)."""
    return _ENCODER.encode(msg)
