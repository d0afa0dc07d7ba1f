"""Sharded gets of broadcast tickets: receivers of the same slices pull
them from each other (plans/_sharded.py, _receive.py, the ledger's range
trees, relays' books keyed by stream).

Real senders, relaying receivers and sockets in one process (tcp and
nixl): the bytes each side sent, relays that are gone, a second version
through the same relays. Every receiver here is on one host, so a child
copies out of its relay's memory.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import tensorferry as tf
from tensorferry import Box

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "transports"))
from _transfer_helpers import require  # noqa: E402

G = torch.Generator().manual_seed(11)
W = torch.randn(48, 40, generator=G)  # row-sharded on 3 sources
B = torch.randn(40, generator=G)  # replicated on every source
ROWS = [(0, 20), (20, 36), (36, 48)]


def source(k: int) -> dict:
    a, b = ROWS[k]
    return {"w": Box(W[a:b].clone(), (a, 0), tuple(W.shape)), "b": B.clone()}


def column_target(first: int, last: int) -> dict:
    """A tensor-parallel worker's target: columns ``first:last`` of w, all of b."""
    return {"w": Box(torch.zeros(48, last - first), (0, first), tuple(W.shape)), "b": torch.zeros(40)}


def check(target: dict, first: int, last: int, scale: float = 1.0) -> None:
    assert torch.equal(target["w"].tensor, scale * W[:, first:last])
    assert torch.equal(target["b"], scale * B)


@pytest.fixture(params=[("tcp", "memory"), ("tcp", "tcp"), ("nixl", "memory"), ("nixl", "tcp")], ids="-".join)
def cluster(request):
    """Three source senders; ``make(n, **kw)`` makes receivers, all closed
    after. A child reads its relay's memory (the relay is on its host), or,
    as one on another host would, takes its tcp stream (tcp) or READs what
    it exposes (nixl)."""
    transport, reads = request.param
    require(transport)
    senders = [tf.Sender(transport) for _ in ROWS]
    made: list[tf.Receiver] = []

    def make(n: int, **kw) -> list[tf.Receiver]:
        kw.setdefault("timeout", 30.0)
        kw.setdefault("relay_reads", reads)
        new = [tf.Receiver(transport, **kw) for _ in range(n)]
        made.extend(new)
        return new

    yield senders, make
    for r in made:
        r.close()
    for s in senders:
        s.close()


def _relayed(r: tf.Receiver) -> int:
    s = r.stats()
    return s["relay_memory_read_nbytes"] + s["relay_stream_nbytes"] + s["relay_nixl_read_nbytes"]


def test_readers_of_the_same_slices_pull_them_from_each_other(cluster):
    senders, make = cluster
    same = make(3, relay=True)  # three replicas' worker 0: columns 0:25
    (other,) = make(1, relay=True)  # worker 1: columns 25:40
    plans = [s.plan(source(k)) for k, s in enumerate(senders)]
    tickets = [s.put(p, readers=4, fanout=1) for s, p in zip(senders, plans)]
    targets = [column_target(0, 25) for _ in same]
    kept = [r.plan(tickets, into=t) for r, t in zip(same, targets)]
    for r, p in zip(same, kept):  # one after another: a chain, the first from the senders
        r.get(tickets, into=p)
    t1 = column_target(25, 40)
    p1 = other.plan(tickets, into=t1)
    other.get(tickets[::-1], into=p1)
    for t in targets:
        check(t, 0, 25)
    check(t1, 25, 40)
    # The first of the same slices came from the senders; the other two from
    # the relay before them, all of it. Worker 1's slices are another range
    # set: from the senders (each set's tree is its own).
    assert [_relayed(r) for r in same] == [0, kept[1].nbytes, kept[2].nbytes]
    assert _relayed(other) == 0
    assert [r.stats()["relay_bytes_sent"] for r in same] == [kept[0].nbytes, kept[0].nbytes, 0]
    if senders[0].transport == "tcp":  # nixl READs leave no count at the sender
        assert sum(s.stats()["bytes_sent"] for s in senders) == kept[0].nbytes + p1.nbytes
    for s, t in zip(senders, tickets):
        s.wait_released(t, timeout=10.0)

    # A second version through the same relays: each relay's streams of the
    # last get (one a source) were kept side by side, then let go for these.
    for p in plans:
        for leaf in {id(x): x for x in p._leaves}.values():
            leaf.mul_(-3)
    tickets = [s.put(p, readers=3, fanout=1) for s, p in zip(senders, plans)]
    for r, p in zip(same, kept):
        r.get(tickets, into=p)
    for t in targets:
        check(t, 0, 25, -3.0)
    assert [_relayed(r) for r in same] == [0, 2 * kept[1].nbytes, 2 * kept[2].nbytes]
    assert same[0].stats()["relay_held_nbytes"] == kept[0].nbytes  # this version's streams only


def test_a_gone_relay_sends_its_child_back_to_the_sender(cluster):
    senders, make = cluster
    first, child = make(2, relay=True)
    tickets = [s.put(source(k), readers=2, fanout=1) for k, s in enumerate(senders)]
    t0, t1 = column_target(8, 33), column_target(8, 33)
    first.get(tickets, into=t0)
    first.close()  # its relay with it: the child's pull fails, the sender names itself
    child.get(tickets, into=t1)
    check(t0, 8, 33)
    check(t1, 8, 33)
    assert _relayed(child) == 0
    for s, t in zip(senders, tickets):
        s.wait_released(t, timeout=10.0)


def test_readers_that_do_not_relay_read_their_ranges_straight_into_the_targets(cluster):
    senders, make = cluster
    relay, leaf, plain = make(1, relay=True) + make(2)
    tickets = [s.put(source(k), readers=3, fanout=1) for k, s in enumerate(senders)]
    got = [column_target(0, 40) for _ in range(3)]
    relay.get(tickets, into=got[0])  # from the senders, passed on
    leaf.get(tickets, into=got[1])  # from the relay
    plain.get(tickets, into=got[2])  # the relay's one child place is taken: from the senders, straight
    for t in got:
        check(t, 0, 40)
    nbytes = (48 * 40 + 40) * 4  # b is read once, from one of the sources that hold it
    assert _relayed(leaf) == nbytes and _relayed(plain) == 0
    assert [r.stats()["bytes_received"] for r in (relay, leaf, plain)] == [nbytes] * 3


def test_the_sender_keeps_a_tree_per_range_set_and_makes_none_for_a_failed_source_it_never_saw():
    """A reader's range digest picks its tree; asking again about a source
    that failed a range set no one acquired makes no tree (each tree costs
    a reader slot, so a peer cannot make them without end)."""
    from tensorferry.wire import protocol as P
    from tensorferry.transports import open_control

    with tf.Sender("tcp") as sender:
        ticket = sender.put(source(0), readers=3, fanout=1)
        entry = sender.ledger._entries[ticket.id]
        ctl, _, session = open_control(sender.address, timeout=5.0)
        try:

            def acquire(**kw):
                P.send_msg(ctl, session.sign(P.Acquire(ticket_id=ticket.id, digest=ticket.digest, **kw)))
                return P.recv_msg(ctl)

            assert acquire(relay="127.0.0.1:1", ranges=b"a" * 16).source == ""  # the first of set a: from the sender
            assert acquire(relay="127.0.0.1:2", ranges=b"a" * 16).source == "127.0.0.1:1"  # the next: below it
            assert acquire(ranges=b"b" * 16).source == ""  # another set: its own tree
            assert sorted(entry.ranged) == [b"a" * 16, b"b" * 16] and entry.tree.children == {"": 0}
            again = acquire(failed_source="127.0.0.1:9", ranges=b"c" * 16)
            assert isinstance(again, P.Failure) and again.kind == "not-held"
            assert sorted(entry.ranged) == [b"a" * 16, b"b" * 16]
            # A failed relay of a set it holds a slot of: another source of that set.
            assert acquire(relay="127.0.0.1:2", failed_source="127.0.0.1:1", ranges=b"a" * 16).source == ""
        finally:
            ctl.close()
        sender.discard(ticket)
