"""Sender on its own (sender.py): arguments, put, streaming, leases, discard.

No receiver here: what a sender promises before anyone reads (its ledger,
its pool, its tickets). Gets over every transport are the contract suite's
(tests/transports/). Real pools and real servers on loopback.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from _transfer_helpers import wait_until
from tensorferry import (
    PoolExhaustedError,
    Receiver,
    Sender,
    Ticket,
    TransferError,
    TransferTimeoutError,
    UnsupportedTensorError,
)

MiB = 1 << 20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def idle(sender: Sender) -> bool:
    s = sender.stats()
    return s["used_nbytes"] == 0 and s["live_tickets"] == 0


def obj(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16)}


# -- arguments ---------------------------------------------------------------------------


def _refused_cleanly(make) -> None:
    """``make()`` raises ValueError and leaves no fd, mapping or thread behind."""
    threads, fds = threading.active_count(), open_fds()
    with pytest.raises(ValueError) as info:
        make()
    gc.collect()
    assert open_fds() <= fds, "a socket (or the pool) was left open"
    assert wait_until(lambda: threading.active_count() <= threads, 3.0), "a thread was left running"
    return info.value


@pytest.mark.parametrize("lease", [0, -1.0])
def test_a_lease_must_be_positive(lease):
    err = _refused_cleanly(lambda: Sender("shm", capacity_nbytes=1 * MiB, lease_seconds=lease))
    assert "lease_seconds" in str(err)


def test_a_piece_larger_than_the_pool_is_refused():
    with pytest.raises(ValueError, match="piece_nbytes"):
        Sender("shm", capacity_nbytes=1 * MiB, piece_nbytes=2 * MiB)


def test_a_piece_larger_than_the_pool_leaves_nothing_open():
    _refused_cleanly(lambda: Sender("shm", capacity_nbytes=1 * MiB, piece_nbytes=2 * MiB))


def test_an_unknown_transport_is_refused():
    err = _refused_cleanly(lambda: Sender("carrier-pigeon", capacity_nbytes=1 * MiB))
    assert "carrier-pigeon" in str(err)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1"])
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_non_loopback_bind_without_token_is_refused_before_binding(transport, host):
    err = _refused_cleanly(lambda: Sender(transport, capacity_nbytes=1 * MiB, host=host))
    assert "token" in str(err)


@pytest.mark.parametrize("readers", [0, -2])
def test_put_needs_a_reader(readers):
    with Sender("shm", capacity_nbytes=1 * MiB) as s:
        with pytest.raises(ValueError, match="readers"):
            s.put(obj(), readers=readers)
        assert idle(s)


def test_an_unsupported_leaf_is_refused_and_holds_nothing():
    with Sender("shm", capacity_nbytes=1 * MiB) as s:
        with pytest.raises(UnsupportedTensorError, match=r"obj\['x'\]"):
            s.put({"w": torch.ones(3), "x": "not a tensor"})
        assert idle(s)


# -- put, release, discard, leases -----------------------------------------------------------


def test_stats_count_the_tensors_bytes_and_the_pool_bytes_readers_read():
    """last_put_nbytes: the tensors' bytes, as the receiver's delivered_nbytes;
    bytes_moved: pool bytes read, each reader counted, alignment padding included."""
    padded = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.ones(5), "c": torch.ones(1, dtype=torch.float64)}
    tensor_nbytes = 3 + 5 * 4 + 8
    with Sender("shm", capacity_nbytes=1 * MiB) as s, Receiver(timeout=10.0) as r1, Receiver(timeout=10.0) as r2:
        t = s.put(padded, readers=2)
        assert t.total_nbytes == 3 + 1 + 5 * 4 + 8  # one byte of padding puts b at a multiple of 4
        for r in (r1, r2):
            got = r.get(t)
            assert all(torch.equal(got[k], v) for k, v in padded.items())
            assert r.stats()["delivered_nbytes"] == tensor_nbytes
        s.wait_released(t, timeout=10.0)
        st = s.stats()
        assert st["last_put_nbytes"] == tensor_nbytes
        assert st["bytes_moved"] == 2 * t.total_nbytes


def test_put_holds_the_bytes_until_discarded():
    with Sender("shm", capacity_nbytes=1 * MiB) as s:
        t = s.put(obj(), readers=None)
        assert t.readers == 0 and not t.streamed
        assert t.total_nbytes == 64 * 32 * 4 + 32 * 2
        st = s.stats()
        assert st["live_tickets"] == 1 and st["used_nbytes"] >= t.total_nbytes
        # readers=None: no lease applies, it stays until discard.
        with pytest.raises(TransferTimeoutError, match="not released"):
            s.wait_released(t, timeout=0.2)
        s.discard(t)
        s.wait_released(t, timeout=5.0)
        assert idle(s)
        assert s.stats()["transfers"] == 1 and s.stats()["bytes_moved"] == 0  # nobody read it


def test_an_unread_ticket_is_freed_when_its_lease_ends():
    with Sender("shm", capacity_nbytes=1 * MiB, lease_seconds=60.0) as s:
        long = s.put(obj(1))
        short = s.put(obj(2), lease_seconds=0.3)
        assert short.lease_seconds == 0.3 and long.lease_seconds == 60.0
        t0 = time.monotonic()
        s.wait_released(short, timeout=10.0)  # the lease running out is the point
        assert time.monotonic() - t0 >= 0.25
        assert s.stats()["live_tickets"] == 1  # the long lease still holds its own
        s.discard(long)
        s.wait_released(long, timeout=5.0)
        assert idle(s)


def test_an_empty_object_needs_no_reader():
    with Sender("shm", capacity_nbytes=1 * MiB) as s:
        for empty in ({}, [], [torch.empty(0)], {"a": ()}):
            t = s.put(empty)
            assert t.blocks == [] and t.total_nbytes == 0 and not t.streamed
            s.wait_released(t, timeout=0.0)
        assert idle(s)


def test_an_object_larger_than_the_free_pool_is_streamed():
    with Sender("shm", capacity_nbytes=1 * MiB, piece_nbytes=256 << 10) as s:
        big = [torch.zeros(5 * MiB // 4 // 4) for _ in range(4)]  # 5 MiB in four tensors
        t = s.put(big)
        assert t.streamed and t.blocks == []
        assert t.piece_nbytes == 256 << 10
        assert t.num_pieces == -(-t.total_nbytes // t.piece_nbytes) == 20
        assert Ticket.from_bytes(t.to_bytes()) == t
        s.discard(t)
        s.wait_released(t, timeout=5.0)
        assert idle(s)


def test_discarding_a_streamed_ticket_lets_a_get_in_progress_finish():
    # The pool holds 4 of the 20 pieces. Of two readers, the first takes
    # pieces 0-3, then waits for room that only the second reader's
    # release of piece 0 would make. Discarded then, the ticket keeps the
    # first reader's slots in the later pieces (packed as room frees) and
    # gives the second reader's up: the get in progress finishes, exact,
    # and a new get is refused.
    with Sender("shm", capacity_nbytes=1 * MiB, piece_nbytes=256 << 10) as s, Receiver("shm") as r1, Receiver("shm") as r2:
        big = [torch.arange(5 * MiB // 4 // 4, dtype=torch.float32) + k for k in range(4)]
        t = s.put(big, readers=2)
        assert t.streamed and t.num_pieces == 20
        got: dict = {}

        def read() -> None:
            try:
                got["value"] = r1.get(t, timeout=30.0)
            except Exception as exc:  # reported below
                got["error"] = exc

        reader = threading.Thread(target=read)
        reader.start()
        entry = s.ledger._entries[t.id]
        assert wait_until(lambda: entry.pieces[0].finished == 1 and entry.pieces[4].packed is None, 10.0)
        time.sleep(0.1)
        assert reader.is_alive()  # waiting for piece 4: the pool is full
        s.discard(t)
        reader.join(30.0)
        assert "error" not in got, got.get("error")
        assert all(torch.equal(a, b) for a, b in zip(got["value"], big))
        with pytest.raises(TransferError):
            r2.get(t, timeout=5.0)
        s.wait_released(t, timeout=5.0)
        assert idle(s)


def test_one_shot_raises_instead_of_streaming_and_holds_nothing():
    with Sender("shm", capacity_nbytes=1 * MiB) as s:
        with pytest.raises(PoolExhaustedError):
            s.put([torch.zeros(MiB // 2)], one_shot=True)
        assert idle(s)
        assert not s.put(obj(), one_shot=True).streamed


def test_tickets_are_distinct_and_carry_the_sender():
    with Sender("tcp", capacity_nbytes=1 * MiB) as s:
        tickets = [s.put(obj(i)) for i in range(20)]
        assert len({t.id for t in tickets}) == 20
        assert {(t.transport, t.address, t.pool_generation) for t in tickets} == {("tcp", s.address, s.pool.generation)}
        assert s.stats()["live_tickets"] == 20
        for t in tickets:
            s.discard(t)
        assert wait_until(lambda: idle(s), 5.0)


def test_ticket_for_another_transport_of_the_same_pool():
    with Sender("shm", capacity_nbytes=1 * MiB, extra_transports=("tcp",)) as s:
        t = s.put(obj())
        over_tcp = s.ticket_for(t, "tcp")
        assert over_tcp.transport == "tcp" and over_tcp.address == s.servers["tcp"].address != t.address
        assert over_tcp.id == t.id and over_tcp.digest == t.digest
        with pytest.raises(ValueError, match="nixl"):
            s.ticket_for(t, "nixl")
        s.discard(t)


def test_close_frees_everything_and_is_idempotent():
    fds = open_fds()
    s = Sender("tcp", capacity_nbytes=1 * MiB)
    s.put(obj())
    s.close()
    s.close()
    gc.collect()
    assert open_fds() <= fds


# -- what cannot be addressed is refused before any copy -------------------------------------


@pytest.fixture
def dtensor():
    """A real DTensor: a one-process gloo group on loopback, a CPU mesh."""
    import socket

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not built in")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        mesh = init_device_mesh("cpu", (1,))
        yield distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh)
    finally:
        dist.destroy_process_group()


def test_a_dtensor_is_sent_as_its_local_shard_with_its_box(dtensor):
    """A DTensor (data_ptr() 0: a copy by address would end the process)
    goes as its local shard, its box in the layout; one with a placement
    tensorferry cannot send is refused before any copy."""
    from torch.distributed.tensor import DTensor, Partial

    assert dtensor.data_ptr() == 0
    with Sender("shm", capacity_nbytes=1 * MiB) as s, Receiver("shm") as r:
        plan = s.plan({"w": torch.ones(8), "d": dtensor})
        boxes = plan.layout.boxes
        assert boxes.index.tolist() == [1] and boxes.shapes.tolist() == [4, 4] and boxes.offsets.tolist() == [0, 0]
        assert torch.equal(r.get(s.put(plan))["d"], dtensor.to_local())
        before = s.pool.stats()
        partial = DTensor.from_local(torch.ones(4, 4), dtensor.device_mesh, [Partial()])
        for attempt in (lambda: s.put({"w": torch.ones(8), "d": partial}), lambda: s.plan({"w": torch.ones(8), "d": partial})):
            with pytest.raises(UnsupportedTensorError, match=r"obj\['d'\] is a DTensor with placements .*Partial.*redistribute"):
                attempt()
            assert s.pool.stats() == before and idle(s)


def test_a_streamed_put_inspects_once_and_runs_windows_of_one_copy_plan(monkeypatch):
    # Each piece executes the part of the plan's runs in its byte range:
    # the object is flattened once and its runs are built once, whatever
    # the number of pieces.
    from tensorferry import Receiver
    from tensorferry.plans import _send

    calls = {"flatten": 0, "build": 0}
    real_flatten, real_build = _send.flatten, _send.CopyPlan.build

    def flatten(obj, *args):
        calls["flatten"] += 1
        return real_flatten(obj, *args)

    class CountingPlan(_send.CopyPlan):
        @classmethod
        def build(cls, *args, **kwargs):
            calls["build"] += 1
            return real_build(*args, **kwargs)

    monkeypatch.setattr(_send, "flatten", flatten)
    monkeypatch.setattr(_send, "CopyPlan", CountingPlan)
    flat = torch.arange(3 * MiB // 4, dtype=torch.float32)  # 3 MiB
    views = [v.view(2, -1) if i % 2 else v for i, v in enumerate(flat.split(786))]
    views.append(torch.arange(100.0)[::3])  # strided: copied value by value, in its piece
    with Sender("shm", capacity_nbytes=1 * MiB, piece_nbytes=256 << 10) as s, Receiver("shm") as r:
        t = s.put(views)
        assert t.streamed and t.num_pieces == -(-t.total_nbytes // (256 << 10)) >= 12
        got = r.get(t, timeout=60)
        s.wait_released(t, timeout=10)
        assert calls == {"flatten": 1, "build": 1}
        assert all(torch.equal(a, b) for a, b in zip(got, views)) and len(got) == len(views)
        assert idle(s)


def test_a_fresh_put_keeps_nothing_of_the_object_once_it_is_in_the_pool():
    # A one-shot plan skips what only a kept plan needs: the caller's
    # tensors are free to go as soon as put returned (resident), or once
    # the ticket is done (streamed: its pieces are packed later).
    import weakref

    with Sender("shm", capacity_nbytes=1 * MiB, piece_nbytes=256 << 10) as s:
        small = torch.ones(1000)
        gone = weakref.ref(small)
        t = s.put([small, torch.arange(10)])
        del small
        gc.collect()
        assert gone() is None and s.stats()["live_tickets"] == 1
        big = torch.ones(2 * MiB // 4)
        gone = weakref.ref(big)
        t2 = s.put([big])
        assert t2.streamed
        del big
        gc.collect()
        assert gone() is not None  # its later pieces are still to be packed
        for ticket in (t, t2):
            s.discard(ticket)
            s.wait_released(ticket, timeout=5.0)
        # A piece the packer was copying when the ticket ended is let go
        # when that copy returns.
        assert wait_until(lambda: gc.collect() >= 0 and gone() is None, 5.0)
        assert wait_until(lambda: idle(s), 5.0)
