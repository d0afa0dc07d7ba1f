"""The address a tcp (or nixl) Sender puts in its tickets.

A sender bound to a wildcard must not hand out ``0.0.0.0``: a peer on
another host cannot connect there. Every connection here stays on this
host: the advertised address is checked to be one of this host's own (a
socket can bind it) before a receiver connects to it, so the kernel delivers
it over loopback.
"""

from __future__ import annotations

import socket

import pytest
import torch
from _transfer_helpers import drip, require

from tensorferry import Receiver, Sender
from tensorferry.errors import ConfigurationError
from tensorferry.transports._tcp import is_wildcard, parse_address

MiB = 1 << 20


def _is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine (only those can be bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True


def _ipv6_works() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
@pytest.mark.parametrize("bind", ["0.0.0.0", "::"])
def test_a_wildcard_bind_advertises_an_address_of_this_host(transport, bind):
    require(transport)
    if ":" in bind and not _ipv6_works():
        pytest.skip("this machine cannot bind IPv6")
    obj = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int64)}
    with Sender(transport, capacity_nbytes=MiB, host=bind, token="s3cret-token-of-24-bytes") as sender:
        ticket = sender.put(obj)
        host, port = parse_address(ticket.address)
        assert not is_wildcard(host), ticket.address
        assert sender.address == ticket.address
        assert _is_local(host), f"{host} is not an address of this host"
        with Receiver(transport, token="s3cret-token-of-24-bytes", timeout=20.0) as receiver:
            got = receiver.get(ticket.to_bytes())
        assert got.keys() == obj.keys() and all(torch.equal(got[k], obj[k]) for k in obj)


def test_advertise_host_is_what_tickets_carry():
    with Sender("tcp", capacity_nbytes=MiB, host="0.0.0.0", token="t-is-a-token-of-24-bytes", advertise_host="127.0.0.1") as sender:
        ticket = sender.put(torch.arange(10))
        port = parse_address(sender.address)[1]
        assert ticket.address == f"127.0.0.1:{port}"
        with Receiver("tcp", token="t-is-a-token-of-24-bytes", timeout=20.0) as receiver:
            assert torch.equal(receiver.get(ticket), torch.arange(10))


def test_a_specific_bind_is_advertised_as_bound():
    with Sender("tcp", capacity_nbytes=MiB) as sender:
        assert sender.put(torch.ones(2)).address.startswith("127.0.0.1:")


@pytest.mark.parametrize("advertise", ["0.0.0.0", "::", "", 17])
def test_advertise_host_must_be_an_address_peers_can_use(advertise):
    with pytest.raises(ConfigurationError, match=f"advertise_host={advertise!r}"):
        Sender("tcp", capacity_nbytes=MiB, host="0.0.0.0", token="t-is-a-token-of-24-bytes", advertise_host=advertise)


# -- a range read of many small ranges, straight into the targets ----------------------


def test_scatter_receive_fills_many_small_runs_in_order_from_a_dripping_sender():
    """``recv_scatter_into`` over a real socket pair: runs of random sizes (empty
    ones included, at the start, in the middle and at the end), the bytes
    sent in chunks that end anywhere inside a run; every run gets its bytes."""
    import random
    import socket
    import threading
    import time

    from tensorferry.wire.protocol import recv_scatter_into

    rng = random.Random(5)
    sizes = [0, 0] + [rng.choice((0, 1, 7, 64, 8192, 20_000)) for _ in range(3000)] + [0]
    payload = bytes(rng.getrandbits(8) for _ in range(sum(sizes)))
    bufs = [bytearray(n) for n in sizes]  # each run memory of its own
    views = [memoryview(b) for b in bufs]
    a, b = socket.socketpair()
    try:
        t = threading.Thread(target=drip, args=(a, payload, rng))
        t.start()
        recv_scatter_into(b, views, deadline=time.monotonic() + 60)
        t.join()
    finally:
        a.close()
        b.close()
    assert b"".join(bytes(x) for x in bufs) == payload


def test_scatter_receive_says_how_far_it_got_when_the_sender_hangs_up():
    import socket
    import time

    from tensorferry.errors import PeerGoneError
    from tensorferry.wire.protocol import recv_scatter_into

    bufs = [bytearray(10) for _ in range(500)]
    a, b = socket.socketpair()
    try:
        a.sendall(b"x" * 1234)
        a.close()
        with pytest.raises(PeerGoneError, match="after 1,234 of 5,000 bytes") as failed:
            recv_scatter_into(b, [memoryview(x) for x in bufs], deadline=time.monotonic() + 10)
        assert "closed its Sender (see its log)" in str(failed.value)  # the fix
    finally:
        b.close()


def test_a_column_slice_of_row_sharded_sources_arrives_exact_over_tcp():
    """A worker's column slice of a row-sharded weight is a run per row: 2,048
    rows of 1 KiB from each of two senders, more and smaller than a range read
    scatters, so the rows are received straight into the target's rows."""
    import tensorferry as tf
    from tensorferry import Box

    g = torch.Generator().manual_seed(3)
    w = torch.randn(4096, 512, generator=g)
    halves = [(0, 2048), (2048, 4096)]
    with tf.Sender("tcp") as s0, tf.Sender("tcp") as s1, tf.Receiver("tcp") as r:
        tickets = [s.put({"w": Box(w[a:b].clone(), (a, 0), tuple(w.shape))}) for s, (a, b) in zip((s0, s1), halves)]
        cols = {"w": Box(torch.zeros(4096, 256), (0, 128), tuple(w.shape))}
        r.get(tickets, into=cols)
        assert torch.equal(cols["w"].tensor, w[:, 128:384])
        assert r.stats()["bytes_received"] == 4096 * 256 * 4


def test_a_row_slice_of_column_sharded_sources_arrives_exact_over_tcp():
    """The mirror of the last: each sender holds a column half of the rows
    (a row of it is one run there, joined into one range by the sender), and
    the worker's target rows take a run from each sender every row: 1,024
    runs apart from each other here, received by address (odd sizes: 3 of
    7 columns of int8, so no run is a word)."""
    import tensorferry as tf
    from tensorferry import Box

    w = torch.randint(-128, 127, (2048, 7), dtype=torch.int8, generator=torch.Generator().manual_seed(4))
    parts = [(0, 3), (3, 7)]
    with tf.Sender("tcp") as s0, tf.Sender("tcp") as s1, tf.Receiver("tcp") as r:
        shards = [{"w": Box(w[:, a:b].clone(), (0, a), tuple(w.shape))} for a, b in parts]
        rows = {"w": Box(torch.zeros(1024, 7, dtype=torch.int8), (512, 0), tuple(w.shape))}
        plan = None
        for _ in range(2):  # a kept plan replays its reads
            tickets = [s.put(x) for s, x in zip((s0, s1), shards)]
            plan = plan or r.plan(tickets, into=rows)
            rows["w"].tensor.zero_()
            r.get(tickets, into=plan)
            assert torch.equal(rows["w"].tensor, w[512:1536])
