"""The execution layer: how a put and a get run their plans, decided once each.

Owns the one decision of how a put executes (``_put``: empty, resident,
streamed or sourced, from the plan and the servers' declared
capabilities), the one decision of how a get's bytes move and the
:class:`Fetcher` that executes it (``_receive``), the sender's book of
tickets, pieces and reader slots (``_ledger``, a ``Holdings`` the control
servers answer from) and the broadcast tree of relays (``_broadcast``).

May import: plans, transports (their public names), memory, copy, tensors,
wire and :mod:`tensorferry.errors`. Only the user API (``sender.py``,
``receiver.py``) imports this layer.
"""

from __future__ import annotations

from ._broadcast import SENDER, Tree
from ._ledger import Entry, Ledger, Piece, delta_entry
from ._put import Execution, PutOptions, choose
from ._receive import Fetcher, route

__all__ = ["SENDER", "Tree", "Entry", "Ledger", "Piece", "delta_entry", "Execution", "PutOptions", "choose",
           "Fetcher", "route"]
