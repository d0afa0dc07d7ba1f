"""``nixl``: one-sided READs with NVIDIA NIXL (UCX), for RDMA-class networks.

Control travels over the same framed TCP protocol as the tcp transport
(Hello / Acquire / Release); the bytes do not. The sender registers its pool
with NIXL once and sends its agent metadata and pool base address in the
Welcome; the receiver registers its receive pool once, loads the sender's
metadata, and pulls each acquired block with a READ: one descriptor per
merged block, straight into receive-pool memory. Destinations outside the
registered receive pool are staged through it in pool-sized chunks.

Optional: needs the ``nixl`` extra (``nixl==1.5.1``, installed after torch).
Set ``UCX_NET_DEVICES`` (``lo`` on a host without RDMA).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from typing import Any, Iterator

import numpy as np

from ..copy import StagedCopy
from ..errors import TransferError
from ..wire import protocol as P
from ._channel import Channel
from ._connections import ReceiveContext
from ._nixl_agent import NixlEndpoint
from ._nixl_reads import ReadPipeline
from ._ranges import block_ranges
from ._tcp import TcpControlServer, connect

__all__ = ["NixlServer", "NixlChannel", "serving_endpoint"]

# How often the serving endpoint polls NIXL: only needed when UCX emulates
# READ in software (TCP between hosts); on one host UCX uses CMA.
_SERVER_PROGRESS_SECONDS = 0.005


# A relaying receiver READs a broadcast's stream from its source in chunks
# of this much, two in flight, and publishes each to its children as it
# lands. Smaller chunks shorten each hop of a chain and cost throughput:
# over 1 Gbit/s links (UCX by TCP), 128 MiB took 1.13 s as one READ, 1.16 s
# in 4 MiB chunks and 1.35 s in 1 MiB chunks; 256 MiB down a chain of 8
# took 3.43 s with 4 MiB chunks (about 140 ms a hop) and 3.21 s with 2 MiB
# (about 80 ms), one receiver 2.34 and 2.42 s.
RELAY_CHUNK_NBYTES = 2 << 20


def _agent_name(side: str) -> str:
    return f"tensorferry-{side}-{os.getpid()}-{secrets.token_hex(4)}"


def serving_endpoint(side: str) -> NixlEndpoint:
    """A NIXL agent whose registered memory peers READ (a sender's pool, a
    relay's tickets): it makes progress on a thread of its own."""
    return NixlEndpoint(_agent_name(side), progress_interval_seconds=_SERVER_PROGRESS_SECONDS)


class NixlServer(TcpControlServer):
    """Control over TCP (Hello, Acquire, Release; no Fetch: receivers
    READ); the pool registered with NIXL once, its metadata in the Welcome."""

    transport = "nixl"
    broadcasts = True

    def __init__(
        self, ledger, *, token: bytes = b"", host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
        tls: Any = None,
    ) -> None:
        pool = ledger.pool
        self.endpoint = serving_endpoint("s")
        try:
            self.endpoint.register(pool.buffer)  # once, for the pool's life
            self._metadata = self.endpoint.metadata()
            super().__init__(ledger, token=token, host=host, port=port, advertise_host=advertise_host, tls=tls)
        except BaseException:
            self.endpoint.close()
            raise

    def _welcome(self, conn, hello):
        pool = self.ledger.pool
        welcome = P.Welcome(
            pool_nbytes=pool.capacity_nbytes,
            pool_generation=pool.generation,
            pool_base_addr=pool.data_ptr,
            nixl_metadata=self._metadata,
            nixl_agent=self.endpoint.name,
        )
        return welcome, []

    def close(self) -> None:
        super().close()
        self.endpoint.close()


def _receiver_endpoint(context: ReceiveContext) -> NixlEndpoint:
    """The receiver's one endpoint, with its receive pool registered once."""

    def make() -> NixlEndpoint:
        # The reading side makes progress while it polls its own reads.
        ep = NixlEndpoint(_agent_name("r"), progress_interval_seconds=None)
        ep.register(context.ensure_pool().buffer)
        return ep

    return context.resource("nixl-endpoint", make)


class NixlChannel(Channel):
    """Control over a TCP connection (:func:`_tcp.connect`), bytes by NIXL
    READs into the receive pool the context lends (registered once)."""

    transport = "nixl"
    secured_by_tls = True  # its control connection; the READs are NIXL's (see docs/security.md)
    reads_registered_only = True
    relays = True
    reads_ranges = True
    # Fixed (a smaller READ costs UCX over TCP more CPU a byte: see above).
    relay_chunk_nbytes = relay_min_chunk_nbytes = ranged_chunk_nbytes = RELAY_CHUNK_NBYTES

    def __init__(self, address: str, *, token: bytes = b"", timeout: float = 30.0, context: ReceiveContext | None = None,
                 tls: Any = None) -> None:
        context = context if context is not None else ReceiveContext(None)
        self.endpoint = _receiver_endpoint(context)
        self.relay_endpoint = self.endpoint  # a pull from a nixl relay READs with it
        self.pool = context.ensure_pool()
        super().__init__(address, token=token, timeout=timeout, context=context, tls=tls)

    def _connect(self, address: str, timeout: float):
        return connect(address, timeout)

    def _on_welcome(self, welcome, fds) -> None:
        super()._on_welcome(welcome, fds)
        if not welcome.nixl_metadata:
            raise TransferError(f"the sender at {self.address} sent no NIXL metadata; is it a nixl sender?")
        self.remote = self.endpoint.add_remote(welcome.nixl_metadata)
        self.base = welcome.pool_base_addr

    @contextlib.contextmanager
    def registered(self, tensor: Any) -> Iterator[None]:
        """``tensor``'s bytes readable into for the duration: registered
        with our endpoint unless they lie in memory it has (the receive pool)."""
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if not nbytes or any(r.addr <= addr and addr + nbytes <= r.addr + r.nbytes for r in self.endpoint.regions):
            yield
            return
        self.endpoint.register(tensor)
        try:
            yield
        finally:
            if not self.endpoint.closed:
                self.endpoint.deregister(tensor)

    def receive_range(self, ticket_id: int, piece: int, blocks, buf: memoryview, start: int, progress: Any, *, deadline: float, chunk_nbytes: int) -> None:
        """READs of ``chunk_nbytes`` (:attr:`relay_chunk_nbytes` is this
        transport's choice), two in flight, into ``buf`` (registered: see
        :meth:`registered`); see :meth:`Channel.receive_range`."""
        total = sum(n for _, n in blocks)
        if total != len(buf):
            raise TransferError(f"the acquired blocks hold {total:,} bytes, the stream {len(buf):,}")
        here = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
        chunk = chunk_nbytes
        pipe = ReadPipeline(self.endpoint, self.remote)  # two READs in flight: the link stays busy between chunks
        try:
            at = 0  # where the block starts in the stream
            for off, n in blocks:
                pos = max(start, at)
                while pos < at + n:
                    if pipe.full:
                        progress(pipe.wait())
                    k = min(chunk, at + n - pos)
                    pipe.post(self.base + off + pos - at, here + pos, k, pos + k, timeout=_left(deadline))
                    pos += k
                at += n
            while pipe.inflight:
                progress(pipe.wait())
        finally:
            pipe.close()

    def read_ranges(self, ticket_id, piece, blocks, pos, address, nbytes, *, deadline):
        """One READ of only these ranges, into registered memory (the
        receive pool, or targets the caller holds :meth:`registered`)."""
        off, addr, n = block_ranges(blocks, pos, address, nbytes)
        self.endpoint.read(self.remote, np.stack([off + self.base, n], axis=1), np.stack([addr, n], axis=1), timeout=_left(deadline))

    def read_into(self, ticket_id, piece, blocks, dests, *, deadline):
        pool = self.pool
        lo, hi = pool.data_ptr, pool.data_ptr + pool.capacity_nbytes
        direct_r, direct_l, staged = [], [], []
        for (off, n), dst in zip(blocks, dests):
            addr = dst.data_ptr()
            if lo <= addr and addr + n <= hi:
                direct_r.append((self.base + off, n))
                direct_l.append((addr, n))
            else:
                staged.append((off, n, dst))
        if direct_r:
            self.endpoint.read(self.remote, direct_r, direct_l, timeout=_left(deadline))
        if staged:
            self._read_staged(ticket_id, piece, [(off, n) for off, n, _ in staged], [d for *_, d in staged], deadline)

    def _read_staged(self, ticket_id: int, piece: int, blocks, dests, deadline: float) -> None:
        """Blocks whose destination lies outside the registered receive pool:
        streamed through as much of the pool as is free (``read_stream``:
        READs into one half while the other is copied out by address)."""
        total = sum(n for _, n in blocks)
        while True:
            lease = self.pool.reserve_up_to(min(total, _STAGE_MAX_NBYTES), min_nbytes=1)
            if lease is not None:
                break
            if time.monotonic() > deadline:
                raise TransferError(
                    f"the receive pool ({self.pool.capacity_nbytes:,} bytes) has no free space to stage a NIXL read; "
                    "give the Receiver a larger pool or release received objects"
                )
            time.sleep(0.001)
        with lease:
            self.read_stream(ticket_id, piece, blocks, lease.view(), StagedCopy.into_blocks(dests), deadline=deadline)


# At most this much of the receive pool stages one read (in two halves that
# take turns): smaller chunks start the copy-out sooner.
_STAGE_MAX_NBYTES = 64 << 20


def _left(deadline: float) -> float:
    from ..errors import TransferTimeoutError

    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeoutError("the get ran out of time before its NIXL read")
    return left
