"""Who may connect (transports/_auth.py, _tls.py), over real sockets:

* the token never crosses the link (a recording TCP proxy between a real
  Sender and Receiver sees neither it nor its hex, base64 or hash);
* a recorded handshake replayed on a new connection is refused before the
  sender serves or allocates anything, and an Acquire replayed on a live
  connection (or copied to another) takes no slot;
* the receiver refuses a sender that cannot prove it holds the token;
* tokens: tf.new_token(), TENSORFERRY_TOKEN, short ones refused, errors
  and logs without the token;
* TLS (certificates made in the test): a get over TLS is private (no
  plaintext frame or tensor byte in the capture), mutual TLS, and clear
  errors when the sides disagree;
* hundreds of garbage and half-open connections held open do not keep a
  receiver from its tensor, and are counted, not logged a line each;
* an old peer (protocol version 1) gets an error naming both versions.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import torch

import tensorferry as tf
from _proxy import RecordingProxy
from _tls_certs import certs_or_skip, client_context, server_context
from _transfer_helpers import assert_same, require, state_dict, wait_until
from tensorferry import AuthenticationError, ConfigurationError, ProtocolError, Receiver, Sender, TensorferryError, TransferError
from tensorferry.transports import open_control
from tensorferry.transports._auth import MIN_TOKEN_NBYTES
from tensorferry.wire import protocol as P

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
TOKEN = b"a-test-token-of-thirty-two-bytes"


def _frame(msg) -> bytes:
    payload = msgspec.msgpack.encode(msg)
    return struct.pack("<4sHHI", P.MAGIC, P.VERSION, P._TYPE_OF[type(msg)], len(payload)) + payload


def _frames(data: bytes) -> list:
    """The control frames in ``data`` (bytes a peer sent), decoded."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.close()
        out = []
        while True:
            try:
                out.append(P.recv_msg(b))
            except TensorferryError:
                return out


def _read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    out = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionError:
            return bytes(out)
        if not chunk:
            return bytes(out)
        out += chunk


def via(ticket, proxy: RecordingProxy):
    """The ticket, pointing at the proxy (the address is not in its digest)."""
    return msgspec.structs.replace(ticket, address=proxy.address)


# -- the token never crosses the link; replays are refused -------------------------------------------


def test_the_token_never_crosses_the_link():
    token = tf.new_token().encode()
    obj = state_dict(1)
    with Sender("tcp", capacity_nbytes=16 * MiB, token=token) as sender, RecordingProxy(sender.address) as proxy:
        with Receiver("tcp", token=token, timeout=20.0) as r:
            ticket = sender.put(obj)
            assert_same(r.get(via(ticket, proxy)), obj)
        captured = proxy.captured()
    assert len(captured) > ticket.total_nbytes  # the whole get went through the proxy
    for form in (token, token.hex().encode(), base64.b64encode(token), hashlib.sha256(token).digest(), token[:8]):
        assert form not in captured


def test_a_recorded_handshake_replayed_on_a_new_connection_is_refused():
    obj = state_dict(2)
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN) as sender, RecordingProxy(sender.address) as proxy:
        ticket = sender.put(obj, readers=2)
        with Receiver("tcp", token=TOKEN, timeout=20.0) as r:
            assert_same(r.get(via(ticket, proxy)), obj)
        recorded = bytes(proxy.sessions[0][0])  # all the receiver sent: Hello, Proof, Acquire, Fetch, Release
        sent = [type(m) for m in _frames(recorded)]
        assert sent[:3] == [P.Hello, P.Proof, P.Acquire] and P.Fetch in sent
        pool_before, stats_before = sender.pool.stats(), sender.stats()
        host, port = sender.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10.0) as raw:
            raw.sendall(recorded)
            reply = _frames(_read_until_closed(raw))
        # A fresh challenge, then the refusal: no Welcome, no Located, no byte of the object.
        assert [type(m) for m in reply] == [P.Challenge, P.Failure] and reply[1].kind == "auth"
        assert wait_until(lambda: sender.server.stats()["failed_handshakes"] == 1, 5.0)
        assert sender.pool.stats() == pool_before
        assert sender.stats()["bytes_sent"] == stats_before["bytes_sent"]
        # The ticket's second slot is still there for a real receiver.
        with Receiver("tcp", token=TOKEN, timeout=20.0) as r:
            assert_same(r.get(ticket), obj)
        sender.wait_released(ticket, timeout=10.0)


def test_an_acquire_replayed_on_a_live_connection_or_copied_to_another_takes_no_slot():
    obj = state_dict(3)
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN) as sender:
        ticket = sender.put(obj, readers=2)
        a, _, session_a = open_control(sender.address, token=TOKEN)
        b, _, _ = open_control(sender.address, token=TOKEN)
        with a, b:
            acquire = _frame(session_a.sign(P.Acquire(ticket_id=ticket.id, digest=ticket.digest)))
            a.sendall(acquire)
            assert isinstance(P.recv_msg(a), P.Located)  # slot 1, for A
            b.sendall(acquire)  # A's signed Acquire on B: not B's key
            refused = _frames(_read_until_closed(b))
            assert [type(m) for m in refused] == [P.Failure] and refused[0].kind == "auth"
            a.sendall(acquire)  # the same bytes again on A: not the next count
            refused = _frames(_read_until_closed(a))
            assert [type(m) for m in refused] == [P.Failure] and refused[0].kind == "auth"
        # A's slot went with its connection; neither copy took slot 2.
        with Receiver("tcp", token=TOKEN, timeout=20.0) as r:
            assert_same(r.get(ticket), obj)
        sender.wait_released(ticket, timeout=10.0)


# -- both sides prove the token ------------------------------------------------------------------------


def _impostor(proofs: list) -> tuple[str, threading.Thread]:
    """A server that answers the handshake as a sender would, without the
    token: it accepts any proof and sends a proof it cannot have made."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            P.recv_msg(conn, expect=(P.Hello,))
            P.send_msg(conn, P.Challenge(nonce=os.urandom(32), token=True))
            proofs.append(P.recv_msg(conn, expect=(P.Proof,)))
            P.send_msg(conn, P.Welcome(pool_nbytes=MiB, pool_generation=0, proof=os.urandom(32)))
            _read_until_closed(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread


def test_the_receiver_refuses_a_sender_that_cannot_prove_it_holds_the_token():
    proofs: list = []
    address, thread = _impostor(proofs)
    with pytest.raises(AuthenticationError, match="did not prove it holds the token"):
        open_control(address, token=TOKEN)
    thread.join(10.0)
    assert len(proofs[0].mac) == 32 and TOKEN not in proofs[0].mac


def test_both_sides_must_hold_the_same_token(caplog):
    obj = state_dict(4)
    other = b"another-token-of-thirty-two-byte"
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN) as sender:
        ticket = sender.put(obj)
        with caplog.at_level(logging.DEBUG, logger="tensorferry"):
            for token, match in ((other, "refused us"), (None, "requires a token")):
                with Receiver("tcp", token=token, timeout=10.0) as r, pytest.raises(AuthenticationError, match=match) as err:
                    r.get(ticket)
                assert TOKEN.decode() not in str(err.value) and other.decode() not in str(err.value)
        assert TOKEN.decode() not in caplog.text and other.decode() not in caplog.text
        with Receiver("tcp", token=TOKEN, timeout=10.0) as r:
            assert_same(r.get(ticket), obj)
    with Sender("tcp", capacity_nbytes=MiB) as open_sender:  # holds no token: cannot prove ours
        with Receiver("tcp", token=TOKEN, timeout=10.0) as r, pytest.raises(AuthenticationError, match="holds no token"):
            r.get(open_sender.put(obj))


def test_a_receiver_of_another_transport_is_told_which_one_the_sender_serves():
    with Sender("tcp", capacity_nbytes=MiB) as sender:
        with pytest.raises(TransferError, match="this sender serves 'tcp'"):
            open_control(sender.address, transport="nixl")
        assert wait_until(lambda: sender.server.stats()["failed_handshakes"] == 1, 5.0)


# -- tokens --------------------------------------------------------------------------------------------


def test_new_token_is_strong_and_fresh():
    tokens = {tf.new_token() for _ in range(100)}
    assert len(tokens) == 100
    for t in tokens:
        assert len(base64.urlsafe_b64decode(t + "=")) == 32  # 256 random bits


def test_a_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("TENSORFERRY_TOKEN", tf.new_token())
    obj = state_dict(5)
    with Sender("tcp", capacity_nbytes=16 * MiB) as sender, Receiver("tcp", timeout=10.0) as r:
        assert sender.server.token == os.environ["TENSORFERRY_TOKEN"].encode()
        ticket = sender.put(obj, readers=2)
        assert_same(r.get(ticket), obj)
        monkeypatch.delenv("TENSORFERRY_TOKEN")
        with Receiver("tcp", timeout=10.0) as stranger, pytest.raises(AuthenticationError, match="TENSORFERRY_TOKEN"):
            stranger.get(ticket)
        sender.discard(ticket)


def test_short_tokens_are_refused_with_the_reason_and_without_the_token(monkeypatch):
    short = "abc123xyz"
    for make in (lambda: Sender("tcp", capacity_nbytes=MiB, token=short), lambda: Receiver("tcp", token=short.encode())):
        with pytest.raises(ConfigurationError, match=f"9 bytes, fewer than {MIN_TOKEN_NBYTES}") as err:
            make()
        assert short not in str(err.value) and "new_token" in str(err.value)
    monkeypatch.setenv("TENSORFERRY_TOKEN", short)
    with pytest.raises(ConfigurationError, match="TENSORFERRY_TOKEN") as err:
        Receiver("tcp")
    assert short not in str(err.value)
    with pytest.raises(ConfigurationError, match="text or bytes"):
        Sender("tcp", capacity_nbytes=MiB, token=12345678901234567890)


# -- TLS -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return certs_or_skip(tmp_path_factory.mktemp("certs"))


def _patterned(nbytes: int) -> dict[str, torch.Tensor]:
    # Recognisable bytes: 0x5A repeated, found at once in a plaintext capture.
    return {"w": torch.full((nbytes // 4,), 0x5A5A5A5A, dtype=torch.int32), **state_dict(6)}


def test_a_get_over_tls_is_private_and_correct(certs):
    obj = _patterned(4 * MiB)
    many = {f"t{i}": torch.randn(64) for i in range(2000)}  # into= many targets: the one-buffer-at-a-time receive
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN, tls=server_context(certs)) as sender, RecordingProxy(sender.address) as proxy:
        with Receiver("tcp", token=TOKEN, tls=client_context(certs), timeout=30.0) as r:
            assert_same(r.get(via(sender.put(obj), proxy)), obj)
            into = {k: torch.empty_like(v) for k, v in many.items()}
            r.get(via(sender.put(many), proxy), into=into)
            assert_same(into, many)
            few = {f"t{i}": torch.randn(4096) for i in range(100)}  # into= up to 256 runs: received into the buffers
            into = {k: torch.empty_like(v) for k, v in few.items()}
            r.get(via(sender.put(few), proxy), into=into)
            assert_same(into, few)
            big = [torch.randn(3 * MiB // 4) for _ in range(4)]  # 12 MiB through a 16 MiB pool: pieces
            assert_same(r.get(via(sender.put(big), proxy)), big)
            plan = sender.plan(few)  # snapshot=False: sent from the tensors themselves, a buffer each
            ticket = sender.put(plan, snapshot=False)
            assert_same(r.get(via(ticket, proxy)), few)
            sender.wait_released(ticket, timeout=10.0)
        captured = proxy.captured()
    assert len(captured) > 16 * MiB
    assert b"\x5a" * 64 not in captured  # no tensor byte in clear
    assert struct.pack("<4sH", P.MAGIC, P.VERSION) not in captured  # no control frame in clear
    assert TOKEN not in captured


def test_sharded_reads_over_tls_arrive_exact(certs):
    """A sharded get's range reads over TLS (no sendmsg/recvmsg on an
    SSLSocket: a run at a time): a column slice of row-sharded sources (a
    run per row at each sender, the rows adjacent here) and a row slice of
    column-sharded ones (a run per row here: many small, through the
    scratch buffer)."""
    from tensorferry import Box

    w = torch.randn(2048, 64, generator=torch.Generator().manual_seed(8))
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN, tls=server_context(certs)) as s0, \
            Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN, tls=server_context(certs)) as s1, \
            Receiver("tcp", token=TOKEN, tls=client_context(certs), timeout=30.0) as r:
        for shard, target in [
            (lambda k: (slice(1024 * k, 1024 * (k + 1)), slice(0, 64)), Box(torch.zeros(2048, 24), (0, 20), (2048, 64))),
            (lambda k: (slice(0, 2048), slice(32 * k, 32 * (k + 1))), Box(torch.zeros(1000, 64), (700, 0), (2048, 64))),
        ]:
            tickets = []
            for k, s in enumerate((s0, s1)):
                rows, cols = shard(k)
                tickets.append(s.put({"w": Box(w[rows, cols].clone(), (rows.start, cols.start), (2048, 64))}))
            r.get(tickets, into={"w": target})
            (o0, o1), (n0, n1) = target.offsets, target.tensor.shape
            assert torch.equal(target.tensor, w[o0 : o0 + n0, o1 : o1 + n1])


def test_mutual_tls(certs):
    obj = state_dict(7)
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN, tls=server_context(certs, require_client=True)) as sender:
        ticket = sender.put(obj, readers=2)
        with Receiver("tcp", token=TOKEN, tls=client_context(certs), timeout=10.0) as r:  # no client certificate
            with pytest.raises(AuthenticationError, match="client certificate"):
                r.get(ticket)
        with Receiver("tcp", token=TOKEN, tls=client_context(certs, with_cert=True), timeout=10.0) as r:
            assert_same(r.get(ticket), obj)
        sender.discard(ticket)
        assert wait_until(lambda: sender.server.stats()["failed_handshakes"] >= 1, 5.0)


def test_tls_on_one_side_only_is_a_clear_error(certs):
    obj = state_dict(8)
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        with Receiver("tcp", token=TOKEN, timeout=10.0) as r, pytest.raises(ProtocolError, match="requires TLS"):
            r.get(sender.put(obj))
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN) as sender:
        with Receiver("tcp", token=TOKEN, tls=client_context(certs), timeout=10.0) as r:
            with pytest.raises(TensorferryError, match="TLS handshake"):
                r.get(sender.put(obj))


def test_tls_arguments_are_checked(certs):
    with pytest.raises(ConfigurationError, match="PROTOCOL_TLS_SERVER"):
        Sender("tcp", capacity_nbytes=MiB, tls=client_context(certs))
    with pytest.raises(ConfigurationError, match="ssl.SSLContext"):
        Receiver("tcp", tls="yes")


def test_nixl_control_over_tls(certs):
    require("nixl")
    obj = state_dict(9)
    with Sender("nixl", capacity_nbytes=16 * MiB, token=TOKEN, tls=server_context(certs)) as sender:
        with Receiver("nixl", token=TOKEN, tls=client_context(certs), timeout=30.0) as r:
            assert_same(r.get(sender.put(obj)), obj)


# -- bounded before authentication -----------------------------------------------------------------------


def test_hundreds_of_garbage_and_half_open_connections_do_not_keep_a_receiver_out(caplog):
    obj = state_dict(10)
    with Sender("tcp", capacity_nbytes=16 * MiB, token=TOKEN) as sender:
        host, port = sender.address.rsplit(":", 1)
        held = []
        with caplog.at_level(logging.WARNING, logger="tensorferry.transports"):
            try:
                for i in range(300):
                    c = socket.create_connection((host, int(port)), timeout=10.0)
                    held.append(c)
                    if i % 3 == 1:  # half a Hello, then nothing
                        c.sendall(_frame(P.Hello(transport="tcp", nonce=os.urandom(32)))[:9])
                    elif i % 3 == 2:  # garbage, kept open
                        c.sendall(os.urandom(200))
                # All 300 still open on our side: a receiver gets its tensor.
                with Receiver("tcp", token=TOKEN, timeout=30.0) as r:
                    assert_same(r.get(sender.put(obj)), obj)
                stats = sender.server.stats()
                assert stats["handshaking"] <= 128
                assert wait_until(lambda: sender.server.stats()["failed_handshakes"] >= 100, 10.0), sender.server.stats()
            finally:
                for c in held:
                    c.close()
            assert wait_until(lambda: sender.server.stats()["handshaking"] == 0, 15.0), sender.server.stats()
        stats = sender.server.stats()
        assert stats["failed_handshakes"] >= 172  # 100 garbage + 172 evicted or closed, at least
        warnings = [rec for rec in caplog.records if "failed before authenticating" in rec.getMessage()]
        assert 1 <= len(warnings) <= 2, [w.getMessage() for w in warnings]
        assert "connection(s)" in warnings[0].getMessage()


# -- protocol versions -----------------------------------------------------------------------------------


def test_a_version_1_peer_is_told_both_versions():
    """A receiver of protocol version 1 sends its Hello in v1 framing; the
    sender answers in its own framing (the old decoder reports 'peer speaks
    protocol version 2, we speak 1'), saying both."""
    old_hello = msgspec.msgpack.encode({"token": b"", "transport": "tcp", "nixl_metadata": b""})
    with Sender("tcp", capacity_nbytes=MiB) as sender:
        host, port = sender.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10.0) as s:
            s.sendall(struct.pack("<4sHHI", P.MAGIC, 1, P.MsgType.HELLO, len(old_hello)) + old_hello)
            reply = _read_until_closed(s)
    magic, version, kind, _ = struct.unpack("<4sHHI", reply[:12])
    assert (magic, version, kind) == (P.MAGIC, 2, P.MsgType.FAILURE)
    (failure,) = _frames(reply)
    assert failure.kind == "version" and "version 2" in failure.message and "you speak 1" in failure.message


def test_a_sender_of_version_1_is_reported_with_both_versions():
    """What a version 1 sender does with our Hello: reads its header, sees
    version 2, closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def old_sender() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(12)

    t = threading.Thread(target=old_sender, daemon=True)
    t.start()
    with listener, pytest.raises(ProtocolError, match=r"version 2; .* speak 1"):
        open_control(f"127.0.0.1:{listener.getsockname()[1]}", timeout=10.0)
    t.join(5.0)


@pytest.fixture(scope="module")
def version_1_tree(tmp_path_factory) -> Path:
    """The package as it was just before protocol version 2: from this
    checkout's own git history (the parent of the commit that bumped the
    version), or ``TENSORFERRY_OLD_TREE`` where a tree is given."""
    import io
    import tarfile

    given = os.environ.get("TENSORFERRY_OLD_TREE")
    if given:
        return Path(given)
    here = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, timeout=60)

    bumps = git("log", "--format=%H", "-S", "VERSION = 2", "--", ":/src/tensorferry/wire/protocol.py")
    if bumps.returncode != 0 or not bumps.stdout.split():
        pytest.skip(f"no git history of the version bump here ({bumps.stderr.decode().strip() or 'not found'}): "
                    "a shallow clone, or not a checkout; set TENSORFERRY_OLD_TREE to a version 1 tree")
    top = git("rev-parse", "--show-toplevel").stdout.decode().strip()
    archive = subprocess.run(["git", "archive", bumps.stdout.split()[-1].decode() + "^", "src"], cwd=top, capture_output=True, timeout=60)
    if archive.returncode != 0:
        pytest.skip(f"git archive of the version 1 tree failed: {archive.stderr.decode().strip()}")
    out = tmp_path_factory.mktemp("protocol-v1")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(out, filter="data")
    return out


def test_a_real_version_1_tree_both_ways(version_1_tree):
    env = {**os.environ, "PYTHONPATH": str(version_1_tree / "src")}
    old_sender = subprocess.Popen(
        [sys.executable, "-c", "import sys, tensorferry as tf; s = tf.Sender('tcp', capacity_nbytes=1 << 20); print(s.address, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=version_1_tree,
    )
    try:
        address = old_sender.stdout.readline().strip()
        with pytest.raises(ProtocolError, match=r"version 2; .* speak 1"):
            open_control(address, timeout=10.0)
    finally:
        old_sender.stdin.close()
        old_sender.wait(30)
    with Sender("tcp", capacity_nbytes=MiB) as sender:
        code = ("import socket\ntry:\n    from tensorferry.wire import protocol as P\nexcept ImportError:\n    from tensorferry import _protocol as P\n"
                "host, port = %r.rsplit(':', 1); "
                "s = socket.create_connection((host, int(port))); P.send_msg(s, P.Hello(transport='tcp')); P.recv_msg(s)") % sender.address
        old_receiver = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=version_1_tree, timeout=60)
    assert old_receiver.returncode != 0
    assert "peer speaks protocol version 2, we speak 1" in old_receiver.stderr
