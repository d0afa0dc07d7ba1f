"""Who pulls a broadcast ticket from whom: the sender's tree of relays.

Sender side, pure bookkeeping (no sockets). A ticket put with ``fanout=k``
is served by the sender to at most ``k`` receivers itself; every later
receiver is told to pull from a relay: a receiver that relays (it said so
when it acquired) and has fewer than ``k`` children. Relays are filled in
the order they joined, so ``k=1`` makes a chain and larger ``k`` a tree of
depth about log_k(N). Each host's link then carries the object about once
in and ``k`` times out, instead of the sender's link carrying it N times.

A relay that dies or stalls is reported by its children (they ask again,
naming it); it is never assigned again, and each child is given the sender
or another relay that is not below it (no cycles), and resumes from the
bytes it already holds.
"""

from __future__ import annotations

__all__ = ["SENDER", "Tree"]

SENDER = ""
"""The source that means "the sender itself"."""


class Tree:
    """The relays of one broadcast ticket and who pulls from whom.

    Args:
        fanout: the most children the sender and each relay serve.
    """

    def __init__(self, fanout: int) -> None:
        self.fanout = fanout
        self.children: dict[str, int] = {SENDER: 0}  # source -> receivers pulling from it
        self.relays: list[str] = []  # relaying receivers, in the order they joined
        self.parent: dict[str, str] = {}  # relay -> the source it pulls from
        self.failed: set[str] = set()

    def join(self, relay: str, host: str = "", planned: str | None = None) -> str:
        """A receiver acquired; returns the source it pulls from. ``relay``
        is where it serves children (``""``: it does not relay); ``host``
        is its address as the sender sees it, when that is not the
        sender's own host: a relay on that host serves it, whatever its
        fanout (the copy crosses no link), so each host takes the object
        over the network once. Else ``planned`` (:meth:`planned`), where
        that source has joined, is not failed and has room; else the
        first source with room, in the order they joined."""
        source = self._local(host, exclude=set())
        if not source:
            source = planned if planned is not None and self._has_room(planned) else self._pick(exclude=set())
        self.children[source] += 1
        if relay and relay not in self.children and relay not in self.failed:
            self.children[relay] = 0
            self.relays.append(relay)
            self.parent[relay] = source
        return source

    def planned(self, relay: str, group: tuple[str, ...] | None) -> str | None:
        """The source ``relay`` pulls from where ``group`` (the relays of
        an earlier broadcast it was in, in address order) is laid out as
        a tree of this fanout, breadth first: the first ``fanout`` from
        the sender, the next ``fanout`` from the first relay, and so on.
        Every sender of relays of the same group lays them out alike, so
        a relay serves one child for all of them, whatever order they
        acquire in (each sender's tree a relay joins would otherwise
        follow the order they reached that sender in). None: ``relay``
        is in no such group, or its place there is below a relay of its
        own host (it copies from one there, whichever joined first)."""
        if not relay or not group or relay not in group:
            return None
        i = group.index(relay)
        source = SENDER if i < self.fanout else group[(i - self.fanout) // self.fanout]
        return None if source and _host_of(source) == _host_of(relay) else source

    def joined(self, source: str) -> bool:
        """``source`` is the sender, or a relay that joined and has not failed."""
        return source == SENDER or (source in self.children and source not in self.failed)

    def members(self) -> tuple[str, ...]:
        """The relays that joined and have not failed, in address order."""
        return tuple(sorted(r for r in self.relays if r not in self.failed))

    def _has_room(self, source: str) -> bool:
        return self.joined(source) and self.children[source] < self.fanout

    def _local(self, host: str, exclude: set[str]) -> str:
        """The relay on ``host`` with the fewest children, or ``""``."""
        if not host:
            return ""
        local = [r for r in self.relays if r not in self.failed and r not in exclude and _host_of(r) == host]
        return min(local, key=lambda r: self.children.get(r, 0)) if local else ""

    def reassign(self, relay: str, failed: str, stripe: int = 0) -> str:
        """The receiver (serving at ``relay``, or ``""``) lost its source
        ``failed``: mark that one failed and pick another source that is
        not below the receiver (it would wait for bytes only it brings).
        ``stripe``: always 0 (one tree carries the whole object)."""
        if failed and failed != SENDER and failed not in self.failed:
            self.failed.add(failed)
            self.children.pop(failed, None)
            # The failed relay no longer pulls from its parent: that place is free.
            up = self.parent.pop(failed, None)
            if up is not None and up in self.children:
                self.children[up] = max(0, self.children[up] - 1)
        below = self._below(relay) if relay else set()
        source = self._pick(exclude=below | ({relay} if relay else set()))
        self.children[source] = self.children.get(source, 0) + 1
        if relay in self.parent:
            self.parent[relay] = source
        return source

    def _pick(self, exclude: set[str]) -> str:
        if self.children[SENDER] < self.fanout:
            return SENDER
        for r in self.relays:
            if r not in self.failed and r not in exclude and self.children.get(r, self.fanout) < self.fanout:
                return r
        # Every source is full (more receivers than the tree holds, or
        # relays failed): the sender serves; it never refuses.
        return SENDER

    def _below(self, relay: str) -> set[str]:
        """Relays that pull, directly or not, from ``relay``."""
        out: set[str] = set()
        frontier = [relay]
        while frontier:
            node = frontier.pop()
            for r, p in self.parent.items():
                if p == node and r not in out:
                    out.add(r)
                    frontier.append(r)
        return out


def _host_of(address: str) -> str:
    """The host part of ``host:port`` (brackets of an IPv6 address dropped)."""
    return address.rpartition(":")[0].strip("[]")
