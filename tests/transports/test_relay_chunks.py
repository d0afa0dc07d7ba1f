"""The chunk a broadcast's relays pass on: chosen from the object's size and
its readers (``transports._relay.chunk_nbytes_for``), so that a chain's hops
add a small part of the transfer however long it is, and used by every
relay of the ticket (loopback, real senders and receivers). The hosts'
16-host chain and tree are in tests/hosts/test_broadcast.py."""

from __future__ import annotations

import pytest

from _transfer_helpers import assert_same, broadcast_object as obj, get_all, pool_empty, wait_until
from tensorferry import Receiver, Sender
from tensorferry.transports import CHUNK_NBYTES, chunk_nbytes_for
from tensorferry.transports._relay import MIN_CHUNK_NBYTES
from tensorferry.transports._relay._book import _Held
from tensorferry.transports._tcp import TcpChannel

MiB = 1 << 20


@pytest.mark.parametrize("total", [0, 1, 4095, 16 * MiB, 32 * MiB, 128 * MiB, 1 << 30, 10 << 30])
@pytest.mark.parametrize("hops", [1, 2, 4, 16, 100, 1000])
def test_a_chains_hops_add_at_most_three_percent_unless_a_limit_holds_the_chunk(total, hops):
    chunk = chunk_nbytes_for(total, hops)
    assert MIN_CHUNK_NBYTES <= chunk <= CHUNK_NBYTES
    assert chunk % 4096 == 0
    if MIN_CHUNK_NBYTES < chunk < CHUNK_NBYTES:
        # Between the limits: (hops - 1) chunks are at most 1/32 of the object.
        assert (hops - 1) * chunk <= total / 32
        # and the chunk is the largest that keeps it so (within a page).
        assert hops * (chunk + 4096) * 32 > total
    # More hops never make the chunk larger; a larger object never smaller.
    assert chunk_nbytes_for(total, hops + 1) <= chunk <= chunk_nbytes_for(2 * total, hops)


def test_the_limits_are_the_transports_and_unknown_readers_take_the_most():
    assert chunk_nbytes_for(32 * MiB, 16, most=4 * MiB, least=2 * MiB) == 2 * MiB
    assert chunk_nbytes_for(1 << 30, 2, most=4 * MiB, least=2 * MiB) == 4 * MiB
    assert chunk_nbytes_for(32 * MiB, 0) == CHUNK_NBYTES
    # The figures of docs/broadcast.md.
    assert chunk_nbytes_for(32 * MiB, 16) == 64 << 10
    assert chunk_nbytes_for(128 * MiB, 16) == 256 << 10
    assert chunk_nbytes_for(512 * MiB, 8) == CHUNK_NBYTES


@pytest.fixture
def receivers():
    made: list[Receiver] = []

    def make(n, **kw):
        new = [Receiver("tcp", timeout=30.0, **kw) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("fanout", [1, 2])
def test_every_relay_receives_and_passes_on_the_chunk_of_the_tickets_size_and_readers(receivers, monkeypatch, fanout):
    """Each relay publishes its stream to its children chunk by chunk: the
    first from the sender's stream, the others from their relays' streams
    (relay_reads="tcp": no same-host lend), each step at least the ticket's
    chunk (more where more had arrived)."""
    steps: dict[int, list[int]] = {}
    progress = _Held.progress

    def record(held, end):
        steps.setdefault(id(held), []).append(end)
        progress(held, end)

    monkeypatch.setattr(_Held, "progress", record)
    want = obj(47)
    readers = 5
    with Sender("tcp", capacity_nbytes=64 * MiB) as sender:
        ticket = sender.put(want, readers=readers, fanout=fanout)
        rs = receivers(readers, relay=True, relay_reads="tcp")
        for got in get_all(rs, ticket):
            assert_same(got, want)
        total = ticket.total_nbytes
        chunk = chunk_nbytes_for(total, readers, most=TcpChannel.relay_chunk_nbytes, least=TcpChannel.relay_min_chunk_nbytes)
        assert chunk < CHUNK_NBYTES  # 12 MB over 5 readers: smaller than the fixed 1 MiB chunk of before
        assert len(steps) == readers
        for ends in steps.values():
            assert ends[-1] == total
            sizes = [b - a for a, b in zip([0, *ends], ends)]
            # A chunk at least a step (a busy relay takes what more has
            # arrived in the same call), never less but for the last.
            assert all(s >= chunk for s in sizes[:-1]) and 0 < sizes[-1], sizes[:4]
            assert len(sizes) <= -(-(total) // chunk)
        # Relays still carry it: the sender sent fanout copies.
        sender.wait_released(ticket, timeout=10.0)
        assert sender.stats()["bytes_sent"] == fanout * total
        assert sum(r._relay_server.bytes_sent for r in rs) == (readers - fanout) * total
        assert wait_until(lambda: pool_empty(sender.pool), 5.0)
