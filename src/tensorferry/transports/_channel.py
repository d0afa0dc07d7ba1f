"""The receiver side of the transport contract: :class:`Channel`, one
connection to one sender (the sender side, its server and the contract's
overview: :mod:`tensorferry.transports._base`).

A transport's channel sends Acquire / Release and moves the bytes of
acquired blocks into destination memory with :meth:`Channel.read_into`;
what more it can do it declares as class attributes, and the receiver
chooses how bytes move from those, never from the name.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Any, ClassVar

import numpy as np
import torch

from ..copy import executor, finish
from ..errors import (
    AuthenticationError,
    ConfigurationError,
    ProtocolError,
    TicketError,
    TransferError,
    TransferTimeoutError,
)
from ..wire import packing
from ..wire import protocol as P
from ._auth import client_handshake
from ._connections import ReceiveContext
from ._tls import wrap_client

__all__ = ["Channel"]

# The halves of a stream's scratch start on page boundaries.
_STREAM_ALIGNMENT = 4096


class Channel:
    """Receiver side: one connection to one sender; a context manager.

    Not thread-safe: a Receiver keeps one channel per sender and thread.

    Every channel moves acquired blocks with :meth:`read_into` and
    :meth:`read_stream`. What else it can do it declares in the class
    attributes below (the receiver chooses how a get's bytes move from them,
    never from :attr:`transport`); a method of a capability a channel lacks
    raises :class:`ConfigurationError` naming it.

    Args:
        address: the sender's address from the ticket.
        token: the shared secret, if the sender wants one (proved, never sent).
        timeout: seconds for the handshake.
        context: what the receiver lends it (its receive pool, shared
            per-transport state).
        tls: a client ``ssl.SSLContext``: the connection is TLS (channels
            that declare ``secured_by_tls``; shm never leaves the host).
    """

    transport: ClassVar[str] = ""
    # Its connection crosses a link and takes TLS when asked (tcp, nixl's control).
    secured_by_tls: ClassVar[bool] = False
    # remote_views: the sender's pool is mapped here; its blocks can be
    # handed out as views, or copied by address without any request.
    maps_sender_memory: ClassVar[bool] = False
    # read_buffers: the bytes land in any writable buffers that cover the
    # blocks back to back (a scatter list over the caller's tensors).
    receives_into_buffers: ClassVar[bool] = False
    # The bytes arrive through a receive loop of this process, which holds
    # the GIL between its system calls: Python work done meanwhile (views
    # built while the bytes move) slows it down.
    receives_by_loop: ClassVar[bool] = False
    # Reads land only in memory registered with the transport: registered()
    # around any destination outside the receive pool.
    reads_registered_only: ClassVar[bool] = False
    # receive_range: a broadcast's block arrives chunk by chunk, so a
    # relaying receiver passes each on while the rest comes in.
    relays: ClassVar[bool] = False
    # read_runs: a snapshot=False piece is read straight out of the sender's
    # tensors (is_sourced says whether an acquired piece is one).
    reads_source_runs: ClassVar[bool] = False
    # read_ranges: any byte ranges of an acquired piece, and nothing else of
    # it, straight into local memory (a sharded get reads its boxes' bytes).
    reads_ranges: ClassVar[bool] = False
    # Bytes a relaying receiver takes from its sender before it passes them
    # on: each hop of a chain adds one chunk's time. These are the most and
    # the least: a broadcast's chunk is chosen between them from the
    # object's size and its readers (transports._relay.chunk_nbytes_for).
    relay_chunk_nbytes: ClassVar[int] = 1 << 20
    relay_min_chunk_nbytes: ClassVar[int] = 64 << 10
    # The same for a sharded get's streams of byte ranges (a relay passes
    # them on, and so do its children's pulls): a worker takes one from
    # each source at once, so each runs at a share of its link and a chunk
    # takes that much longer to arrive. 512 KiB: relayed sharded syncs
    # 1.25x -> 1.22x the link (4 replicas, 4 ranks; 256 KiB made each
    # chunk's turn of Python the limit on two busy cores, 1.72x).
    ranged_chunk_nbytes: ClassVar[int] = 512 << 10
    # What a pull from a relay READs with (nixl: the receiver's endpoint,
    # destinations registered); None: a stream or a same-host copy.
    relay_endpoint: Any = None

    def __init__(self, address: str, *, token: bytes = b"", timeout: float = 30.0, context: ReceiveContext | None = None,
                 tls: Any = None) -> None:
        self.address = address
        self.context = context if context is not None else ReceiveContext(None)
        self.sock = self._connect(address, timeout)
        self.holds = 0  # zero-copy views alive (their Release is pending)
        self.retired = False  # discarded while held: closed after the last
        self.closed = False
        self.lock = threading.Lock()
        try:
            deadline = time.monotonic() + timeout
            if tls is not None and self.secured_by_tls:
                self.sock = wrap_client(self.sock, tls, address.rpartition(":")[0].strip("[]"), deadline)
            self.sock.settimeout(timeout)
            fds: list[int] = []
            self.welcome, self.session = client_handshake(self.sock, token=token, transport=self.transport, address=address,
                                                          deadline=deadline, fds=fds)
            self._on_welcome(self.welcome, fds)
        except BaseException:
            self.sock.close()
            raise

    def _connect(self, address: str, timeout: float) -> socket.socket:
        raise NotImplementedError

    def _on_welcome(self, welcome: P.Welcome, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)

    def _lacks(self, capability: str, method: str) -> ConfigurationError:
        return ConfigurationError(
            f"the {self.transport} transport cannot {method} (its channel does not declare {capability}); "
            "choose the way of moving bytes from the channel's capabilities"
        )

    # -- every channel -------------------------------------------------------------

    def request(self, msg: Any, expect: type, *, timeout: float) -> Any:
        """Send one request and wait for its reply (Failure -> TransferError)."""
        self.sock.settimeout(max(timeout, 0.001))
        P.send_msg(self.sock, msg)
        reply = P.recv_msg(self.sock, expect=(expect,))
        if isinstance(reply, P.Failure):
            if reply.kind == "timeout":
                raise TransferTimeoutError(f"sender at {self.address}: {reply.message}")
            if reply.kind == "altered":
                raise TicketError(f"sender at {self.address}: {reply.message}")
            if reply.kind == "auth":
                raise AuthenticationError(f"sender at {self.address}: {reply.message}")
            raise TransferError(f"sender at {self.address}: {reply.message}")
        return reply

    def acquire(self, ticket_id: int, piece: int, *, timeout: float, digest: bytes, relay: str = "", failed_source: str = "",
                ranges: bytes = b"", stripe: int = 0) -> P.Located:
        """Take a reader slot of a ticket's piece: where its blocks are
        (checked against the sender's pool), and for a broadcast whom to
        pull from (``relay``: this receiver's relay address, if it relays;
        ``failed_source``: a relay that failed us; ``ranges``: the digest
        of the byte ranges a sharded get reads, whose readers relay to
        each other; ``stripe``: the half of a two-tree broadcast whose
        ``failed_source`` failed). A two-tree broadcast's Located names
        two sources (``stripes``), distinct from this receiver's relay."""
        # The sender waits up to `timeout` for a streamed piece; our socket
        # waits a little longer so its answer (or its Failure) gets here.
        msg = self.session.sign(P.Acquire(ticket_id=ticket_id, piece=piece, timeout_seconds=timeout, digest=digest, relay=relay,
                                          failed_source=failed_source, ranges=ranges, stripe=stripe))
        located = self.request(msg, P.Located, timeout=timeout + 5.0)
        if located.stripes and (len(located.stripes) != 2 or (relay and relay in located.stripes)):
            raise ProtocolError(f"sender named {located.stripes!r:.200} as the sources of a two-tree broadcast's halves (relaying at {relay!r})")
        pool_n = self.welcome.pool_nbytes
        for off, n in located.blocks:
            if off < 0 or n <= 0 or off + n > pool_n:
                raise ProtocolError(f"sender located a block ({off}, {n}) outside its {pool_n:,}-byte pool")
        return located

    def release(self, ticket_id: int, piece: int, *, timeout: float) -> bool:
        """Give back a reader slot; whether the sender still held it."""
        return self.request(P.Release(ticket_id=ticket_id, piece=piece), P.Released, timeout=timeout).valid

    def read_into(self, ticket_id: int, piece: int, blocks: list[tuple[int, int]], dests: list[torch.Tensor], *, deadline: float) -> None:
        """Move the bytes of acquired ``blocks`` into ``dests`` (1-D uint8, same sizes)."""
        raise NotImplementedError

    def read_stream(self, ticket_id: int, piece: int, blocks: list[tuple[int, int]], scratch: torch.Tensor, sink: Any, *, deadline: float) -> None:
        """Move the bytes of acquired ``blocks`` through ``scratch`` (1-D uint8, host).

        The blocks, concatenated, are a stream; it arrives a chunk at a
        time, and after each chunk ``sink(pos, k, base)`` is called with
        stream bytes ``[pos, pos + k)`` at host address ``base`` in
        ``scratch``. Bounded memory for objects of any size. When the stream
        is longer than ``scratch``, its two halves take turns: the next
        chunk arrives in one while ``sink`` copies the other out, on a
        thread (both the receive and the copy run without the GIL).
        """
        total = sum(n for _, n in blocks)
        if not total:
            return
        fill = self._stream_filler(ticket_id, piece, blocks, deadline)
        cap = scratch.numel()
        if total > cap and cap >= 2 * _STREAM_ALIGNMENT:
            half = cap // 2 // _STREAM_ALIGNMENT * _STREAM_ALIGNMENT
            bufs = [scratch[:half], scratch[half : 2 * half]]
        else:
            bufs = [scratch]
        busy: list[Any] = [None] * len(bufs)
        try:
            pos = i = 0
            while pos < total:
                j = i % len(bufs)
                if busy[j] is not None:
                    finish(*busy[j])  # its last chunk is copied out: reuse it
                    busy[j] = None
                buf = bufs[j]
                k = min(buf.numel(), total - pos)
                fill(pos, k, buf)
                if len(bufs) == 1:
                    sink(pos, k, buf.data_ptr())
                else:
                    busy[j] = (executor().submit(sink, pos, k, buf.data_ptr()), sink, pos, k, buf.data_ptr())
                pos += k
                i += 1
        finally:
            # Always wait: the caller frees or reuses the scratch on return.
            errors = []
            for job in busy:
                if job is not None:
                    try:
                        finish(*job)
                    except BaseException as exc:
                        errors.append(exc)
        if errors:
            raise errors[0]

    def _stream_filler(self, ticket_id: int, piece: int, blocks: list[tuple[int, int]], deadline: float) -> Any:
        """``fill(pos, k, buf)``: stream bytes ``[pos, pos + k)`` into ``buf[:k]``
        (called in stream order). Here: :meth:`read_into` of the blocks'
        sub-ranges (one-sided transports read any range)."""
        starts, at = [], 0
        for _, n in blocks:
            starts.append(at)
            at += n

        def fill(pos: int, k: int, buf: torch.Tensor) -> None:
            sub, dests = [], []
            for (off, n), s in zip(blocks, starts):
                lo, hi = max(pos, s), min(pos + k, s + n)
                if lo < hi:
                    sub.append((off + lo - s, hi - lo))
                    dests.append(buf[lo - pos : hi - pos])
            self.read_into(ticket_id, piece, sub, dests, deadline=deadline)

        return fill

    def registered(self, tensor: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        """``tensor``'s memory readable into for the duration of the block
        (channels that ``reads_registered_only`` register it; any other
        channel reads into any host memory: nothing to do)."""
        return contextlib.nullcontext()

    # -- capabilities ----------------------------------------------------------------

    def remote_views(self, blocks: list[tuple[int, int]], on_release: Any = None) -> list[torch.Tensor]:
        """``maps_sender_memory``: views of the sender's blocks (no copy),
        one storage per block; ``on_release()`` runs as each block's
        storage is collected."""
        raise self._lacks("maps_sender_memory", "hand out views of the sender's memory (zero_copy=True needs transport='shm')")

    def read_buffers(self, ticket_id: int, piece: int, blocks: list[tuple[int, int]], buffers: list[memoryview], *, deadline: float) -> None:
        """``receives_into_buffers``: move the bytes of acquired ``blocks``
        into writable byte ``buffers`` that cover them back to back."""
        raise self._lacks("receives_into_buffers", "receive into a list of buffers")

    def receive_range(self, ticket_id: int, piece: int, blocks: list[tuple[int, int]], buf: memoryview, start: int, progress: Any, *,
                      deadline: float, chunk_nbytes: int) -> None:
        """``relays``: bytes ``[start, len(buf))`` of the acquired blocks
        (back to back) into ``buf``, ``chunk_nbytes`` at a time, calling
        ``progress(end)`` after each: a relaying receiver serves what has
        arrived while the rest comes in."""
        raise self._lacks("relays", "receive a broadcast chunk by chunk")

    def is_sourced(self, ticket_id: int, piece: int) -> bool:
        """Whether an acquired piece is the sender's tensors themselves
        (snapshot=False), not its pool (only channels that
        ``reads_source_runs`` keep such a piece apart)."""
        return False

    def read_runs(self, ticket_id: int, piece: int, pos: np.ndarray, address: np.ndarray, nbytes: np.ndarray, *, deadline: float) -> None:
        """``reads_source_runs``: bytes of an acquired snapshot=False piece
        (``pos``: positions in the piece) into local runs (``address``,
        ``nbytes``), straight out of the sender's tensors."""
        raise self._lacks("reads_source_runs", "read a snapshot=False piece out of the sender's tensors")

    def read_ranges(self, ticket_id: int, piece: int, blocks: list[tuple[int, int]], pos: np.ndarray, address: np.ndarray,
                    nbytes: np.ndarray, *, deadline: float) -> None:
        """``reads_ranges``: bytes ``[pos, pos + nbytes)`` of the acquired
        ``blocks`` (back to back), ascending (they may overlap), into local host
        memory at ``address`` (registered, for a channel that
        ``reads_registered_only``); no other byte of the piece moves."""
        raise self._lacks("reads_ranges", "read byte ranges of a piece (a sharded get)")

    def receive_ranges(self, ticket_id: int, piece: int, blocks: list[tuple[int, int]], pos: np.ndarray, nbytes: np.ndarray,
                       buf: memoryview, start: int, progress: Any, *, deadline: float, chunk_nbytes: int) -> None:
        """``reads_ranges`` and ``relays``: the ranges ``[pos, pos + nbytes)``
        of the acquired ``blocks``, back to back, as a stream into ``buf``
        (registered, for a channel that ``reads_registered_only``): its
        bytes from ``start`` on, ``chunk_nbytes`` at a time, ``progress(end)``
        after each. A sharded get's relay passes each chunk on to the
        readers of the same ranges while the rest comes in. Here: a
        :meth:`read_ranges` a chunk."""
        at = np.cumsum(nbytes) - nbytes
        here = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0
        for lo in range(start, len(buf), chunk_nbytes):
            hi = min(lo + chunk_nbytes, len(buf))
            w_at, w_pos, w_n = packing.window((at, pos, nbytes), lo, hi)
            self.read_ranges(ticket_id, piece, blocks, w_pos, here + lo + w_at, w_n, deadline=deadline)
            progress(hi)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
