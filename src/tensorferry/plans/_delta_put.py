"""A delta plan's put: compare, encode, and what the ticket offers. Sender side.

After :func:`._execution.choose` placed (or sourced) a delta plan's put,
:func:`offer_delta` compares the current values with the plan's kept
version (``plans/_delta.py``) and makes the ticket's
:class:`~tensorferry.ticket.DeltaOffer`: the new version's id, its base,
and the delta's block, served under reader slots of its own
(:func:`delta_entry`). The whole object is served as by any put, so every
receiver can read it.

The values are compared where they are: a snapshot put whose tensors can
be read by address is compared as it is placed, and the kept version is
served as the whole object (``DeltaVersion.place``); otherwise the pool
block it was packed into (one run), or the tensors' own memory of a
``snapshot=False`` put (the plan's runs). A broadcast's (``fanout=``)
delta is broadcast too, on a tree of its own. A put streamed in pieces, or one made while a ticket
still serves the kept bytes, offers no delta and drops the kept version:
the next put fills it again.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..wire import DeltaOffer
from ._delta import ACROSS_HOSTS_MAX_FRACTION, SAME_HOST_MAX_FRACTION, KeptBlock, Values
from ._send import SendPlan

if TYPE_CHECKING:
    from ..execution import Execution, PutOptions
    from ..memory import Packed

__all__ = ["max_delta_fraction", "offer_delta"]


def max_delta_fraction(servers: "Iterable[Any]") -> float:
    """The largest delta, as a fraction of the whole object, worth sending
    by these servers: less when every reader is on this host."""
    return SAME_HOST_MAX_FRACTION if all(s.same_host_only for s in servers) else ACROSS_HOSTS_MAX_FRACTION


def offer_delta(plan: SendPlan, ex: "Execution", opts: "PutOptions") -> tuple[DeltaOffer | None, "Packed | None"]:
    """The ticket's delta section of a put of ``plan`` executed as ``ex``,
    and the delta's block (None: nothing to read). None, None for a plan
    that is not a delta plan."""
    keeper = plan.delta
    if keeper is None:
        return None, None
    pending = keeper.take_pending()
    if pending is not None and ex.kind == "resident" and isinstance(ex.pieces[0].packed, KeptBlock):
        put, packed = pending  # compared as it was placed: the kept bytes are the whole object
    else:
        values = None
        if ex.kind == "resident" and len(ex.pieces[0].packed.blocks) == 1:
            block = ex.pieces[0].packed.blocks[0]
            values = Values(np.zeros(1, dtype=np.int64), np.array([plan.pool.data_ptr + block.offset], dtype=np.int64),
                            np.array([plan.total_nbytes], dtype=np.int64))
        elif ex.kind == "sourced":
            values = Values(*plan.source_runs(0, plan.total_nbytes))
        put, packed = keeper.put(values, plan.layout)
    if not put.version:
        return None, None
    if packed is None:
        return DeltaOffer(put.version, put.base, changed=put.changed), None
    block = packed.blocks[0]
    offer = DeltaOffer(put.version, put.base, secrets.randbits(63) | 1, [(block.offset, block.nbytes)], put.delta_nbytes, put.changed)
    return offer, packed
