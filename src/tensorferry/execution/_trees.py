"""Two complementary binary trees: who pulls each half of a broadcast.

Sender side, pure bookkeeping (no sockets). A ticket put with
``trees=True`` is split into two halves (``transports._relay.stripe_bounds``),
and each half flows down a binary tree of its own over the relaying
receivers. The ``n`` reader slots are ``n`` places, taken by relays in the
order they join; place ``i`` is place ``i`` of tree A, laid out as a heap
(its parent is place ``(i - 1) // 2``, place 0 pulls from the sender), and
place ``n - 1 - i`` of tree B, laid out the same way. The interior places of
a heap of ``n`` are its first half, so the first half of the relays are
interior in A and leaves in B, the second half the other way round: each
relay passes on two half-copies in one tree and none in the other (one
object in all, as a chain's relay does), the sender one half to each root
(one object), and each half is at most about log2(n) hops deep. A relay
pulls its two halves from its two parents at the same time.

A relay's parent in B is a relay that joins after it (B is A's order
mirrored), so its Acquire waits for that parent (the ledger, a moment at
most: the relays of a broadcast acquire at about the same time); one that
has not joined by then, or has failed, is replaced by a source with room
in that tree, as in :class:`~tensorferry.execution._broadcast.Tree`.
Receivers that do not relay, and relays of a host that already has one
(they copy from it: no link crossed), take no place.
"""

from __future__ import annotations

from ._broadcast import SENDER, Tree, _host_of

__all__ = ["Trees", "relay_tree"]

# Children a relay serves in a tree where it is interior: a binary tree.
_DEGREE = 2
# Children the sender serves in each tree: the root.
_ROOTS = 1


class Trees:
    """The relays of one two-tree broadcast ticket and who pulls each half
    from whom.

    Args:
        readers: the ticket's reader slots: the places of each tree.
    """

    stripes = 2
    fanout = _DEGREE  # the range sets of a sharded get's readers are plain trees of this fanout

    def __init__(self, readers: int) -> None:
        self.n = max(1, readers)
        self.order: list[str] = []  # relays with a place, in the order they joined (place i)
        self.place: dict[str, int] = {}  # relay -> its place
        self.relays: list[str] = []  # every relay that joined (with a place or not)
        self.children: tuple[dict[str, int], dict[str, int]] = ({SENDER: 0}, {SENDER: 0})
        self.parent: tuple[dict[str, str], dict[str, str]] = ({}, {})  # per tree: relay -> its source
        self.failed: set[str] = set()

    # -- placing -----------------------------------------------------------------------

    def join(self, relay: str, host: str = "") -> list[str | None]:
        """A receiver acquired (``relay``: where it serves children, ``""``
        if it does not; ``host``: its address as the sender sees it, when
        not the sender's own): the source of each half, None where that is
        a relay yet to join (:meth:`resolve` again, then :meth:`settle`)."""
        local = self._local(host, relay)
        new = bool(relay) and relay not in self.children[0] and relay not in self.failed
        if new:
            self._add(relay)
        if local:
            return [self._take(t, local, relay if new else "") for t in (0, 1)]
        if not new:
            # A leaf, or a relay's second slot: a source with room, never
            # itself nor below it (its own place, if any, stays as it is).
            return [self._take(t, self._pick(t, relay), "") for t in (0, 1)]
        self.place[relay] = len(self.order)
        self.order.append(relay)
        place: list[str | None] = [None, None]
        self.resolve(relay, place)
        return place

    def _add(self, relay: str) -> None:
        self.relays.append(relay)
        for t in (0, 1):
            self.children[t][relay] = 0

    def resolve(self, relay: str, place: list[str | None]) -> None:
        """Fill in the halves of ``place`` whose planned parent has joined
        since (or failed: then any source with room)."""
        i = self.place.get(relay)
        if i is None:
            return
        for t in (0, 1):
            if place[t] is not None:
                continue
            j = self.parent_place(t, i)
            if j < 0:
                place[t] = self._take(t, SENDER, relay)
            elif j >= self.n:
                place[t] = self._take(t, self._pick(t, relay), relay)  # no place in this tree: any with room
            elif j < len(self.order):
                above = self.order[j]
                place[t] = self._take(t, above if above not in self.failed else self._pick(t, relay), relay)

    def settle(self, relay: str, place: list[str | None]) -> list[str]:
        """``place`` with every half still open given a source with room
        (not below ``relay`` in that tree), the sender if none has."""
        return [p if p is not None else self._take(t, self._pick(t, relay), relay) for t, p in enumerate(place)]

    def parent_place(self, tree: int, i: int) -> int:
        """The place (join order) of place ``i``'s parent in ``tree`` (0: A,
        1: B); -1: the sender; ``n`` or more: ``i`` has no place in it."""
        if i >= self.n:
            return self.n
        p = i if tree == 0 else self.n - 1 - i
        if p == 0:
            return -1
        q = (p - 1) // 2
        return q if tree == 0 else self.n - 1 - q

    def interior(self, tree: int, i: int) -> bool:
        """Whether place ``i`` has children in ``tree`` (when every place is taken)."""
        p = i if tree == 0 else self.n - 1 - i
        return 0 <= p and 2 * p + 1 < self.n

    # -- faults ------------------------------------------------------------------------

    def reassign(self, relay: str, failed: str, stripe: int = 0) -> str:
        """The receiver (serving at ``relay``, or ``""``) lost ``failed``, its
        source of half ``stripe``: mark that one failed (in both trees: it
        is gone) and pick another source of that half not below the receiver."""
        if failed and failed != SENDER and failed not in self.failed:
            self.failed.add(failed)
            for t in (0, 1):
                self.children[t].pop(failed, None)
                up = self.parent[t].pop(failed, None)
                if up is not None and up in self.children[t]:
                    self.children[t][up] = max(0, self.children[t][up] - 1)
        return self._take(stripe, self._pick(stripe, relay), relay)

    # -- what the ledger asks of any tree ----------------------------------------------

    def joined(self, source: str) -> bool:
        return source == SENDER or (source in self.children[0] and source not in self.failed)

    def members(self) -> tuple[str, ...]:
        """No group is remembered from trees: places follow the join order."""
        return ()

    # -- internals ---------------------------------------------------------------------

    def _take(self, tree: int, source: str, relay: str) -> str:
        self.children[tree][source] = self.children[tree].get(source, 0) + 1
        if relay:
            self.parent[tree][relay] = source
        return source

    def _pick(self, tree: int, relay: str) -> str:
        """A source of ``tree``'s half with room for ``relay``: the sender
        while its root place is free, then relays interior in that tree by
        plan (a leaf of it would upload more than one object), then any."""
        if self.children[tree][SENDER] < _ROOTS:
            return SENDER
        exclude = self._below(tree, relay) | {relay} if relay else set()
        planned = [r for i, r in enumerate(self.order) if self.interior(tree, i)]
        chosen = set(planned)
        for r in planned + [r for r in self.relays if r not in chosen]:
            if r not in self.failed and r not in exclude and self.children[tree].get(r, _DEGREE) < _DEGREE:
                return r
        return SENDER  # every source full, or failed: the sender never refuses

    def _local(self, host: str, relay: str) -> str:
        """A relay on ``host`` other than ``relay`` (the one with the fewest children), or ``""``."""
        if not host:
            return ""
        local = [r for r in self.relays if r not in self.failed and r != relay and _host_of(r) == host]
        return min(local, key=lambda r: self.children[0].get(r, 0) + self.children[1].get(r, 0)) if local else ""

    def _below(self, tree: int, relay: str) -> set[str]:
        """Relays that pull ``tree``'s half, directly or not, from ``relay``."""
        out: set[str] = set()
        frontier = [relay]
        while frontier:
            node = frontier.pop()
            for r, p in self.parent[tree].items():
                if p == node and r not in out:
                    out.add(r)
                    frontier.append(r)
        return out


def relay_tree(fanout: int | None, trees: bool, readers: int) -> Tree | Trees | None:
    """Who pulls a broadcast from whom: two complementary trees over
    ``readers`` places (``trees``), a tree of ``fanout`` (a chain for 1),
    or None (no broadcast: every reader pulls from the sender)."""
    if trees:
        return Trees(readers)
    return Tree(fanout) if fanout else None
