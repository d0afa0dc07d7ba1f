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

from _transfer_helpers import assert_same, pool_empty, require, state_dict, wait_until
from tensorferry import Receiver, Sender, TransferError
from tensorferry import _protocol as P

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _nixl():
    require("nixl")


def obj(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3_000_000, generator=g), "steps": torch.arange(999), **state_dict(seed)}


def get_all(receivers, ticket, **kw):
    out: list = [None] * len(receivers)
    errors: list = []

    def run(i):
        try:
            out[i] = receivers[i].get(ticket, **kw)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(receivers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


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


def test_a_relay_that_exposes_memory_outside_its_registration_is_refused():
    """A relay is not trusted: the address it exposes must lie in the
    regions its metadata names, or the child's READ is refused before NIXL
    moves a byte."""
    from tensorferry.transports._nixl import _receiver_endpoint, serving_endpoint
    from tensorferry.transports._relay import pull

    relay_ep = serving_endpoint("fake-relay")
    exposed = torch.zeros(1 * MiB, dtype=torch.uint8)
    region = relay_ep.register(exposed)
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    def fake_relay():
        conn, _ = listener.accept()
        with conn:
            P.recv_msg(conn, expect=(P.Hello,))
            P.send_msg(conn, P.Welcome(pool_nbytes=0, pool_generation=0))
            pull_msg = P.recv_msg(conn, expect=(P.Pull,))
            assert pull_msg.nixl
            # Its own registration ends where this stream would begin.
            P.send_msg(conn, P.Exposed(metadata=relay_ep.metadata(), address=region.addr + region.nbytes, nbytes=MiB))
            P.send_msg(conn, P.Arrived(end=MiB))
            try:
                P.recv_msg(conn, deadline=time.monotonic() + 5)
            except TransferError:
                pass

    thread = threading.Thread(target=fake_relay, daemon=True)
    thread.start()
    with Receiver("nixl", capacity_nbytes=4 * MiB) as child:
        endpoint = _receiver_endpoint(child._context)  # the receive pool registered with it
        buf = child._context.ensure_pool().buffer[:MiB]
        with pytest.raises(TransferError, match="does not hold"):
            pull(address, token=b"", ticket_id=1, digest=b"d" * 16, buf=memoryview(buf.numpy()), start=0,
                 progress=lambda end: None, stall_seconds=5.0, deadline=time.monotonic() + 10, nixl=endpoint)
        assert int(buf.sum()) == 0  # nothing landed
        assert endpoint.peers == []  # the relay's metadata was let go
    thread.join(timeout=10)
    listener.close()
    relay_ep.close()
