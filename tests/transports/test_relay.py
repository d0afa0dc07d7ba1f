"""Broadcast tickets and relaying receivers on loopback (tcp).

Real senders, receivers and sockets in one process: the placement (chain,
tree, leaves), what each side sent, and faults made deterministic (a relay
that closed before its child pulled, a relay that accepts and never sends).
Links with real rates and killed relay processes are in tests/hosts/.

Children on the relay's host copy out of its memory (process_vm_readv):
here every receiver is on one host, so that path is the default one; the
tests at the end run relays and children as separate processes, also one
the kernel refuses to let its children read (they fall back to the stream).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import tensorferry
from _transfer_helpers import assert_same, broadcast_object as obj, get_all, pool_empty, wait_until
from tensorferry import (
    ConfigurationError,
    PoolExhaustedError,
    Receiver,
    Sender,
    TransferError,
    TransferTimeoutError,
)
from tensorferry.wire import protocol as P
from tensorferry.transports import open_control

MiB = 1 << 20


@pytest.fixture
def receivers(request):
    made: list[Receiver] = []

    def make(n, **kw):
        kw.setdefault("timeout", 30.0)
        new = [Receiver("tcp", **kw) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("fanout,count", [(1, 4), (2, 6), (3, 3)])
def test_the_sender_sends_fanout_copies_and_relays_the_rest(receivers, fanout, count):
    want = obj(1)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        ticket = sender.put(want, readers=count, fanout=fanout)
        rs = receivers(count, relay=True)
        for got in get_all(rs, ticket):
            assert_same(got, want)
        sender.wait_released(ticket, timeout=10.0)
        copies = min(fanout, count)
        assert sender.stats()["bytes_sent"] == copies * ticket.total_nbytes
        relayed = sum(r._relay_server.bytes_sent for r in rs)
        assert relayed == (count - copies) * ticket.total_nbytes  # every other copy came from a relay
        if fanout == 1:
            # A chain: each relay passes the object on once, but the last.
            assert sorted(r._relay_server.bytes_sent for r in rs) == [0] + [ticket.total_nbytes] * (count - 1)
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)


def test_leaves_only_pull_and_into_and_plans_work_through_relays(receivers):
    want = obj(2)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        relays = receivers(2, relay=True)
        leaves = receivers(2)
        plan = sender.plan(want)
        ticket = sender.put(plan, readers=4, fanout=1)
        targets = [obj(9) for _ in range(2)]
        # The relays first (they join the tree), then the leaves below them.
        for got in get_all(relays, ticket):
            assert_same(got, want)
        leaves[0].get(ticket, into=targets[0])
        rplan = leaves[1].plan(ticket, into=targets[1])
        leaves[1].get(ticket, into=rplan)
        for t in targets:
            assert_same(t, want)
        # sender -> relay 0 -> relay 1 -> leaf 0; leaf 1 finds every relay
        # full (fanout 1) and is served by the sender, which never refuses.
        assert sender.stats()["bytes_sent"] == 2 * ticket.total_nbytes
        assert [r._relay_server.bytes_sent for r in relays] == [ticket.total_nbytes] * 2
        sender.wait_released(ticket, timeout=10.0)


def test_a_child_whose_relay_is_gone_resumes_from_the_sender(receivers):
    want = obj(3)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        first, second = receivers(2, relay=True, stall_seconds=1.0)
        ticket = sender.put(want, readers=2, fanout=1)
        assert_same(first.get(ticket), want)
        first.close()  # its relay is gone before its child pulls
        assert_same(second.get(ticket), want)
        # The sender served both: the second after the first failed it.
        assert sender.stats()["bytes_sent"] == 2 * ticket.total_nbytes
        sender.wait_released(ticket, timeout=10.0)


def test_a_relay_that_never_sends_is_given_up_after_stall_seconds(receivers):
    want = obj(4)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    fake = f"127.0.0.1:{silent.getsockname()[1]}"
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        ticket = sender.put(want, readers=2, fanout=1)
        # A "receiver" takes the sender's one direct slot and registers a
        # relay that accepts connections and never answers.
        ctl, _, session = open_control(sender.address, timeout=5.0)
        P.send_msg(ctl, session.sign(P.Acquire(ticket_id=ticket.id, digest=ticket.digest, relay=fake)))
        assert P.recv_msg(ctl, expect=(P.Located,)).source == ""
        (child,) = receivers(1, stall_seconds=0.5)
        assert_same(child.get(ticket), want)  # from the sender, after the stall
        silent.settimeout(0)
        silent.accept()[0].close()  # the child did try the silent relay first
        ctl.close()  # the fake's slot is dropped with its connection
        sender.wait_released(ticket, timeout=10.0)
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)
    silent.close()


def test_a_late_receiver_pulls_from_a_relay_that_still_holds_the_object(receivers):
    want = obj(5)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        early = receivers(2, relay=True)
        ticket = sender.put(want, readers=3, fanout=1)
        get_all(early, ticket)
        (late,) = receivers(1)
        assert_same(late.get(ticket), want)
        assert sender.stats()["bytes_sent"] == ticket.total_nbytes  # the late one came from a relay
        sender.wait_released(ticket, timeout=10.0)


def test_relays_check_the_digest_and_children_the_token(receivers):
    want = obj(6)
    with Sender("tcp", capacity_nbytes=64 * MiB, token="s3cret-token-of-24-bytes") as sender:
        (relay,) = receivers(1, relay=True, token="s3cret-token-of-24-bytes")
        ticket = sender.put(want, readers=2, fanout=1)
        relay.get(ticket)
        from tensorferry.transports._relay import pull

        buf = memoryview(bytearray(ticket.total_nbytes))
        with pytest.raises(TransferError, match="holds no ticket"):
            pull(relay.relay_address, token=b"s3cret-token-of-24-bytes", ticket_id=ticket.id, digest=b"x" * 16, buf=buf, start=0,
                 progress=lambda end: None, stall_seconds=5.0, deadline=time.monotonic() + 10)
        with pytest.raises(TransferError, match="token"):
            pull(relay.relay_address, token=b"wrong-token-of-24-bytes!", ticket_id=ticket.id, digest=ticket.digest, buf=buf, start=0,
                 progress=lambda end: None, stall_seconds=5.0, deadline=time.monotonic() + 10)
        pull(relay.relay_address, token=b"s3cret-token-of-24-bytes", ticket_id=ticket.id, digest=ticket.digest, buf=buf, start=1000,
             progress=lambda end: None, stall_seconds=5.0, deadline=time.monotonic() + 10)
        stream = torch.frombuffer(buf, dtype=torch.uint8)
        sender_bytes = sender.pool.view(tuple(ticket.blocks[0]))  # the packed block
        assert torch.equal(stream[1000:], sender_bytes[1000:])
        sender.discard(ticket)


def test_broadcast_settings_are_checked():
    with Sender("shm") as shm:
        with pytest.raises(ConfigurationError, match="over tcp"):
            shm.put(torch.ones(3), fanout=1)
    with Sender("tcp") as tcp:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ConfigurationError, match="fanout"):
                tcp.put(torch.ones(3), fanout=bad)
        with pytest.raises(ConfigurationError, match="over tcp"):
            tcp.put(tcp.plan([torch.ones(3)]), snapshot=False, fanout=1)
        assert tcp.stats()["live_tickets"] == 0
    with pytest.raises(ConfigurationError, match="relays over tcp"):
        Receiver("shm", relay=True)
    with pytest.raises(ConfigurationError, match="token"):
        Receiver("tcp", relay=True, host="0.0.0.0")


def test_shm_readers_of_a_broadcast_map_the_pool_and_stay_out_of_the_tree(receivers):
    want = obj(7)
    with Sender("tcp", capacity_nbytes=64 * MiB, extra_transports=("shm",)) as sender:
        ticket = sender.put(want, readers=3, fanout=1)
        (relay,) = receivers(1, relay=True)
        assert_same(relay.get(ticket), want)
        with Receiver("shm") as local:
            assert_same(local.get(sender.ticket_for(ticket, "shm")), want)
        (child,) = receivers(1)
        assert_same(child.get(ticket), want)  # below the relay: the shm reader took no place in the tree
        assert sender.stats()["bytes_sent"] == ticket.total_nbytes
        # The relay counts a chunk once it is sent: the child can have it first.
        assert wait_until(lambda: relay._relay_server.bytes_sent == ticket.total_nbytes, 5.0)


def test_a_relay_lets_go_of_a_ticket_after_lingering_or_at_the_next_one(receivers):
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        (relay,) = receivers(1, relay=True, relay_linger_seconds=0.3)
        first = sender.put(obj(8), readers=1, fanout=1)
        relay.get(first)
        assert relay._book.held_nbytes() == first.total_nbytes
        second = sender.put(obj(9), readers=1, fanout=1)
        relay.get(second)
        assert relay._book.held_nbytes() == second.total_nbytes  # the first was let go
        assert wait_until(lambda: relay._book.held_nbytes() == 0, 5.0)  # and the second after lingering


@pytest.mark.parametrize("reads", ["memory", "tcp"])
def test_children_on_the_relays_host_copy_out_of_its_memory_or_take_the_stream(receivers, reads):
    want = obj(10)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        rs = receivers(3, relay=True, relay_reads=reads)
        ticket = sender.put(want, readers=3, fanout=1)
        for got in get_all(rs, ticket):
            assert_same(got, want)
        t = ticket.total_nbytes
        stats = [r.stats() for r in rs]
        assert sender.stats()["bytes_sent"] == t
        assert sorted(s["relay_bytes_sent"] for s in stats) == [0, t, t]
        lent = sum(s["relay_bytes_lent"] for s in stats)
        read = sum(s["relay_memory_read_nbytes"] for s in stats)
        streamed = sum(s["relay_stream_nbytes"] for s in stats)
        # Two children of relays, every byte either copied out of the relay
        # (this host: the same boot, pid and network namespace) or streamed.
        assert (lent, read, streamed) == ((2 * t, 2 * t, 0) if reads == "memory" else (0, 0, 2 * t))
        sender.wait_released(ticket, timeout=10.0)


def test_relay_reads_is_checked():
    with pytest.raises(ConfigurationError, match="relay_reads"):
        Receiver("tcp", relay_reads="shm")


# -- relays and children as processes (tests/hosts/_workers.py bc_receiver) ---------

_WORKERS_PATH = Path(__file__).parents[1] / "hosts" / "_workers.py"
_spec = importlib.util.spec_from_file_location("_relay_test_workers", _WORKERS_PATH)
workers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workers)

NBYTES = 32 * MiB


class Files(NamedTuple):
    """What a worker process runs: the interpreter, the worker file, the
    folder tensorferry is imported from, and its working folder (None: ours)."""

    python: str
    workers: Path
    src: Path
    cwd: Path | None


class Proc:
    """A bc_receiver process on loopback, spoken to in JSON lines."""

    def __init__(self, token: str, *, relay: bool, guarded: bool = False, prefix: tuple[str, ...] = (), files: "Files | None" = None) -> None:
        files = files or Files(sys.executable, _WORKERS_PATH, Path(tensorferry.__file__).parents[1], None)
        env = {**os.environ, "PYTHONPATH": str(files.src)}
        argv = [*prefix, files.python, str(files.workers), "bc_receiver", "127.0.0.1", token, str(int(relay)), "5", "60", "memory", str(int(guarded))]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=files.cwd)
        self.ready = self.fact()

    def fact(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"worker exited {self.proc.wait()}: {self.proc.stderr.read()}"
        got = json.loads(line)
        assert "error" not in got, got["error"]
        return got

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.fact()

    def stop(self) -> str:
        """Stop it; its stderr."""
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stderr.read()


@pytest.fixture
def procs():
    made: list[Proc] = []

    def start(*args, **kw) -> Proc:
        made.append(Proc(*args, **kw))
        return made[-1]

    yield start
    for p in made:
        p.stop()


def test_child_processes_copy_out_of_their_relay_processes_memory(procs):
    token = secrets.token_hex(8)
    want = workers.make_object(1717, NBYTES)
    with Sender("tcp", capacity_nbytes=2 * NBYTES, token=token) as sender:
        chain = [procs(token, relay=True) for _ in range(3)]
        for round_ in range(2):  # the second round reuses the memory the first let go
            ticket = sender.put(want, readers=3, fanout=1)
            hexed = ticket.to_bytes().hex()
            # One after the other: a chain in this order, each child reads a
            # relay that already holds everything (the pipelined case, over
            # links, is in tests/hosts/test_broadcast.py).
            for p in chain:
                assert p.call(cmd="get", ticket=hexed)["checksum"] == workers.checksum(want)
            sender.wait_released(ticket, timeout=10.0)
            t = ticket.total_nbytes
            stats = [p.call(cmd="stats") for p in chain]
            assert sender.stats()["bytes_sent"] == (round_ + 1) * t
            assert [s["memory_read_nbytes"] for s in stats] == [0, (round_ + 1) * t, (round_ + 1) * t]
            assert [s["relay_bytes_lent"] for s in stats] == [(round_ + 1) * t, (round_ + 1) * t, 0]
            assert all(s["stream_nbytes"] == 0 and s["refused"] == "" for s in stats)
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)


def _no_ptrace_prefix() -> tuple[str, ...]:
    """setpriv without CAP_SYS_PTRACE (root reads any process's memory with it)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to start a process without CAP_SYS_PTRACE")
    return ("setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", "--")


def _relay_then_child_twice(sender, relay, child, want) -> int:
    """Two broadcasts of ``want`` (fanout 1): the relay process gets each,
    then the child below it; both hold the sender's bytes and every reader
    released. The ticket's size."""
    for _ in range(2):
        ticket = sender.put(want, readers=2, fanout=1)
        for p in (relay, child):
            assert p.call(cmd="get", ticket=ticket.to_bytes().hex())["checksum"] == workers.checksum(want)
        sender.wait_released(ticket, timeout=10.0)
    return ticket.total_nbytes


def test_a_child_the_kernel_refuses_maps_the_relays_memory_file(procs):
    """The relay is non-dumpable and the child lacks CAP_SYS_PTRACE: its
    process_vm_readv gets EPERM (as under Yama's ptrace_scope 1 between
    siblings); it fetches the relay's memfd over the relay's Unix socket,
    maps it read-only and copies out of it, needing no ptrace permission,
    and does not try process_vm_readv again (logged at INFO: nothing is
    lost, no warning)."""
    token = secrets.token_hex(8)
    want = workers.make_object(1818, NBYTES)
    with Sender("tcp", capacity_nbytes=2 * NBYTES, token=token) as sender:
        relay = procs(token, relay=True, guarded=True)
        child = procs(token, relay=False, prefix=_no_ptrace_prefix())
        t = _relay_then_child_twice(sender, relay, child, want)  # the second round: the relay's memory of the first again
        got, lent = child.call(cmd="stats"), relay.call(cmd="stats")
        assert got["memory_read_nbytes"] == got["file_read_nbytes"] == 2 * t and got["stream_nbytes"] == 0
        assert "not permitted" in got["refused"] and str(relay.ready["pid"]) in got["refused"]
        assert lent["relay_bytes_sent"] == lent["relay_bytes_lent"] == 2 * t
        assert sender.stats()["bytes_sent"] == 2 * t
        log = child.stop()
        assert "over tcp" not in log, log


@pytest.fixture
def other_user():
    """How to start a worker as user and group nobody (65534), with no
    capabilities, reading nothing below the checkout or the interpreter's
    prefix, either of which may be under a folder only we can enter (a
    clone in ``mktemp -d``, its venv inside it): the worker file and the
    tensorferry package this test imports are copied into a fresh folder
    (folders 755, files 644), and the prefix (its site-packages: torch) is
    bind-mounted into that folder in a mount namespace of the child's own.
    The prefix and the Files to pass to Proc."""
    if os.geteuid() != 0 or not (shutil.which("setpriv") and shutil.which("unshare")):
        pytest.skip("needs root, setpriv and unshare to start a process as another user")
    if not Path(sys.executable).is_relative_to(sys.prefix):
        pytest.skip(f"the interpreter {sys.executable} is not below its prefix {sys.prefix}: nothing to bind-mount")
    root = Path(tempfile.mkdtemp(prefix="tensorferry-other-user-"))
    try:
        shutil.copy(_WORKERS_PATH, root / "_workers.py")
        shutil.copytree(Path(tensorferry.__file__).parent, root / "src" / "tensorferry", ignore=shutil.ignore_patterns("__pycache__"))
        (root / "prefix").mkdir()
        for folder, _, names in os.walk(root):
            os.chmod(folder, 0o755)
            for name in names:
                os.chmod(os.path.join(folder, name), 0o644)
        prefix = (
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", sys.prefix, str(root / "prefix"),
            "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--",
        )
        python = root / "prefix" / Path(sys.executable).relative_to(sys.prefix)
        yield prefix, Files(str(python), root / "_workers.py", root / "src", root)
    finally:
        shutil.rmtree(root)


def test_a_child_of_another_user_takes_the_stream_and_says_why(procs, other_user):
    """A child of another user may neither read the relay's memory
    (process_vm_readv: EPERM) nor have its file (the relay checks the
    peer's uid on its Unix socket): it takes the tcp stream from the byte
    it had, logs both reasons once, and does not try again."""
    token = secrets.token_hex(8)
    want = workers.make_object(1919, NBYTES)
    with Sender("tcp", capacity_nbytes=2 * NBYTES, token=token) as sender:
        relay = procs(token, relay=True)
        prefix, files = other_user
        child = procs(token, relay=False, prefix=prefix, files=files)
        t = _relay_then_child_twice(sender, relay, child, want)
        got, lent = child.call(cmd="stats"), relay.call(cmd="stats")
        assert got["memory_read_nbytes"] == 0 and got["stream_nbytes"] == 2 * t
        assert "not permitted" in got["refused"] and "user 65534 may not map" in got["refused"]
        assert lent["relay_bytes_sent"] == 2 * t and lent["relay_bytes_lent"] == 0  # announced, never read: not lent
        assert sender.stats()["bytes_sent"] == 2 * t
        log = child.stop()
        assert log.count("over tcp: process_vm_readv of relay process") == 1, log


@pytest.fixture
def lending():
    """A relay's book and server with one ticket part-way in: a real
    server on loopback, its stream moved on by hand (``held.progress``);
    closed after the test."""
    from tensorferry.transports._relay import RelayBook, RelayServer

    book = RelayBook(linger_seconds=60.0)
    server = RelayServer(book, token=b"", host="127.0.0.1", port=0, advertise_host=None)
    stream = torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(11))
    held = book.add(7, b"d" * 16, memoryview(stream.numpy()))
    yield server, stream, held
    server.close()
    book.close()


def _pull_lent(server, stream, reached, stall_seconds):
    from tensorferry.transports._relay import SameHostReads, pull

    buf = memoryview(bytearray(stream.numel()))
    reads = SameHostReads(enabled=True)
    pull(server.address, token=b"", ticket_id=7, digest=b"d" * 16, buf=buf, start=0, progress=reached.append,
         stall_seconds=stall_seconds, deadline=time.monotonic() + 30, reads=reads)
    return buf, reads


def test_a_lent_stream_that_stops_growing_is_given_up_after_stall_seconds(lending):
    server, stream, held = lending
    held.progress(3 * MiB)
    reached: list[int] = []
    with pytest.raises(TransferError, match="stalled"):
        _pull_lent(server, stream, reached, stall_seconds=0.5)
    assert reached[-1] == 3 * MiB  # what had arrived, read out of the relay's memory
    assert wait_until(lambda: server.bytes_lent == 3 * MiB, 5.0)  # the child said how far it read


def test_a_closing_relay_ends_its_lent_streams_and_keeps_the_memory_until_the_child_closes(lending):
    server, stream, held = lending
    held.progress(2 * MiB)
    reached: list[int] = []
    failed: list[BaseException] = []
    buf_box: list = []

    def child():
        try:
            buf_box.append(_pull_lent(server, stream, reached, stall_seconds=20.0))
        except BaseException as exc:  # noqa: BLE001 - checked below
            failed.append(exc)

    t = threading.Thread(target=child)
    t.start()
    assert wait_until(lambda: reached and reached[-1] == 2 * MiB, 10.0)
    assert server._lending  # the child's connection is open: the memory stays
    server.close()
    t.join(timeout=60)
    assert not t.is_alive()
    # Told by the relay (its stream ended), not given up after stall_seconds.
    assert len(failed) == 1 and isinstance(failed[0], TransferError) and not isinstance(failed[0], TransferTimeoutError), failed
    assert wait_until(lambda: not server._lending, 5.0)  # let go once the child closed
    assert reached[-1] == 2 * MiB


def test_a_relay_that_closes_mid_stream_is_named_in_its_childs_error(lending):
    from tensorferry import PeerGoneError
    from tensorferry.transports._relay import SameHostReads, pull

    server, stream, held = lending
    held.progress(5 * MiB // 2)
    buf = memoryview(bytearray(stream.numel()))
    reached: list[int] = []
    failed: list[BaseException] = []

    def child():
        try:
            pull(server.address, token=b"", ticket_id=7, digest=b"d" * 16, buf=buf, start=0, progress=reached.append,
                 stall_seconds=20.0, deadline=time.monotonic() + 30, reads=SameHostReads(enabled=False))
        except BaseException as exc:  # noqa: BLE001 - checked below
            failed.append(exc)

    t = threading.Thread(target=child)
    t.start()
    # Every byte that arrived is in the child's socket before the relay closes.
    assert wait_until(lambda: server.bytes_sent == 5 * MiB // 2, 10.0)
    server.close()
    t.join(timeout=60)
    assert not t.is_alive()
    assert len(failed) == 1 and isinstance(failed[0], PeerGoneError), failed
    message = str(failed[0])
    # The stream's bytes, not the chunk's; the relay, not the sender.
    assert message.startswith(f"the relay at {server.address} closed the connection after 2,621,440 of 8,388,608 bytes"), message
    assert "sender" not in message.lower(), message
    # At least two whole chunks reached, more where a chunk's receive took
    # what more had arrived in the same call; never past the bytes sent.
    assert 2 * MiB <= reached[-1] <= 5 * MiB // 2, reached


def test_what_a_child_copies_out_of_a_relay_is_the_relays_bytes(lending):
    server, stream, held = lending
    held.progress(5 * MiB)
    reached: list[int] = []
    out: list = []
    t = threading.Thread(target=lambda: out.append(_pull_lent(server, stream, reached, stall_seconds=10.0)))
    t.start()
    assert wait_until(lambda: reached and reached[-1] == 5 * MiB, 10.0)
    held.progress(stream.numel())  # the rest arrives: the child reads it too
    held.finish(True)
    t.join(timeout=10)
    buf, reads = out[0]
    assert torch.equal(torch.frombuffer(buf, dtype=torch.uint8), stream)
    assert reads.memory_nbytes == stream.numel() and reads.stream_nbytes == 0
    assert server.bytes_lent == server.bytes_sent == stream.numel()


def _relay_with_file(nbytes: int, file_nbytes: int, *, sealed: bool):
    """A relay's book and server holding one whole ticket whose memory is
    lent with a memfd of ``file_nbytes`` (sealed or not): a real server and
    a real file; what the file holds is the stream's bytes."""
    import mmap

    from tensorferry.memory._system import shared_host_mapping
    from tensorferry.transports._relay import RelayBook, RelayServer

    if sealed:
        mapping, fd = shared_host_mapping(file_nbytes, "test-relay")
    else:
        fd = os.memfd_create("test-relay", os.MFD_CLOEXEC)
        os.ftruncate(fd, file_nbytes)
        mapping = mmap.mmap(fd, file_nbytes, flags=mmap.MAP_SHARED)
    stream = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
    stream.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(12)))
    book = RelayBook(linger_seconds=60.0)
    server = RelayServer(book, token=b"", host="127.0.0.1", port=0, advertise_host=None)
    held = book.add(7, b"d" * 16, memoryview(stream.numpy()), fd)
    held.progress(nbytes)
    held.finish(True)
    return book, server, stream, fd


def _pull_by_file(server, nbytes: int):
    """A child that process_vm_readv was refused at this relay before (the
    record SameHostReads keeps): it goes to the relay's file at once."""
    from tensorferry.transports._relay import SameHostReads, pull

    buf = memoryview(bytearray(nbytes))
    reads = SameHostReads(enabled=True)
    reads.refuse_vm(server.address, "process_vm_readv of relay process 1: not permitted (as the kernel says)")
    pull(server.address, token=b"", ticket_id=7, digest=b"d" * 16, buf=buf, start=0, progress=lambda end: None,
         stall_seconds=5.0, deadline=time.monotonic() + 30, reads=reads)
    return buf, reads


def test_a_child_refused_process_vm_readv_copies_out_of_the_relays_sealed_file():
    book, server, stream, fd = _relay_with_file(6 * MiB + 3, 8 * MiB, sealed=True)
    try:
        buf, reads = _pull_by_file(server, stream.numel())
        assert torch.equal(torch.frombuffer(buf, dtype=torch.uint8), stream)
        assert reads.memory_nbytes == reads.file_nbytes == stream.numel() and reads.stream_nbytes == 0
        assert server.bytes_lent == stream.numel()
    finally:
        server.close()
        book.close()


def test_a_relay_file_that_can_shrink_is_not_mapped_the_child_streams():
    """A file the relay could shrink under the child's mapping (no seal)
    could fault the child's reads: the child takes the stream instead."""
    book, server, stream, fd = _relay_with_file(4 * MiB, 4 * MiB, sealed=False)
    try:
        buf, reads = _pull_by_file(server, stream.numel())
        assert torch.equal(torch.frombuffer(buf, dtype=torch.uint8), stream)
        assert reads.file_nbytes == 0 and reads.stream_nbytes == stream.numel()
        assert "can shrink" in reads.refused
    finally:
        server.close()
        book.close()
        os.close(fd)


def test_a_relay_file_smaller_than_its_stream_is_a_protocol_error():
    """Sizes are checked against the file itself: a relay lending a
    4 MiB stream in a 2 MiB file is a bad source (the get asks the sender
    for another), never a read past the file's end."""
    from tensorferry import ProtocolError

    book, server, stream, fd = _relay_with_file(2 * MiB, 2 * MiB, sealed=True)
    try:
        held = book.find(7, b"d" * 16, timeout=1.0)
        held.total = 4 * MiB  # what the relay claims: more than its file has
        with pytest.raises(ProtocolError, match="2,097,152-byte file"):
            _pull_by_file(server, 4 * MiB)
    finally:
        server.close()
        book.close()


def test_a_broadcast_that_does_not_fit_one_block_says_so_and_holds_nothing():
    with Sender("tcp", capacity_nbytes=1 * MiB) as sender:
        with pytest.raises(PoolExhaustedError, match=r"fanout=\.\.\.\) sends the object as one block.*at least 2,097,152"):
            sender.put(torch.ones(MiB // 2), readers=2, fanout=1)
        assert sender.stats()["live_tickets"] == 0 and pool_empty(sender.pool)
        assert sender.put(torch.ones(MiB // 2), readers=1).streamed  # without fanout it streams in pieces


def _pull_stream(server, stream, links):
    """One pull of the whole of ticket 7 from ``server`` as a tcp stream
    (same-host reads off), through ``links``."""
    from tensorferry.transports._relay import SameHostReads, pull

    buf = memoryview(bytearray(stream.numel()))
    reached: list[int] = []
    pull(server.address, token=b"", ticket_id=7, digest=b"d" * 16, buf=buf, start=0, progress=reached.append,
         stall_seconds=5.0, deadline=time.monotonic() + 30, reads=SameHostReads(enabled=False), links=links)
    assert bytes(buf) == stream.numpy().tobytes() and reached[-1] == stream.numel()


def _server_conns(server) -> int:
    with server._lock:
        return len(server._conns)


def test_a_child_keeps_its_connection_to_a_relay_for_the_next_pull(lending):
    from tensorferry.transports._relay import RelayLinks

    server, stream, held = lending
    held.progress(stream.numel())
    links = RelayLinks()
    try:
        for _ in range(3):
            _pull_stream(server, stream, links)
        # Three pulls, one connection (one handshake): the relay's server holds one.
        assert _server_conns(server) == 1
        # Counted once each chunk is sent: the child can have the last one first.
        assert wait_until(lambda: server.bytes_sent == 3 * stream.numel(), 5.0)
        # The relay lets the kept connection go: the next pull sees it closed
        # before it asks, and makes a new one (the relay is not given up).
        with server._lock:
            (conn,) = server._conns
        conn.sock.shutdown(socket.SHUT_RDWR)
        assert wait_until(lambda: _server_conns(server) == 0, 5.0)
        _pull_stream(server, stream, links)
        assert _server_conns(server) == 1
    finally:
        links.close()
    # Closed links close what they kept: the relay's server sees it go.
    assert wait_until(lambda: _server_conns(server) == 0, 5.0)


def test_a_kept_connection_the_relay_closed_while_the_pull_asked_is_replaced(lending, monkeypatch):
    from tensorferry.transports._relay import RelayLinks, _links

    server, stream, held = lending
    held.progress(stream.numel())
    links = RelayLinks()
    try:
        _pull_stream(server, stream, links)
        with server._lock:
            (conn,) = server._conns
        conn.sock.shutdown(socket.SHUT_RDWR)
        assert wait_until(lambda: _server_conns(server) == 0, 5.0)
        # As if the relay closed it just after the child's check: the Pull
        # goes out on a dead connection, and a new one takes its place.
        monkeypatch.setattr(_links, "_still_open", lambda sock: True)
        _pull_stream(server, stream, links)
        assert wait_until(lambda: server.bytes_sent == 2 * stream.numel(), 5.0)
    finally:
        links.close()


def test_a_receiver_pulls_each_round_over_the_connection_it_kept(receivers):
    want = obj(5)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        first, second = receivers(2, relay=True, relay_reads="tcp")
        for _ in range(3):
            ticket = sender.put(want, readers=2, fanout=1)
            assert_same(first.get(ticket), want)
            assert_same(second.get(ticket), want)  # from the first, a relay
            sender.wait_released(ticket, timeout=10.0)
        assert second.stats()["relay_stream_nbytes"] == 3 * ticket.total_nbytes
        assert _server_conns(first._relay_server) == 1  # the second's one connection, kept
        second.close()
        assert wait_until(lambda: _server_conns(first._relay_server) == 0, 5.0)


def test_a_relays_next_stream_takes_the_memory_of_the_one_it_replaces(receivers):
    # A weight sync sends a version of the same size every step: the relay
    # lets the last one go before taking memory for the next, so the next
    # reuses it (faulted in) rather than mapping new memory each step.
    want = obj(6)
    into = torch.utils._pytree.tree_map(torch.empty_like, want)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        (relay,) = receivers(1, relay=True)
        for step in range(3):
            ticket = sender.put(want, readers=1, fanout=1)
            relay.get(ticket, into=into)
            assert_same(into, want)
            cache = relay._cache.stats()
            assert relay._book.held_nbytes() == ticket.total_nbytes  # kept for late children until the next one
            assert (cache.misses, cache.hits) == (1, step), (step, cache)


def test_relays_keep_one_chain_for_every_sender_from_the_second_broadcast_on(receivers):
    # Two senders (a sharded trainer's ranks), three relaying receivers that
    # read each at once, acquiring in whatever order their threads run: from
    # the second round on, both senders chain them in address order, so each
    # relay passes both streams to the same child and the last serves no one.
    want = [obj(10), obj(11)]
    with Sender("tcp", capacity_nbytes=64 * MiB) as s0, Sender("tcp", capacity_nbytes=64 * MiB) as s1:
        # Three loopback addresses: three hosts as relays' addresses go.
        relays = [receivers(1, relay=True, relay_reads="tcp", host=f"127.0.0.{i}")[0] for i in (3, 2, 4)]
        relays.sort(key=lambda r: r.relay_address)
        for rnd in range(4):
            sent = [r._relay_server.bytes_sent for r in relays]
            pulled = [r.stats()["relay_stream_nbytes"] for r in relays]
            tickets = [s.put(w, readers=3, fanout=1) for s, w in zip((s0, s1), want)]
            for s, t, w in zip((s0, s1), tickets, want):
                for got in get_all(relays, t):
                    assert_same(got, w)
                s.wait_released(t, timeout=10.0)
            if rnd:
                total = sum(t.total_nbytes for t in tickets)
                assert [r._relay_server.bytes_sent - b for r, b in zip(relays, sent)] == [total, total, 0], rnd
                assert [r.stats()["relay_stream_nbytes"] - b for r, b in zip(relays, pulled)] == [0, total, total], rnd


def test_a_relay_whose_planned_source_is_gone_pulls_elsewhere_after_a_moment(receivers):
    want = obj(12)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        relays = sorted((receivers(1, relay=True, relay_reads="tcp", host=f"127.0.0.{i}")[0] for i in (2, 3, 4)), key=lambda r: r.relay_address)
        ticket = sender.put(want, readers=3, fanout=1)
        assert all(assert_same(got, want) is None for got in get_all(relays, ticket))
        sender.wait_released(ticket, timeout=10.0)
        # The first of the chain is gone: the second waits for it (it would
        # pull from it) about a second, then takes the sender's place.
        relays[0].close()
        pulled = [r.stats()["relay_stream_nbytes"] for r in relays[1:]]
        ticket = sender.put(want, readers=3, fanout=1)  # as many readers: the group's plan holds
        assert_same(relays[1].get(ticket), want)
        assert_same(relays[2].get(ticket), want)  # from the second: its planned source, there
        sender.discard(ticket)  # the third reader never comes
        assert [r.stats()["relay_stream_nbytes"] - b for r, b in zip(relays[1:], pulled)] == [0, ticket.total_nbytes]
