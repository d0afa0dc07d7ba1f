"""Vectored socket I/O of runs given by address (wire/_iovec.py: libc's
sendmsg and recvmsg over numpy iovec arrays), over real TCP connections on
loopback: exact bytes at scattered addresses, sizes odd and empty, more
runs than one call takes, short transfers resumed inside a run, hang-ups
and deadlines that say how far they got."""

from __future__ import annotations

import random
import socket
import threading
import time

import numpy as np
import pytest
from _transfer_helpers import drip as dripped

from tensorferry.errors import PeerGoneError, TransferTimeoutError
from tensorferry.wire import protocol as P


@pytest.fixture
def tcp_pair():
    """A connected TCP pair on loopback with small buffers (64 KiB asked),
    so that sends and receives stop short inside runs; both ends have a
    timeout (a non-blocking descriptor), as a server's and a channel's have."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.socket()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        a.connect(srv.getsockname())
        b, _ = srv.accept()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    a.settimeout(30.0)
    b.settimeout(10.0)
    yield a, b
    a.close()
    b.close()


def _scattered(rng: random.Random, sizes: list[int], gap: int) -> tuple[np.ndarray, np.ndarray]:
    """One buffer holding runs of these sizes at random gaps (0 to ``gap``
    bytes) and, shuffled, their offsets in it; returns (buffer, offsets)."""
    offsets, at = [], 0
    for n in sizes:
        at += rng.randrange(gap + 1)
        offsets.append(at)
        at += n
    return np.zeros(at + gap, dtype=np.uint8), np.array(offsets, dtype=np.int64)


def _exchange(a, b, src, src_off, dst, dst_off, sizes, *, drip: random.Random | None = None) -> None:
    n = np.array(sizes, dtype=np.int64)
    if drip is None:
        t = threading.Thread(target=P.send_runs, args=(a, src.ctypes.data + src_off, n))
    else:  # the same bytes, dripped in chunks that end anywhere inside a run
        payload = b"".join(src[o : o + k].tobytes() for o, k in zip(src_off.tolist(), sizes))
        t = threading.Thread(target=dripped, args=(a, payload, drip))
    t.start()
    P.recv_runs(b, dst.ctypes.data + dst_off, n, deadline=time.monotonic() + 60)
    t.join(30)
    assert not t.is_alive()


@pytest.mark.parametrize("drip", [False, True])
def test_runs_at_scattered_addresses_arrive_exact_and_nothing_between_is_written(tcp_pair, drip):
    """3,000 runs (more than IOV_MAX a call) of odd sizes and empty ones
    (first, inside, last), at random gaps on both ends, in another order
    on each end; the gaps at the receiver keep their bytes."""
    a, b = tcp_pair
    rng = random.Random(11)
    sizes = [0, 0] + [rng.choice((0, 1, 3, 7, 64, 4095, 8192, 20_001, 300_007)) for _ in range(3000)] + [0]
    src, src_off = _scattered(rng, sizes, 64)
    src[:] = np.frombuffer(rng.randbytes(src.size), dtype=np.uint8)
    dst, dst_off = _scattered(random.Random(12), sizes, 64)
    dst[:] = 0xEE
    _exchange(a, b, src, src_off, dst, dst_off, sizes, drip=random.Random(13) if drip else None)
    written = np.zeros(dst.size, dtype=bool)
    for so, do, n in zip(src_off.tolist(), dst_off.tolist(), sizes):
        assert dst[do : do + n].tobytes() == src[so : so + n].tobytes()
        written[do : do + n] = True
    assert (dst[~written] == 0xEE).all()


def test_a_run_read_twice_and_runs_that_continue_each_other(tcp_pair):
    """The same source bytes sent twice (a tied tensor asked for twice) and
    adjacent runs on both ends: what a Fetch of ranges can hold."""
    a, b = tcp_pair
    src = np.arange(1000, dtype=np.uint8)
    dst = np.zeros(1000, dtype=np.uint8)
    sizes = [10, 10, 5, 5]
    _exchange(a, b, src, np.array([0, 0, 500, 505]), dst, np.array([0, 10, 20, 25]), sizes)
    assert dst[:30].tolist() == src[:10].tolist() * 2 + src[500:510].tolist()


def test_no_runs_or_only_empty_ones_move_nothing(tcp_pair):
    a, b = tcp_pair
    nothing = np.zeros(0, dtype=np.int64)
    P.send_runs(a, nothing, nothing)
    P.recv_runs(b, nothing, nothing, deadline=time.monotonic() + 1)
    P.send_runs(a, np.array([0, 0]), np.array([0, 0]))  # addresses never read when empty
    P.recv_runs(b, np.array([0]), np.array([0]), deadline=time.monotonic() + 1)
    a.sendall(b"z")
    got = np.zeros(1, dtype=np.uint8)
    P.recv_runs(b, np.array([got.ctypes.data]), np.array([1]), deadline=time.monotonic() + 5)
    assert got[0] == ord("z")


def test_a_receive_says_how_far_it_got_when_the_sender_hangs_up(tcp_pair):
    a, b = tcp_pair
    dst = np.zeros(5000, dtype=np.uint8)
    a.sendall(b"x" * 1234)
    a.close()
    with pytest.raises(PeerGoneError, match="after 1,234 of 5,000 bytes") as failed:
        P.recv_runs(b, dst.ctypes.data + np.arange(0, 5000, 10), np.full(500, 10), deadline=time.monotonic() + 10)
    assert "closed its Sender (see its log)" in str(failed.value)  # the fix
    assert dst[:1234].tobytes() == b"x" * 1234 and not dst[1234:].any()


def test_a_receive_stops_at_its_deadline_and_says_how_far_it_got(tcp_pair):
    a, b = tcp_pair
    dst = np.zeros(100, dtype=np.uint8)
    a.sendall(b"y" * 42)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="after receiving 42 of 100 bytes") as failed:
        P.recv_runs(b, dst.ctypes.data + np.array([0, 50]), np.array([50, 50]), deadline=time.monotonic() + 0.5)
    assert "raise get(timeout=) or Receiver(timeout=)" in str(failed.value)
    assert time.monotonic() - t0 < 5


def test_a_send_to_a_receiver_that_stops_reading_times_out_and_one_that_hung_up_fails(tcp_pair):
    a, b = tcp_pair
    src = np.zeros(64 << 20, dtype=np.uint8)  # far more than both sockets' buffers hold
    a.settimeout(0.5)
    with pytest.raises(TransferTimeoutError, match=r"timed out sending .* of 67,108,864 bytes: it read nothing for 0.5 s") as failed:
        P.send_runs(a, src.ctypes.data + np.arange(0, src.size, 1 << 20), np.full(64, 1 << 20))
    assert "check that its process runs" in str(failed.value)
    b.close()
    with pytest.raises(PeerGoneError, match=r"closed the connection during a send, after [\d,]+ of 1,048,576 bytes") as failed:
        for _ in range(100):  # the first sends may still land in the buffers
            P.send_runs(a, np.array([src.ctypes.data]), np.array([1 << 20]))
    assert "its error or log says why" in str(failed.value)
