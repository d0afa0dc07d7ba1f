"""Kept plans (``Sender.plan``, ``Receiver.plan``) over every transport.

Real senders and receivers, real sockets and pools; one test runs the sender
in another process. Every sync changes the data in place first, so a plan
that replayed stale bytes (or wrote the wrong targets) fails the comparison.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from _transfer_helpers import assert_same, make_tensor, pool_empty, require, state_dict, wait_until
from tensorferry import (
    ConfigurationError,
    LayoutMismatchError,
    PlanBusyError,
    PlanStaleError,
    Receiver,
    RecvPlan,
    SendPlan,
    Sender,
    Ticket,
    TransferError,
)

MiB = 1 << 20


@pytest.fixture
def sender_capacity_nbytes() -> int:
    return 8 * MiB




def bump(obj) -> None:
    """Change every tensor of ``obj`` in place (what a training step does)."""
    with torch.no_grad():
        for t in _leaves(obj):
            if t.dtype == torch.bool:
                t.logical_not_()
            elif t.is_complex() or t.is_floating_point():
                t.mul_(-1.5).add_(1)
            else:
                t.add_(3)


def _leaves(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _leaves(v)]
    return []


def first_sync(sender, receiver, plan, into=None):
    """The first sync: put, make the receiver's plan from its ticket, get it."""
    ticket = sender.put(plan)
    rplan = receiver.plan(ticket, into=into)
    receiver.get(ticket, into=rplan)
    return rplan


def idle(sender) -> bool:
    return wait_until(lambda: pool_empty(sender.pool) and sender.stats()["live_tickets"] == 0, 5.0)


# -- replays -------------------------------------------------------------------------------


def test_planned_syncs_carry_every_change_into_the_same_objects(sender, receiver):
    obj = state_dict(1)
    plan = sender.plan(obj)
    assert isinstance(plan, SendPlan) and plan.num_tensors == len(_leaves(obj))
    ticket = sender.put(plan)
    rplan = receiver.plan(ticket)
    assert isinstance(rplan, RecvPlan)
    first = receiver.get(ticket, into=rplan)
    assert_same(first, obj)
    for _ in range(3):
        bump(obj)
        ticket = sender.put(plan)
        got = receiver.get(ticket, into=rplan)
        assert got is first  # the same structure and tensor objects, every time
        assert_same(got, obj)
        sender.wait_released(ticket, timeout=10.0)
    assert idle(sender)


def test_planned_get_into_existing_tensors_of_any_shape_of_memory(sender, receiver):
    obj = state_dict(2)
    plan = sender.plan(obj)
    g = torch.Generator().manual_seed(9)
    targets = state_dict(3)  # same layout, other values
    # A transposed (non-contiguous) target is written through a kept staging buffer.
    targets["layers"][0]["w"] = make_tensor(g, torch.float32, (32, 64)).t()
    rplan = first_sync(sender, receiver, plan, into=targets)
    for _ in range(2):
        bump(obj)
        before = targets["layers"][1]["w"]._version
        assert receiver.get(sender.put(plan), into=rplan) is targets
        assert_same(targets, obj)
        assert targets["layers"][1]["w"]._version > before  # autograd sees the in-place write
    assert idle(sender)


def test_views_of_one_flat_buffer_are_one_copy_each_side(sender, receiver):
    flat = torch.arange(100_000, dtype=torch.float32)
    views = list(flat.view(1000, 100).unbind(0))
    plan = sender.plan(views)
    assert plan.copy_runs == 1
    ticket = sender.put(plan)
    rplan = receiver.plan(ticket, into=[torch.empty(100) for _ in range(1000)])
    assert rplan.coords(tuple(n for _, n in ticket.blocks) or (ticket.total_nbytes,)).copy.num_runs == 1000  # targets apart
    own = receiver.plan(ticket)
    sender.discard(ticket)  # only planned from
    flat.add_(7)
    ticket = sender.put(plan, readers=2)
    got = receiver.get(ticket, into=own)
    assert torch.equal(torch.stack(got), flat.view(1000, 100))
    receiver.get(ticket, into=rplan)
    assert torch.equal(torch.stack(rplan.result), flat.view(1000, 100))
    assert idle(sender)


def test_tied_tensors_in_a_plan(sender, receiver):
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
    model[1].weight = model[0].weight  # tied, as in GPT-2
    plan = sender.plan(model)
    twin = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))  # untied here
    rplan = first_sync(sender, receiver, plan, into=twin.state_dict())
    with torch.no_grad():
        model[0].weight.add_(1)
    receiver.get(sender.put(plan), into=rplan)
    assert torch.equal(twin[0].weight, model[0].weight) and torch.equal(twin[1].weight, model[0].weight)


def test_a_plan_of_an_object_larger_than_the_pool_streams(transport, receiver):
    with Sender(transport, capacity_nbytes=1 * MiB) as sender:
        g = torch.Generator().manual_seed(4)
        obj = [make_tensor(g, torch.float32, (300_000,)), make_tensor(g, torch.float64, (100_000,)), make_tensor(g, torch.int16, (999,))]
        plan = sender.plan(obj)
        ticket = sender.put(plan)
        assert ticket.streamed
        rplan = receiver.plan(ticket)
        targets = [torch.empty_like(t) for t in obj]
        tplan = receiver.plan(ticket, into=targets)
        assert_same(receiver.get(ticket, into=rplan), obj)
        bump(obj)
        ticket = sender.put(plan)
        receiver.get(ticket, into=tplan)
        assert_same(targets, obj)
        assert idle(sender)


def test_a_ticket_of_several_blocks_lands_by_the_kept_runs(transport, receiver):
    # A plain put into a fragmented pool splits the object over several
    # blocks; a plan follows whatever blocks a ticket has.
    with Sender(transport, capacity_nbytes=1 * MiB) as sender:
        pool = sender.pool
        hold = [pool.pack(torch.zeros(n // 4)) for n in (300_000, 300_000, 300_000)]
        hold[1].release()
        # 250,000 bytes fit the 300,000-byte hole, 120,000 the 148,576-byte tail.
        obj = [torch.arange(62_500, dtype=torch.float32), torch.arange(15_000, dtype=torch.int64) * 3]
        ticket = sender.put(obj, one_shot=True)
        assert len(ticket.blocks) > 1, ticket.blocks
        targets = [torch.zeros(62_500), torch.zeros(15_000, dtype=torch.int64)]
        tplan = receiver.plan(ticket, into=targets)
        own = receiver.plan(ticket)
        sender.discard(ticket)  # only planned from
        sender.wait_released(ticket, timeout=5.0)
        ticket = sender.put(obj, readers=2, one_shot=True)
        assert len(ticket.blocks) > 1
        receiver.get(ticket, into=tplan)
        assert_same(targets, obj)
        assert_same(receiver.get(ticket, into=own), obj)
        for p in hold:
            p.release()


def test_dtype_converts_floating_point_only(sender, receiver):
    g = torch.Generator().manual_seed(5)
    flat = make_tensor(g, torch.float32, (10_000,))
    obj = {
        "w": flat[:6000].view(60, 100),
        "b": flat[6000:],
        "t": make_tensor(g, torch.float64, (30, 20)).t(),  # non-contiguous: converted value by value
        "steps": torch.arange(5, dtype=torch.int64),
        "mask": torch.ones(4, dtype=torch.bool),
    }
    plan = sender.plan(obj, dtype=torch.bfloat16)
    assert plan.total_nbytes < sum(t.numel() * t.element_size() for t in obj.values())
    assert [plan.layout.dtype_names()[i] for i in range(5)] == ["bfloat16", "bfloat16", "bfloat16", "int64", "bool"]
    rplan = first_sync(sender, receiver, plan)
    bump(obj)
    got = receiver.get(sender.put(plan), into=rplan)
    for k, v in obj.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


def test_dtype_conversion_across_streamed_pieces(transport, receiver):
    with Sender(transport, capacity_nbytes=1 * MiB) as sender:
        flat = torch.randn(700_000)  # 2.8 MB of fp32, 1.4 MB sent: pieces cut the run
        plan = sender.plan([flat[:400_001], flat[400_001:]], dtype=torch.float16)
        ticket = sender.put(plan)
        assert ticket.streamed
        got = receiver.get(ticket, into=receiver.plan(ticket))
        assert torch.equal(torch.cat(got), flat.to(torch.float16))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "bfloat16"])
def test_dtype_must_be_a_floating_point_dtype(sender, dtype):
    with pytest.raises(ConfigurationError, match="floating-point"):
        sender.plan([torch.zeros(3)], dtype=dtype)


def test_empty_and_zero_size_plans(sender, receiver):
    for obj in ({}, [torch.empty(0), {"z": torch.empty(2, 0)}]):
        plan = sender.plan(obj)
        ticket = sender.put(plan)
        got = receiver.get(ticket, into=receiver.plan(ticket))
        assert_same(got, obj)


# -- stale plans and misuse -------------------------------------------------------------------


def test_module_plans_refuse_moved_or_replaced_parameters(sender):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    either = r"'(0\.weight|1\.running_mean)' (moved|is no longer)"
    cases = [
        (r"'0\.weight' moved", lambda: setattr(model[0].weight, "data", torch.zeros(8, 4))),
        # These give parameters new memory (or new objects) and buffers new
        # objects: whichever comes first in the state dict is named.
        (either, lambda: model.load_state_dict({**model.state_dict(), "1.running_mean": torch.ones(8)}, assign=True)),
        (r"'1\.running_var' is no longer", lambda: model[1].register_buffer("running_var", torch.ones(8))),
        (either, lambda: model.to(torch.float64)),
    ]
    for pattern, change in cases:
        plan = sender.plan(model)
        change()
        with pytest.raises(PlanStaleError, match=pattern):
            sender.put(plan)
        assert sender.stats()["live_tickets"] == 0 and pool_empty(sender.pool)


def test_a_tensor_swapped_for_one_without_memory_makes_the_plan_stale(sender, receiver):
    # torch.utils.swap_tensors keeps the Parameter object but gives it a
    # sparse tensor's insides: no data pointer to read. Both sides say the
    # plan is stale (never a bare RuntimeError, never a crash), nothing moved.
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    plan = sender.plan(model)
    torch.utils.swap_tensors(model[1].weight, torch.nn.Parameter(torch.ones(2, 8).to_sparse()))
    with pytest.raises(PlanStaleError, match="'1.weight' has no memory of its own any more.*nothing was sent"):
        sender.put(plan)
    assert sender.stats()["live_tickets"] == 0 and pool_empty(sender.pool)

    obj = [torch.ones(3), torch.ones(5)]
    targets = [torch.zeros(3), torch.zeros(5)]
    rplan = first_sync(sender, receiver, sender.plan(obj), into=targets)
    torch.utils.swap_tensors(targets[1], torch.zeros(5).to_sparse())
    obj[0].fill_(7.0)
    ticket = sender.put(obj)
    with pytest.raises(PlanStaleError, match="#1 has no memory of its own any more.*nothing was written"):
        receiver.get(ticket, into=rplan)
    assert targets[0].eq(1).all()
    sender.discard(ticket)


def test_plain_plans_refuse_moved_and_regrown_tensors(sender):
    a, b, c = torch.zeros(10), torch.zeros(10), torch.zeros(10)
    plan = sender.plan({"a": a, "b": b, "c": c})
    b.resize_(100_000)  # grows: new memory
    with pytest.raises(PlanStaleError, match="'b' moved from address .* and was resized from 10 to 100,000"):
        sender.put(plan)
    plan = sender.plan({"a": a, "b": b, "c": c})
    c.set_(torch.ones(10).untyped_storage())  # the same shape in other memory
    with pytest.raises(PlanStaleError, match="'c' moved"):
        sender.put(plan)
    assert pool_empty(sender.pool)


def test_a_tensor_re_viewed_in_place_makes_the_plan_stale_on_both_sides(sender, receiver):
    # The same storage and address in another layout: a kept plan would
    # send (or write) the bytes in the planned order under the planned
    # shape, which is no longer the tensor's. Each change is refused by name.
    changes = [
        (lambda w: w.t_(), r"'w' was \(4, 6\) with strides \(6, 1\) and is \(6, 4\) with strides \(1, 6\)"),
        (lambda w: setattr(w, "data", w.data.view(6, 4)), r"'w' was \(4, 6\) .* is \(6, 4\) with strides \(4, 1\)"),
        (lambda w: w.resize_(2, 6), r"'w' was \(4, 6\) .* is \(2, 6\)"),  # shrinks: the address stays
        (lambda w: w.as_strided_((4, 3), (6, 2)), r"'w' was \(4, 6\) .* is \(4, 3\) with strides \(6, 2\)"),
    ]
    for change, pattern in changes:
        w = torch.arange(24, dtype=torch.float32).view(4, 6).clone()
        plan = sender.plan({"w": w, "b": torch.ones(3)})
        change(w)
        with pytest.raises(PlanStaleError, match=pattern + ".*nothing was sent"):
            sender.put(plan)
        assert sender.stats()["live_tickets"] == 0 and pool_empty(sender.pool)
        assert not plan.matches({"w": w, "b": plan.source["b"]})

    obj = [torch.arange(12, dtype=torch.float32).view(3, 4)]
    targets = [torch.zeros(3, 4)]
    rplan = first_sync(sender, receiver, sender.plan(obj), into=targets)
    targets[0].t_()
    ticket = sender.put(obj)
    with pytest.raises(PlanStaleError, match=r"#0 was \(3, 4\) .* is \(4, 3\).*nothing was written"):
        receiver.get(ticket, into=rplan)
    assert targets[0].t().equal(obj[0])  # as the first sync left it
    sender.discard(ticket)


def test_matches_needs_the_planned_shapes_strides_and_dtypes_not_only_the_memory(sender):
    flat = torch.arange(24, dtype=torch.float32)
    plan = sender.plan([flat[:12].view(3, 4), flat[12:]])
    assert plan.matches([flat[:12].view(3, 4), flat[12:]])  # new tensor objects, the same views
    assert not plan.matches([flat[:12].view(4, 3), flat[12:]])  # same address and size
    assert not plan.matches([flat[:12].view(3, 4).t(), flat[12:]])
    assert not plan.matches([flat[:12].view(3, 4), flat[12:].view(torch.int32)])
    assert not plan.matches([flat[:12].view(3, 4), flat[12:].view(3, 4)])
    assert not plan.matches([flat[:12].view(3, 4)])


def test_many_separate_targets_are_marked_written_while_the_bytes_land(sender, receiver):
    # 5,000 separate targets: their version counters are bumped on a copy
    # thread during the get, and all of them by the time it returns; a
    # backward that saved one of them refuses the new values.
    obj = [torch.full((3,), float(i)) for i in range(5000)]
    targets = [torch.zeros(3, requires_grad=True) for _ in obj]
    plan = sender.plan(obj)
    rplan = first_sync(sender, receiver, plan, into=targets)
    saved = targets[4321] * targets[4321]  # mul saves its inputs
    before = [t._version for t in targets]
    bump(obj)
    receiver.get(sender.put(plan), into=rplan)
    assert all(t._version > v for t, v in zip(targets, before))
    assert_same(targets, obj)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_inference_targets_are_written_and_left_out_of_the_marking(sender, receiver):
    # Targets made under inference_mode have no version counter: the plan
    # marks only the others (views through their base), and the bytes land
    # in all of them.
    obj = [torch.full((4,), float(i)) for i in range(6000)]
    with torch.inference_mode():
        inf = [torch.zeros(4) for _ in range(3000)]
    flat = torch.zeros(3000 * 4)
    targets = inf + list(flat.split(4))
    plan = sender.plan(obj)
    rplan = first_sync(sender, receiver, plan, into=targets)
    assert len(rplan._versioned) == 1 and rplan._versioned[0] is flat
    before = flat._version
    bump(obj)
    receiver.get(sender.put(plan), into=rplan)
    assert_same(targets, obj)
    assert flat._version > before


def test_strided_and_untied_inference_targets_are_written(sender, receiver):
    # Inference tensors refuse in-place writes outside inference_mode: the
    # targets not written by address (strided; the second of a tied pair
    # untied on this side) get theirs inside it, fresh and planned.
    w = torch.arange(24.0).view(6, 4)
    obj = {"a": w, "b": w, "c": torch.ones(3), "d": w * 2}  # a and b tied
    with torch.inference_mode():
        ta, tb, tc = torch.zeros(4, 6), torch.zeros(6, 4), torch.zeros(3)
    # A plain strided target beside them (copied in the same mode) is
    # still marked written for autograd.
    td = torch.zeros(4, 6, requires_grad=True)
    into = {"a": ta.t(), "b": tb, "c": tc, "d": td.t()}
    before = td._version
    receiver.get(sender.put(obj), into=into)
    assert_same(into, obj)
    assert td._version > before
    plan = sender.plan(obj)
    rplan = first_sync(sender, receiver, plan, into=into)
    bump(obj)
    receiver.get(sender.put(plan), into=rplan)
    assert_same(into, obj)


def test_views_of_flat_buffers_are_checked_while_their_bytes_move(sender, receiver):
    # 64 views of two flat buffers: the plan holds the two storages and
    # checks the views on a copy thread during the copy into the pool. A
    # view moved (its old memory still held by the plan) or a buffer grown
    # (its memory moved) is refused all the same, and the pool is as it was.
    flat_a, flat_b = torch.arange(4096, dtype=torch.float32), torch.arange(4096, dtype=torch.float64)
    views = {f"a{i}": v for i, v in enumerate(flat_a.split(128))} | {f"b{i}": v for i, v in enumerate(flat_b.split(128))}
    plan = sender.plan(views)
    rplan = first_sync(sender, receiver, plan)
    assert plan._watch.storages is not None and len(plan._watch.storages.storages) == 2
    bump(views)
    receiver.get(sender.put(plan), into=rplan)
    assert_same(rplan.result, views)

    views["a7"].data = torch.zeros(128)  # rebound: other memory
    with pytest.raises(PlanStaleError, match=r"'a7' moved from address"):
        sender.put(plan)
    assert idle(sender)

    views["a7"] = flat_a[7 * 128 : 8 * 128]
    plan = sender.plan(views)
    flat_b.resize_(1 << 20)  # the storage grows: its memory moves, every view of it is stale
    with pytest.raises(PlanStaleError, match=r"'b0' \(a storage of 32,768 bytes at .*\) moved to"):
        sender.put(plan)
    assert idle(sender)


def test_storages_that_share_an_address_are_each_held_and_checked(sender):
    # b aliases a's memory through DLPack: two storages, one address. Growing
    # a moves its memory (b's view of it dangles): the plan held and checked
    # both, so the put refuses before its copy reads the old address.
    a = torch.arange(4096, dtype=torch.float32)
    b = torch.from_dlpack(a)
    views = {f"a{i}": v for i, v in enumerate(a.split(256))} | {f"b{i}": v for i, v in enumerate(b.split(256))}
    plan = sender.plan(views)
    assert len(plan._watch.storages.storages) == 2
    a.resize_(1 << 22)
    with pytest.raises(PlanStaleError, match="moved"):
        sender.put(plan)
    assert idle(sender)


def test_a_stale_plan_says_so_even_where_the_copy_trips_first(sender):
    # A value-copied tensor (a transposed view) replaced by one of another
    # size trips the copy, which runs beside the check: the error is the
    # stale plan, and the memory its tensors left is let go.
    flat = torch.arange(4096, dtype=torch.float32)
    views = {f"v{i}": v for i, v in enumerate(flat.split(256))}
    views["t"] = torch.arange(9, dtype=torch.float32).view(3, 3).t()
    plan = sender.plan(views)
    assert plan._watch.storages is not None
    views["t"].set_(torch.zeros(64))
    with pytest.raises(PlanStaleError, match="'t' moved"):
        sender.put(plan)
    assert plan._watch.storages is None and idle(sender)
    with pytest.raises(PlanStaleError):
        sender.put(plan)  # still stale, checked first now


def test_a_stale_plan_into_a_full_pool_says_it_is_stale(sender):
    plan = sender.plan([torch.zeros(3 << 20, dtype=torch.uint8)])  # 3 MiB of the 8 MiB pool
    hold = sender.put(plan, readers=None), sender.put(plan, readers=None)
    plan.source[0].data = torch.zeros(3 << 20, dtype=torch.uint8)
    with pytest.raises(PlanStaleError):
        sender.put(plan, one_shot=True)
    for t in hold:
        sender.discard(t)
    assert idle(sender)


def test_a_plan_belongs_to_its_sender_and_receiver(transport, sender, receiver):
    plan = sender.plan([torch.ones(4)])
    ticket = sender.put(plan)
    rplan = receiver.plan(ticket)
    with Sender(transport) as other:
        with pytest.raises(ConfigurationError, match="another Sender"):
            other.put(plan)
    with Receiver(transport) as other:
        with pytest.raises(ConfigurationError, match="another Receiver"):
            other.get(ticket, into=rplan)
    receiver.get(ticket, into=rplan)  # the slot was not taken by the refusals
    with Sender(transport) as closing:
        p = closing.plan([torch.ones(2)])
    with pytest.raises(ConfigurationError, match="closed"):
        closing.put(p)
    with Receiver(transport) as closing_r:
        rp = closing_r.plan(ticket)
    with pytest.raises(ConfigurationError, match="closed"):
        closing_r.get(ticket, into=rp)


def test_a_ticket_of_another_layout_is_refused_before_any_slot_is_taken(sender, receiver):
    plan_a = sender.plan({"w": torch.ones(4, 4)})
    plan_b = sender.plan({"w": torch.ones(4, 5)})
    rplan = first_sync(sender, receiver, plan_a)
    other = sender.put(plan_b)
    with pytest.raises(LayoutMismatchError, match=r"shape \(4, 5\), planned \(4, 4\)"):
        receiver.get(other, into=rplan)
    assert torch.equal(receiver.get(other)["w"], torch.ones(4, 5))  # the slot was still there


def test_plan_from_ticket_bytes_and_a_forged_size(sender, receiver):
    ticket = sender.put(sender.plan([torch.ones(8)]))
    receiver.plan(ticket.to_bytes())  # bytes are fine
    import msgspec

    forged = msgspec.structs.replace(ticket, total_nbytes=ticket.total_nbytes + 16)
    from tensorferry import TicketError

    with pytest.raises(TicketError, match="packs into"):
        receiver.plan(forged)


# -- snapshot=False -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_snapshot_false_serves_the_tensors_themselves(kind):
    require(kind)
    with Sender(kind, capacity_nbytes=1 * MiB) as sender, Receiver(kind, timeout=20.0) as receiver:
        flat = torch.randn(600_000)  # 2.4 MB: more than the pool, served in pieces
        obj = {"a": flat[:1000].view(10, 100), "b": torch.arange(7, dtype=torch.int16), "c": flat[1000:]}
        plan = sender.plan(obj)
        rplan = first_sync(sender, receiver, plan)
        targets = {k: torch.empty_like(v) for k, v in obj.items()}
        tplan = first_sync(sender, receiver, plan, into=targets)
        assert idle(sender)
        for _ in range(2):
            bump(obj)
            ticket = sender.put(plan, snapshot=False, readers=2)
            assert pool_empty(sender.pool)  # nothing copied into the pool
            with pytest.raises(PlanBusyError, match="wait_released"):
                sender.put(plan, snapshot=False)
            assert_same(receiver.get(ticket, into=rplan), obj)
            receiver.get(ticket, into=tplan)
            assert_same(targets, obj)
            sender.wait_released(ticket, timeout=10.0)
        assert_same(receiver.get(sender.put(plan, snapshot=False)), obj)  # a plain get reads it too


def test_snapshot_false_is_refused_where_it_cannot_work(transport, sender):
    plan = sender.plan([torch.ones(4)])
    if transport == "nixl":
        with pytest.raises(ConfigurationError, match="tcp transport sends"):
            sender.put(plan, snapshot=False)
    with pytest.raises(ConfigurationError, match="needs a plan"):
        sender.put([torch.ones(4)], snapshot=False)
    if transport != "nixl":
        with pytest.raises(ConfigurationError, match="converts dtypes"):
            sender.put(sender.plan([torch.ones(4)], dtype=torch.float16), snapshot=False)
        with pytest.raises(ConfigurationError, match="not dense host memory"):
            sender.put(sender.plan([torch.ones(4, 3).t()]), snapshot=False)
    assert pool_empty(sender.pool) and sender.stats()["live_tickets"] == 0


def test_a_nixl_receiver_cannot_take_a_snapshot_false_ticket():
    require("nixl")
    with Sender("tcp", extra_transports=("nixl",)) as sender, Receiver("nixl") as receiver:
        plan = sender.plan([torch.ones(4)])
        ticket = sender.ticket_for(sender.put(plan, snapshot=False), "nixl")
        with pytest.raises(TransferError, match="snapshot=False"):
            receiver.get(ticket)


def _sourced_sender(kind: str, rounds: int, out_q, in_q) -> None:
    from tensorferry import Sender

    obj = state_dict(12, scale=64)
    with Sender(kind, capacity_nbytes=256 << 10) as sender:
        plan = sender.plan(obj)
        for _ in range(rounds):
            bump(obj)
            ticket = sender.put(plan, snapshot=False)
            out_q.put(ticket.to_bytes())
            sender.wait_released(ticket, timeout=30.0)
            in_q.get()
        out_q.put(sender.stats()["used_nbytes"])


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_snapshot_false_from_another_process(kind):
    # shm readers copy the sender's tensors out of its memory (process_vm_readv).
    def streamed(ticket: Ticket) -> None:
        assert ticket.streamed  # more than the sender's small pool: pieces

    def pool_unused(out_q) -> None:
        assert out_q.get(timeout=30) == 0  # the sender's pool never held any of it

    _replayed_from_another_process(_sourced_sender, kind, 2, state_dict(12, scale=64), each=streamed, after=pool_unused)


def _replayed_from_another_process(sender_main, transport: str, rounds: int, want, *, each=None, after=None) -> None:
    """``sender_main(transport, rounds, out_q, in_q)`` in a spawned process
    puts its plan ``rounds`` times; each ticket is received into one kept
    receive plan and must equal ``want`` bumped once more (``each(ticket)``
    checks it first); ``after(out_q)`` reads what the sender reports last."""
    ctx = mp.get_context("spawn")
    out_q, in_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=sender_main, args=(transport, rounds, out_q, in_q), daemon=True)
    proc.start()
    try:
        with Receiver(transport, timeout=30.0) as receiver:
            rplan = None
            for _ in range(rounds):
                ticket = Ticket.from_bytes(out_q.get(timeout=120))
                if each is not None:
                    each(ticket)
                rplan = rplan or receiver.plan(ticket)
                got = receiver.get(ticket, into=rplan)
                bump(want)
                assert_same(got, want)
                in_q.put(None)
        if after is not None:
            after(out_q)
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        gc.collect()


# -- another process ------------------------------------------------------------------------------


def _plan_sender(transport: str, rounds: int, out_q, in_q) -> None:
    os.environ["UCX_NET_DEVICES"] = "lo"
    from tensorferry import Sender

    obj = state_dict(11, scale=8)
    with Sender(transport, capacity_nbytes=8 * MiB) as sender:
        plan = sender.plan(obj)
        for _ in range(rounds):
            bump(obj)
            ticket = sender.put(plan)
            out_q.put(ticket.to_bytes())
            sender.wait_released(ticket, timeout=30.0)
            in_q.get()


def test_a_sender_process_replays_its_plan(transport):
    _replayed_from_another_process(_plan_sender, transport, 3, state_dict(11, scale=8))


def test_a_plan_into_a_module_checks_its_parameters_each_get(sender, receiver):
    src = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))
    dst = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))
    plan = sender.plan(src)
    rplan = first_sync(sender, receiver, plan, into=dst)
    assert rplan.result is dst
    with torch.no_grad():
        src[0].weight.add_(1)
    receiver.get(sender.put(plan), into=rplan)
    assert torch.equal(dst[0].weight, src[0].weight) and torch.equal(dst[1].bias, src[1].bias)
    dst[1].weight = torch.nn.Parameter(torch.zeros(4))  # replaced on the receiving side
    ticket = sender.put(plan)
    with pytest.raises(PlanStaleError, match=r"'1\.weight' is no longer"):
        receiver.get(ticket, into=rplan)
    assert torch.equal(dst[1].weight, torch.zeros(4))  # nothing written


def test_matches_tells_whether_a_fresh_state_dict_is_the_planned_memory(sender, receiver):
    model = torch.nn.Linear(5, 3)
    plan = sender.plan(model.state_dict())
    assert plan.matches(model.state_dict()) and plan.matches(model)
    rplan = first_sync(sender, receiver, plan, into=model.state_dict())
    assert rplan.matches(model.state_dict())
    model.weight.data = torch.zeros(3, 5)
    assert not plan.matches(model.state_dict()) and not rplan.matches(model.state_dict())
    assert not plan.matches({"weight": model.weight}) and not plan.matches([torch.zeros(1)])


# -- the buffer lists of tcp (scatter and snapshot=False) ------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 15), st.integers(1, 40)), min_size=0, max_size=12),
    tail=st.integers(0, 15),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_a_buffer_list_window_is_exactly_the_stream_range(runs, tail, cut):
    from tensorferry.plans._buffers import BufferList as _BufferList

    memory = np.arange(1000, dtype=np.uint8)
    pos, addr, n, at, mem_at = [], [], [], 0, 0
    expected = bytearray()
    for gap, k in runs:
        at += gap
        expected += bytes(gap)
        pos.append(at)
        addr.append(memory.ctypes.data + mem_at)
        n.append(k)
        expected += memory[mem_at : mem_at + k].tobytes()
        at += k
        mem_at += k
    total = at + tail
    expected += bytes(tail)
    bl = _BufferList(np.array(pos, dtype=np.int64), np.array(addr, dtype=np.int64), np.array(n, dtype=np.int64), total)
    lo, hi = sorted(int(c * total) for c in cut)
    got = b"".join(bytes(b) for b in bl.window(lo, hi))
    assert got == bytes(expected[lo:hi])
    assert b"".join(bytes(b) for b in bl.window(0, total)) == bytes(expected)


def test_the_c_copy_loop_is_built(c_loop):
    # The install builds it wherever a C compiler is (CI's machines): a
    # failed build would only show as slow syncs, so it is checked here.
    assert callable(c_loop.copy_runs) and callable(c_loop.convert_runs)


@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["as-is", "to-float16"])
@pytest.mark.parametrize("capacity", [8 * MiB, 16 << 10], ids=["resident", "streamed"])
def test_many_small_tensors_move_by_vectored_io(transport, receiver, dtype, capacity, copies):
    # Hundreds of small tensors apart in memory. With the C loop they move
    # as memmove runs; without it the sender writes them into the pool's
    # file with pwritev (or gathers them with torch.cat) and a shm receiver
    # reads its targets with preadv. Tensors that are converted or copied
    # value by value lie among them, written after the zeros the vectored
    # write puts in their place.
    g = torch.Generator().manual_seed(21)
    obj = []
    for i in range(600):
        kind = (torch.float32, torch.int16, torch.float64, torch.uint8)[i % 4]
        obj.append(make_tensor(g, kind, (i % 37 + 1,)))
    obj[5] = make_tensor(g, torch.float32, (9, 4)).t()  # not dense: value by value
    with Sender(transport, capacity_nbytes=capacity) as sender:
        plan = sender.plan(obj, dtype=dtype)
        assert plan._vectored == (copies == "python")
        targets = [torch.empty(t.shape, dtype=torch.float16 if dtype is not None and t.is_floating_point() else t.dtype) for t in obj]
        rplan = first_sync(sender, receiver, plan, into=targets)
        assert rplan.coords((plan.total_nbytes,)).small == (copies == "python")
        for _ in range(2):
            bump(obj)
            ticket = sender.put(plan)
            assert ticket.streamed == (capacity < plan.total_nbytes)
            receiver.get(ticket, into=rplan)
            want = [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in obj]
            assert_same(targets, want)
        assert idle(sender)


@pytest.mark.parametrize("copies", ["python"], indirect=True)
def test_a_large_gather_of_mixed_dtypes_splits_over_the_copy_threads(monkeypatch, copies):
    # Without the C loop: 56 MiB in 3,000 tensors of four dtypes (alignment
    # gaps between them, bridged with zeros) and a few converted ones: the
    # gather is cut into one torch.cat job per copy thread, seams inside tensors.
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", "3")
    g = torch.Generator().manual_seed(5)
    obj = [make_tensor(g, (torch.float32, torch.int16, torch.float64, torch.uint8)[i % 4], (5000 + i % 7,)) for i in range(3000)]
    with Sender("shm", capacity_nbytes=128 * MiB) as sender, Receiver("shm", timeout=20.0) as receiver:
        for dtype in (None, torch.bfloat16):
            plan = sender.plan(obj, dtype=dtype)
            assert plan._vectored and len(plan._gathers()) == 3
            rplan = first_sync(sender, receiver, plan)
            bump(obj)
            receiver.get(sender.put(plan), into=rplan)
            want = [t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in obj]
            assert_same(rplan.result, want)


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(1, 30), min_size=1, max_size=6)), min_size=1, max_size=6),
    k=st.integers(1, 5),
)
def test_gather_stretches_split_for_threads_cover_every_byte_once(shape, k):
    from tensorferry.plans import _send as plans

    stretches, at, fill = [], 0, 0
    for gap, sizes in shape:
        at += gap
        parts = []
        for n in sizes:
            parts.append(torch.arange(fill, fill + n, dtype=torch.int64).to(torch.uint8))
            fill += n
        n = sum(sizes)
        stretches.append((at, at + n, parts))
        at += n
    split = plans._split_stretches(stretches, k, min_nbytes=0)
    assert 1 <= len(split) <= k
    want, got = torch.zeros(at, dtype=torch.uint8), torch.full((at,), 7, dtype=torch.uint8)
    want.fill_(7)
    for start, end, parts in stretches:
        torch.cat(parts, out=want[start:end])
    for job in split:
        for start, end, parts in job:
            assert parts and end - start == sum(p.numel() for p in parts)
            torch.cat(parts, out=got[start:end])
    assert torch.equal(got, want)


@settings(max_examples=200, deadline=None)
@given(
    covered=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 30)), min_size=0, max_size=10),
    cuts_a=st.lists(st.integers(1, 300), max_size=8),
    cuts_b=st.lists(st.integers(1, 300), max_size=8),
)
def test_intersecting_two_cuttings_of_one_stream_maps_every_byte_once(covered, cuts_a, cuts_b):
    # The same covered bytes (tensors, gaps between) cut into runs two ways,
    # each run at an address of its own: the sender's runs and the
    # receiver's destinations of a snapshot=False piece.
    from tensorferry.transports._shm import _intersect

    spans, at = [], 0
    for gap, n in covered:
        at += gap
        spans.append((at, at + n))
        at += n

    def cut(points, base):
        pos, addr, length = [], [], []
        for lo, hi in spans:
            edges = sorted({lo, hi, *(p for p in points if lo < p < hi)})
            for a, b in zip(edges, edges[1:]):
                pos.append(a)
                addr.append(base + a)  # byte p of the stream sits at base + p
                length.append(b - a)
        return (np.array(v, dtype=np.int64) for v in (pos, addr, length))

    la, ra, lengths = _intersect(*cut(cuts_a, 10_000), *cut(cuts_b, 90_000))
    pos = la - 10_000
    assert np.array_equal(pos, ra - 90_000)  # both ends of each piece are the same stream byte
    assert (lengths > 0).all() and (pos[1:] >= pos[:-1] + lengths[:-1]).all()  # in order, apart
    covered_bytes = {p for lo, hi in spans for p in range(lo, hi)}
    assert {int(p) + i for p, n in zip(pos, lengths) for i in range(int(n))} == covered_bytes


@pytest.mark.parametrize("capacity", [8 * MiB, 16 << 10], ids=["one-piece", "pieces"])
def test_snapshot_false_into_many_small_targets_over_shm(capacity):
    # The receiver's kept runs (hundreds of targets) and the sender's runs
    # cut each piece differently; every byte lands where it belongs.
    g = torch.Generator().manual_seed(31)
    obj = [make_tensor(g, (torch.float32, torch.int16, torch.float64)[i % 3], (i % 29 + 1,)) for i in range(500)]
    with Sender("shm", capacity_nbytes=capacity) as sender, Receiver("shm", timeout=20.0) as receiver:
        plan = sender.plan(obj)
        targets = [torch.empty_like(t) for t in obj]
        rplan = first_sync(sender, receiver, plan, into=targets)
        own = first_sync(sender, receiver, plan)
        for _ in range(2):
            bump(obj)
            ticket = sender.put(plan, snapshot=False, readers=2)
            receiver.get(ticket, into=rplan)
            assert_same(targets, obj)
            assert_same(receiver.get(ticket, into=own), obj)
            sender.wait_released(ticket, timeout=10.0)
