"""Two-tree broadcasts (``put(trees=True)``) on loopback: real senders,
relaying receivers and sockets in one process (tcp; nixl where it loads).

Each relay pulls one half from its parent in each tree at once and passes
both on as they arrive. Here every receiver is on one host, so a child
copies out of its relay's memory (``relay_reads="memory"``) unless it is
told to take the stream as one on another host would (``"tcp"``). Real
links, and a relay process killed mid-stream, are in tests/hosts/.
"""

from __future__ import annotations

import json
import secrets
import signal
import time

import pytest
import torch
import test_relay as relay_test

from _transfer_helpers import assert_same, broadcast_object as obj, get_all, in_threads, pool_empty, require, wait_until
from _proxy import RecordingProxy
from tensorferry import ConfigurationError, Receiver, Sender
from tensorferry.transports import stripe_bounds
from test_relay import procs  # noqa: F401 - the fixture: relay processes on loopback

MiB = 1 << 20


@pytest.fixture(params=["memory", "tcp"])
def receivers(request):
    made: list[Receiver] = []

    def make(n, transport="tcp", **kw):
        kw.setdefault("timeout", 30.0)
        kw.setdefault("relay_reads", request.param)
        new = [Receiver(transport, **kw) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for r in made:
        r.close()


def _relayed(r: Receiver) -> int:
    s = r.stats()
    return s["relay_memory_read_nbytes"] + s["relay_stream_nbytes"] + s["relay_nixl_read_nbytes"]


@pytest.mark.parametrize("count", [2, 7, 8])
def test_every_relay_sends_about_one_object_and_the_sender_one(receivers, count):
    want = obj(21)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        ticket = sender.put(want, readers=count, trees=True)
        rs = receivers(count, relay=True)
        for got in get_all(rs, ticket):
            assert_same(got, want)
        sender.wait_released(ticket, timeout=10.0)
        total = ticket.total_nbytes
        (lo, mid), (_, hi) = stripe_bounds(total, 2)
        # The sender sent each half once (to each tree's root).
        assert sender.stats()["bytes_sent"] == total
        sent = [r._relay_server.bytes_sent for r in rs]
        # Every other half-copy came from a relay; none sent more than two
        # halves (interior in one tree, a leaf in the other).
        assert sum(sent) == (count - 1) * total
        assert max(sent) <= 2 * max(mid - lo, hi - mid)
        assert sum(_relayed(r) for r in rs) == (count - 1) * total
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)


def test_a_receiver_that_does_not_relay_pulls_both_halves_from_relays(receivers):
    want = obj(22)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        ticket = sender.put(want, readers=5, trees=True)
        relays = receivers(4, relay=True)
        for got in get_all(relays, ticket):
            assert_same(got, want)
        (leaf,) = receivers(1)
        target = torch.utils._pytree.tree_map(torch.empty_like, want)
        leaf.get(ticket, into=target)
        assert_same(target, want)
        assert sender.stats()["bytes_sent"] == ticket.total_nbytes  # one object: the leaf's halves came from relays
        assert _relayed(leaf) == ticket.total_nbytes
        sender.wait_released(ticket, timeout=10.0)


def test_a_gone_relay_sends_its_children_elsewhere_for_each_half(receivers):
    want = obj(23)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        rs = receivers(4, relay=True, stall_seconds=1.0)
        ticket = sender.put(want, readers=4, trees=True)
        # r0 and r1 first (their parents in tree B, r2 and r3, are not there:
        # after a moment they take sources with room), then r0 is gone.
        for got in get_all(rs[:2], ticket):
            assert_same(got, want)
        rs[0].close()
        for got in get_all(rs[2:], ticket):
            assert_same(got, want)  # r2 (and r3) lost r0 in tree A: from the sender or r1
        sender.wait_released(ticket, timeout=10.0)
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)


def test_a_late_receiver_pulls_its_halves_from_relays_that_still_hold_them(receivers):
    want = obj(24)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        early = receivers(3, relay=True)
        ticket = sender.put(want, readers=4, trees=True)
        get_all(early, ticket)
        before = sender.stats()["bytes_sent"]
        (late,) = receivers(1)
        assert_same(late.get(ticket), want)
        assert sender.stats()["bytes_sent"] == before  # both halves came from relays
        sender.wait_released(ticket, timeout=10.0)


def test_relays_pass_a_delta_on_in_two_trees(receivers):
    w = {"a": torch.randn(1 << 20), "b": torch.randn(300_000)}
    rs = receivers(4, relay=True)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        plan = sender.plan(w, delta=True)
        plans = [None] * 4
        for step in range(3):
            if step:
                w["a"][step * 1000 : step * 1000 + 5000] += 1.0
            ticket = sender.put(plan, readers=4, trees=True)

            def one(i: int) -> None:
                if plans[i] is None:
                    plans[i] = rs[i].plan(ticket)
                got = rs[i].get(ticket, into=plans[i])
                assert all(torch.equal(got[k], w[k]) for k in w)

            in_threads(one, 4)
            if step:
                assert ticket.delta.base and 0 < ticket.delta.nbytes < ticket.total_nbytes / 10
            sender.wait_released(ticket, timeout=20.0)


def test_nixl_relays_pass_both_halves_on():
    require("nixl")
    want = obj(25)
    rs = [Receiver("nixl", timeout=30.0, relay=True, relay_reads="tcp") for _ in range(4)]
    try:
        with Sender("nixl", capacity_nbytes=64 * MiB) as sender:
            ticket = sender.put(want, readers=4, trees=True)
            for got in get_all(rs, ticket):
                assert_same(got, want)
            sender.wait_released(ticket, timeout=10.0)
            assert sum(_relayed(r) for r in rs) == 3 * ticket.total_nbytes
    finally:
        for r in rs:
            r.close()


def test_trees_settings_are_checked():
    with Sender("tcp", capacity_nbytes=8 * MiB) as sender:
        x = torch.ones(10)
        with pytest.raises(ConfigurationError, match=r"fanout=3.*binary"):
            sender.put(x, readers=4, fanout=3, trees=True)
        with pytest.raises(ConfigurationError, match=r"readers=None.*readers=N"):
            sender.put(x, readers=None, trees=True)
        with pytest.raises(ConfigurationError, match="trees='yes'"):
            sender.put(x, readers=4, trees="yes")
        ticket = sender.put(x, readers=1, fanout=2, trees=True)  # fanout 2 said: the same
        sender.discard(ticket)


def test_sharded_gets_of_a_two_tree_broadcast_relay_their_ranges_in_a_plain_tree(receivers):
    """The readers of the same byte ranges of a two-tree ticket pull them
    from each other as one stream, in a binary tree (not split in halves)."""
    from tensorferry import Box

    w = torch.randn(64, 48)
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        ticket = sender.put({"w": Box(w.clone(), (0, 0), tuple(w.shape))}, readers=4, trees=True)
        rs = receivers(4, relay=True)
        targets = [{"w": Box(torch.zeros(64, 16), (0, 16), tuple(w.shape))} for _ in rs]
        plans = [r.plan([ticket], into=t) for r, t in zip(rs, targets)]
        in_threads(lambda i: rs[i].get([ticket], into=plans[i]), 4)
        for t in targets:
            assert torch.equal(t["w"].tensor, w[:, 16:32])
        # A binary tree of the range set: the sender serves two of the four.
        assert sender.stats()["bytes_sent"] == 2 * plans[0].nbytes
        sender.wait_released(ticket, timeout=10.0)


def test_a_relay_process_killed_mid_stream_its_children_resume_their_half_elsewhere(procs):
    """Four relay processes on loopback (children copy out of their relay's
    memory), the sender's link slowed by a proxy to about a second a half:
    0.4 s in, while every half is still moving, one relay is SIGKILLed. The
    other three end with the exact bytes, and the sender's pool empties."""
    token = secrets.token_hex(8)
    want = relay_test.workers.make_object(4747, 16 * MiB)
    # The sender listens on 127.0.0.2 and tells receivers 127.0.0.1 at the
    # same port, where the proxy passes each of its streams at 8 MB/s.
    with Sender("tcp", capacity_nbytes=32 * MiB, token=token, host="127.0.0.2", advertise_host="127.0.0.1") as sender:
        port = int(sender.address.rsplit(":", 1)[1])
        with RecordingProxy(f"127.0.0.2:{port}", port=port, rate_nbytes=8_000_000):
            relays = [procs(token, relay=True) for _ in range(4)]
            ticket = sender.put(want, readers=4, trees=True)
            for p in relays:
                p.proc.stdin.write(json.dumps({"cmd": "get", "ticket": ticket.to_bytes().hex()}) + "\n")
                p.proc.stdin.flush()
            time.sleep(0.4)
            victim = relays[1]
            victim.proc.send_signal(signal.SIGKILL)
            assert victim.proc.wait(timeout=10) == -signal.SIGKILL
            assert victim.proc.stdout.read() == ""  # killed before its get returned
            for p in relays[:1] + relays[2:]:
                assert p.fact()["checksum"] == relay_test.workers.checksum(want)
            sender.wait_released(ticket, timeout=30.0)  # the victim's slot went with its connection
            assert wait_until(lambda: pool_empty(sender.pool), 10.0)
