"""Receiver side: a broadcast's block, from relays or from the sender,
passed on to this receiver's children as it arrives (a mixin of
:class:`~tensorferry.execution._receive.Fetcher`: the ``relay`` route).

The block comes from the source the sender names (a relay, or ``""``: the
sender itself), or, of a two-tree broadcast, one half from each of two
(:mod:`._stripes`). A relay that fails or stalls is reported to the
sender, which names another; the receive resumes from the bytes it has.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from ..errors import PeerGoneError, ProtocolError, TicketError, TransferTimeoutError
from ..memory import ReceiveCache
from ..plans import RecvPlan
from ..transports import CHUNK_NBYTES, Channel, RelayBook, RelayLinks, SameHostReads, chunk_nbytes_for, half_chunk_nbytes, pull
from ..wire import Ticket
from ._stripes import Source, pull_halves

__all__ = ["Relayed"]


class Relayed:
    """The broadcast receives of a :class:`~tensorferry.execution._receive.Fetcher`
    (which sets these attributes)."""

    _book: RelayBook | None
    _cache: ReceiveCache
    _links: RelayLinks
    _reads: SameHostReads
    _relay_address: str
    _stall_seconds: float
    _token: bytes
    _tls: Any
    destination: Callable[[list[int]], tuple[list[torch.Tensor], bool]]

    def _receive_broadcast(self, ch: Channel, ticket: Ticket, blocks: list, source: Source, plan: RecvPlan, deadline: float) -> torch.Tensor:
        """The one block of a ticket, chunk by chunk, from ``source`` (a
        relay, or ``""``: the sender; one a half, of a two-tree broadcast),
        into memory of its own; published to this receiver's children as it
        arrives if it relays. The chunk follows the block's size and the
        ticket's readers (the longest chain it can make; the trees' depth),
        the same in every relay of it."""
        if len(blocks) != 1:
            raise TicketError(f"a broadcast ticket has one block; this one has {len(blocks)}")
        total = blocks[0][1]
        size = half_chunk_nbytes if isinstance(source, tuple) else chunk_nbytes_for
        chunk = size(total, ticket.readers, most=ch.relay_chunk_nbytes, least=ch.relay_min_chunk_nbytes)

        def from_sender(buf: memoryview, start: int, progress: Any) -> None:
            if len(buf) == total:
                ch.receive_range(ticket.id, 0, blocks, buf, start, progress, deadline=deadline, chunk_nbytes=chunk)
            else:  # a first half: the block's bytes up to where the buffer ends
                whole = np.array([0], dtype=np.int64), np.array([total], dtype=np.int64)
                ch.receive_ranges(ticket.id, 0, blocks, *whole, buf, start, progress, deadline=deadline, chunk_nbytes=chunk)

        return self._receive_stream(ch, ticket, blocks[0][1], ticket.digest, source, from_sender, deadline, chunk_nbytes=chunk)

    def _receive_stream(self, ch: Channel, ticket: Ticket, total: int, digest: bytes, source: Source,
                        from_sender: Callable[[memoryview, int, Any], None], deadline: float, group: object = None,
                        arrived: Callable[[torch.Tensor, int, int], None] | None = None, *, chunk_nbytes: int = CHUNK_NBYTES) -> torch.Tensor:
        """A stream of ``total`` bytes of ``ticket`` (``digest``: the
        ticket's, or a sharded get's ranges of it) into memory of its own,
        from ``source`` (a relay; ``""``: the sender, ``from_sender(buf,
        start, progress)``); published to this receiver's children as it
        arrives if it relays (``group``: see :meth:`RelayBook.add`), then
        ``arrived(stream, lo, hi)`` for each new part, in order; a relay's
        stream ``chunk_nbytes`` at a time (as the sender's). A relay
        that fails or stalls is reported to the sender, which names another
        source; the receive resumes from the bytes it has."""
        if self._book is not None:
            # Shareable: children on this host map its file (the receive
            # pool, if any, is left to other gets). The streams this one
            # replaces go first, so their memory (faulted in) is reused.
            self._book.make_room(group)
            stream, _, fd = self._cache.take_shared(total)
        else:
            stream, fd = self.destination([total])[0][0], -1
        buf = memoryview(stream.numpy())
        held = self._book.add(ticket.id, digest, buf, fd, group) if self._book is not None else None
        got = [0]

        def progress(end: int) -> None:
            lo, got[0] = got[0], end
            if held is not None:
                held.progress(end)
            if arrived is not None and end > lo:
                arrived(stream, lo, end)

        if isinstance(source, tuple) and arrived is not None:
            raise ProtocolError(f"sender named a source a half ({source!r:.200}) for a sharded get's ranges, which relay as one stream")
        ok = False
        try:
            with ch.registered(stream):
                if isinstance(source, tuple):
                    alone = threading.Lock()  # the channel's one connection: one request on it at a time

                    def half(k: int, src: str, lo: int, hi: int) -> None:
                        at = [lo]

                        def progress(end: int) -> None:
                            at[0] = end
                            if held is not None:
                                held.progress(end, lo)

                        self._pull(ch, ticket, src, buf, at, functools.partial(from_sender, buf[:hi], progress=progress), progress, digest,
                                   deadline, chunk_nbytes, stripe=k, stop=hi, alone=alone)

                    pull_halves(source, total, half)
                else:
                    self._pull(ch, ticket, source, buf, got, functools.partial(from_sender, buf, progress=progress), progress, digest,
                               deadline, chunk_nbytes)
            ok = True
        finally:
            if held is not None:
                held.finish(ok)
        return stream

    def _pull(self, ch: Channel, ticket: Ticket, source: str, buf: memoryview, got: list[int], from_sender: Callable[[int], None],
              progress: Any, digest: bytes, deadline: float, chunk_nbytes: int, *, stripe: int = 0, stop: int | None = None,
              alone: Any = None) -> None:
        """Fill ``buf`` (the stream of ``digest``: the ticket's, or a sharded
        get's ranges of it) from ``got[0]`` on, up to ``stop`` (None: its
        end; less: half ``stripe`` of a two-tree broadcast): from the sender
        (``source`` "": ``from_sender(start)``), else from relays, as the
        sender names them (a relay's stream ``chunk_nbytes`` at a time).
        ``alone``: a lock held around each use of the channel's connection
        (the halves' threads share it)."""
        stop = len(buf) if stop is None else stop
        alone = alone if alone is not None else contextlib.nullcontext()
        while got[0] < stop:
            try:
                if not source:
                    with alone:
                        from_sender(got[0])
                else:
                    pull(source, token=self._token, ticket_id=ticket.id, digest=digest, buf=buf, start=got[0], progress=progress,
                         stall_seconds=self._stall_seconds, deadline=deadline, reads=self._reads, nixl=ch.relay_endpoint, links=self._links,
                         tls=self._tls, chunk_nbytes=chunk_nbytes, stop=stop)
            except (PeerGoneError, TransferTimeoutError, ProtocolError):
                if not source or time.monotonic() > deadline:
                    raise
                # The relay died or stalled: the sender names another
                # source (or itself); resume from what has arrived.
                with alone:
                    located = ch.acquire(ticket.id, 0, timeout=_left(deadline), digest=ticket.digest, relay=self._relay_address,
                                         failed_source=source, ranges=digest if digest != ticket.digest else b"", stripe=stripe)
                source = located.source


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeoutError("the get ran out of time")
    return left
