"""``tensorferry.execution._trees.Trees``: two complementary binary trees,
who pulls each half of a broadcast from whom."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from tensorferry import ConfigurationError
from tensorferry.execution._broadcast import SENDER
from tensorferry.execution._trees import Trees
from tensorferry.transports import stripe_bounds


def _all_joined(n: int) -> tuple[Trees, dict[str, list[str]]]:
    """n relays join in order; each one's halves once every relay has joined."""
    t = Trees(n)
    places = {f"r{i}:1": t.join(f"r{i}:1") for i in range(n)}
    for relay, place in places.items():
        t.resolve(relay, place)
    return t, {relay: t.settle(relay, place) for relay, place in places.items()}


def _depth(sources: dict[str, list[str]], tree: int, relay: str) -> int:
    d = 1
    while (up := sources[relay][tree]) != SENDER:
        relay, d = up, d + 1
    return d


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=300))
def test_every_relay_is_interior_in_at_most_one_tree_and_uploads_about_one_object(n):
    t, sources = _all_joined(n)
    children = [{r: 0 for r in sources} for _ in (0, 1)]
    for relay, (a, b) in sources.items():
        for tree, up in ((0, a), (1, b)):
            if up != SENDER:
                children[tree][up] += 1
    for relay in sources:
        interior = [tree for tree in (0, 1) if children[tree][relay]]
        assert len(interior) <= 1, (relay, interior)
        # At most two children in its one tree: two halves, one object.
        assert children[0][relay] + children[1][relay] <= 2
    # The sender sends one half to each tree's root: one object in all.
    assert sum(1 for a, _ in sources.values() if a == SENDER) == 1
    assert sum(1 for _, b in sources.values() if b == SENDER) == 1
    # Each half reaches every relay within about log2(n) hops.
    deepest = max(_depth(sources, tree, r) for tree in (0, 1) for r in sources)
    assert deepest <= math.floor(math.log2(n)) + 1
    # No relay is its own ancestor in either tree (no waiting on itself).
    for tree in (0, 1):
        for r in sources:
            seen, node = set(), r
            while node != SENDER:
                assert node not in seen
                seen.add(node)
                node = sources[node][tree]


def test_sixteen_relays_two_mirrored_heaps():
    _, sources = _all_joined(16)
    a = [sources[f"r{i}:1"][0] for i in range(16)]
    b = [sources[f"r{i}:1"][1] for i in range(16)]
    assert a[:3] == [SENDER, "r0:1", "r0:1"] and a[15] == "r7:1"
    # Tree B is tree A's order mirrored: r15 is its root, r0 a leaf under r8.
    assert b[15] == SENDER and b[14] == "r15:1" and b[13] == "r15:1" and b[0] == "r8:1"


def test_a_parent_in_tree_b_joins_later_the_place_waits_for_it():
    t = Trees(4)
    first = t.join("r0:1")
    assert first == [SENDER, None]  # its parent in B, r2, is yet to join
    t.join("r1:1")
    t.join("r2:1")
    t.resolve("r0:1", first)
    assert first == [SENDER, "r2:1"]


def test_a_parent_that_never_joins_is_replaced_by_a_source_with_room():
    t = Trees(4)
    place = t.join("r0:1")
    assert t.settle("r0:1", place) == [SENDER, SENDER]  # B's root place is free: the sender
    # r1's parent in B (r2) has not joined either: B's sender place is
    # taken, so the one relay with room there, never r1 itself.
    assert t.settle("r1:1", t.join("r1:1")) == ["r0:1", "r0:1"]
    # r2's parent in B (r3) has not joined: r0 has room for a second child
    # there (r2 is below no one in B, so no relay is excluded).
    assert t.settle("r2:1", t.join("r2:1")) == ["r0:1", "r0:1"]
    # r3 is B's planned root: it takes its place at the sender (which then
    # serves B twice: it never refuses) and the plan holds from there on.
    assert t.settle("r3:1", t.join("r3:1")) == ["r1:1", SENDER]


def test_receivers_that_do_not_relay_take_no_place():
    t = Trees(3)
    assert t.join("") == [SENDER, SENDER]
    r = t.join("r0:1")
    t.settle("r0:1", r)
    assert t.join("") == ["r0:1", "r0:1"]  # room in both trees under the one relay
    assert t.order == ["r0:1"]


def test_a_receiver_on_a_host_with_a_relay_copies_both_halves_from_it():
    t = Trees(4)
    t.settle("10.0.0.2:7", t.join("10.0.0.2:7", host="10.0.0.2"))
    assert t.join("10.0.0.2:8", host="10.0.0.2") == ["10.0.0.2:7", "10.0.0.2:7"]
    assert t.order == ["10.0.0.2:7"]  # the second one took no place


def test_a_failed_relay_is_replaced_in_the_tree_of_the_half_it_failed():
    t, sources = _all_joined(8)
    # r1 is interior in A (children r3, r4); r3 lost it for half 0.
    assert sources["r3:1"][0] == "r1:1"
    new = t.reassign("r3:1", "r1:1", stripe=0)
    assert new not in ("r1:1", "r3:1") and "r1:1" in t.failed
    assert new not in t._below(0, "r3:1")
    # r1 is never named again, in either tree.
    assert "r1:1" not in (t.reassign("r4:1", "r1:1", stripe=0), t.reassign("r4:1", "r1:1", stripe=1))


def test_the_halves_are_page_aligned_and_cover_the_stream():
    assert stripe_bounds(10 << 20, 2) == [(0, 5 << 20), (5 << 20, 10 << 20)]
    assert stripe_bounds(4097 * 3, 2) == [(0, 4096), (4096, 4097 * 3)]
    assert stripe_bounds(100, 2) == [(0, 0), (0, 100)]  # under a page: one half holds it all
    with pytest.raises(ConfigurationError, match="stripes=0"):
        stripe_bounds(100, 0)


def test_a_relay_that_acquires_again_is_never_its_own_source():
    t = Trees(2)
    t.settle("10.0.0.2:7", t.join("10.0.0.2:7", host="10.0.0.2"))
    # The same relay's second slot (a second get of the ticket): it is
    # the only relay of its host, and must not pull from itself.
    assert "10.0.0.2:7" not in t.join("10.0.0.2:7", host="10.0.0.2")
