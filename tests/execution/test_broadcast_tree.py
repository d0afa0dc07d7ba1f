"""``tensorferry._broadcast.Tree``: who pulls a broadcast ticket from whom."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tensorferry.execution._broadcast import SENDER, Tree


def test_fanout_one_is_a_chain_in_the_order_receivers_joined():
    t = Tree(1)
    assert [t.join(f"r{i}:1") for i in range(4)] == [SENDER, "r0:1", "r1:1", "r2:1"]


def test_fanout_two_is_a_tree_filled_breadth_first():
    t = Tree(2)
    got = [t.join(f"r{i}:1") for i in range(7)]
    assert got == [SENDER, SENDER, "r0:1", "r0:1", "r1:1", "r1:1", "r2:1"]


def test_leaves_take_places_but_serve_no_one_and_the_sender_never_refuses():
    t = Tree(1)
    assert t.join("") == SENDER  # a leaf first: no relay below the sender
    assert t.join("r1:1") == SENDER  # every source full: the sender serves
    assert t.join("") == "r1:1"
    assert t.join("") == SENDER


def test_a_receiver_on_another_host_pulls_from_a_relay_of_its_own_host():
    t = Tree(1)
    assert t.join("10.0.0.2:7", host="10.0.0.2") == SENDER
    assert t.join("10.0.0.3:7", host="10.0.0.3") == "10.0.0.2:7"  # over the network, once per host
    # Two more on host 3: both from the relay there, past its fanout (no link crossed).
    assert t.join("10.0.0.3:8", host="10.0.0.3") == "10.0.0.3:7"
    assert t.join("", host="10.0.0.3") in ("10.0.0.3:7", "10.0.0.3:8")


def test_a_failed_relay_is_never_used_again_and_no_one_pulls_from_below_itself():
    t = Tree(1)
    for i in range(4):
        t.join(f"r{i}:1")  # sender -> r0 -> r1 -> r2 -> r3
    # r1 lost r0: r0's place at the sender is free again, and r1 takes it
    # (r2 and r3, below r1, are never its source).
    assert t.reassign("r1:1", "r0:1") == SENDER
    assert "r0:1" in t.failed and t.children[SENDER] == 1
    # r3 lost r2: r2's place under r1 frees, and r3 takes it: the chain
    # closes over the gap, the sender still sends one copy.
    assert t.reassign("r3:1", "r2:1") == "r1:1"
    assert t.failed == {"r0:1", "r2:1"}
    assert t.join("") == "r3:1"  # the one relay with room, never a failed one


def test_the_orphans_of_a_dead_relay_go_to_its_parent():
    t = Tree(1)
    assert [t.join(x) for x in ("a:1", "b:1", "c:1")] == [SENDER, "a:1", "b:1"]
    assert t.reassign("c:1", "b:1") == "a:1"  # b's place under a is free: no extra copy from the sender
    assert t.children == {SENDER: 1, "a:1": 1, "c:1": 0}


def test_a_group_is_laid_out_in_address_order_breadth_first():
    group = ("a:1", "b:1", "c:1", "d:1", "e:1")
    assert [Tree(1).planned(r, group) for r in group] == [SENDER, "a:1", "b:1", "c:1", "d:1"]
    assert [Tree(2).planned(r, group) for r in group] == [SENDER, SENDER, "a:1", "a:1", "b:1"]
    assert Tree(1).planned("z:1", group) is None and Tree(1).planned("a:1", None) is None and Tree(1).planned("", group) is None
    # Below a relay of its own host: no place (it copies from whichever of its host joined first).
    assert Tree(1).planned("10.0.0.2:8", ("10.0.0.1:7", "10.0.0.2:7", "10.0.0.2:8")) is None
    assert Tree(1).planned("10.0.0.2:7", ("10.0.0.1:7", "10.0.0.2:7", "10.0.0.2:8")) == "10.0.0.1:7"


def test_relays_take_their_planned_places_whatever_order_they_join_in():
    # Two senders' trees of the same group, joined in opposite orders: the
    # same chain (a relay passes each sender's stream to the same child).
    group = ("a:1", "b:1", "c:1")
    for order in (group, group[::-1], ("b:1", "a:1", "c:1")):
        t = Tree(1)
        got = {}
        waiting = list(order)
        while waiting:  # a relay joins once its planned source has (the ledger waits for it)
            r = next(r for r in waiting if t.joined(t.planned(r, group)))
            got[r] = t.join(r, planned=t.planned(r, group))
            waiting.remove(r)
        assert got == {"a:1": SENDER, "b:1": "a:1", "c:1": "b:1"}


def test_a_planned_source_that_is_absent_failed_or_full_gives_way_to_the_first_with_room():
    group = ("a:1", "b:1", "c:1")
    t = Tree(1)
    assert t.join("c:1", planned=t.planned("c:1", group)) == SENDER  # b has not joined: the sender has room
    assert t.join("b:1", planned=t.planned("b:1", group)) == "c:1"  # a has not joined either
    assert t.join("a:1", planned=t.planned("a:1", group)) == "b:1"  # the sender is full
    t = Tree(1)
    t.join("a:1", planned=SENDER)
    t.reassign("b:1", "a:1")
    assert not t.joined("a:1") and t.join("c:1", planned="a:1") == SENDER  # a failed: never a source again


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.booleans(), st.integers(0, 9)), max_size=30), st.lists(st.integers(0, 29), max_size=6),
       st.permutations(range(30)))
def test_sources_are_never_failed_never_below_and_fanout_holds_for_network_children(fanout, joins, failures, order):
    # Some relays join with a planned source: a group of an earlier broadcast
    # in another order than they join in, some of it absent.
    group = tuple(sorted(f"r{i}:1" for i in order[: len(order) // 2]))
    t = Tree(fanout)
    parent: dict[str, str] = {}
    names = []
    for i, (relays, _) in enumerate(joins):
        name = f"r{i}:1" if relays else ""
        src = t.join(name, planned=t.planned(name, group))
        if name:
            names.append(name)
            parent[name] = src
    for f in failures:
        if f < len(names):
            child = names[f]
            lost = parent.get(child, SENDER)
            if lost == SENDER:
                continue
            src = t.reassign(child, lost)
            assert src not in t.failed
            # The new source does not pull, directly or not, from the child.
            node, seen = src, set()
            while node and node not in seen:
                assert node != child
                seen.add(node)
                node = t.parent.get(node, SENDER)
            parent[child] = src
    # A relay never serves more than fanout receivers (the sender may: it never refuses).
    assert all(t.children.get(r, 0) <= fanout for r in t.relays if r not in t.failed)
