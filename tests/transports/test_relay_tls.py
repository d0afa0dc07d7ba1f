"""TLS on relay links and signed requests to relays (transports/_relay,
_tls.py, _auth.py), over real sockets, real certificates (made in the test)
and, where a relay dies, a real process:

* ``Receiver(relay=True, tls=..., relay_tls=...)`` serves its children over
  TLS: a recording proxy between a relay and its child sees no weight byte,
  no control frame and no token, and the same check finds the weights in
  the capture of the same chain without TLS;
* every Pull is signed with the connection's session key: one replayed on
  its connection, copied to another or unsigned is refused, and the
  connection closed, before the relay serves a byte;
* a child checks a relay's certificate as it checks a sender's: one it does
  not trust, or a relay that wants a client certificate the child lacks, is
  an ``AuthenticationError``, not a silent fall back to the sender;
* the relay faults of test_relay.py and tests/hosts that TLS changes (a
  relay gone, one that never answers, a relay process killed before its
  child pulls and one killed mid-stream, kept connections, a lend ended by
  a closing relay, nixl's reads) behave the same over TLS.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

import tensorferry
from _proxy import RecordingProxy
from _tls_certs import certs_or_skip, client_context, server_context
from _transfer_helpers import assert_same, broadcast_object, get_all, pool_empty, require, state_dict, wait_until
from tensorferry import AuthenticationError, ConfigurationError, Receiver, Sender, TransferError, TransferTimeoutError
from tensorferry.transports import open_control
from tensorferry.transports._auth import client_handshake
from tensorferry.transports._tls import wrap_client
from tensorferry.wire import protocol as P

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
TOKEN = b"a-test-token-of-thirty-two-bytes"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return certs_or_skip(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def strange_certs(tmp_path_factory):
    """Certificates of another CA, which the children do not trust."""
    return certs_or_skip(tmp_path_factory.mktemp("strange"))


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make(n, **kw):
        kw.setdefault("timeout", 30.0)
        kw.setdefault("token", TOKEN)
        transport = kw.pop("transport", "tcp")
        new = [Receiver(transport, **kw) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for r in made:
        r.close()


def _tls(certs, *, relay: bool = True) -> dict:
    """A receiver's TLS arguments: its client context, and a relay's server one."""
    return {"tls": client_context(certs), **({"relay_tls": server_context(certs)} if relay else {})}


def _patterned(nbytes: int) -> dict[str, torch.Tensor]:
    # Recognisable bytes: 0x5A repeated, found at once in a plaintext capture.
    return {"w": torch.full((nbytes // 4,), 0x5A5A5A5A, dtype=torch.int32), **state_dict(6)}


def _frame(msg) -> bytes:
    payload = msgspec.msgpack.encode(msg)
    return struct.pack("<4sHHI", P.MAGIC, P.VERSION, P._TYPE_OF[type(msg)], len(payload)) + payload


# -- what crosses a relay's link ---------------------------------------------------------------------


def test_a_chain_of_tls_relays_passes_the_object_on_exact(certs, receivers):
    want = broadcast_object(1)
    with Sender("tcp", capacity_nbytes=64 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        # Two stream over their links; the last copies out of its relay's
        # memory (same host), the lend's control over TLS.
        rs = receivers(2, relay=True, relay_reads="tcp", **_tls(certs)) + receivers(1, relay=True, **_tls(certs))
        ticket = sender.put(want, readers=3, fanout=1)
        for r in rs:  # in order: a chain sender -> 0 -> 1 -> 2
            assert_same(r.get(ticket), want)
        sender.wait_released(ticket, timeout=10.0)
        t = ticket.total_nbytes
        assert sender.stats()["bytes_sent"] == t
        assert rs[1].stats()["relay_stream_nbytes"] == t and rs[2].stats()["relay_memory_read_nbytes"] == t
        assert wait_until(lambda: [r._relay_server.bytes_sent for r in rs] == [t, t, 0], 5.0)
        assert rs[1]._relay_server.bytes_lent == t  # counted from the child's signed Arrived
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "clear"])
def test_a_proxy_between_a_relay_and_its_child_sees_weights_only_without_tls(certs, receivers, tls):
    want = _patterned(8 * MiB)
    with Sender("tcp", capacity_nbytes=32 * MiB, token=TOKEN, **({"tls": server_context(certs)} if tls else {})) as sender:
        # The relay listens on 127.0.0.2 and tells children 127.0.0.1 at the
        # same port, where the proxy listens: every byte to its child
        # crosses the proxy (the certificate names 127.0.0.1).
        (relay,) = receivers(1, host="127.0.0.2", advertise_host="127.0.0.1", relay=True,
                             **(_tls(certs) if tls else {}))
        port = int(relay.relay_address.rsplit(":", 1)[1])
        with RecordingProxy(f"127.0.0.2:{port}", port=port) as proxy:
            (child,) = receivers(1, relay_reads="tcp", **(_tls(certs, relay=False) if tls else {}))
            ticket = sender.put(want, readers=2, fanout=1)
            assert_same(relay.get(ticket), want)
            assert_same(child.get(ticket), want)
            assert child.stats()["relay_stream_nbytes"] == ticket.total_nbytes  # through the proxy, from the relay
            captured = proxy.captured()
        sender.wait_released(ticket, timeout=10.0)
    assert len(captured) > 8 * MiB
    if tls:
        assert b"\x5a" * 64 not in captured  # no weight byte in clear
        assert struct.pack("<4sH", P.MAGIC, P.VERSION) not in captured  # no control frame in clear
        assert TOKEN not in captured
    else:
        # The same check fails in clear: it would catch weights that crossed unencrypted.
        assert b"\x5a" * 64 in captured
        assert struct.pack("<4sH", P.MAGIC, P.VERSION) in captured


# -- signed Pulls ---------------------------------------------------------------------------------------


def _child_connection(address: str, certs, tls: bool):
    """A child's connection to a relay, as pull makes it: TLS where asked,
    the token's handshake; the socket and its session."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10.0)
    if tls:
        sock = wrap_client(sock, client_context(certs), host, time.monotonic() + 10.0, who="relay")
    _, session = client_handshake(sock, token=TOKEN, transport="tcp", address=address, deadline=time.monotonic() + 10.0)
    return sock, session


def _refused_and_closed(sock) -> None:
    """The relay answers the last request with an auth Failure and closes."""
    reply = P.recv_msg(sock, deadline=time.monotonic() + 10.0)
    assert isinstance(reply, P.Failure) and reply.kind == "auth", reply
    assert "not the next one signed" in reply.message
    sock.settimeout(10.0)
    assert sock.recv(1) == b""  # then the end of the connection


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "clear"])
def test_a_replayed_copied_or_unsigned_pull_is_refused_before_a_byte(certs, receivers, tls):
    want = broadcast_object(2)
    with Sender("tcp", capacity_nbytes=64 * MiB, token=TOKEN, **({"tls": server_context(certs)} if tls else {})) as sender:
        (relay,) = receivers(1, relay=True, **(_tls(certs) if tls else {}))
        ticket = sender.put(want, readers=2, fanout=1)
        assert_same(relay.get(ticket), want)
        total = ticket.total_nbytes
        server = relay._relay_server

        sock, session = _child_connection(relay.relay_address, certs, tls)
        frame = _frame(session.sign(P.Pull(ticket_id=ticket.id, digest=ticket.digest, start=0, nbytes=total)))
        sock.sendall(frame)
        assert P.recv_msg(sock, deadline=time.monotonic() + 10.0) == ("DATA", total)
        got = bytearray(total)
        P.recv_exact_into(sock, memoryview(got), deadline=time.monotonic() + 10.0)
        assert wait_until(lambda: server.bytes_sent == total, 5.0)
        sock.sendall(frame)  # the same Pull again, on its own connection
        _refused_and_closed(sock)
        sock.close()

        other, _ = _child_connection(relay.relay_address, certs, tls)
        other.sendall(frame)  # copied to another connection: another key
        _refused_and_closed(other)
        other.close()

        bare, _ = _child_connection(relay.relay_address, certs, tls)
        bare.sendall(_frame(P.Pull(ticket_id=ticket.id, digest=ticket.digest, start=0, nbytes=total)))  # unsigned
        _refused_and_closed(bare)
        bare.close()
        assert server.bytes_sent == total  # nothing served to any of them

        (child,) = receivers(1, relay_reads="tcp", **(_tls(certs, relay=False) if tls else {}))
        assert_same(child.get(ticket), want)  # a real child is still served, from the relay
        assert child.stats()["relay_stream_nbytes"] == total
        sender.wait_released(ticket, timeout=10.0)


def test_a_child_that_is_refused_a_pull_gets_an_authentication_error(certs, monkeypatch):
    """A relay's auth Failure reaches the child as AuthenticationError (not
    a failed relay to go round): here the child signs with a key the relay
    does not share, as a copied Pull would be."""
    from tensorferry.transports._auth import Session
    from tensorferry.transports._relay import RelayBook, RelayServer, SameHostReads, pull

    book = RelayBook(linger_seconds=60.0)
    server = RelayServer(book, token=TOKEN, host="127.0.0.1", port=0, advertise_host=None, tls=server_context(certs))
    try:
        stream = torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        held = book.add(7, b"d" * 16, memoryview(stream.numpy()))
        held.progress(MiB)
        held.finish(True)
        real_sign = Session.sign
        monkeypatch.setattr(Session, "sign", lambda self, msg: real_sign(Session(b"another key"), msg))
        with pytest.raises(AuthenticationError, match="refused our Pull as not signed"):
            pull(server.address, token=TOKEN, ticket_id=7, digest=b"d" * 16, buf=memoryview(bytearray(MiB)), start=0,
                 progress=lambda end: None, stall_seconds=5.0, deadline=time.monotonic() + 30, reads=SameHostReads(enabled=False),
                 tls=client_context(certs))
        assert server.bytes_sent == 0
    finally:
        server.close()
        book.close()


# -- a relay's certificate -----------------------------------------------------------------------------


def test_a_relay_whose_certificate_the_child_does_not_trust_is_an_authentication_error(certs, strange_certs, receivers):
    want = broadcast_object(3)
    with Sender("tcp", capacity_nbytes=64 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        (relay,) = receivers(1, relay=True, tls=client_context(certs), relay_tls=server_context(strange_certs))
        (child,) = receivers(1, relay_reads="tcp", **_tls(certs, relay=False))
        ticket = sender.put(want, readers=2, fanout=1)
        assert_same(relay.get(ticket), want)
        with pytest.raises(AuthenticationError, match=rf"TLS handshake with the relay at {relay.relay_address.rsplit(':', 1)[0]} failed"):
            child.get(ticket)
        # Not taken from the sender instead: an impostor is an error, not a slow relay.
        assert sender.stats()["bytes_sent"] == ticket.total_nbytes
        assert relay._relay_server.bytes_sent == 0
        child.close()  # its slot goes with its connection
        assert wait_until(lambda: pool_empty(sender.pool), 10.0)


def test_a_relay_that_wants_a_client_certificate_the_child_lacks_says_so(certs, receivers):
    want = broadcast_object(4)
    with Sender("tcp", capacity_nbytes=64 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        (relay,) = receivers(1, relay=True, tls=client_context(certs), relay_tls=server_context(certs, require_client=True))
        (bare,) = receivers(1, relay_reads="tcp", tls=client_context(certs))
        (holder,) = receivers(1, relay_reads="tcp", tls=client_context(certs, with_cert=True))
        ticket = sender.put(want, readers=2, fanout=1)
        assert_same(relay.get(ticket), want)
        with pytest.raises(AuthenticationError, match="client certificate"):
            bare.get(ticket)
        ticket = sender.put(want, readers=2, fanout=1)
        assert_same(relay.get(ticket), want)
        assert_same(holder.get(ticket), want)  # from the relay, with its certificate
        assert holder.stats()["relay_stream_nbytes"] == ticket.total_nbytes


def test_relay_tls_arguments_are_checked(certs):
    with pytest.raises(ConfigurationError, match=r"relay_tls=ssl.SSLContext\(ssl.PROTOCOL_TLS_SERVER\)"):
        Receiver("tcp", relay=True, tls=client_context(certs))
    with pytest.raises(ConfigurationError, match="pass relay=True too"):
        Receiver("tcp", tls=client_context(certs), relay_tls=server_context(certs))
    with pytest.raises(ConfigurationError, match="without tls="):
        Receiver("tcp", relay=True, relay_tls=server_context(certs))
    with pytest.raises(ConfigurationError, match="PROTOCOL_TLS_SERVER"):
        Receiver("tcp", relay=True, tls=client_context(certs), relay_tls=client_context(certs))


# -- relay faults over TLS ---------------------------------------------------------------------------------


def test_a_child_whose_tls_relay_is_gone_resumes_from_the_sender(certs, receivers):
    want = broadcast_object(5)
    with Sender("tcp", capacity_nbytes=64 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        first, second = receivers(2, relay=True, stall_seconds=1.0, **_tls(certs))
        ticket = sender.put(want, readers=2, fanout=1)
        assert_same(first.get(ticket), want)
        first.close()  # its relay is gone before its child pulls
        assert_same(second.get(ticket), want)
        assert sender.stats()["bytes_sent"] == 2 * ticket.total_nbytes
        sender.wait_released(ticket, timeout=10.0)


def test_a_tls_relay_that_never_answers_is_given_up_after_stall_seconds(certs, receivers):
    """A relay that accepts and says nothing: the child's TLS handshake
    waits stall_seconds, then the sender names itself."""
    want = broadcast_object(6)
    silent = socket.create_server(("127.0.0.1", 0))
    fake = f"127.0.0.1:{silent.getsockname()[1]}"
    with Sender("tcp", capacity_nbytes=64 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        ticket = sender.put(want, readers=2, fanout=1)
        ctl, _, session = open_control(sender.address, timeout=5.0, token=TOKEN, tls=client_context(certs))
        P.send_msg(ctl, session.sign(P.Acquire(ticket_id=ticket.id, digest=ticket.digest, relay=fake)))
        assert P.recv_msg(ctl, expect=(P.Located,)).source == ""
        (child,) = receivers(1, stall_seconds=0.5, **_tls(certs, relay=False))
        assert_same(child.get(ticket), want)  # from the sender, after the stall
        silent.settimeout(0)
        silent.accept()[0].close()  # the child did try the silent relay first
        ctl.close()
        sender.wait_released(ticket, timeout=10.0)
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)
    silent.close()


def test_a_child_keeps_its_tls_connection_to_a_relay_from_pull_to_pull(certs, receivers):
    """The kept connection keeps its session too: each round's Pull is the
    next one signed on it."""
    want = broadcast_object(7)
    with Sender("tcp", capacity_nbytes=64 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        first, second = receivers(2, relay=True, relay_reads="tcp", **_tls(certs))
        for _ in range(3):
            ticket = sender.put(want, readers=2, fanout=1)
            assert_same(first.get(ticket), want)
            assert_same(second.get(ticket), want)
            sender.wait_released(ticket, timeout=10.0)
        assert second.stats()["relay_stream_nbytes"] == 3 * ticket.total_nbytes
        assert first._relay_server.stats()["connections"] == 1  # one connection, one handshake, three Pulls
        assert first._relay_server.stats()["failed_handshakes"] == 0


_RELAY_PROCESS = r"""
import sys, ssl, tensorferry as tf
from tensorferry.wire import Ticket
ca, cert, key, token = sys.argv[1:5]
client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); client.load_verify_locations(ca)
server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); server.load_cert_chain(cert, key)
r = tf.Receiver("tcp", token=token, tls=client, relay=True, relay_tls=server, timeout=30.0)
ticket = Ticket.from_bytes(bytes.fromhex(sys.stdin.readline()))
r.get(ticket)
print(r.relay_address, flush=True)
sys.stdin.readline()  # held until the test kills it
"""


def test_a_killed_tls_relay_process_sends_its_child_back_to_the_sender(certs, receivers):
    want = broadcast_object(8)
    env = {**os.environ, "PYTHONPATH": str(Path(tensorferry.__file__).parents[1])}
    with Sender("tcp", capacity_nbytes=64 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        ticket = sender.put(want, readers=2, fanout=1)
        proc = subprocess.Popen([sys.executable, "-c", _RELAY_PROCESS, str(certs.ca), str(certs.server_cert), str(certs.server_key), TOKEN.decode()],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            proc.stdin.write(ticket.to_bytes().hex() + "\n")
            proc.stdin.flush()
            address = proc.stdout.readline().strip()
            assert address, proc.stderr.read()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        (child,) = receivers(1, stall_seconds=1.0, relay_reads="tcp", **_tls(certs, relay=False))
        assert_same(child.get(ticket), want)
        assert sender.stats()["bytes_sent"] == 2 * ticket.total_nbytes  # the relay's copy, then the child's
        sender.wait_released(ticket, timeout=10.0)
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)


_STREAMING_RELAY = r"""
import sys, ssl, threading, time, tensorferry as tf
from tensorferry.wire import Ticket
ca, cert, key, token, after = sys.argv[1:6]
client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT); client.load_verify_locations(ca)
server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); server.load_cert_chain(cert, key)
r = tf.Receiver("tcp", token=token, tls=client, relay=True, relay_tls=server, relay_reads="tcp", timeout=60.0)
ticket = Ticket.from_bytes(bytes.fromhex(sys.stdin.readline()))
threading.Thread(target=r.get, args=(ticket,), daemon=True).start()
for what, key_, least in (("receiving", "relay_held_nbytes", 1), ("passing", "relay_bytes_sent", int(after))):
    while r.stats()[key_] < least:
        time.sleep(0.002)
    print(what, r.stats()["relay_bytes_sent"], flush=True)
sys.stdin.readline()  # held until the test kills it
"""


def test_a_tls_relay_process_killed_mid_stream_its_child_resumes_from_the_sender(certs, receivers):
    """The relay's link from the sender is slowed (a proxy, 24 MiB/s), so
    it is still receiving when it is SIGKILLed, after it passed 2 MiB on:
    its child has part of the stream and takes the rest from the sender,
    from the byte it reached."""
    want = {"w": torch.randn(8 * MiB, generator=torch.Generator().manual_seed(10))}  # 32 MiB
    env = {**os.environ, "PYTHONPATH": str(Path(tensorferry.__file__).parents[1])}
    with Sender("tcp", capacity_nbytes=64 * MiB, token=TOKEN, tls=server_context(certs)) as sender, \
            RecordingProxy(sender.address, rate_nbytes=24 * MiB) as slow:
        ticket = msgspec.structs.replace(sender.put(want, readers=2, fanout=1), address=slow.address)
        total = ticket.total_nbytes
        proc = subprocess.Popen([sys.executable, "-c", _STREAMING_RELAY, str(certs.ca), str(certs.server_cert), str(certs.server_key),
                                 TOKEN.decode(), str(2 * MiB)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        out: list = []
        try:
            proc.stdin.write(ticket.to_bytes().hex() + "\n")
            proc.stdin.flush()
            assert proc.stdout.readline().startswith("receiving"), proc.stderr.read()  # it acquired: the child goes below it
            (child,) = receivers(1, stall_seconds=2.0, relay_reads="tcp", **_tls(certs, relay=False))
            t = threading.Thread(target=lambda: out.append(child.get(ticket)))
            t.start()
            line = proc.stdout.readline()
            assert line.startswith("passing"), proc.stderr.read()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            t.join(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert not t.is_alive() and out, "the child's get did not finish"
        assert_same(out[0], want)
        streamed = child.stats()["relay_stream_nbytes"]
        assert 2 * MiB <= streamed < total, streamed  # part from the relay, the rest from the sender
        # The killed relay's reader slot is let go when the sender sees its
        # connections close, or at the latest when its lease ends (60 s after
        # the last acquire). The first does not always come here: about 1 run
        # in 4 on a loaded machine, with the code before 2026-12-07's changes
        # too (not traced yet; see the session note). The lease bounds it.
        sender.wait_released(ticket, timeout=75.0)
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)


def test_a_closing_tls_relay_ends_a_lent_stream_and_counts_what_the_child_read(certs):
    """A lend's control over TLS: the relay half-closes its side (the
    child sees its stream end, not a stall) and still reads the child's
    signed last Arrived, so the bytes it read are counted."""
    from tensorferry.transports._relay import RelayBook, RelayServer, SameHostReads, pull

    book = RelayBook(linger_seconds=60.0)
    server = RelayServer(book, token=TOKEN, host="127.0.0.1", port=0, advertise_host=None, tls=server_context(certs))
    stream = torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
    held = book.add(7, b"d" * 16, memoryview(stream.numpy()))
    held.progress(2 * MiB)
    reached: list[int] = []
    failed: list[BaseException] = []
    buf = memoryview(bytearray(stream.numel()))

    def child():
        try:
            pull(server.address, token=TOKEN, ticket_id=7, digest=b"d" * 16, buf=buf, start=0, progress=reached.append,
                 stall_seconds=20.0, deadline=time.monotonic() + 30, reads=SameHostReads(enabled=True), tls=client_context(certs))
        except BaseException as exc:  # noqa: BLE001 - checked below
            failed.append(exc)

    t = threading.Thread(target=child)
    try:
        t.start()
        assert wait_until(lambda: reached and reached[-1] == 2 * MiB, 10.0)
        assert server._lending
        server.close()
        t.join(timeout=60)
        assert not t.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], TransferError) and not isinstance(failed[0], TransferTimeoutError), failed
        assert wait_until(lambda: server.bytes_lent == 2 * MiB, 5.0)
        assert bytes(buf[: 2 * MiB]) == stream.numpy()[: 2 * MiB].tobytes()
    finally:
        server.close()
        book.close()


def test_nixl_children_read_a_relay_whose_control_is_tls(certs, receivers):
    require("nixl")
    want = broadcast_object(9)
    with Sender("nixl", capacity_nbytes=64 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        rs = receivers(3, transport="nixl", relay=True, relay_reads="tcp", **_tls(certs))
        ticket = sender.put(want, readers=3, fanout=1)
        for got in get_all(rs, ticket):
            assert_same(got, want)
        sender.wait_released(ticket, timeout=10.0)
        t = ticket.total_nbytes
        assert sorted(r.stats()["relay_nixl_read_nbytes"] for r in rs) == [0, t, t]
        assert wait_until(lambda: sorted(r._relay_server.bytes_exposed for r in rs) == [0, t, t], 5.0)
