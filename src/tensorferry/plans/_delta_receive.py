"""A get of a delta plan's ticket: the delta, or the whole object. Receiver side.

A ticket with a delta section (``plans/_delta.py``) offers its delta to a
receive plan holding the base version, and the whole object to everyone
else. :func:`reads_delta` decides, once per get, from the plan's version
and what the channel declares: a kept plan holding the base, whose runs
reach every byte of its targets, reads the delta, unless its channel maps
the sender's memory (one host: the whole object is a memory copy away)
and the delta is so dense that applying it costs more than that copy.
:func:`receive_delta` moves the delta and applies it in place through the
plan's runs (C, without the GIL); :func:`settle` gives back the slots of
what a get did not read, so the sender frees both when every reader is done.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import numpy as np

from ..errors import ProtocolError, TransferError
from ..transports import Channel
from ..wire import Ticket
from ._recv import RecvPlan
from ._delta import SAME_HOST_MAX_FRACTION, ChunkTable, apply_delta, chunk_table, delta_runs

__all__ = ["give_back", "reads_delta", "receive_delta", "settle", "version_of"]


# A kept plan's runs in stream order and its chunk table, made at its first
# delta (False: its targets are not all written by address).
_RUNS: "weakref.WeakKeyDictionary[RecvPlan, Any]" = weakref.WeakKeyDictionary()


def version_of(plan: RecvPlan, ticket: Ticket) -> int:
    """The version a get of ``ticket`` leaves in ``plan`` (0: none)."""
    return ticket.delta.version if plan.kept and ticket.delta is not None else 0


def reads_delta(plan: RecvPlan, ticket: Ticket, holds: int, ch: Channel) -> bool:
    """Whether this get reads the delta (``holds``: the version the plan's
    targets hold), not the whole object."""
    d = ticket.delta
    if d is None or not d.base or d.base != holds or not plan.kept:
        return False
    if ch.maps_sender_memory and d.nbytes > SAME_HOST_MAX_FRACTION * ticket.total_nbytes:
        return False
    return _runs(plan) is not None


def _runs(plan: RecvPlan) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ChunkTable] | None:
    """The plan's runs in stream order and the layout's chunk table (made
    once per plan), or None where some target bytes are not written by
    address (then the plan reads the whole object)."""
    cached = _RUNS.get(plan)
    if cached is None:
        copy = plan.coords((plan.total_nbytes,)).copy
        covered = not copy.elementwise.size and int(copy.nbytes.sum()) == int(plan.layout.nbytes.sum())
        cached = (delta_runs(copy.dst, copy.src, copy.nbytes), chunk_table(plan.layout, plan.offsets)) if covered else False
        _RUNS[plan] = cached
    return cached or None


def receive_delta(ch: Channel, plan: RecvPlan, ticket: Ticket, destination: Callable[[list[int]], Any], deadline: float, *,
                  relay_address: str = "", broadcast: Callable[[Ticket, list, str], Any] | None = None) -> int:
    """Read the delta of ``ticket`` and apply it to ``plan``'s targets in
    place; returns the delta's bytes. The caller holds the plan's lock and
    has dropped its version (a failure leaves it none: the next get reads
    the whole object). A broadcast's delta comes as a broadcast does:
    ``broadcast(delta ticket, blocks, source)`` returns its bytes, pulled
    from the relay the sender names (``relay_address``: where this
    receiver relays, if it does; it passes the delta on to its children).

    Raises:
        ProtocolError: a malformed delta (nothing more is applied).
    """
    d = ticket.delta
    runs, table = _runs(plan)
    if d.ticket_id:
        sub = ticket.delta_ticket()
        located = ch.acquire(sub.id, 0, timeout=_left(deadline), digest=sub.digest, relay=relay_address)
        try:
            blocks = [tuple(b) for b in located.blocks]
            if blocks != [tuple(b) for b in sub.blocks]:
                raise ProtocolError(f"sender locates the delta of ticket {ticket.id} at {blocks}, the ticket says {sub.blocks}")
            # As a whole object's get decides it (Fetcher._move): from a relay, or relayed on.
            # A two-tree broadcast names a source for each half.
            source: Any = tuple(located.stripes) if located.stripes else located.source
            relayed = any(located.stripes) or bool(located.source) or (bool(relay_address) and ch.relays)
            with plan.writing():
                if relayed and broadcast is not None:
                    src = broadcast(sub, blocks, source)
                elif ch.maps_sender_memory:
                    src = ch.remote_views(blocks)[0]
                else:
                    src = destination([d.nbytes])[0][0]
                    with ch.registered(src):
                        ch.read_into(sub.id, 0, blocks, [src], deadline=deadline)
                try:
                    apply_delta(src, runs, table)
                except (ValueError, ProtocolError) as exc:
                    raise ProtocolError(f"the delta of ticket {ticket.id} is malformed: {exc}") from exc
        finally:
            ch.release(sub.id, 0, timeout=max(deadline - time.monotonic(), 5.0))
    # The whole object was not read: its slots go back unread.
    for piece in range(ticket.num_pieces):
        give_back(ch, ticket.id, piece, ticket.digest, deadline)
    return d.nbytes


def settle(ch: Channel, ticket: Ticket, deadline: float) -> None:
    """After reading the whole object of a ticket that offers delta bytes:
    give their slot back unread."""
    d = ticket.delta
    if d is not None and d.ticket_id:
        sub = ticket.delta_ticket()
        give_back(ch, sub.id, 0, sub.digest, deadline)


def give_back(ch: Channel, ticket_id: int, piece: int, digest: bytes, deadline: float) -> None:
    """Take a slot and give it back at once (a few bytes each way). A slot
    already gone (expired, discarded) needs nothing."""
    try:
        ch.acquire(ticket_id, piece, timeout=_left(deadline), digest=digest)
    except TransferError as exc:
        if type(exc) is TransferError:  # the sender's refusal (gone, taken), not a dead peer
            return
        raise
    ch.release(ticket_id, piece, timeout=max(deadline - time.monotonic(), 5.0))


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
