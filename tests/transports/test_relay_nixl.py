"""Broadcast tickets over nixl: relays whose children READ their memory.

Real NIXL (UCX on loopback) senders, relays and children in one process. A
nixl relay registers each ticket's receive memory with an agent of its own
(the exposer) and answers a child's Pull with its metadata and address; the
child READs each range as the relay announces it. Children here are on the
relay's host, so ``relay_reads="tcp"`` makes them read it as from another
host (by NIXL); the default copies out of its memory as for tcp relays.
Killed relay processes over shaped links are in tests/hosts/.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from _transfer_helpers import assert_same, broadcast_object as obj, get_all, pool_empty, require, wait_until
from tensorferry import Receiver, Sender, TransferError, TransferTimeoutError
from tensorferry.transports._auth import server_handshake
from tensorferry.wire import protocol as P

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _nixl():
    require("nixl")


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make(n, **kw):
        kw.setdefault("timeout", 30.0)
        new = [Receiver("nixl", capacity_nbytes=32 * MiB, **kw) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("fanout,count", [(1, 4), (2, 5)])
def test_nixl_children_read_their_relays_memory(receivers, fanout, count):
    want = obj(1)
    with Sender("nixl", capacity_nbytes=64 * MiB) as sender:
        ticket = sender.put(want, readers=count, fanout=fanout)
        rs = receivers(count, relay=True, relay_reads="tcp")
        for got in get_all(rs, ticket):
            assert_same(got, want)
        t = ticket.total_nbytes
        stats = [r.stats() for r in rs]
        # The sender's pool was READ by ``fanout`` receivers; every other
        # one READ the object out of a relay's exposed memory.
        read_from_relays = [s["relay_nixl_read_nbytes"] for s in stats]
        assert sorted(read_from_relays) == [0] * fanout + [t] * (count - fanout)
        assert sum(s["relay_bytes_exposed"] for s in stats) == (count - fanout) * t
        assert all(s["relay_bytes_lent"] == 0 and s["relay_stream_nbytes"] == 0 for s in stats)
        if fanout == 1:
            assert sorted(s["relay_bytes_sent"] for s in stats) == [0] + [t] * (count - 1)  # a chain
        else:
            assert max(s["relay_bytes_sent"] for s in stats) <= fanout * t
        sender.wait_released(ticket, timeout=10.0)
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)


def test_nixl_children_on_the_relays_host_copy_out_of_its_memory(receivers):
    want = obj(2)
    with Sender("nixl", capacity_nbytes=64 * MiB) as sender:
        rs = receivers(3, relay=True)  # relay_reads="memory": this host's relays lend
        ticket = sender.put(want, readers=3, fanout=1)
        for got in get_all(rs, ticket):
            assert_same(got, want)
        stats = [r.stats() for r in rs]
        t = ticket.total_nbytes
        assert sum(s["relay_memory_read_nbytes"] for s in stats) == 2 * t
        assert sum(s["relay_nixl_read_nbytes"] for s in stats) == 0
        assert all(r._relay_server._exposer is None for r in rs)  # no NIXL agent was needed to serve
        sender.wait_released(ticket, timeout=10.0)


def test_leaves_and_plans_read_nixl_relays(receivers):
    want = obj(3)
    with Sender("nixl", capacity_nbytes=64 * MiB) as sender:
        (relay,) = receivers(1, relay=True, relay_reads="tcp")
        leaves = receivers(2, relay_reads="tcp")
        plan = sender.plan(want)
        ticket = sender.put(plan, readers=3, fanout=2)
        assert_same(relay.get(ticket), want)
        target = obj(9)
        rplan = leaves[1].plan(ticket, into=target)
        # The sender serves two (the relay, then leaf 0); leaf 1 READs the relay.
        got0 = leaves[0].get(ticket)
        leaves[1].get(ticket, into=rplan)
        assert_same(got0, want)
        assert_same(target, want)
        t = ticket.total_nbytes
        assert leaves[0].stats()["relay_nixl_read_nbytes"] == 0
        assert leaves[1].stats()["relay_nixl_read_nbytes"] == t
        assert relay.stats()["relay_bytes_exposed"] == t
        sender.wait_released(ticket, timeout=10.0)


def test_a_nixl_child_whose_relay_is_gone_resumes_from_the_sender(receivers):
    want = obj(4)
    with Sender("nixl", capacity_nbytes=64 * MiB) as sender:
        first, second = receivers(2, relay=True, relay_reads="tcp", stall_seconds=1.0)
        ticket = sender.put(want, readers=2, fanout=1)
        assert_same(first.get(ticket), want)
        first.close()  # its relay is gone before its child pulls
        assert_same(second.get(ticket), want)
        assert second.stats()["relay_nixl_read_nbytes"] == 0  # every byte from the sender
        sender.wait_released(ticket, timeout=10.0)
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)


def test_a_relay_lets_its_registrations_go_with_its_tickets_and_closes_its_agent(receivers):
    with Sender("nixl", capacity_nbytes=64 * MiB) as sender:
        relay, child = receivers(2, relay=True, relay_reads="tcp", relay_linger_seconds=0.3)
        for seed in (5, 6):
            ticket = sender.put(obj(seed), readers=2, fanout=1)
            for got in get_all([relay, child], ticket):
                assert_same(got, obj(seed))
        server = relay._relay_server if relay.stats()["relay_bytes_exposed"] else child._relay_server
        exposer = server._exposer
        assert exposer is not None
        # The first ticket was let go when the second came; the second after lingering.
        assert wait_until(lambda: server._exposures == 0 and not exposer.regions, 5.0)
        relay.close()
        child.close()
        assert exposer.closed


class FakeRelay:
    """A relay on loopback that answers one nixl Pull with what it is told
    to say: its own NIXL agent's metadata, an address, and Arrived frames;
    then it stays silent until the child closes."""

    def __init__(self, nbytes: int) -> None:
        from tensorferry.transports._nixl import serving_endpoint

        self.endpoint = serving_endpoint("fake-relay")
        self.memory = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)  # bytes 0, 1, 2, ...
        self.region = self.endpoint.register(self.memory)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"

    def serve(self, address: int, nbytes: int, arrived: list[int]) -> threading.Thread:
        def run() -> None:
            conn, _ = self.listener.accept()
            with conn:
                server_handshake(conn, token=b"", transport="tcp", peer="child", deadline=time.monotonic() + 10)
                P.send_msg(conn, P.Welcome(pool_nbytes=0, pool_generation=0))
                assert P.recv_msg(conn, expect=(P.Pull,)).nixl
                P.send_msg(conn, P.Exposed(metadata=self.endpoint.metadata(), address=address, nbytes=nbytes))
                for end in arrived:
                    P.send_msg(conn, P.Arrived(end=end))
                try:
                    P.recv_msg(conn, deadline=time.monotonic() + 10)
                except TransferError:
                    pass

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.listener.close()
        self.endpoint.close()


def _pull_from(relay: FakeRelay, child: Receiver, nbytes: int, stall_seconds: float = 5.0) -> torch.Tensor:
    """A nixl pull of ``nbytes`` from ``relay`` into ``child``'s receive pool (registered)."""
    from tensorferry.transports._nixl import _receiver_endpoint
    from tensorferry.transports._relay import pull

    endpoint = _receiver_endpoint(child._context)
    buf = child._context.ensure_pool().buffer[:nbytes]
    try:
        pull(relay.address, token=b"", ticket_id=1, digest=b"d" * 16, buf=memoryview(buf.numpy()), start=0,
             progress=lambda end: None, stall_seconds=stall_seconds, deadline=time.monotonic() + 20, nixl=endpoint)
    finally:
        assert endpoint.peers == []  # the relay's metadata was let go
    return buf


def test_a_relay_that_exposes_memory_outside_its_registration_is_refused():
    """A relay is not trusted: the address it exposes must lie in the
    regions its metadata names, or the child's READ is refused before NIXL
    moves a byte."""
    relay = FakeRelay(MiB)
    # Its own registration ends where this stream would begin.
    thread = relay.serve(relay.region.addr + relay.region.nbytes, MiB, [MiB])
    with Receiver("nixl", capacity_nbytes=4 * MiB) as child:
        with pytest.raises(TransferError, match="does not hold"):
            _pull_from(relay, child, MiB)
        assert int(child._context.ensure_pool().buffer[:MiB].sum()) == 0  # nothing landed
    thread.join(timeout=10)
    relay.close()


def test_a_nixl_relay_that_stops_announcing_is_given_up_after_stall_seconds():
    relay = FakeRelay(4 * MiB)
    thread = relay.serve(relay.region.addr, 4 * MiB, [MiB])  # a quarter, then silence
    with Receiver("nixl", capacity_nbytes=8 * MiB) as child:
        with pytest.raises(TransferTimeoutError, match="stalled"):
            _pull_from(relay, child, 4 * MiB, stall_seconds=0.5)
        got = child._context.ensure_pool().buffer[: 4 * MiB]
        assert torch.equal(got[:MiB], relay.memory[:MiB])  # what was announced was READ
    thread.join(timeout=10)
    relay.close()
