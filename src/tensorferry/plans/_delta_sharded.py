"""A sharded get's part of one source's delta: the records of the chunks its
ranges touch, and nothing else. Receiver side.

A delta of shards (a layout with boxes: ``plans/_delta.py``) ends with an
index, one int64 a chunk of the source's one-block layout: where that
chunk's record ends in the records (an unchanged chunk's record is empty).
A kept :class:`~tensorferry.plans.ShardedPlan` knows, per source, which
chunks its byte ranges touch, as groups of consecutive chunks; a group's
records are consecutive in the delta. A get of a source whose delta is
against the version the plan's targets hold from that source reads, after
acquiring the delta's slot, two index entries a group (where the group's
records begin and end), then those records, and applies them through the
plan's runs of that source, skipping words outside them (C, without the
GIL). It gives the whole object's slot back unread. Everyone else reads
its ranges of the whole object: a plan made again, one that skipped a put
or whose previous get failed, a one-shot get. Versions are per source:
each source's ranges land in targets no other source writes.

The granularity is the chunk (4096 words): a receiver whose ranges are
narrower than a chunk (a column slice of rows shorter than a chunk) reads
the whole records of the chunks they touch.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ..errors import ProtocolError, TicketError
from ..wire import Layout, packing
from ._delta import SAME_HOST_MAX_FRACTION, apply_records, chunk_table
from ._delta_receive import give_back

if TYPE_CHECKING:
    from ..transports import Channel
    from ..wire import Ticket

__all__ = ["SourceDelta", "Stream"]

# A receiver's broadcast of byte ranges as one stream: (delta ticket,
# blocks, source, positions, nbytes, name) -> the ranges back to back.
Stream = Callable[["Ticket", list, str, np.ndarray, np.ndarray, bytes], torch.Tensor]

_ENTRY = 8  # an index entry: int64


class SourceDelta:
    """What a kept sharded plan reads of one source's delta, and the version
    of that source its targets hold; receiver side.

    Args:
        layout: the source's layout (a layout of shards: its delta is indexed).
        runs: the plan's runs of that source in its one-block stream
            (position, address here, nbytes), ascending.

    Attributes:
        version: the id of the source's version the targets hold (0: none).
        last_nbytes: bytes the last :meth:`read` moved over the channel
            (index, records; or the whole ranges).
    """

    def __init__(self, layout: Layout, runs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        offsets, self.total_nbytes = packing.packed_offsets(layout.nbytes, layout.alignments)
        self.table = chunk_table(layout, offsets)
        self.runs = tuple(np.ascontiguousarray(a, dtype=np.int64) for a in runs)
        self.ranges_nbytes = int(self.runs[2].sum())
        self.first, self.last = _groups(self.table, *self.runs)
        # What names this worker's records to relays: workers of the same
        # slices (replicas) have the same groups, so the same records.
        self.groups_digest = hashlib.blake2b(self.first.astype("<i8").tobytes() + self.last.astype("<i8").tobytes(), digest_size=16).digest()
        self.version = 0
        self.last_nbytes = 0

    def read(self, ch: "Channel", ticket: "Ticket", deadline: float, whole: Callable[[], None], *, relay: str = "",
             stream: Stream | None = None) -> None:
        """This source's part of a get: its delta where the targets hold the
        delta's base, else ``whole()`` (the ranges of the whole object, the
        delta's slot given back unread). A failed read leaves no version.

        Over a channel that relays, with ``stream`` (the receiver's way of
        receiving a broadcast's ranges as one stream, passed on to its
        children if it relays at ``relay``): workers of the same slices
        take the records from each other as the sender names them; each
        reads the few index entries from the sender."""
        holds, self.version = self.version, 0
        d = ticket.delta
        # As a whole object's get decides it (plans/_delta_receive.py): a
        # channel that maps the sender's memory copies the whole share
        # faster than it applies a delta past the same-host limit.
        dense = d is not None and ch.maps_sender_memory and d.nbytes > SAME_HOST_MAX_FRACTION * ticket.total_nbytes
        # (A put streamed for want of pool room offers no delta; a
        # snapshot=False put's pieces are the tensors, its delta a block.)
        if d is not None and d.base and d.base == holds and not dense:
            self.last_nbytes = self._receive(ch, ticket, deadline, relay if stream is not None and ch.relays else "",
                                             stream if ch.relays else None)
        else:
            whole()
            self.last_nbytes = self.ranges_nbytes
        self.version = d.version if d is not None else 0

    def _receive(self, ch: "Channel", ticket: "Ticket", deadline: float, relay: str, stream: Stream | None) -> int:
        d = ticket.delta
        moved = 0
        if d.ticket_id and not self.first.size:
            sub = ticket.delta_ticket()  # nothing of it is ours: its slot goes back unread
            give_back(ch, sub.id, 0, sub.digest, deadline)
        elif d.ticket_id:
            sub = ticket.delta_ticket()
            named = hashlib.blake2b(sub.digest + self.groups_digest, digest_size=16).digest() if stream is not None else b""
            located = ch.acquire(sub.id, 0, timeout=_left(deadline), digest=sub.digest, relay=relay, ranges=named)
            # From relays as the sender names them, or passed on to this
            # worker's children (as a whole object's get decides it).
            relayed = stream is not None and (bool(located.source) or bool(relay))
            try:
                blocks = [tuple(b) for b in located.blocks]
                if blocks != [tuple(b) for b in sub.blocks]:
                    raise TicketError(f"sender locates the delta of ticket {ticket.id} at {blocks}, the ticket says {sub.blocks}")
                via = (lambda pos, n: stream(sub, blocks, located.source, pos, n, named)) if relayed else None
                moved = self._apply(ch, sub.id, blocks, d.nbytes, ticket.id, deadline, via)
            finally:
                ch.release(sub.id, 0, timeout=max(deadline - time.monotonic(), 5.0))
        for piece in range(ticket.num_pieces):
            give_back(ch, ticket.id, piece, ticket.digest, deadline)
        return moved

    def _apply(self, ch: "Channel", sub_id: int, blocks: list, nbytes: int, ticket_id: int, deadline: float,
               via: Callable[[np.ndarray, np.ndarray], torch.Tensor] | None = None) -> int:
        """Read the groups' index entries, then their records (``via(pos,
        nbytes)``: as one stream from relays, else straight from the
        sender); apply them. Returns the bytes read."""
        if not self.table.index_nbytes:
            # A source of whole tensors (no boxes): its delta has no index;
            # every record is read, the words outside the runs skipped.
            buf = torch.empty(nbytes, dtype=torch.uint8)
            with ch.registered(buf):
                ch.read_ranges(sub_id, 0, blocks, np.zeros(1, np.int64), np.array([buf.data_ptr()], np.int64), np.array([nbytes], np.int64),
                               deadline=deadline)
            self._apply_records(buf, ticket_id)
            return nbytes
        records = nbytes - self.table.index_nbytes
        if records < 0:
            raise ProtocolError(f"the delta of ticket {ticket_id} has {nbytes:,} bytes, less than its index of {self.table.index_nbytes:,}: "
                                "a sender of another layout or version of tensorferry; make the plan again")
        # Where each group's records begin (the end of the chunk before it; 0
        # for chunk 0) and end: two entries a group, read in one go.
        want = np.concatenate([self.first - 1, self.last - 1])
        known = want >= 0
        read = torch.zeros(want.size, dtype=torch.int64)  # little-endian hosts only, as the pool's layout
        pos = records + want[known] * _ENTRY
        order = np.argsort(pos, kind="stable")
        at = read.data_ptr() + np.flatnonzero(known)[order] * _ENTRY
        if pos.size:
            with ch.registered(read):
                ch.read_ranges(sub_id, 0, blocks, pos[order], at.astype(np.int64), np.full(pos.size, _ENTRY, dtype=np.int64), deadline=deadline)
        entries = read.numpy()
        begin, end = entries[: self.first.size], entries[self.first.size :]
        if ((begin > end) | (begin < 0) | (end > records)).any() or (begin[1:] < end[:-1]).any():
            raise ProtocolError(f"the delta of ticket {ticket_id} has an index out of order or past its {records:,} bytes of records; "
                                "the targets hold no version now: the next get reads the whole object")
        take = end > begin
        sizes = (end - begin)[take]
        total = int(sizes.sum())
        if sizes.size and via is not None:
            self._apply_records(via(begin[take], sizes)[:total], ticket_id)
        elif sizes.size:
            buf = torch.empty(total, dtype=torch.uint8)
            dst = buf.data_ptr() + np.cumsum(sizes) - sizes
            with ch.registered(buf):
                ch.read_ranges(sub_id, 0, blocks, begin[take], dst.astype(np.int64), sizes, deadline=deadline)
            self._apply_records(buf, ticket_id)
        return int(pos.size) * _ENTRY + int(sizes.sum())

    def _apply_records(self, buf: torch.Tensor, ticket_id: int) -> None:
        try:
            apply_records(buf, self.runs, self.table)
        except (ValueError, ProtocolError) as exc:
            raise ProtocolError(f"the delta of ticket {ticket_id} is malformed: {exc}; the targets hold no version now: "
                                "the next get reads the whole object") from exc


def _groups(table, pos: np.ndarray, addr: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chunks the runs touch, as groups of consecutive chunks: first
    and one-past-last chunk of each (int64 arrays, ascending). O(runs + chunks)."""
    count = table.count
    if not count or not pos.size:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy()
    start = table.offsets
    stop = start + table.words * table.word_nbytes
    lo = np.searchsorted(stop, pos, side="right")  # the first chunk ending past the run's start
    hi = np.searchsorted(start, pos + nbytes, side="left")  # chunks starting before its end
    keep = hi > lo
    marks = np.zeros(count + 1, dtype=np.int64)
    np.add.at(marks, lo[keep], 1)
    np.add.at(marks, hi[keep], -1)
    touched = np.cumsum(marks[:-1]) > 0
    edges = np.diff(np.concatenate([[0], touched.astype(np.int8), [0]]))
    return np.flatnonzero(edges == 1).astype(np.int64), np.flatnonzero(edges == -1).astype(np.int64)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
