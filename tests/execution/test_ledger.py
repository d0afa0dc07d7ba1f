"""The sender's ledger (_ledger.py): reader slots, releases, dropped
connections, lease expiry, discard and the backpressure of streamed pieces.

Real pools, real servers and real connections on this host: a Sender's
ledger answering a receiver-side channel (shm, tcp) that speaks the
protocol directly, so each step of a reader is seen on its own.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tensorferry import MemoryPool, Sender, TicketError, TransferError, TransferTimeoutError
from tensorferry.execution._ledger import Ledger
from tensorferry.transports import channel_class
from tensorferry.transports._base import ControlServer
from tensorferry.transports._shm import ShmServer
from tensorferry.transports._tcp import TcpServer

MiB = 1 << 20
from _transfer_helpers import wait_until  # tests/transports, on pytest's pythonpath



def used(sender: Sender) -> int:
    return sender.pool.stats().used_nbytes


@pytest.fixture(params=["shm", "tcp"])
def sender(request):
    with Sender(request.param, capacity_nbytes=1 * MiB, piece_nbytes=256 << 10) as s:
        yield s


@pytest.fixture
def channel(sender):
    ch = channel_class(sender.transport)(sender.address, timeout=10.0)
    yield ch
    ch.close()


def acquire(ch, ticket, piece: int = 0, timeout: float = 10.0):
    return ch.acquire(ticket.id, piece, timeout=timeout, digest=ticket.digest)


def test_each_reader_takes_a_slot_and_the_last_release_frees_the_blocks(sender, channel):
    t = sender.put([torch.ones(1000), torch.arange(10)], readers=2)
    held = used(sender)
    assert held >= t.total_nbytes and sender.stats()["live_tickets"] == 1
    located = acquire(channel, t)
    assert located.blocks == t.blocks and not located.sourced
    acquire(channel, t)
    with pytest.raises(TransferError, match="all 2 reader slots"):
        acquire(channel, t)
    assert channel.release(t.id, 0, timeout=5.0)
    assert used(sender) == held  # one reader still holds it
    assert channel.release(t.id, 0, timeout=5.0)
    sender.wait_released(t, timeout=5.0)
    assert used(sender) == 0 and sender.stats()["transfers"] == 1
    assert sender.stats()["bytes_moved"] == 2 * t.blocks[0][1]
    with pytest.raises(TransferError, match="not held"):
        channel.release(t.id, 0, timeout=5.0)


def test_an_altered_ticket_takes_no_slot(sender, channel):
    t = sender.put([torch.ones(100)])
    with pytest.raises(TicketError, match="altered"):
        channel.acquire(t.id, 0, timeout=5.0, digest=bytes(16))
    with pytest.raises(TransferError, match="has 1 pieces, not piece 3"):
        acquire(channel, t, piece=3)
    acquire(channel, t)  # the one real reader still has its slot
    channel.release(t.id, 0, timeout=5.0)
    sender.wait_released(t, timeout=5.0)
    with pytest.raises(TransferError, match="unknown"):
        acquire(channel, t)


def test_a_reader_that_goes_away_finishes_its_slots(sender):
    t = sender.put([torch.ones(1000)], readers=2)
    ch = channel_class(sender.transport)(sender.address, timeout=10.0)
    acquire(ch, t)
    acquire(ch, t)
    ch.close()  # both slots held on that connection: finished when it drops
    sender.wait_released(t, timeout=5.0)
    assert used(sender) == 0


def test_the_lease_frees_unclaimed_slots_but_not_held_ones(sender, channel):
    unread = sender.put([torch.ones(100)], lease_seconds=0.2)
    held = sender.put([torch.ones(100)], lease_seconds=0.2, readers=2)
    acquire(channel, held)
    sender.wait_released(unread, timeout=5.0)
    # The second slot of `held` expired; the acquired one stays until released.
    time.sleep(0.5)
    assert sender.stats()["live_tickets"] == 1 and used(sender) > 0
    with pytest.raises(TransferError, match="reader slots"):
        acquire(channel, held)
    channel.release(held.id, 0, timeout=5.0)
    sender.wait_released(held, timeout=5.0)
    assert used(sender) == 0


def test_discard_refuses_new_readers_and_frees_after_the_holders(sender, channel):
    t = sender.put([torch.ones(100)], readers=None)
    acquire(channel, t)
    acquire(channel, t)  # any number of readers until discard
    sender.discard(t)
    with pytest.raises(TransferError, match="reader slots"):
        acquire(channel, t)
    assert used(sender) > 0
    channel.release(t.id, 0, timeout=5.0)
    assert used(sender) > 0
    channel.release(t.id, 0, timeout=5.0)
    sender.wait_released(t, timeout=5.0)
    assert used(sender) == 0


def test_streamed_pieces_are_packed_as_readers_free_the_pool(sender, channel):
    flat = torch.arange(3 * MiB // 4, dtype=torch.float32)
    t = sender.put([flat])
    assert t.streamed and t.num_pieces == 12
    pool_cap = sender.pool.capacity_nbytes
    # The pool holds 4 pieces: the packer stops there until a reader releases one.
    assert wait_until(lambda: used(sender) == pool_cap, 5.0)
    for piece in range(4):
        acquire(channel, t, piece)
    with pytest.raises(TransferTimeoutError, match="not packed in time"):
        acquire(channel, t, 4, timeout=0.3)
    for piece in range(4, t.num_pieces):
        assert channel.release(t.id, piece - 4, timeout=5.0)
        located = acquire(channel, t, piece)
        assert located.virtual_offset == piece * t.piece_nbytes
        assert used(sender) <= pool_cap
    for piece in range(t.num_pieces - 4, t.num_pieces):
        channel.release(t.id, piece, timeout=5.0)
    sender.wait_released(t, timeout=5.0)
    assert used(sender) == 0


def test_bytes_sent_are_counted_from_every_connection_thread():
    with MemoryPool(4096) as pool:
        ledger = Ledger(pool)
        try:
            threads = [threading.Thread(target=lambda: [ledger.count_sent(3) for _ in range(20_000)]) for _ in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert ledger.bytes_sent == 4 * 20_000 * 3
        finally:
            ledger.close()


def test_servers_declare_what_they_can_do():
    # The sender decides how a put executes from these, never from a name.
    assert (ControlServer.serves_source_memory, ControlServer.broadcasts) == (False, False)
    assert (ShmServer.serves_source_memory, ShmServer.broadcasts) == (True, False)
    assert (TcpServer.serves_source_memory, TcpServer.broadcasts) == (True, True)
    try:
        from tensorferry.transports._nixl import NixlServer
    except ImportError:
        return
    assert (NixlServer.serves_source_memory, NixlServer.broadcasts) == (False, True)
