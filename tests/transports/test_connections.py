"""The receiver's plumbing (``transports._connections``) and the channel
contract (``transports._channel.Channel``), against real senders: pooled
channels, the releaser of zero-copy holds, use after close, and what a
channel that lacks a capability says."""

from __future__ import annotations

import time

import pytest
import torch
from _transfer_helpers import require

from tensorferry import Sender
from tensorferry.errors import ConfigurationError, TicketError, TransferTimeoutError
from tensorferry.transports import Channel, ChannelPool, ReceiveContext, Releaser, channel_class

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


@pytest.fixture(params=["shm", "tcp"])
def transport(request):
    require(request.param)
    return request.param


@pytest.fixture
def sender(transport):
    with Sender(transport, capacity_nbytes=4 * MiB) as s:
        yield s


@pytest.fixture
def channels():
    context = ReceiveContext(None)
    pool = ChannelPool(channel_class, token=b"", context=context)
    yield pool
    pool.close()
    context.close()


def _checkout(pool: ChannelPool, ticket):
    return pool.checkout(ticket.transport, ticket.address, ticket.pool_generation, ticket.id, 10.0)


def _read_all(ch: Channel, ticket) -> torch.Tensor:
    located = ch.acquire(ticket.id, 0, timeout=10.0, digest=ticket.digest)
    blocks = [tuple(b) for b in located.blocks]
    out = torch.empty(sum(n for _, n in blocks), dtype=torch.uint8)
    dests, at = [], 0
    for _, n in blocks:
        dests.append(out[at : at + n])
        at += n
    ch.read_into(ticket.id, 0, blocks, dests, deadline=time.monotonic() + 10.0)
    assert ch.release(ticket.id, 0, timeout=10.0)
    return out


def test_an_idle_channel_is_reused_and_a_discarded_one_is_not(sender, channels):
    value = torch.arange(1000, dtype=torch.int32)
    t1 = sender.put(value)
    ch = _checkout(channels, t1)
    assert torch.equal(_read_all(ch, t1)[: value.nbytes].view(torch.int32), value)
    channels.give_back(ch)
    assert channels.idle_keys() == [(t1.transport, t1.address)]
    t2 = sender.put(value + 1)
    again = _checkout(channels, t2)
    assert again is ch, "an idle channel to the same sender is reused"
    assert channels.idle_keys() == []
    # Two gets at once get two channels.
    other = _checkout(channels, t2)
    assert other is not ch
    assert torch.equal(_read_all(other, t2)[: value.nbytes].view(torch.int32), value + 1)
    channels.discard(ch)
    assert ch.closed
    channels.give_back(ch)  # a closed channel is not kept
    channels.give_back(other)
    assert _checkout(channels, sender.put(value)) is other
    sender.wait_released(t1, timeout=10.0)
    sender.wait_released(t2, timeout=10.0)


def test_a_ticket_of_an_earlier_pool_is_refused_and_the_channel_kept(sender, channels):
    t = sender.put(torch.ones(4))
    with pytest.raises(TicketError, match="restarted"):
        channels.checkout(t.transport, t.address, t.pool_generation ^ 1, t.id, 10.0)
    assert channels.idle_keys() == [(t.transport, t.address)]
    ch = _checkout(channels, t)
    _read_all(ch, t)
    channels.give_back(ch)


def test_an_idle_channel_whose_sender_closed_is_dropped(transport, channels):
    s = Sender(transport, capacity_nbytes=1 * MiB)
    t = s.put(torch.ones(4))
    ch = _checkout(channels, t)
    _read_all(ch, t)
    channels.give_back(ch)
    s.close()
    deadline = time.monotonic() + 10.0
    while channels.idle_keys() and time.monotonic() < deadline:
        channels.prune()
        time.sleep(0.02)
    assert channels.idle_keys() == [] and ch.closed


def test_a_closed_pool_refuses_checkouts_as_a_configuration_error(sender):
    context = ReceiveContext(None)
    pool = ChannelPool(channel_class, token=b"", context=context)
    t = sender.put(torch.ones(4))
    ch = _checkout(pool, t)
    pool.give_back(ch)
    pool.close()
    context.close()
    assert ch.closed
    with pytest.raises(ConfigurationError, match="closed"):
        _checkout(pool, t)
    sender.discard(t)


def test_the_releaser_releases_a_hold_and_closes_a_retired_channel(sender, channels):
    t = sender.put(torch.ones(64))
    ch = _checkout(channels, t)
    ch.acquire(t.id, 0, timeout=10.0, digest=t.digest)
    ch.holds += 1  # as a zero-copy get does until its views die
    channels.discard(ch)
    assert ch.retired and not ch.closed, "a channel with a hold outlives its discard"
    with pytest.raises(TransferTimeoutError):
        sender.wait_released(t, timeout=0.2)
    releaser = Releaser()
    try:
        releaser.submit(ch, t.id, 0)
        sender.wait_released(t, timeout=10.0)
        deadline = time.monotonic() + 10.0
        while not ch.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ch.closed and ch.holds == 0
    finally:
        releaser.stop()


def test_a_channel_is_a_context_manager(sender, transport):
    t = sender.put(torch.ones(4))
    with channel_class(transport)(t.address, timeout=10.0) as ch:
        assert not ch.closed
        _read_all(ch, t)
    assert ch.closed


def test_what_a_channel_lacks_is_a_configuration_error_naming_the_capability(sender, transport):
    t = sender.put(torch.ones(4))
    cls = channel_class(transport)
    with cls(t.address, timeout=10.0) as ch:
        located = ch.acquire(t.id, 0, timeout=10.0, digest=t.digest)
        blocks = [tuple(b) for b in located.blocks]
        checked = 0
        if not cls.maps_sender_memory:
            with pytest.raises(ConfigurationError, match="maps_sender_memory"):
                ch.remote_views(blocks)
            checked += 1
        if not cls.relays:
            buf = memoryview(bytearray(blocks[0][1]))
            with pytest.raises(ConfigurationError, match="relays"):
                ch.receive_range(t.id, 0, blocks, buf, 0, lambda end: None, deadline=time.monotonic() + 5, chunk_nbytes=1 << 20)
            checked += 1
        if not cls.reads_source_runs:
            with pytest.raises(ConfigurationError, match="reads_source_runs"):
                ch.read_runs(t.id, 0, *([torch.zeros(0, dtype=torch.int64).numpy()] * 3), deadline=time.monotonic() + 5)
            checked += 1
        assert checked >= 1  # shm lacks relays, tcp views and source runs
        with ch.registered(torch.empty(16, dtype=torch.uint8)):
            pass  # memory any read lands in: nothing to register
        assert ch.release(t.id, 0, timeout=10.0)


def test_capabilities_are_declared_on_the_class():
    shm, tcp = channel_class("shm"), channel_class("tcp")
    assert shm.maps_sender_memory and shm.receives_into_buffers and shm.reads_source_runs
    assert not shm.relays and not shm.receives_by_loop and not shm.reads_registered_only
    assert tcp.receives_into_buffers and tcp.relays and tcp.receives_by_loop
    assert not tcp.maps_sender_memory and not tcp.reads_source_runs and not tcp.reads_registered_only
    assert tcp.relay_endpoint is None
