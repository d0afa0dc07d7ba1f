"""Faults and hostile input: dying peers, leaks under load, corrupted and
forged tickets redeemed against a live sender, hostile bytes on the TCP port,
authentication. (Ticket decoding alone: tests/test_ticket.py.)

Real processes (``spawn``), real sockets on 127.0.0.1 only, nothing mocked.
Processes are ended only by the pid of the process the test started.
"""

from __future__ import annotations

import os

os.environ["UCX_NET_DEVICES"] = "lo"  # before anything imports nixl

import gc
import multiprocessing
import random
import signal
import socket
import struct
import threading
import time

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _transfer_helpers import (
    COMPLEX_HALF_WARNING,
    Worker,
    assert_same,
    build,
    leaves,
    memfd_mappings,
    open_fds,
    pool_empty,
    random_object,
    receiver_worker,
    rss_bytes,
    sender_worker,
    shm_tensorferry_entries,
    state_dict,
    wait_until,
)
from tensorferry import (
    AuthenticationError,
    MemoryPool,
    PeerGoneError,
    Receiver,
    Sender,
    TensorferryError,
    Ticket,
)
from tensorferry.wire import protocol as P
from tensorferry.transports import _base, open_control

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings(COMPLEX_HALF_WARNING)]

MiB = 1 << 20
CTX = multiprocessing.get_context("spawn")


@pytest.fixture(scope="module", autouse=True)
def _dev_shm_unchanged():
    before = shm_tensorferry_entries()
    yield
    gc.collect()
    assert shm_tensorferry_entries() - before == set(), "tensorferry left files in /dev/shm"


def _sender_idle(sender, timeout: float = 5.0) -> bool:
    return wait_until(lambda: pool_empty(sender.pool) and sender.stats()["live_tickets"] == 0, timeout)


# -- the sender dies ---------------------------------------------------------------------


@pytest.mark.slow
def test_sender_killed_before_during_and_after_a_get(transport):
    snd = Worker(CTX, sender_worker, 4 * MiB)
    receiver = Receiver(transport, timeout=20.0)
    try:
        snd.ready()
        # After: a get that completed (copies; and zero-copy views on shm).
        (_, ta) = snd.call("put", transport, "state", 40, 1, 1)
        a = receiver.get(ta)
        c = None
        if transport == "shm":
            (_, tc) = snd.call("put", transport, "state", 41, 1, 1)
            c = receiver.get(tc, zero_copy=True)
            c_slice = c["head"][10:20]
        # Before: a ticket nobody fetched yet.
        (_, tb) = snd.call("put", transport, "state", 42, 1, 1)
        # During: a streamed object read by one of its two readers stalls
        # mid-stream (the first pieces fill the 4 MiB pool until reader 2 reads).
        (_, td) = snd.call("put", transport, "big", 43, 2, 24 * MiB)
        assert Ticket.from_bytes(td).streamed
        outcome: dict[str, object] = {}

        def during():
            t0 = time.monotonic()
            try:
                receiver.get(td, timeout=20.0)
                outcome["result"] = "finished"
            except BaseException as exc:
                outcome["result"] = exc
            outcome["t"] = time.monotonic()
            outcome["t0"] = t0

        def moved() -> int:
            return snd.call("stats", transport)[1]["bytes_moved"]

        moved_before = moved()
        th = threading.Thread(target=during)
        th.start()
        # Mid-stream once a first piece is read: the rest cannot come until
        # the second reader frees the pool, and it never comes.
        assert wait_until(lambda: moved() > moved_before, 10.0), f"the streamed get read nothing: {outcome}"
        assert th.is_alive(), f"the streamed get should be stuck mid-stream: {outcome}"
        t_kill = time.monotonic()
        snd.kill()
        th.join(15.0)
        assert not th.is_alive()
        assert isinstance(outcome["result"], PeerGoneError), outcome["result"]
        assert outcome["t"] - t_kill < 10.0, "the mid-stream get did not notice the dead sender in time"

        # What was received before the kill stays valid.
        assert_same(a, build("state", 40))
        if c is not None:
            assert_same(c, build("state", 41))  # zero-copy views of a dead sender's pool
            assert torch.equal(c_slice, build("state", 41)["head"][10:20])

        # A ticket never fetched: the warm receiver and a cold one both raise in time.
        # PeerGoneError, not TransferTimeoutError: the loss was seen, not waited out.
        for r in (receiver, Receiver(transport, timeout=20.0)):
            with pytest.raises(PeerGoneError):
                r.get(tb, timeout=5.0)
            if r is not receiver:
                r.close()

        # The same Receiver works with a new sender.
        with Sender(transport, capacity_nbytes=4 * MiB) as s2:
            obj = state_dict(44)
            assert_same(receiver.get(s2.put(obj)), obj)
            assert _sender_idle(s2)
    finally:
        receiver.close()
        snd.stop()


def test_receiver_survives_many_dead_senders(transport):
    """A long-lived receiver must not keep an fd (or a mapping) per dead sender."""
    with Receiver(transport, timeout=10.0) as r:
        for i in range(3):  # warm up lazy state (threads, imports)
            with Sender(transport, capacity_nbytes=1 * MiB) as s:
                assert_same(r.get(s.put(state_dict(i))), state_dict(i))
        gc.collect()
        fds, maps = open_fds(), memfd_mappings("tensorferry")
        for i in range(20):
            with Sender(transport, capacity_nbytes=1 * MiB) as s:
                assert_same(r.get(s.put(state_dict(i))), state_dict(i))
                # An open sender's pool is seen: the count below can see a leak.
                assert memfd_mappings("tensorferry") > maps
        gc.collect()
        assert open_fds() <= fds + 3, f"open fds grew from {fds} to {open_fds()} over 20 senders"
        pools = memfd_mappings("tensorferry")
        assert pools <= maps + 1, f"pool mappings grew from {maps} to {pools} over 20 closed senders"


# -- the receiver dies -------------------------------------------------------------------


@pytest.mark.slow
def test_receiver_killed_mid_read(transport):
    rcv = Worker(CTX, receiver_worker)
    # 8 MiB pieces in 40 MiB: whatever the held ticket takes, the first
    # pieces fit and the 48 MiB object's last one does not.
    with Sender(transport, capacity_nbytes=40 * MiB, piece_nbytes=8 * MiB, lease_seconds=60.0) as sender:
        try:
            rcv.ready()
            held = None
            if transport == "shm":
                # Zero-copy views in the dead process held the slot.
                held = sender.put(state_dict(50))
                assert rcv.call("get", held.to_bytes(), "state", 50, 1, True, True) == ("got", True, "")
            elif transport == "tcp":
                # Acquired, asked for 24 MiB, read 64 KiB of them: the sender
                # is blocked sending the rest when the receiver dies.
                held = sender.put(build("big", 51, 24 * MiB))
                assert rcv.call("raw_partial_fetch", held.to_bytes(), 64 << 10) == ("stalled",)
            # A streamed get of one of two readers, stuck mid-stream; its
            # other reader never comes: the lease must return those pieces.
            streamed = sender.put(build("big", 52, 48 * MiB), readers=2, lease_seconds=1.5)
            assert streamed.streamed
            moved = sender.stats()["bytes_moved"]
            rcv.send("get", streamed.to_bytes(), "big", 52, 48 * MiB, False, False)
            # Killed mid-read: after its first piece, before the last (which
            # the missing second reader holds back).
            assert wait_until(lambda: sender.stats()["bytes_moved"] > moved, 10.0), "the receiver read no piece"
            assert sender.pool.stats().used_nbytes > 0
            rcv.kill()
            if held is not None:
                # Raises TransferTimeoutError unless the connection drop released it (the lease is longer).
                sender.wait_released(held, timeout=5.0)
            assert _sender_idle(sender, timeout=10.0), sender.pool.stats()
            # The sender keeps serving.
            with Receiver(transport, timeout=10.0) as r:
                obj = state_dict(53)
                assert_same(r.get(sender.put(obj)), obj)
            assert _sender_idle(sender)
        finally:
            rcv.stop()


@pytest.mark.slow
def test_receiver_stalled_mid_read_tcp(monkeypatch):
    """A receiver that stops reading (SIGSTOP) must not pin the sender's
    blocks forever: the sender gives up after its frame timeout."""
    monkeypatch.setattr(_base, "_FRAME_TIMEOUT_SECONDS", 1.0)
    rcv = Worker(CTX, receiver_worker)
    with Sender("tcp", capacity_nbytes=32 * MiB) as sender:
        try:
            rcv.ready()
            ticket = sender.put(build("big", 54, 24 * MiB))
            assert rcv.call("raw_partial_fetch", ticket.to_bytes(), 64 << 10) == ("stalled",)
            os.kill(rcv.pid, signal.SIGSTOP)
            try:
                sender.wait_released(ticket, timeout=10.0)
                assert _sender_idle(sender)
            finally:
                os.kill(rcv.pid, signal.SIGCONT)
        finally:
            rcv.kill()


# -- load: cycles and concurrency -------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_put_get_cycles_no_leaks(transport):
    with Sender(transport, capacity_nbytes=16 * MiB) as sender, Receiver(transport, timeout=20.0) as receiver:
        for i in range(20):  # warm-up: lazy imports, threads, first page faults
            assert_same(receiver.get(sender.put(random_object(i))), random_object(i))
        gc.collect()
        fds, rss = open_fds(), rss_bytes()
        transfers = sender.stats()["transfers"]
        nonempty = 0
        for i in range(200):
            obj = random_object(1000 + i)
            nonempty += any(t.numel() for t in leaves(obj))  # empty ones need no transfer
            kw = {"zero_copy": True} if transport == "shm" and i % 3 == 0 else {}
            got = receiver.get(sender.put(obj), **kw)
            assert_same(got, obj)
            del got
        gc.collect()
        assert _sender_idle(sender), sender.pool.stats()
        assert open_fds() <= fds + 2, f"open fds grew from {fds} to {open_fds()}"
        grew = rss_bytes() - rss
        assert grew < 48 * MiB, f"RSS grew by {grew / MiB:.1f} MiB over 200 cycles"
        assert sender.stats()["transfers"] - transfers == nonempty > 150


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_eight_concurrent_receivers(transport):
    """8 threads x 100 gets of random objects; 4 threads share one Receiver."""
    with Sender(transport, capacity_nbytes=32 * MiB) as sender:
        shared = Receiver(transport, timeout=30.0)
        own = [Receiver(transport, timeout=30.0) for _ in range(4)]
        # Warm up, then measure.
        for r in (shared, *own):
            r.get(sender.put(state_dict(0)))
        gc.collect()
        fds, rss = open_fds(), rss_bytes()
        errors: list[str] = []

        def work(k: int, r: Receiver) -> None:
            try:
                for i in range(100):
                    seed = 10_000 * (k + 1) + i
                    obj = random_object(seed)
                    got = r.get(sender.put(obj))
                    assert_same(got, random_object(seed))
            except BaseException as exc:
                errors.append(f"thread {k}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=work, args=(k, shared if k < 4 else own[k - 4])) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50.0)
        assert not any(t.is_alive() for t in threads), "a receiver thread hung"
        assert not errors, errors[:3]
        assert _sender_idle(sender), sender.pool.stats()
        # At most one connection per thread: its socket, the server's end (in
        # this process too), and for shm the pool mapping's fd.
        per_conn = 3 if transport == "shm" else 2
        busy_fds = open_fds()
        assert busy_fds <= fds + 8 * per_conn, f"open fds grew from {fds} to {busy_fds}"
        for r in (shared, *own):
            r.close()
        gc.collect()
        assert wait_until(lambda: open_fds() <= fds, 5.0), f"closing the receivers left {open_fds()} fds (baseline {fds})"
        grew = rss_bytes() - rss
        assert grew < 64 * MiB, f"RSS grew by {grew / MiB:.1f} MiB"


# -- corrupted and forged tickets, redeemed ---------------------------------------------


def test_fuzz_corrupted_tickets_against_a_live_sender():
    """Corrupted tickets redeemed for real: a TensorferryError or a result,
    never another exception, a hang, or a leak on the sender."""
    with Sender("shm", capacity_nbytes=8 * MiB) as sender, Receiver("shm", timeout=2.0) as receiver:
        obj = state_dict(61)
        good = sender.put(obj, readers=None)
        data = good.to_bytes()
        rng = random.Random(61)
        outcomes = {"ok": 0, "error": 0}
        for _ in range(150):
            buf = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            try:
                t = Ticket.from_bytes(bytes(buf))
                if t.transport != "shm":
                    continue  # never follow a corrupted address off this host
                receiver.get(t, timeout=2.0)
                outcomes["ok"] += 1
            except TensorferryError:
                outcomes["error"] += 1
        assert outcomes["error"] > 0
        assert_same(receiver.get(good), obj)  # the receiver is still usable
        sender.discard(good)
        assert _sender_idle(sender), sender.pool.stats()


@pytest.mark.parametrize(
    "field",
    ["huge_streamed", "huge_pieces", "blocks_outside_pool", "misaligned_block", "many_blocks", "other_layout", "reshaped_layout", "bad_address", "closed_port"],
)
def test_hostile_ticket_fields(field):
    """Tickets that decode but lie: rejected with a TensorferryError before
    any allocation sized by them; the receiver and sender stay usable."""
    with Sender("shm", capacity_nbytes=8 * MiB) as sender, Receiver(timeout=3.0) as receiver:
        obj = state_dict(62)
        # One reader: a forged ticket that reuses the id must be refused
        # before it takes that one slot (the sender checks the digest).
        t = sender.put(obj, readers=1)
        rep = msgspec.structs.replace
        if field == "huge_streamed":
            forged = rep(t, blocks=[], total_nbytes=1 << 60, piece_nbytes=1 << 59, num_pieces=2)
        elif field == "huge_pieces":
            forged = rep(t, blocks=[], total_nbytes=1 << 40, piece_nbytes=1, num_pieces=1 << 40)
        elif field == "blocks_outside_pool":
            forged = rep(t, blocks=[(1 << 40, 1 << 20)])
        elif field == "misaligned_block":
            forged = rep(t, blocks=[(t.blocks[0][0] + 8, t.blocks[0][1])])
        elif field == "many_blocks":
            forged = rep(t, blocks=[(16 * i, 16) for i in range(1 << 16)])
        elif field == "other_layout":
            with MemoryPool(8 * MiB) as p:
                forged = rep(t, layout_bytes=p.pack([torch.zeros(1 << 20)]).layout.to_bytes())
        elif field == "reshaped_layout":
            # The same dtypes and bytes in the same order, other shapes: the
            # sizes all agree, only the sender's digest tells it apart.
            with MemoryPool(8 * MiB) as p:
                flat = p.pack([x.reshape(-1) for x in leaves(obj)])
                assert flat.blocks[0].nbytes == t.blocks[0][1]
                forged = rep(t, layout_bytes=flat.layout.to_bytes())
        elif field == "bad_address":
            forged = rep(t, address="@no-such-tensorferry-sender")
        else:
            probe = socket.socket()
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
            probe.close()
            forged = rep(t, transport="tcp", address=f"127.0.0.1:{port}")
        rss = rss_bytes()
        try:
            receiver.get(Ticket.from_bytes(forged.to_bytes()), timeout=3.0)
        except TensorferryError:
            pass
        else:
            raise AssertionError(f"a forged ticket ({field}) was redeemed")
        assert rss_bytes() - rss < 32 * MiB, "the forged ticket made the receiver allocate"
        assert_same(receiver.get(t), obj)  # the one slot is still there
        sender.wait_released(t, timeout=10.0)
        assert _sender_idle(sender), sender.pool.stats()


# -- hostile bytes on the TCP port ------------------------------------------------------------


def _header(kind: int, length: int, magic: bytes = P.MAGIC, version: int = P.VERSION) -> bytes:
    return struct.pack("<4sHHI", magic, version, kind, length)


def _send(sock: socket.socket, data: bytes, *, shut_write: bool = False) -> None:
    """Send hostile bytes; the server may close (even reset) the connection
    before they are all out, which is what the tests want to see."""
    try:
        sock.sendall(data)
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True if the server closes the connection within ``timeout`` seconds
    (reading and dropping whatever it sends first, e.g. a Failure)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionError:
            return True
        if not chunk:
            return True
    return False


def _drip_closed(sock: socket.socket, data: bytes, seconds: float) -> bool:
    """Drip ``data`` one byte every 0.2 s (each byte well inside any
    per-receive timeout) for up to ``seconds``; True once the server closes."""
    deadline = time.monotonic() + seconds
    for b in data:
        if time.monotonic() > deadline:
            return False
        try:
            sock.sendall(bytes([b]))
        except OSError:
            return True
        if _closed_by_server(sock, 0.2):
            return True
    return _closed_by_server(sock, max(0.0, deadline - time.monotonic()))


class _LegitTraffic:
    """A receiver that keeps getting verified objects while attacks run."""

    def __init__(self, sender: Sender, token: bytes = b"") -> None:
        self.sender = sender
        self.token = token
        self.count = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with Receiver("tcp", token=self.token, timeout=10.0) as r:
            i = 0
            while not self._stop.is_set():
                try:
                    obj = random_object(500 + i)
                    assert_same(r.get(self.sender.put(obj)), obj)
                    self.count += 1
                except BaseException as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                i += 1

    def __enter__(self) -> "_LegitTraffic":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15.0)


TOKEN = b"s3cret-token-of-24-bytes"


def _frame(msg) -> bytes:
    payload = msgspec.msgpack.encode(msg)
    return _header(P._TYPE_OF[type(msg)], len(payload)) + payload


def _hello() -> bytes:
    return _frame(P.Hello(transport="tcp", nonce=os.urandom(32)))


ATTACKS = {
    "random_bytes": lambda: random.Random(7).randbytes(4096),
    "claims_4gib_frame": lambda: _header(P.MsgType.HELLO, 0xFFFFFFFF) + b"\0" * 64,
    "claims_4gib_unknown_type": lambda: _header(200, 0xFFFFFFFF),
    "bad_magic": lambda: _header(P.MsgType.HELLO, 4, magic=b"HTTP") + b"GET /",
    "bad_version": lambda: _header(P.MsgType.HELLO, 0, version=99),
    "short_nonce": lambda: _frame(P.Hello(transport="tcp", nonce=b"n")),
    "proof_before_hello": lambda: _frame(P.Proof(mac=b"m" * 32)),
    "hello_then_a_wrong_proof": lambda: _hello() + _frame(P.Proof(mac=b"m" * 32)),
    "hello_then_no_proof": lambda: _hello() + _frame(P.Proof()),
    "acquire_before_hello": lambda: _frame(P.Acquire(ticket_id=1, digest=b"d" * 16)),
    "data_frame_first": lambda: _header(P.MsgType.DATA, 0) + struct.pack("<Q", 1 << 40),
    "malformed_hello": lambda: _header(P.MsgType.HELLO, 5) + b"\xff\xff\xff\xff\xff",
}


@pytest.mark.slow
def test_hostile_bytes_on_the_tcp_port(monkeypatch):
    monkeypatch.setattr(_base, "_FRAME_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(_base, "HANDSHAKE_SECONDS", 1.0)
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN) as sender:
        host, port = sender.address.rsplit(":", 1)
        assert host == "127.0.0.1"
        addr = (host, int(port))
        with _LegitTraffic(sender, TOKEN) as legit:
            for name, make in ATTACKS.items():
                with socket.create_connection(addr, timeout=5.0) as s:
                    _send(s, make())
                    assert _closed_by_server(s, 5.0), f"{name}: the server kept the connection open"
            # A half frame, then close: the server must simply drop it.
            for _ in range(5):
                with socket.create_connection(addr, timeout=5.0) as s:
                    _send(s, _hello()[:7])
            # Slowloris before the handshake: one byte, then nothing.
            with socket.create_connection(addr, timeout=5.0) as s:
                s.sendall(P.MAGIC[:1])
                assert _closed_by_server(s, 5.0), "slowloris (1 byte before Hello) kept its connection"
            # Slowloris after a good handshake: one byte of a request, then nothing.
            s, _, _ = open_control(sender.address, token=TOKEN)
            with s:
                s.sendall(P.MAGIC[:1])
                assert _closed_by_server(s, 5.0), "slowloris (1 byte of a request) kept its connection"
            # Drip-feed: a byte every 0.2 s never trips a per-receive
            # timeout; the frame's own deadline (1 s here) must.
            with socket.create_connection(addr, timeout=5.0) as s:
                assert _drip_closed(s, _hello(), 4.0), "a Hello dripped a byte at a time kept its connection"
            s, _, session = open_control(sender.address, token=TOKEN)
            with s:
                request = _frame(session.sign(P.Acquire(ticket_id=1, piece=0, timeout_seconds=1.0)))
                assert _drip_closed(s, request, 4.0), "a request dripped a byte at a time kept its connection"
            # An authenticated peer that sends garbage after the handshake.
            s, _, _ = open_control(sender.address, token=TOKEN)
            with s:
                s.sendall(_header(P.MsgType.ACQUIRE, 0xFFFFFFF0))
                assert _closed_by_server(s, 5.0), "an oversized request kept its connection"
            # Many connections that do nothing but open and close.
            for _ in range(50):
                socket.create_connection(addr, timeout=5.0).close()
            # The legitimate receiver still gets objects after all of it.
            after = legit.count
            assert wait_until(lambda: legit.count > after or legit.errors, 10.0), "legitimate gets stalled after the attacks"
        assert not legit.errors, legit.errors[:3]
        assert legit.count > 0
        # Every hostile connection is gone on the server.
        assert wait_until(lambda: len(sender.server._conns) == 0, 5.0), len(sender.server._conns)
        assert _sender_idle(sender)


@pytest.mark.slow
def test_a_flood_of_silent_connections_is_bounded(monkeypatch):
    """Connections that never finish a handshake hold a thread each for up
    to the handshake deadline; beyond a bound, the oldest is closed for each
    new one. Receivers already connected keep working, and a new one gets in
    during the flood (its handshake takes milliseconds)."""
    monkeypatch.setattr(_base, "HANDSHAKE_SECONDS", 30.0)
    monkeypatch.setattr(_base, "_MAX_HANDSHAKING", 8)
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN) as sender:
        host, port = sender.address.rsplit(":", 1)
        addr = (host, int(port))
        with _LegitTraffic(sender, TOKEN) as legit:
            assert wait_until(lambda: legit.count > 0, 10.0)
            silent = [socket.create_connection(addr, timeout=5.0) for _ in range(20)]
            try:
                assert wait_until(lambda: sender.server.evicted >= 12, 5.0), sender.server.evicted
                assert len(sender.server._shaking) <= 8
                before = legit.count
                assert wait_until(lambda: legit.count > before + 3, 5.0), "the connected receiver stalled during the flood"
                with Receiver("tcp", token=TOKEN, timeout=10.0) as r:  # a new one, the flood still open
                    obj = state_dict(64)
                    assert_same(r.get(sender.put(obj)), obj)
                # The oldest were closed by the server; the newest still wait.
                assert all(_closed_by_server(c, 5.0) for c in silent[:10])
            finally:
                for c in silent:
                    c.close()
            assert wait_until(lambda: not sender.server._shaking, 5.0), len(sender.server._shaking)
        assert not legit.errors, legit.errors[:3]
        assert sender.server.stats()["failed_handshakes"] >= 12
        assert _sender_idle(sender)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=256))
def test_fuzz_tcp_port_with_random_frames(tcp_sender, data):
    sender, addr = tcp_sender
    with socket.create_connection(addr, timeout=5.0) as s:
        # A valid header in front half of the time, so the payload decoder is hit.
        if data[0] & 1:
            _send(s, _header(P.MsgType.HELLO, len(data) - 1) + data[1:], shut_write=True)
        else:
            _send(s, data, shut_write=True)
        assert _closed_by_server(s, 5.0)
    with Receiver("tcp", timeout=5.0) as r:
        obj = state_dict(63)
        assert_same(r.get(sender.put(obj)), obj)


@pytest.fixture(scope="module")
def tcp_sender():
    with Sender("tcp", capacity_nbytes=4 * MiB) as s:
        host, port = s.address.rsplit(":", 1)
        yield s, (host, int(port))


# -- authentication and binding ------------------------------------------------------------------


def test_token_required(transport):
    with Sender(transport, capacity_nbytes=1 * MiB, token="tok3n-is-24-bytes-long!") as sender:
        ticket = sender.put(state_dict(64))
        for token in (None, "wrong-token-of-24-bytes!"):
            with Receiver(transport, token=token, timeout=5.0) as r:
                with pytest.raises(AuthenticationError):
                    r.get(ticket)
        with Receiver(transport, token=b"tok3n-is-24-bytes-long!", timeout=5.0) as r:
            assert_same(r.get(ticket), state_dict(64))
        assert _sender_idle(sender)


def test_shm_trusts_the_same_user_without_a_token():
    """Documented behaviour: the shm socket (abstract, checked with
    SO_PEERCRED) accepts any process of the same user when the sender has no
    token; another user's process is refused (not testable unprivileged)."""
    with Sender("shm", capacity_nbytes=1 * MiB) as sender, Receiver("shm", timeout=5.0) as r:
        assert sender.address.startswith("@")  # abstract: nothing on the file system
        assert_same(r.get(sender.put(state_dict(65))), state_dict(65))
