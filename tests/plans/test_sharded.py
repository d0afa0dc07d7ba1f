"""Sharded sources to sharded targets (plans/_sharded.py, _boxes.py, shards.py).

In one process: Box sources (several real Senders) to Box and plain targets
over every transport, the errors, the box math and the wire section. The
DTensor suites with real gloo process groups are in
``test_sharded_dtensor.py``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import tensorferry as tf
from tensorferry import Box, LayoutMismatchError, ShardedPlan, UnsupportedTensorError
from tensorferry.wire._boxes import Cell, box_runs, cover
from tensorferry.errors import PlanStaleError, TicketError
from tensorferry.wire._layout import Layout

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "transports"))
from _transfer_helpers import TRANSPORTS, require  # noqa: E402

G = torch.Generator().manual_seed(7)
W = torch.randn(10, 7, generator=G)  # row-sharded on 3 sources, unevenly
EMB = torch.randn(11, 4, generator=G)  # replicated on every source
ROWS = [(0, 4), (4, 8), (8, 10)]


def source(k: int, w: torch.Tensor = W, emb: torch.Tensor = EMB) -> dict:
    a, b = ROWS[k]
    e = emb.clone()
    return {"w": Box(w[a:b].clone(), (a, 0), tuple(w.shape)), "e": e, "tied": e, "s": torch.tensor(3.0 + k * 0)}


def targets() -> tuple[dict, dict]:
    """Worker 0: columns 0:3 of w, all of e; worker 1: columns 3:7, rows 6:11 of e."""
    e0 = torch.zeros(11, 4)
    t0 = {"w": Box(torch.zeros(10, 3), (0, 0), (10, 7)), "e": e0, "tied": e0, "s": torch.tensor(0.0)}
    t1 = {"w": Box(torch.zeros(10, 4), (0, 3), (10, 7)), "e": Box(torch.zeros(5, 4), (6, 0), (11, 4)),
          "tied": torch.zeros(11, 4), "s": torch.tensor(0.0)}
    return t0, t1


@pytest.fixture(params=TRANSPORTS)
def senders(request):
    require(request.param)
    made = [tf.Sender(request.param) for _ in ROWS]
    yield made
    for s in made:
        s.close()


def test_box_sources_to_box_targets_planned_and_replayed(senders):
    transport = senders[0].transport
    plans = [s.plan(source(k)) for k, s in enumerate(senders)]
    with tf.Receiver(transport) as r0, tf.Receiver(transport) as r1:
        t0, t1 = targets()
        tickets = [s.put(p, readers=2) for s, p in zip(senders, plans)]
        p0 = r0.plan(tickets[::-1], into=t0)  # any order
        assert p0.nbytes == (10 * 3 + 11 * 4 + 11 * 4) * 4 + 4 - 11 * 4 * 4  # e and tied are one tensor here
        assert r0.get(tickets[::-1], into=p0) is t0
        r1.get(tickets, into=t1)  # one-shot
        assert torch.equal(t0["w"].tensor, W[:, :3]) and torch.equal(t1["w"].tensor, W[:, 3:])
        assert torch.equal(t0["e"], EMB) and torch.equal(t1["e"].tensor, EMB[6:]) and torch.equal(t1["tied"], EMB)
        assert t0["s"].item() == 3.0 == t1["s"].item()
        # Each worker received exactly the bytes of its boxes.
        assert r0.stats()["bytes_received"] == p0.nbytes
        assert r1.stats()["bytes_received"] == (10 * 4 + 5 * 4 + 11 * 4) * 4 + 4
        # The sources change in place; the plan replays.
        for p in plans:
            for leaf in {id(t): t for t in p._leaves}.values():  # e and tied are one tensor
                leaf.mul_(-2)
        tickets = [s.put(p, readers=1) for s, p in zip(senders, plans)]
        r0.get(tickets, into=p0)
        assert torch.equal(t0["w"].tensor, -2 * W[:, :3]) and torch.equal(t0["e"], -2 * EMB) and t0["s"].item() == -6.0


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_delta_plan_sources_are_read_by_delta_and_every_slot_given_back(transport):
    """A kept sharded plan's first get reads ranges of the whole object (the
    delta slot goes back unread), its second the delta each source offers
    (tcp, nixl: a one-element change pays across hosts; the whole object's
    slot goes back unread), so each source's wait_released returns, and
    the targets end exact (the sharded deltas themselves:
    ``test_sharded_delta.py``)."""
    require(transport)
    senders = [tf.Sender(transport, capacity_nbytes=1 << 20) for _ in range(3)]
    try:
        plans = [s.plan(source(k), delta=True) for k, s in enumerate(senders)]
        with tf.Receiver(transport) as r:
            t0, _ = targets()
            p0 = None
            for step in range(2):
                if step:
                    for p in plans:
                        p._leaves[0].view(-1)[0] += 1  # one element: the second puts offer a delta
                tickets = [s.put(p) for s, p in zip(senders, plans)]
                assert all(bool(t.delta.ticket_id) == bool(step) for t in tickets)
                p0 = p0 or r.plan(tickets, into=t0)
                r.get(tickets, into=p0)
                for s, t in zip(senders, tickets):
                    s.wait_released(t, timeout=10)
        want = W.clone()
        for a, _ in ROWS:
            want[a, 0] += 1  # each source's first element of its rows of w
        assert torch.equal(t0["w"].tensor, want[:, :3]) and torch.equal(t0["e"], EMB)
    finally:
        for s in senders:
            s.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_streamed_sources_and_bf16_cast(transport):
    """Sources larger than their pools are streamed in pieces; dtype= casts."""
    require(transport)
    big = torch.randn(64, 16384, generator=G)
    rows = [(0, 40), (40, 64)]
    made = [tf.Sender(transport, capacity_nbytes=1 << 20, piece_nbytes=1 << 18) for _ in rows]
    try:
        plans = [s.plan({"w": Box(big[a:b].clone(), (a, 0), (64, 16384))}, dtype=torch.bfloat16) for s, (a, b) in zip(made, rows)]
        tickets = [s.put(p) for s, p in zip(made, plans)]
        assert [t.streamed for t in tickets] == [True, False]  # 1.25 MiB of bf16 in a 1 MiB pool
        target = {"w": Box(torch.zeros(64, 300, dtype=torch.bfloat16), (0, 500), (64, 16384))}
        with tf.Receiver(transport) as r:
            r.get(tickets, into=target)
        assert torch.equal(target["w"].tensor, big[:, 500:800].to(torch.bfloat16))
    finally:
        for s in made:
            s.close()


def test_replicated_sources_spread_over_receivers():
    """Every source holds all of e: receivers with another spread read it from another source."""
    made = [tf.Sender("tcp") for _ in range(2)]
    try:
        tickets = [s.put({"e": EMB.clone()}, readers=2) for s in made]
        with tf.Receiver("tcp") as r:
            for spread in (0, 1):
                t = {"e": torch.zeros(11, 4)}
                plan = ShardedPlan(r._owner, tickets, t, kept=False, spread=spread)
                r.get(tickets, into=plan)
                assert torch.equal(t["e"], EMB)
        # tcp counts what each sender sent itself: one get's bytes from each.
        assert [s.stats()["bytes_sent"] for s in made] == [11 * 4 * 4, 11 * 4 * 4]
    finally:
        for s in made:
            s.close()


def test_the_watch_of_a_sharded_source_plan():
    with tf.Sender("shm") as s:
        src = source(0)
        plan = s.plan(src)
        src["w"].tensor.set_(torch.zeros(4, 7))
        with pytest.raises(PlanStaleError):
            s.put(plan)


def test_a_kept_target_plan_checks_its_targets():
    with tf.Sender("shm") as s, tf.Receiver("shm") as r:
        t = {"e": torch.zeros(11, 4)}
        tickets = [s.put({"e": EMB}, readers=None)]
        plan = r.plan(tickets, into=t)
        t["e"].set_(torch.zeros(11, 4))
        with pytest.raises(PlanStaleError):
            r.get(tickets, into=plan)


# -- errors, before any byte moves ------------------------------------------------------


@pytest.fixture
def put_sources():
    made = [tf.Sender("tcp") for _ in ROWS]
    tickets = [s.put(source(k), readers=None) for k, s in enumerate(made)]
    yield made, tickets
    for s in made:
        s.close()


def _nothing_written(t: dict) -> None:
    assert not t["w"].tensor.any() and not t["e"].any()


def test_error_uncovered_region(put_sources):
    _, tickets = put_sources
    t0, _ = targets()
    with tf.Receiver("tcp") as r, pytest.raises(LayoutMismatchError, match=r"\['w'\]: no source holds region \[8:10, 0:3\]"):
        r.get(tickets[:2], into=t0)
    _nothing_written(t0)


def test_error_global_shape_and_dtype(put_sources):
    _, tickets = put_sources
    t0, _ = targets()
    t0["w"] = Box(torch.zeros(10, 3), (0, 0), (10, 8))
    with tf.Receiver("tcp") as r, pytest.raises(LayoutMismatchError, match=r"\['w'\] is float32 of global shape \(10, 7\) at source 0 .*global shape \(10, 8\)"):
        r.get(tickets, into=t0)
    t0, _ = targets()
    t0["e"] = torch.zeros(11, 4, dtype=torch.float64)
    with tf.Receiver("tcp") as r, pytest.raises(LayoutMismatchError, match=r"\['e'\] is float32 .* torch.float64"):
        r.plan(tickets, into=t0)


def test_error_key_on_one_side(put_sources):
    _, tickets = put_sources
    t0, _ = targets()
    t0["extra"] = torch.zeros(2)
    del t0["s"]
    with tf.Receiver("tcp") as r, pytest.raises(LayoutMismatchError) as info:
        r.get(tickets, into=t0)
    assert "['extra'] is in the target, in no source's tickets" in str(info.value)
    assert "['s'] sent by source 0" in str(info.value)
    _nothing_written(t0)


def test_error_mixed_versions():
    made = [tf.Sender("tcp") for _ in ROWS]
    try:
        plans = [s.plan(source(k)) for k, s in enumerate(made)]
        first = [s.put(p, readers=None) for s, p in zip(made, plans)]
        second = [s.put(p, readers=None) for s, p in zip(made, plans)]
        assert {t.version for t in first} == {1} and {t.version for t in second} == {2}
        t0, _ = targets()
        with tf.Receiver("tcp") as r:
            plan = r.plan(first, into=t0)
            with pytest.raises(LayoutMismatchError, match="different versions"):
                r.get(first[:2] + second[2:], into=plan)
            with pytest.raises(LayoutMismatchError, match="different versions"):
                r.get(second[:1] + first[1:], into=targets()[0])
            # A ticket of another layout than the planned sources'.
            with tf.Sender("tcp") as other:
                odd = other.put(other.plan({"w": Box(torch.zeros(2, 7), (8, 0), (10, 7))}), readers=None)
                with pytest.raises(LayoutMismatchError, match="no planned source had"):
                    r.get(first[:2] + [odd], into=plan)
        _nothing_written(t0)
    finally:
        for s in made:
            s.close()


def test_error_targets_not_writable_by_address(put_sources):
    _, tickets = put_sources
    t0, _ = targets()
    t0["e"] = torch.zeros(4, 11).t()
    with tf.Receiver("tcp") as r, pytest.raises(UnsupportedTensorError, match=r"\['e'\]"):
        r.get(tickets, into=t0)


def test_box_wrapper_checks_itself():
    with pytest.raises(ValueError, match="does not lie inside"):
        Box(torch.zeros(3, 2), (8, 0), (10, 2))
    with pytest.raises(ValueError, match="needs 2 offsets"):
        Box(torch.zeros(3, 2), (0,), (10, 2))


# -- box math and the wire section ---------------------------------------------------------


def test_cover_cuts_by_every_source_edge():
    cells, uncovered = cover((0, 2), (10, 3), [((0, 0), (4, 7)), ((4, 0), (6, 7)), ((0, 0), (10, 7))])
    assert uncovered is None
    assert [(c.offsets, c.sizes, c.sources) for c in cells] == [((0, 2), (4, 3), [0, 2]), ((4, 2), (6, 3), [1, 2])]
    _, uncovered = cover((0, 0), (5, 5), [((0, 0), (5, 2))])
    assert uncovered == Cell((0, 2), (5, 3), [])
    assert cover((), (), [((), ())]) == ([Cell((), (), [0])], None)
    assert cover((0,), (0,), []) == ([], None)


@pytest.mark.parametrize("seed", range(20))
def test_box_runs_copy_what_indexing_copies(seed):
    """Random global shapes, source and target boxes: the runs move exactly
    the elements torch's indexing picks."""
    rng = np.random.default_rng(seed)
    nd = int(rng.integers(1, 4))
    shape = tuple(int(x) for x in rng.integers(1, 7, nd))
    glob = torch.arange(int(np.prod(shape))).reshape(shape)

    def box():
        lo = [int(rng.integers(0, s)) for s in shape]
        return tuple(lo), tuple(int(rng.integers(1, s - o + 1)) for o, s in zip(lo, shape))

    (so, ss), (to, ts) = box(), box()
    src = glob[tuple(slice(o, o + s) for o, s in zip(so, ss))].contiguous().flatten()
    out = torch.full(ts, -1).flatten()
    cells, _ = cover(to, ts, [(so, ss)])
    for cell in cells:
        if cell.sources:
            s_el, d_el, run = box_runs(cell, (so, ss), (to, ts))
            for a, b in zip(s_el.tolist(), d_el.tolist()):
                out[b : b + run] = src[a : a + run]
    want = torch.full(ts, -1)
    lo = [max(a, b) for a, b in zip(so, to)]
    hi = [min(a + m, b + n) for a, m, b, n in zip(so, ss, to, ts)]
    if all(a < b for a, b in zip(lo, hi)):
        want[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, to))] = glob[tuple(slice(a, b) for a, b in zip(lo, hi))]
    assert torch.equal(out.reshape(ts), want)


def test_layout_round_trips_its_boxes_and_plain_layouts_stay_as_they_were():
    with tf.Sender("shm") as s:
        plain = s.plan({"a": torch.zeros(3)}).layout_bytes
        boxed = s.plan({"a": Box(torch.zeros(2, 3), (1, 0), (4, 3)), "b": torch.zeros(2)})
    assert Layout.from_bytes(plain).boxes is None
    back = Layout.from_bytes(boxed.layout_bytes)
    assert back.same_as(boxed.layout) and not back.same_as(Layout.from_bytes(plain))
    assert back.boxes.index.tolist() == [0] and back.boxes.shapes.tolist() == [4, 3] and back.boxes.offsets.tolist() == [1, 0]


def test_layout_refuses_a_box_past_its_global_tensor():
    import dataclasses

    from tensorferry.wire._boxes import Boxes

    with tf.Sender("shm") as s:
        lay = s.plan({"a": torch.zeros(2, 3)}).layout
    forged = dataclasses.replace(lay, boxes=Boxes(np.array([0]), np.array([4, 3]), np.array([3, 0])))
    with pytest.raises(LayoutMismatchError, match="extends past"):
        Layout.from_bytes(forged.to_bytes())
    truncated = forged.to_bytes()[:-3]
    with pytest.raises(TicketError):
        Layout.from_bytes(truncated)


def test_tcp_serves_only_well_formed_ranges_of_the_piece():
    """The sender's side of a ranged Fetch: ranges cut across the piece's
    buffers, as addresses in its memory, joined where they continue each
    other there; overlapping ones (a tied tensor read twice) are served,
    ones out of order, empty or past the piece are refused (bytes from the
    network)."""
    import ctypes

    from tensorferry.transports._tcp import _ranges_of

    memory = bytes(range(0, 40))
    buffers = [memoryview(memory)[0:10], memoryview(bytes(range(10, 30)))]

    def ask(*pairs):
        out = _ranges_of(buffers, np.array(pairs, dtype="<i8").tobytes())
        return None if out is None else [ctypes.string_at(a, n) for a, n in zip(out[0].tolist(), out[1].tolist())]

    assert ask((2, 3), (8, 4), (29, 1)) == [bytes([2, 3, 4]), bytes([8, 9]), bytes([10, 11]), bytes([29])]
    assert ask((2, 3), (2, 3)) == [bytes([2, 3, 4])] * 2
    # Adjacent in the piece and in memory: one run; apart in memory: two.
    assert ask((0, 2), (2, 3), (5, 5)) == [bytes(range(0, 10))]
    assert ask((12, 2), (14, 2)) == [bytes(range(12, 16))]
    assert ask((9, 1), (10, 1)) == [bytes([9]), bytes([10])]
    for bad in [((5, 1), (2, 1)), ((0, 0),), ((25, 6),), ((-1, 2),)]:
        assert ask(*bad) is None, bad
    assert _ranges_of(buffers, b"\x00" * 15) is None


def test_block_ranges_cut_ranges_at_block_seams():
    """A piece of several pool blocks (a fragmented pool): a range that
    crosses a block's end becomes two pool ranges, the local side cut alike."""
    from tensorferry.errors import ProtocolError
    from tensorferry.transports._ranges import block_ranges

    blocks = [(1000, 10), (5000, 20)]
    off, addr, n = block_ranges(blocks, np.array([2, 8, 29]), np.array([100, 200, 300]), np.array([3, 4, 1]))
    assert off.tolist() == [1002, 1008, 5000, 5019] and addr.tolist() == [100, 200, 202, 300] and n.tolist() == [3, 2, 2, 1]
    with pytest.raises(ProtocolError):
        block_ranges(blocks, np.array([29]), np.array([0]), np.array([2]))
    with pytest.raises(ProtocolError):
        block_ranges([(0, 8)], np.array([4]), np.array([0]), np.array([5]))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_snapshot_false_sources_serve_only_the_ranges(transport):
    """put(plan, snapshot=False): the ranges come out of the sources' own
    tensors (shm: process_vm_readv of the runs; tcp: sent from them)."""
    made = [tf.Sender(transport) for _ in ROWS]
    try:
        plans = [s.plan(source(k)) for k, s in enumerate(made)]
        tickets = [s.put(p, snapshot=False) for s, p in zip(made, plans)]
        _, t1 = targets()
        with tf.Receiver(transport) as r:
            r.get(tickets, into=t1)
        assert torch.equal(t1["w"].tensor, W[:, 3:]) and torch.equal(t1["e"].tensor, EMB[6:]) and torch.equal(t1["tied"], EMB)
        if transport == "tcp":
            assert sum(s.stats()["bytes_sent"] for s in made) == r.stats()["bytes_received"]
    finally:
        for s in made:
            s.close()
