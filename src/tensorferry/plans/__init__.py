"""Kept plans: a transfer's per-tensor work done once, replayed on every sync.

RL weight sync sends the same state dict, changed in place, to the same
workers thousands of times. Without a plan every sync pays for every tensor
again: the sender inspects each one and encodes a layout, each receiver
decodes it, matches it to its targets and computes its copy runs.

* :class:`SendPlan` (``Sender.plan``): the tensors inspected once, the layout
  encoded once, the copy runs into a pool block computed once (dtype
  conversions included). ``Sender.put(plan)`` checks that the tensors still
  live where the plan found them (a few C-level passes) and moves bytes.
* :class:`RecvPlan` (``Receiver.plan``): the ticket's layout checked once
  against ``into=`` targets (or destination tensors allocated once), the
  runs from the received byte stream into them computed once.
  ``Receiver.get(ticket, into=plan)`` compares the ticket's layout bytes with
  the plan's, moves bytes, and returns the same tensor objects every time.

Coordinates: a ticket's bytes form one *stream*, its blocks (resident) or
its pieces (streamed) concatenated. A planned sender always puts one block,
or pieces of the one-block layout, so stream positions are the packed
offsets; a ticket with several blocks (a plain ``put`` into a fragmented
pool) gets its positions from the block sizes, vectorised, cached per sizes.

The package, one concept a module: :mod:`._send` (``SendPlan``),
:mod:`._recv` (``RecvPlan``), :mod:`._watch` (what a kept plan checks
before each use) and :mod:`._buffers` (a byte stream as buffers over
memory someone else owns); :mod:`._sharded` (``ShardedPlan``); a delta
plan's kept version (:mod:`._delta`, the C compare/encode and apply in
``_diff.c``), its put side (:mod:`._delta_put`: what a ticket offers) and
its receive side (:mod:`._delta_receive`: whether a get reads the delta,
and applying it).

May import: transports (their public names), memory, copy, tensors, wire
and :mod:`tensorferry.errors`. Execution and the user API import plans.
"""

from __future__ import annotations

# A delta plan's put and receive sides, for the execution layer and the
# user API (not user-facing, so not in __all__).
from ._delta_put import max_delta_fraction, offer_delta
from ._delta_receive import reads_delta, receive_delta, settle, version_of
from ._delta_sharded import SourceDelta
from ._recv import RecvPlan
from ._send import SendPlan, SourcedPiece
from ._sharded import ShardedPlan

__all__ = ["SendPlan", "RecvPlan", "ShardedPlan", "SourcedPiece"]
