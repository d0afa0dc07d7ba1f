"""A discrete-event model of relay broadcasts (issue 47): chain, tree and
two complementary binary trees, chunk by chunk. A model, not product code:
``broadcast_model.py`` checks it against bench_broadcast's measured ratios
and predicts what no machine here can run (100 and 1,000 hosts at
100 Gbit/s).

What it models. The object (``nbytes``) moves in chunks. A node (the sender
or a relay) may send chunk ``i`` to a child once it holds all of it, plus
``hop_seconds`` (the per-hop latency: a relay noticing the chunk, waking its
serving thread, the send call, the wire's propagation). Each node's uplink
is one server of the link's rate (``link_bytes_per_second``, the payload
rate): it sends the chunks in order, and for each chunk one copy to each
of its children in turn (round robin), so a node with ``k`` children sends
each at ``1/k`` of the link. A child holds a chunk when its copy ends. The
sender holds everything at ``start_seconds`` (the put and the receivers'
acquire: the same for one receiver as for many).

The events of one uplink are a FIFO queue: a send starts at
``max(released, previous end)`` and ends a chunk's time later, which is
``end = D + cummax(released - D_before)`` over the queue (``D``: the
running sum of durations); numpy evaluates it per node, so 1,000 nodes of
160,000 chunks take about a second.

Schedules (who sends to whom, in the product's join order):

* ``chain``: receiver ``j`` pulls from receiver ``j - 1``, the first from
  the sender (``put(fanout=1)``);
* ``tree``: ``fanout=k``, breadth first: the first ``k`` from the sender,
  the next ``k`` from the first relay, and so on (``Tree.join``);
* ``trees``: two complementary binary trees, each carrying half of the
  object (``put(trees=True)``; ``execution/_trees.py``). Tree A is the
  receivers in join order as a heap (``i``'s children ``2i + 1`` and
  ``2i + 2``), tree B the same over the receivers in reverse order, so a
  receiver interior in one is a leaf in the other: each uploads half the
  object to two children, one object in all, and the depth is about
  log2(N). The sender's uplink alternates the roots' chunks. The halves are
  the product's (``stripe_bounds``: page-aligned), and so is their chunk
  (``half_chunk_nbytes``: a half over the trees' depth).

Not modelled: receive-side contention (each downlink carries at most one
object's rate here in every schedule), CPU limits of the relays (the model
is a network's), TCP's slow start and losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from tensorferry.transports import stripe_bounds

__all__ = ["Link", "broadcast_seconds", "ratio", "SCHEDULES"]

SCHEDULES = ("chain", "tree", "trees")


@dataclass(frozen=True)
class Link:
    """What every link and hop costs.

    Attributes:
        link_bytes_per_second: the payload rate of every link, each way.
        hop_seconds: the per-hop latency, paid by every send of a chunk.
        start_seconds: put to the sender's first send (acquire, connect).
    """

    link_bytes_per_second: float
    hop_seconds: float
    start_seconds: float = 0.0


def _chunks(nbytes: int, chunk_nbytes: int) -> np.ndarray:
    """The sizes of the chunks of ``nbytes``, the last one short."""
    m = max(1, -(-nbytes // chunk_nbytes))
    sizes = np.full(m, float(chunk_nbytes))
    sizes[-1] = nbytes - chunk_nbytes * (m - 1)
    return sizes


def _uplink(ready: np.ndarray, sizes: np.ndarray, children: int, link: Link) -> np.ndarray:
    """One node's uplink: chunk ``i`` released at ``ready[i] + hop``, one copy
    to each of ``children`` in turn. Returns the arrival times, shape
    (children, chunks)."""
    released = np.repeat(ready + link.hop_seconds, children)
    durations = np.repeat(sizes / link.link_bytes_per_second, children)
    done = np.cumsum(durations)
    ends = done + np.maximum.accumulate(released - (done - durations))
    return ends.reshape(len(sizes), children).T


def _tree_done(parents: list[int], ready0: np.ndarray, sizes: np.ndarray, link: Link) -> np.ndarray:
    """Every receiver's last arrival where receiver ``j`` pulls every chunk
    of ``sizes`` from ``parents[j]`` (-1: the sender, which holds all at
    ``ready0``); parents come before their children."""
    n = len(parents)
    kids: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        kids.setdefault(p, []).append(j)
    ready: dict[int, np.ndarray] = {-1: ready0}
    done = np.zeros(n)
    for p in [-1, *range(n)]:
        if p not in kids:
            continue
        arrivals = _uplink(ready[p], sizes, len(kids[p]), link)
        for row, j in zip(arrivals, kids[p]):
            ready[j] = row
            done[j] = row[-1]
        if p >= 0:
            del ready[p]  # its children have theirs: keep memory flat for 1,000 nodes
    return done


def broadcast_seconds(nbytes: int, receivers: int, schedule: Literal["chain", "tree", "trees"], chunk_nbytes: int, link: Link,
                      fanout: int = 2) -> float:
    """Put to the last receiver holding the object, by ``schedule``."""
    start = link.start_seconds
    if schedule in ("chain", "tree"):
        k = 1 if schedule == "chain" else fanout
        parents = [-1 if j < k else (j - k) // k for j in range(receivers)]
        sizes = _chunks(nbytes, chunk_nbytes)
        return float(_tree_done(parents, np.full(len(sizes), start), sizes, link).max())
    if schedule != "trees":
        raise ValueError(f"schedule {schedule!r}: one of {SCHEDULES}")
    if receivers == 1:
        sizes = _chunks(nbytes, chunk_nbytes)
        return float(_tree_done([-1], np.full(len(sizes), start), sizes, link).max())
    # The halves as the product cuts them (page-aligned: B is the larger by
    # under a page; both are modelled at B's size).
    (_, mid), (_, hi) = stripe_bounds(nbytes, 2)
    half = _chunks(hi - mid, chunk_nbytes)
    # The sender's uplink alternates stripe A's root and stripe B's.
    roots = _uplink(np.full(len(half), start), half, 2, link)
    done = np.zeros(receivers)
    for stripe, root_ready in enumerate(roots):
        # Heap order over the receivers (reversed for stripe B); the root's
        # chunks are already sent, so the tree below it starts from them.
        order = list(range(receivers)) if stripe == 0 else list(range(receivers))[::-1]
        # Positions 1.. below the root (position 0), renumbered from 0; -1: the root.
        below = [-1 if (i - 1) // 2 == 0 else (i - 1) // 2 - 1 for i in range(1, receivers)]
        at = np.concatenate([[root_ready[-1]], _tree_done(below, root_ready, half, link)])
        for i, who in enumerate(order):
            done[who] = max(done[who], at[i])
    return float(done.max())


def ratio(nbytes: int, receivers: int, schedule: Literal["chain", "tree", "trees"], chunk_nbytes: int, link: Link,
          fanout: int = 2, one_chunk_nbytes: int | None = None) -> float:
    """``receivers`` by ``schedule`` against one receiver (whose chunk is
    ``one_chunk_nbytes``: the product's chunk for one reader)."""
    one = broadcast_seconds(nbytes, 1, "chain", one_chunk_nbytes or chunk_nbytes, link)
    return broadcast_seconds(nbytes, receivers, schedule, chunk_nbytes, link, fanout) / one
