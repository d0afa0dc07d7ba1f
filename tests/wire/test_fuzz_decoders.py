"""Fuzzing every decoder that reads the network (hypothesis): control
frames, the handshake (both sides), signed Acquires, tickets (delta
sections included), layouts and a Fetch's range list.

Each must end in a typed error (a TensorferryError) or a valid value: no
other exception, no hang (every read has a deadline; pytest-timeout would
catch one that does not), and no allocation proportional to a size the
bytes claim (tracemalloc's peak stays within a bound of the bytes given).
A short run is part of the default test run; the long one is under the
``stress`` marker (``pytest -m stress tests/wire/test_fuzz_decoders.py``).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorferry.errors import TensorferryError
from tensorferry.tensors import flatten, inspect_leaves
from tensorferry.transports._auth import Session, client_handshake, server_handshake
from tensorferry.transports._tcp import _ranges_of
from tensorferry.wire import DeltaOffer, Layout, Ticket
from tensorferry.wire import protocol as P

pytestmark = [pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]

# Examples per decoder: a short run by default, a long one under `stress`.
RUNS = [pytest.param(60, id="short"), pytest.param(3000, id="long", marks=pytest.mark.stress)]
TOKEN = b"a-fuzzing-token-of-32-bytes-long"
# What a decode may take beyond the bytes it was given: a receive chunk
# (1 MiB), the decoders' own tables, and tracemalloc's noise.
_SLACK_NBYTES = 3 << 20


def run(examples: int, strategy, check) -> None:
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def inner(x):
        check(x)

    inner()


def bounded(fn, given_nbytes: int):
    """``fn()``, asserting the peak allocation stays within the bytes given
    plus slack; returns what it returned or the TensorferryError it raised."""
    tracemalloc.start()
    try:
        out = fn()
    except TensorferryError as exc:
        out = exc
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 4 * given_nbytes + _SLACK_NBYTES, f"{peak:,} bytes allocated for {given_nbytes:,} given"
    return out


def header(kind: int, length: int, version: int = P.VERSION, magic: bytes = P.MAGIC) -> bytes:
    return struct.pack("<4sHHI", magic, version, kind, length)


def frame(msg) -> bytes:
    payload = msgspec.msgpack.encode(msg)
    return header(P._TYPE_OF[type(msg)], len(payload)) + payload


SAMPLES = [
    P.Hello(transport="tcp", nonce=b"n" * 32),
    P.Challenge(nonce=b"s" * 32, token=True),
    P.Proof(mac=b"m" * 32),
    P.Claim(key=b"k" * 16),
    P.Welcome(pool_nbytes=1 << 30, pool_generation=7, pool_base_addr=1 << 40, nixl_metadata=b"md", nixl_agent="a", proof=b"p" * 32),
    P.Acquire(ticket_id=5, digest=b"d" * 16, relay="198.18.0.2:4000", seq=3, mac=b"m" * 16),
    P.Located(blocks=[(0, 16), (4096, 1 << 20)], virtual_offset=1 << 21, source="198.18.0.2:4000"),
    P.Fetch(ticket_id=1, piece=2, start=7, ranges=struct.pack("<4q", 0, 16, 32, 16)),
    P.Pull(ticket_id=9, digest=b"d" * 16, start=1 << 20, nbytes=1 << 30, host=b"boot/1/2"),
    P.Lend(pid=42, address=1 << 40, nbytes=1 << 30, file="@x", key=b"k" * 16),
    P.Exposed(metadata=b"m" * 300, address=1 << 40, nbytes=1 << 30),
    P.Arrived(end=1 << 20),
    P.SourceRuns(pid=42, pos=b"\0" * 8, address=b"\1" * 8, nbytes=b"\2" * 8),
    P.Release(ticket_id=1, piece=2),
    P.Released(valid=False),
    P.Failure(kind="timeout", message="é"),
]


@st.composite
def mutated(draw, samples: list[bytes]):
    """A valid encoding with bytes flipped, cut, inserted or repeated."""
    data = bytearray(draw(st.sampled_from(samples)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "repeat"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif data:
            data[at:at] = data[at : at + draw(st.integers(1, 64))] * draw(st.integers(1, 8))
    return bytes(data)


frames_st = st.one_of(
    st.binary(max_size=512),
    st.builds(lambda k, n, body: header(k, n) + body, st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF), st.binary(max_size=256)),
    st.builds(lambda k, body: header(k, len(body)) + body, st.sampled_from(sorted(P._TYPES)), st.binary(max_size=256)),
    mutated([frame(m) for m in SAMPLES]),
    st.builds(lambda v, body: header(P.MsgType.HELLO, len(body), version=v) + body, st.integers(0, 0xFFFF), st.binary(max_size=64)),
)


def _read_frames(data: bytes, *, max_nbytes: int = P.MAX_FRAME_NBYTES) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        for _ in range(64):
            try:
                P.recv_msg(b, deadline=time.monotonic() + 5.0, max_nbytes=max_nbytes)
            except TensorferryError:
                return


@pytest.mark.parametrize("examples", RUNS)
def test_control_frames(examples):
    run(examples, frames_st, lambda data: bounded(lambda: _read_frames(data), len(data)))


def test_a_frame_claiming_16_mib_allocates_what_arrived():
    data = header(P.MsgType.FAILURE, P.MAX_FRAME_NBYTES) + b"\x82" * 100
    assert isinstance(bounded(lambda: _read_frames(data), len(data)), type(None))


# -- the handshake, both sides --------------------------------------------------------------------------


def _serve_bytes(data: bytes, token: bytes):
    """server_handshake over a socket pair whose peer sent ``data``."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        return server_handshake(b, token=token, transport="tcp", peer="fuzz", deadline=time.monotonic() + 5.0)


def _client_bytes(data: bytes, token: bytes):
    """client_handshake against a peer that answers ``data`` whatever we say."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        return client_handshake(b, token=token, transport="tcp", address="fuzz", deadline=time.monotonic() + 5.0)


hello = frame(SAMPLES[0])
handshake_st = st.one_of(
    frames_st,
    st.builds(lambda rest: hello + rest, frames_st),
    st.builds(lambda mac, rest: hello + frame(P.Proof(mac=mac)) + rest, st.binary(max_size=40), st.binary(max_size=64)),
)


@pytest.mark.parametrize("examples", RUNS)
def test_the_sender_side_of_the_handshake(examples):
    def check(data: bytes) -> None:
        out = bounded(lambda: _serve_bytes(data, TOKEN), len(data))
        assert isinstance(out, TensorferryError), "random bytes proved the token"
        out = bounded(lambda: _serve_bytes(data, b""), len(data))  # no token: any well-formed Proof will do
        assert isinstance(out, (TensorferryError, tuple))

    run(examples, handshake_st, check)


challenge = frame(SAMPLES[1])
client_st = st.one_of(
    frames_st,
    st.builds(lambda rest: challenge + rest, frames_st),
    st.builds(lambda proof, rest: challenge + frame(P.Welcome(pool_nbytes=1, pool_generation=0, proof=proof)) + rest,
              st.binary(max_size=40), st.binary(max_size=32)),
)


@pytest.mark.parametrize("examples", RUNS)
def test_the_receiver_side_of_the_handshake(examples):
    def check(data: bytes) -> None:
        out = bounded(lambda: _client_bytes(data, TOKEN), len(data))
        assert isinstance(out, TensorferryError), "random bytes proved the token to the receiver"

    run(examples, client_st, check)


acquire_st = st.builds(
    P.Acquire, ticket_id=st.integers(-(1 << 63), (1 << 63) - 1), piece=st.integers(-(1 << 63), (1 << 63) - 1),
    digest=st.binary(max_size=64), seq=st.integers(0, (1 << 63) - 1), mac=st.binary(max_size=32),
)


@pytest.mark.parametrize("examples", RUNS)
def test_forged_acquires_are_refused_without_raising(examples):
    session = Session(b"k" * 32)
    run(examples, acquire_st, lambda msg: assert_false(session.check(msg)))


def assert_false(value: bool) -> None:
    assert value is False


# -- tickets (and their delta sections) and layouts ------------------------------------------------------


def _layout_bytes() -> list[bytes]:
    objs = [
        {"a": torch.zeros(3, 4), "b": [torch.ones(2, dtype=torch.int64), torch.zeros((), dtype=torch.bool)]},
        [torch.zeros(5, dtype=torch.float16)] * 3,
        {f"layer.{i}.weight": torch.zeros(i + 1, 2) for i in range(20)},
    ]
    out = []
    for obj in objs:
        leaves, ops, counts, keys, _ = flatten(obj)
        out.append(inspect_leaves(obj, leaves, ops, counts, keys).layout.to_bytes())
    return out


LAYOUTS = _layout_bytes()


def _ticket(layout: bytes, delta: DeltaOffer | None, **kw) -> bytes:
    fields = dict(id=7, transport="tcp", address="127.0.0.1:4000", pool_generation=3, layout_bytes=layout, blocks=[(0, 4096)],
                  total_nbytes=4096, piece_nbytes=4096, num_pieces=1, readers=1, lease_seconds=60.0, version=2, delta=delta)
    fields.update(kw)
    return Ticket(**fields).to_bytes()


TICKETS = [
    _ticket(LAYOUTS[0], None),
    _ticket(LAYOUTS[1], DeltaOffer(5, 4, 99, [(4096, 64)], 64, 3)),
    _ticket(LAYOUTS[2], DeltaOffer(5, 0), blocks=[], num_pieces=3, piece_nbytes=2048, total_nbytes=5000),
]
delta_st = st.builds(DeltaOffer, st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1), st.integers(-(1 << 63), (1 << 63) - 1),
                     st.lists(st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-(1 << 63), (1 << 63) - 1)), max_size=2),
                     st.integers(0, 1 << 63), st.integers(0, 1 << 63))
tickets_st = st.one_of(
    st.binary(max_size=600),
    mutated(TICKETS),
    st.builds(lambda d: msgspec.msgpack.encode(d), delta_st).map(lambda d: TICKETS[1][: -len(msgspec.msgpack.encode(DeltaOffer(5, 4, 99, [(4096, 64)], 64, 3)))] + d),
)


def _decode_ticket(data: bytes):
    ticket = Ticket.from_bytes(data)
    ticket.layout  # what a receiver decodes next: a layout from the same bytes
    return ticket


@pytest.mark.parametrize("examples", RUNS)
def test_tickets_and_their_delta_sections(examples):
    run(examples, tickets_st, lambda data: bounded(lambda: _decode_ticket(data), len(data)))


@pytest.mark.parametrize("examples", RUNS)
def test_layouts(examples):
    run(examples, st.one_of(mutated(LAYOUTS), st.binary(max_size=400)), lambda data: bounded(lambda: Layout.from_bytes(data), len(data)))


# -- a Fetch's range list (the tcp sender reads it) ---------------------------------------------------------

# Any int64, the edges and sums that overflow (2**62 + 2**62) drawn often.
_int64 = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.sampled_from([0, 1, 1 << 62, (1 << 63) - 1, -(1 << 63), (1 << 63) - 5, 4096]))

ranges_st = st.tuples(
    st.lists(st.integers(1, 4096), min_size=1, max_size=4),
    st.one_of(
        st.binary(min_size=1, max_size=256),
        st.lists(st.tuples(_int64, _int64), min_size=1, max_size=8).map(lambda pairs: np.array(pairs, dtype="<i8").tobytes()),
        st.lists(st.tuples(st.integers(0, 16384), st.integers(-4, 4096)), min_size=1, max_size=8)
        .map(lambda pairs: np.array(sorted(pairs), dtype="<i8").tobytes()),
    ),
)


@pytest.mark.parametrize("examples", RUNS)
def test_range_lists(examples):
    """Found by this test: a range of position and length near 2**63 (their
    sum past int64) passed the bounds check."""
    def check(case) -> None:
        sizes, ranges = case
        memory = bytearray(sum(sizes))
        views, at = [], 0
        for n in sizes:
            views.append(memoryview(memory)[at : at + n])
            at += n
        out = _ranges_of(views, ranges)
        if out is None:
            return
        pairs = np.frombuffer(ranges, dtype="<i8").reshape(-1, 2)
        assert all((pairs[:, 0] >= 0) & (pairs[:, 1] > 0)) and int(pairs[:, 0].max() + 0) <= len(memory)
        address, nbytes = out
        base = np.frombuffer(memory, dtype=np.uint8).ctypes.data
        assert int(nbytes.sum()) == int(pairs[:, 1].sum())
        assert ((address >= base) & (address + nbytes <= base + len(memory)) & (nbytes > 0)).all()

    run(examples, ranges_st, check)


# -- the same range lists and frames at a live, authenticated tcp sender -----------------------------------


@pytest.fixture(scope="module")
def live_sender():
    from tensorferry import Sender

    with Sender("tcp", capacity_nbytes=8 << 20, token=TOKEN) as sender:
        ticket = sender.put({"a": torch.arange(50_000, dtype=torch.float32), "b": torch.ones(3, 5)}, readers=None)
        yield sender, ticket
        sender.discard(ticket)


after_auth_st = st.tuples(
    st.one_of(ranges_st.map(lambda case: case[1]), st.just(b"")),
    st.integers(0, 1 << 62),
    st.one_of(st.just(b""), frames_st),
)


@pytest.mark.parametrize("examples", RUNS)
def test_an_authenticated_peer_fuzzing_fetches_and_frames(live_sender, examples):
    """After the handshake and an Acquire: a Fetch with any range list and
    start, then any bytes. The sender answers (a Failure, or exactly the
    bytes announced) or closes that connection, and keeps serving others."""
    from tensorferry import Receiver
    from tensorferry.transports import open_control

    sender, ticket = live_sender

    def check(case) -> None:
        ranges, start, tail = case
        sock, _, session = open_control(sender.address, token=TOKEN)
        with sock:
            P.send_msg(sock, session.sign(P.Acquire(ticket_id=ticket.id, digest=ticket.digest)))
            assert isinstance(P.recv_msg(sock), P.Located)
            P.send_msg(sock, P.Fetch(ticket_id=ticket.id, ranges=ranges, start=start))
            try:
                reply = P.recv_msg(sock, deadline=time.monotonic() + 10.0)
            except TensorferryError:
                return  # closed on us: allowed
            if isinstance(reply, tuple):
                _, nbytes = reply
                if ranges:
                    assert nbytes == int(np.frombuffer(ranges, dtype="<i8").reshape(-1, 2)[:, 1].sum())
                else:
                    assert nbytes == max(0, ticket.total_nbytes - start)
                left = nbytes
                while left:
                    chunk = sock.recv(min(left, 1 << 20))
                    assert chunk
                    left -= len(chunk)
            else:
                assert isinstance(reply, P.Failure)
            if tail:
                try:
                    sock.sendall(tail)
                except OSError:
                    pass

    run(examples, after_auth_st, check)
    with Receiver("tcp", token=TOKEN, timeout=20.0) as r:
        got = r.get(ticket)
        assert torch.equal(got["a"], torch.arange(50_000, dtype=torch.float32))
