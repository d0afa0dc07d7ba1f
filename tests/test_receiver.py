"""Receiver on its own (receiver.py): arguments, what a get checks before it
connects, one receiver for several transports, close.

Gets over every transport, into= and zero copy are the contract suite's
(tests/transports/). Real senders on loopback; tickets pointing nowhere are
real tickets with the address changed.
"""

from __future__ import annotations

import gc
import os
import time

import msgspec
import pytest
import torch

from tensorferry import ConfigurationError, LayoutMismatchError, Receiver, Sender, TicketError

MiB = 1 << 20
NOWHERE = "@no-such-tensorferry-sender"  # an abstract socket name nobody binds


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def obj(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=g), "n": [torch.arange(3)]}


@pytest.fixture(scope="module")
def shm_ticket():
    """A real shm ticket, never redeemed, whose sender is gone."""
    with Sender("shm", capacity_nbytes=1 * MiB) as s:
        t = s.put(obj())
    return msgspec.structs.replace(t, address=NOWHERE)


def test_an_unknown_transport_is_refused():
    with pytest.raises(ValueError, match="bogus"):
        Receiver("bogus")


def test_bytes_that_are_no_ticket_are_a_ticket_error():
    with Receiver("shm", timeout=2.0) as r:
        for data in (b"", b"hello", b"TFTK\x01\x00\xff"):
            with pytest.raises(TicketError):
                r.get(data)


@pytest.mark.parametrize("wrong", [None, "hex", 42, {"ticket": 1}])
def test_what_is_no_ticket_is_a_ticket_error_saying_what_a_ticket_is(shm_ticket, wrong):
    """get(None), get(ticket_bytes.hex()): a TicketError naming Ticket and to_bytes(), not an AttributeError."""
    given = shm_ticket.to_bytes().hex() if wrong == "hex" else wrong
    with Receiver(timeout=2.0) as r:
        for call in (r.get, r.plan, lambda t: r.get([t])):
            with pytest.raises(TicketError, match=r"a ticket is a Ticket \(what Sender.put returns\) or the bytes of its to_bytes\(\)") as info:
                call(given)
            if isinstance(given, str):
                assert "bytes.fromhex(it)" in str(info.value)
        assert r.gets == 0


def test_a_ticket_of_another_transport_is_refused_before_connecting(shm_ticket):
    with Receiver("tcp", timeout=2.0) as r:
        with pytest.raises(TicketError, match="shm transport, this receiver speaks tcp"):
            r.get(shm_ticket)


def test_a_ticket_whose_size_disagrees_with_its_layout_is_refused_before_connecting(shm_ticket):
    forged = msgspec.structs.replace(shm_ticket, total_nbytes=shm_ticket.total_nbytes + 16)
    with Receiver("shm", timeout=2.0) as r:
        with pytest.raises(TicketError, match="its layout packs into"):
            r.get(forged)


def test_into_is_matched_before_connecting(shm_ticket):
    with Receiver("shm", timeout=2.0) as r:
        with pytest.raises(LayoutMismatchError, match=r"obj\['w'\]"):
            r.get(shm_ticket, into={"w": torch.empty(4, 8), "n": [torch.empty(3, dtype=torch.int64)]})
        with pytest.raises(ConfigurationError, match="zero_copy"):
            r.get(shm_ticket, into=obj(), zero_copy=True)


def test_zero_copy_needs_shm():
    with Sender("tcp", capacity_nbytes=1 * MiB) as s, Receiver("tcp", timeout=5.0) as r:
        t = s.put(obj())
        with pytest.raises(ConfigurationError, match="shm"):
            r.get(t, zero_copy=True)
        got = r.get(t)  # the slot was not taken by the refused get
        assert torch.equal(got["w"], obj()["w"]) and torch.equal(got["n"][0], torch.arange(3))


def test_one_receiver_for_any_transport():
    with Sender("shm", capacity_nbytes=1 * MiB) as a, Sender("tcp", capacity_nbytes=1 * MiB) as b:
        with Receiver(timeout=5.0) as r:
            for i, s in enumerate((a, b, a)):
                got = r.get(s.put(obj(i)).to_bytes())
                assert torch.equal(got["w"], obj(i)["w"])


def test_a_closed_receiver_refuses_gets_and_keeps_nothing_open():
    with Sender("tcp", capacity_nbytes=1 * MiB) as s:
        t = s.put(obj(), readers=2)
        fds = open_fds()
        r = Receiver("tcp", timeout=5.0)
        r.get(t)
        assert open_fds() > fds  # its connection
        r.close()
        r.close()
        gc.collect()
        # The count is the process's: the sender's end of that connection
        # (this process too) closes when its server thread sees the EOF.
        deadline = time.monotonic() + 5.0
        while open_fds() > fds and time.monotonic() < deadline:
            time.sleep(0.01)
        assert open_fds() <= fds
        with pytest.raises(ConfigurationError, match="closed"):
            r.get(t)
        s.discard(t)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_sender_that_closes_as_soon_as_it_is_released_never_fails_the_get(transport):
    # The sender answers a Release before it counts it: wait_released (and a
    # close right after it) cannot cut off the answer the get is waiting for.
    import threading

    want = torch.arange(4096, dtype=torch.int64)
    with Receiver(transport, timeout=10.0) as receiver:
        for _ in range(25):
            sender = Sender(transport, capacity_nbytes=1 << 20)
            ticket = sender.put(want)

            def close_when_released(s=sender, t=ticket):
                s.wait_released(t, timeout=10.0)
                s.close()

            closer = threading.Thread(target=close_when_released)
            closer.start()
            try:
                assert torch.equal(receiver.get(ticket), want)
            finally:
                closer.join(timeout=10.0)
                sender.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_into_a_module_writes_its_state_dict_as_a_plan_would(transport):
    src, dst = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    weight = dst.weight
    with Sender(transport, capacity_nbytes=1 * MiB) as s, Receiver(transport, timeout=10.0) as r:
        assert r.get(s.put(src.state_dict()), into=dst) is dst
        assert dst.weight is weight and torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias)
        with pytest.raises(LayoutMismatchError, match="weight"):
            r.get(s.put(torch.nn.Linear(4, 8).state_dict()), into=dst)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_streamed_get_into_targets_writes_each_piece_straight_into_them(transport):
    """An object four times the sender's pool arrives in pieces; with
    into= each piece lands in the targets, so the receiver takes no memory
    of the object's size (it took all of it and copied it out before)."""
    g = torch.Generator().manual_seed(5)
    sent = [torch.randn(256 << 10, generator=g), torch.randn(3, 1000, generator=g).to(torch.float64), torch.arange(7)]
    total = sum(t.nbytes for t in sent)
    with Sender(transport, capacity_nbytes=total // 4) as s, Receiver(transport, timeout=30.0, cache_nbytes=64 * MiB) as r:
        dest = [torch.zeros_like(t) for t in sent]
        dest[1] = torch.zeros(1000, 3, dtype=torch.float64).t()  # strided: staged, then copied
        ticket = s.put(sent)
        assert ticket.streamed and ticket.num_pieces > 2
        assert r.get(ticket, into=dest) is dest
        for a, b in zip(dest, sent):
            assert torch.equal(a, b)
        assert r.stats()["cache_taken_nbytes"] == 0, "a streamed into= took memory for the whole object"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_into_targets_of_every_kind_from_an_object_in_several_blocks(transport):
    """A fragmented sender pool splits the object over several blocks;
    into= targets that are strided, conjugated or negated each get
    their own tensor's values (shm copies those straight out of the mapped
    pool by torch, tcp through a staged buffer each)."""
    with Sender(transport, capacity_nbytes=512 << 10) as s, Receiver(transport, timeout=10.0) as r:
        fill = [s.pool.pack([torch.zeros(8 << 10, dtype=torch.uint8) for _ in range(4)]) for _ in range(16)]
        for f in fill[::2]:
            f.release()  # eight 32 KiB holes
        try:
            g = torch.Generator().manual_seed(8)
            sent = [torch.randn(40, 50, generator=g) for _ in range(6)] + [torch.randn(30, 30, generator=g, dtype=torch.complex64)]
            ticket = s.put(sent, one_shot=True)
            assert len(ticket.blocks) > 1, ticket.blocks
            dest = [torch.zeros(40, 50) for _ in range(6)] + [torch.zeros(30, 30, dtype=torch.complex64).conj()]
            dest[1] = torch.zeros(50, 40).t()
            dest[4] = torch.zeros(40, 50)._neg_view()
            assert r.get(ticket, into=dest) is dest
            for i, (a, b) in enumerate(zip(dest, sent)):
                assert torch.equal(a.resolve_conj().resolve_neg(), b), i
            s.wait_released(ticket, timeout=10.0)
        finally:
            for f in fill[1::2]:
                f.release()
