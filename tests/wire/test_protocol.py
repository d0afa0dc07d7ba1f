"""The control protocol (_protocol.py): frames, their bounds, and the raw
byte helpers, over real socket pairs.

What a server does with hostile bytes on its port (closes the connection,
keeps serving) is tested against a live sender in
tests/transports/test_transfer_faults.py; here, the decoder alone.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import msgspec
import pytest

from tensorferry.wire import protocol as P
from tensorferry.errors import PeerGoneError, ProtocolError, TransferTimeoutError

MESSAGES = [
    P.Hello(transport="tcp", nonce=b"n" * 32),
    P.Hello(),
    P.Challenge(nonce=b"s" * 32, token=True),
    P.Proof(mac=b"m" * 32),
    P.Proof(),
    P.Claim(key=b"k" * 16),
    P.Welcome(pool_nbytes=1 << 30, pool_generation=7, pool_base_addr=1 << 40, nixl_metadata=b"md", nixl_agent="a", proof=b"p" * 32),
    P.Acquire(ticket_id=(1 << 63) - 1, piece=3, timeout_seconds=2.5, digest=b"d" * 16),
    P.Acquire(ticket_id=5, digest=b"d" * 16, seq=(1 << 63) - 1, mac=b"m" * 16),
    P.Located(blocks=[(0, 16), (4096, 1 << 20)], virtual_offset=1 << 21),
    P.Located(blocks=[]),
    P.Acquire(ticket_id=5, digest=b"d" * 16, relay="198.18.0.2:4000", failed_source="198.18.0.3:4000"),
    P.Located(blocks=[(0, 16)], source="198.18.0.2:4000"),
    P.Fetch(ticket_id=1, piece=2),
    P.Fetch(ticket_id=1, start=4096),
    P.Pull(ticket_id=9, digest=b"d" * 16, start=1 << 20, nbytes=1 << 30),
    P.Pull(ticket_id=9, digest=b"d" * 16, start=0, nbytes=64, host=b"boot/4026531836/4026531833"),
    P.Lend(pid=42, address=1 << 40, nbytes=1 << 30),
    P.Pull(ticket_id=9, digest=b"d" * 16, start=0, nbytes=64, nixl=True),
    P.Exposed(metadata=b"m" * 300, address=1 << 40, nbytes=1 << 30),
    P.Arrived(end=1 << 20),
    P.Pull(ticket_id=9, digest=b"d" * 16, start=0, nbytes=64, seq=(1 << 63) - 1, mac=b"m" * 16),
    P.Arrived(end=1 << 20, seq=2, mac=b"m" * 16),
    P.Located(blocks=[(0, 64)], sourced=True),
    P.Sources(ticket_id=3, piece=1),
    P.SourceRuns(pid=42, pos=b"\0" * 8, address=b"\1" * 8, nbytes=b"\2" * 8),
    P.Release(ticket_id=1, piece=2),
    P.Released(valid=False),
    P.Failure(kind="timeout", message="é 🙂"),
]


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5.0)
    b.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


def header(kind: int, length: int, magic: bytes = P.MAGIC, version: int = P.VERSION) -> bytes:
    return struct.pack("<4sHHI", magic, version, kind, length)


def frame(kind: int, payload: bytes) -> bytes:
    return header(kind, len(payload)) + payload


def send_in_thread(sock: socket.socket, data: bytes) -> threading.Thread:
    """Send ``data`` from a thread (larger than the socket buffer)."""

    def run() -> None:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the reader may close first: that is what some tests check

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# -- round trips -----------------------------------------------------------------------------


def test_every_message_round_trips(pair):
    a, b = pair
    for msg in MESSAGES:
        P.send_msg(a, msg)
        assert P.recv_msg(b) == msg
    P.send_data_header(a, 1 << 40)
    assert P.recv_msg(b) == ("DATA", 1 << 40)


def test_every_message_type_has_a_decoder():
    kinds = {v for k, v in vars(P.MsgType).items() if not k.startswith("_")}
    assert {P._TYPE_OF[type(m)] for m in MESSAGES} | {P.MsgType.DATA} == kinds


def test_a_lend_names_a_live_process_and_an_address(pair):
    # A child copies out of the pid and address a relay lends: neither may be 0.
    a, b = pair
    for bad in ({"pid": 0, "address": 4096, "nbytes": 1}, {"pid": 7, "address": 0, "nbytes": 1}, {"pid": 7, "address": 4096, "nbytes": -1}):
        a.sendall(frame(P.MsgType.LEND, msgspec.msgpack.encode(bad)))
        with pytest.raises(ProtocolError, match="malformed Lend"):
            P.recv_msg(b)


def test_an_exposed_stream_names_an_address_and_bounded_metadata(pair):
    # A nixl child READs the address a relay exposes: it may not be 0, and
    # the metadata is bounded before it is loaded.
    a, b = pair
    for bad in ({"metadata": b"m", "address": 0, "nbytes": 1}, {"metadata": b"m", "address": 4096, "nbytes": -1},
                {"metadata": b"m" * ((8 << 20) + 1), "address": 4096, "nbytes": 1}):
        # A thread sends: a frame larger than the socket pair's buffer
        # waits for the reader.
        sender = threading.Thread(target=a.sendall, args=(frame(P.MsgType.EXPOSED, msgspec.msgpack.encode(bad)),))
        sender.start()
        with pytest.raises(ProtocolError, match="malformed Exposed"):
            P.recv_msg(b)
        sender.join(timeout=10)


def test_a_frame_with_file_descriptors_arrives_whole_when_the_socket_takes_part_of_it_at_a_time(pair):
    a, b = pair  # with a timeout: a send returns what fit in the socket's buffer
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # far below the frame, whatever the system's default
    r, w = os.pipe()
    msg = P.Exposed(metadata=os.urandom(4 << 20), address=1, nbytes=1)
    got: list = []
    fds: list[int] = []
    reader = threading.Thread(target=lambda: got.append(P.recv_msg(b, fds=fds, deadline=time.monotonic() + 10.0)))
    reader.start()
    try:
        P.send_msg(a, msg, fds=[w])
        reader.join(timeout=10)
        assert got == [msg] and len(fds) == 1
    finally:
        for fd in (r, w, *fds):
            os.close(fd)


def test_file_descriptors_travel_with_a_frame(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        P.send_msg(a, P.Welcome(pool_nbytes=1, pool_generation=1), fds=[w])
        fds: list[int] = []
        assert P.recv_msg(b, fds=fds) == P.Welcome(pool_nbytes=1, pool_generation=1)
        assert len(fds) == 1 and fds[0] != w
        os.write(fds[0], b"through the copy")
        os.close(fds[0])
        assert os.read(r, 64) == b"through the copy"
    finally:
        os.close(r)
        os.close(w)


def test_expect_refuses_another_type_but_passes_a_failure(pair):
    a, b = pair
    P.send_msg(a, P.Released(valid=True))
    with pytest.raises(ProtocolError, match="sent Released, expected Located or Welcome; use the same tensorferry version"):
        P.recv_msg(b, expect=(P.Located, P.Welcome))
    failure = P.Failure(kind="unknown", message="no such ticket")
    P.send_msg(a, failure)
    assert P.recv_msg(b, expect=(P.Located,)) == failure


# -- bounds and hostile frames ------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, message",
    [
        (header(P.MsgType.HELLO, 0, magic=b"HTTP"), "bad magic b'HTTP'.*: check that the receiver's address and port"),
        # The first bytes of a TLS ClientHello: a receiver with tls= at a sender without.
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\x00", "bad magic.*speaks TLS and this side does not: give both sides tls="),
        (header(P.MsgType.HELLO, 0, version=P.VERSION + 1), f"version {P.VERSION + 1}.*use the same tensorferry version"),
        (header(0, 0), "unknown message type 0; use the same tensorferry version"),
        (header(200, 0xFFFFFFFF), "unknown message type 200"),
        (frame(P.MsgType.HELLO, b"\xff\xff\xff"), "malformed Hello.*; use the same tensorferry version"),
        (frame(P.MsgType.ACQUIRE, msgspec.msgpack.encode({"piece": 0})), "malformed Acquire"),
        (frame(P.MsgType.ACQUIRE, msgspec.msgpack.encode(P.Acquire(ticket_id=1, digest=b"x" * 65))), "malformed Acquire"),
        (frame(P.MsgType.LOCATED, msgspec.msgpack.encode({"blocks": [[0, "sixteen"]]})), "malformed Located"),
    ],
)
def test_bad_frames_are_protocol_errors(pair, data, message):
    a, b = pair
    a.sendall(data)
    with pytest.raises(ProtocolError, match=message):
        P.recv_msg(b, deadline=time.monotonic() + 2.0)


def test_the_frame_length_is_bounded_before_the_payload_is_read(pair):
    a, b = pair
    # Only the header is sent: reading a payload would wait for the deadline.
    a.sendall(header(P.MsgType.HELLO, P.MAX_FRAME_NBYTES + 1))
    # A ProtocolError, not a TransferTimeoutError at the deadline: the length
    # was refused before any payload byte was waited for.
    with pytest.raises(ProtocolError, match="limit is 16,777,216: check that the peer is tensorferry"):
        P.recv_msg(b, deadline=time.monotonic() + 5.0)


def test_a_frame_of_exactly_the_limit_is_read(pair):
    a, b = pair
    overhead = len(msgspec.msgpack.encode(P.Failure(kind="", message="x" * 70_000))) - 70_000
    msg = P.Failure(kind="", message="x" * (P.MAX_FRAME_NBYTES - overhead))
    payload = msgspec.msgpack.encode(msg)
    assert len(payload) == P.MAX_FRAME_NBYTES, len(payload)
    t = send_in_thread(a, frame(P.MsgType.FAILURE, payload))
    assert P.recv_msg(b, deadline=time.monotonic() + 20.0) == msg
    t.join(5.0)


def test_located_blocks_are_bounded(pair):
    a, b = pair
    limit = P._MAX_BLOCKS
    for n, ok in ((limit, True), (limit + 1, False)):
        payload = msgspec.msgpack.encode(P.Located(blocks=[(0, 16)] * n))
        assert len(payload) <= P.MAX_FRAME_NBYTES
        t = send_in_thread(a, frame(P.MsgType.LOCATED, payload))
        if ok:
            assert len(P.recv_msg(b, deadline=time.monotonic() + 20.0).blocks) == limit
        else:
            with pytest.raises(ProtocolError, match="located 1,048,577 blocks; the limit is 1,048,576, as a ticket's: use the same"):
                P.recv_msg(b, deadline=time.monotonic() + 20.0)
        t.join(10.0)


def test_a_peer_that_closes_mid_frame_is_gone():
    data = frame(P.MsgType.FETCH, msgspec.msgpack.encode(P.Fetch(ticket_id=9)))
    head = len(header(0, 0))
    for cut in (0, 5, len(data) - 1):  # in the header, in the payload
        x, y = socket.socketpair()
        x.sendall(data[:cut])
        x.close()
        got, of = (cut, head) if cut < head else (cut - head, len(data) - head)
        with pytest.raises(PeerGoneError, match=f"after {got} of {of} bytes") as failed:
            P.recv_msg(y, deadline=time.monotonic() + 2.0)
        assert "it closed its Sender or Receiver or this connection (its log says why)" in str(failed.value)  # the fix
        y.close()


def test_one_deadline_bounds_a_dripped_frame(pair):
    a, b = pair
    data = frame(P.MsgType.FETCH, msgspec.msgpack.encode(P.Fetch(ticket_id=9)))
    stop = threading.Event()

    def drip() -> None:  # a byte every 50 ms: each receive alone would be quick
        for byte in data:
            if stop.wait(0.05):
                return
            try:
                a.sendall(bytes([byte]))
            except OSError:
                return

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    # Either the deadline passes between two bytes or a receive times out at
    # it: both mean the frame as a whole ran out of time (a deadline per
    # receive would let the drip complete the frame, and nothing would raise).
    with pytest.raises(TransferTimeoutError, match=r"after \d+ of 12 bytes of a control frame") as failed:
        P.recv_msg(b, deadline=time.monotonic() + 0.3)
    assert "raise get(timeout=) or Receiver(timeout=); check that the peer's process runs" in str(failed.value)
    stop.set()
    t.join(2.0)


# -- raw bytes ----------------------------------------------------------------------------------------


def test_scatter_gather_moves_more_buffers_than_one_call_takes(pair):
    a, b = pair
    sizes = [(i * 37) % 100 for i in range(3000)]  # zeros included, > IOV_MAX buffers
    src = bytes((i * 7) % 251 for i in range(sum(sizes)))
    views, pos = [], 0
    for n in sizes:
        views.append(memoryview(src)[pos : pos + n])
        pos += n
    dst = bytearray(len(src))
    outs, pos = [], 0
    for n in sizes:
        outs.append(memoryview(dst)[pos : pos + n])
        pos += n
    t = threading.Thread(target=P.send_all_views, args=(a, views), daemon=True)
    t.start()
    P.recv_scatter_into(b, outs, deadline=time.monotonic() + 10.0)
    t.join(5.0)
    assert bytes(dst) == src


def test_recv_exact_into_fills_the_view_or_says_how_far_it_got(pair):
    a, b = pair
    data = os.urandom(3 << 20)
    t = send_in_thread(a, data)
    buf = bytearray(len(data))
    P.recv_exact_into(b, memoryview(buf), deadline=time.monotonic() + 10.0)
    t.join(5.0)
    assert bytes(buf) == data
    a.sendall(b"abc")
    a.close()
    with pytest.raises(PeerGoneError, match="after 3 of 10 bytes") as failed:
        P.recv_exact_into(b, memoryview(bytearray(10)), deadline=time.monotonic() + 2.0)
    assert "closed its Sender (see its log)" in str(failed.value)


def test_recv_exact_into_stops_at_its_deadline_and_says_how_far_it_got(pair):
    a, b = pair
    a.sendall(b"abc")
    with pytest.raises(TransferTimeoutError, match="after receiving 3 of 10 bytes: raise get.timeout=. or Receiver.timeout=."):
        P.recv_exact_into(b, memoryview(bytearray(10)), deadline=time.monotonic() + 0.3)


def test_recv_exact_into_from_a_relay_names_the_relay_not_the_sender(pair):
    a, b = pair
    a.sendall(b"abc")
    with pytest.raises(TransferTimeoutError, match=r"after receiving 5 of 12 bytes from the relay at 10\.0\.0\.7:5000: raise get") as failed:
        P.recv_exact_into(b, memoryview(bytearray(10)), deadline=time.monotonic() + 0.3, done=2, total=12, relay="10.0.0.7:5000")
    assert "sender" not in str(failed.value)
    a.close()
    with pytest.raises(PeerGoneError, match=r"^the relay at 10\.0\.0\.7:5000 closed the connection after 0 of 10 bytes") as failed:
        P.recv_exact_into(b, memoryview(bytearray(10)), deadline=time.monotonic() + 2.0, relay="10.0.0.7:5000")
    assert "closed its Receiver" in str(failed.value) and "Sender" not in str(failed.value)


# -- what a send says when the peer stops reading or hangs up ------------------------------------------------


def test_a_control_frame_the_peer_does_not_take_times_out_with_its_size(pair):
    a, b = pair
    a.settimeout(0.3)
    msg = P.Failure(kind="", message="x" * (4 << 20))  # more than the socket pair's buffers hold
    size = len(header(0, 0)) + len(msgspec.msgpack.encode(msg))
    with pytest.raises(TransferTimeoutError, match=rf"sending a {size:,}-byte Failure frame .* within 0.3 s") as failed:
        P.send_msg(a, msg)
    assert "check that the peer's process runs (its log)" in str(failed.value)
    b.close()
    with pytest.raises(PeerGoneError, match=r"while we were sending a \d+-byte Released frame") as failed:
        P.send_msg(a, P.Released(valid=True))
    assert "its log says why" in str(failed.value)


def test_block_bytes_to_a_receiver_that_stops_reading_or_hangs_up_say_how_far_they_got(pair):
    a, b = pair
    a.settimeout(0.3)
    src = bytes(64 << 20)
    views = [memoryview(src)[i : i + (1 << 20)] for i in range(0, len(src), 1 << 20)]
    with pytest.raises(TransferTimeoutError, match=r"after [\d,]+ of 67,108,864 bytes: it read nothing for 0.3 s") as failed:
        P.send_all_views(a, views)
    assert "check that its process runs" in str(failed.value)
    b.close()
    with pytest.raises(PeerGoneError, match="during a send, after 0 of 1,048,576 bytes") as failed:
        P.send_data_header(a, 1 << 20)
    assert "its error or log says why" in str(failed.value)
