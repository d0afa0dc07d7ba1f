"""READs of a :class:`~tensorferry.transports._nixl_agent.NixlEndpoint`:
blocking (:meth:`~_Reads.read`) or posted and polled (:class:`PendingRead`,
and :class:`ReadPipeline` for a stream's chunks), every range checked
against both sides' registered regions before NIXL sees it, and the polling
that stands in for the blocking wait NIXL lacks."""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import numpy as np

from ..errors import ConfigurationError, TransferError, TransferTimeoutError
from ._nixl_wire import Regions, as_ranges, merged_descs, nixl_errors

if TYPE_CHECKING:
    from ._nixl_agent import NixlEndpoint

__all__ = ["PendingRead", "ReadPipeline"]

log = logging.getLogger("tensorferry.transports.nixl")

# Polling: spin this long (a small read completes in microseconds), then
# sleep with a doubling pause up to _MAX_PAUSE_SECONDS, so a long wait does
# not take a core from the peer on a small machine.
_SPIN_SECONDS = 0.001
_FIRST_PAUSE_SECONDS = 20e-6
_MAX_PAUSE_SECONDS = 0.001


class _Reads:
    """The READ half of :class:`NixlEndpoint` (its base): the agent, lock,
    peers and registered regions are the endpoint's."""

    name: str
    _lock: threading.RLock
    _agent: Any
    _local: Regions
    _peers: dict[str, Regions]
    _abandoned: list[Any]
    _check_open: Callable[[], None]

    def read(
        self,
        remote: str,
        remote_ranges: Sequence[tuple[int, int]] | np.ndarray,
        local_ranges: Sequence[tuple[int, int]] | np.ndarray,
        *,
        timeout: float,
    ) -> None:
        """READ ``remote_ranges`` of a peer's registered memory into ``local_ranges`` of ours (receiver side).

        Blocks, polling, until the data is in place. Pair ``i`` moves
        ``remote_ranges[i]`` to ``local_ranges[i]``; both are absolute
        ``(address, nbytes)``, the byte counts must match, and each range must
        lie inside one registered region of its side (checked before NIXL is
        called). Zero-byte pairs are skipped; pairs adjacent on both sides
        go out as one descriptor. One copy, by NIXL/UCX (CMA on one host,
        RDMA or TCP between hosts), straight into local memory.

        The timeout bounds waiting for the lock and for completion. On one
        host UCX copies inside the post call, which cannot be interrupted: a
        huge read may then return (complete, never reported as timed out)
        after the deadline by at most its own copy time. On a timeout or an
        error the local ranges may hold partial data.

        Args:
            remote: the peer's name from :meth:`add_remote`.
            remote_ranges: ``(address, nbytes)`` pairs in the peer's memory,
                a sequence or an (N, 2) integer array (faster for many).
            local_ranges: ``(address, nbytes)`` pairs in this endpoint's memory.
            timeout: seconds, positive and finite.

        Raises:
            ValueError: bad ranges (shape, negative, unequal counts or byte
                counts, outside the registered regions, mixed memory kinds),
                an unknown peer, a bad timeout.
            TransferTimeoutError: not done within ``timeout``; the request
                was cancelled and released.
            PeerGoneError: the peer died or disconnected.
            TransferError: NIXL rejected or failed the transfer; the endpoint is closed.
        """
        deadline = _deadline(timeout)
        if not self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise TransferTimeoutError(f"read from {remote!r} waited {timeout} s for another read on this endpoint to finish")
        try:
            prepared = self._prepare(remote, remote_ranges, local_ranges)
            if prepared is not None:
                pending = self._start(remote, *prepared, deadline, timeout)
                try:
                    _wait(lambda: True if self._poll(pending) else None)
                finally:
                    self._drop(pending)
        finally:
            self._lock.release()

    def post_read(self, remote: str, remote_ranges: Any, local_ranges: Any, *, timeout: float) -> "PendingRead":
        """Start the READ that :meth:`read` would make and return at once;
        :meth:`poll_read` it until done (or :meth:`cancel_read` it). Several
        may be in flight on one endpoint: a stream of chunks read two at a
        time keeps a TCP link busy between them (one at a time, each READ's
        round trip leaves the link idle: 4 MiB chunks at 1 Gbit/s took 10%
        longer than one READ of everything; two in flight, 3%).

        The ranges are checked as by :meth:`read`; ``timeout`` bounds the
        transfer (``poll_read`` raises after it). The reading side must keep
        polling: on TCP, UCX moves the bytes only while we poll.
        """
        deadline = _deadline(timeout)
        with self._lock:
            prepared = self._prepare(remote, remote_ranges, local_ranges)
            if prepared is None:
                return PendingRead(None, "an empty READ", deadline, timeout, remote)
            return self._start(remote, *prepared, deadline, timeout)

    def poll_read(self, pending: "PendingRead") -> bool:
        """True once ``pending`` is done (then released); False while in flight.

        Raises:
            TransferTimeoutError: past its timeout (cancelled and released).
            PeerGoneError, TransferError: it failed (released).
        """
        if pending.handle is None:
            return True
        with self._lock:
            return self._poll(pending)

    def cancel_read(self, pending: "PendingRead") -> None:
        """Give up a READ still in flight (its local range may hold part of its bytes)."""
        if pending.handle is not None:
            with self._lock:
                self._drop(pending)

    def _prepare(self, remote: str, remote_ranges: Any, local_ranges: Any) -> tuple[np.ndarray, str, np.ndarray, str] | None:
        """Under the lock: the checked, merged descriptors of a READ (None: nothing to move)."""
        rr = as_ranges(remote_ranges, "remote")
        lr = as_ranges(local_ranges, "local")
        if len(rr) != len(lr):
            raise ConfigurationError(f"{len(remote_ranges)} remote ranges but {len(local_ranges)} local ranges: pass one local range per remote range")
        unequal = rr[:, 1] != lr[:, 1]
        if unequal.any():
            i = int(np.flatnonzero(unequal)[0])
            raise ConfigurationError(f"pair {i} reads {int(rr[i, 1]):,} remote bytes into a {int(lr[i, 1]):,}-byte local range: byte counts must match")
        keep = rr[:, 1] > 0
        if not keep.all():
            rr, lr = rr[keep], lr[keep]
        if len(rr) == 0:
            return None
        self._check_open()
        peer = self._peers.get(remote)
        if peer is None:
            raise ConfigurationError(f"unknown peer {remote!r}: call add_remote(metadata) first (known: {', '.join(self._peers) or 'none'})")
        nbytes = rr[:, 1]
        l_idx = self._local.locate(lr[:, 0], nbytes, side="local", owner=f"this endpoint ({self.name!r})")
        r_idx = peer.locate(rr[:, 0], nbytes, side="remote", owner=f"peer {remote!r}")
        l_mem = self._one_mem(self._local, l_idx, "local")
        r_mem = self._one_mem(peer, r_idx, "remote")
        local_descs, remote_descs = merged_descs(lr[:, 0], rr[:, 0], nbytes, l_idx, r_idx, self._local, peer)
        return local_descs, l_mem, remote_descs, r_mem

    @staticmethod
    def _one_mem(regions: Regions, idx: np.ndarray, side: str) -> str:
        if len(set(regions.mems)) == 1:  # the usual case: one pool, nothing to look up
            return regions.mems[0]
        kinds = {regions.mems[i] for i in np.unique(idx).tolist()}
        if len(kinds) > 1:
            raise ConfigurationError(f"{side} ranges span {' and '.join(sorted(kinds))} memory; one read moves one memory kind per side: split it")
        return kinds.pop()

    def _start(self, remote: str, local_descs: np.ndarray, l_mem: str, remote_descs: np.ndarray, r_mem: str,
               deadline: float, timeout: float) -> "PendingRead":
        """Under the lock: make and post the READ of these descriptors."""
        agent = self._agent
        what = f"READ of {int(local_descs[:, 1].sum()):,} bytes in {len(local_descs):,} descriptors from {remote!r}"
        with nixl_errors(what, remote):
            # initialize_xfer over prep_xfer_dlist + make_prepped_xfer:
            # ranges change every read, so nothing is reused, and for
            # 100k descriptors it is ~20% cheaper (16 vs 20 ms); prepped
            # lists would merge adjacent ranges, which we already did.
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local_descs, l_mem), agent.get_xfer_descs(remote_descs, r_mem), remote)
        pending = PendingRead(handle, what, deadline, timeout, remote)
        with nixl_errors(what, remote):
            try:
                pending.state = agent.transfer(handle)
            except Exception:
                self._drop(pending)
                raise
        return pending

    def _poll(self, pending: "PendingRead") -> bool:
        """Under the lock: :meth:`poll_read` of a READ still held."""
        try:
            if pending.state == "PROC":
                if time.monotonic() >= pending.deadline:
                    raise TransferTimeoutError(
                        f"{pending.what} did not finish within {pending.timeout} s; it was cancelled. "
                        "The peer may be stopped or not progressing (a serving endpoint must call progress() "
                        "when UCX reads over TCP), or the timeout is too short for the size"
                    )
                with nixl_errors(pending.what, pending.remote):
                    pending.state = self._agent.check_xfer_state(pending.handle)
            if pending.state == "PROC":
                return False
            if pending.state != "DONE":
                raise TransferError(f"{pending.what} failed: NIXL reports transfer state {pending.state!r}")
        except BaseException:
            self._drop(pending)
            raise
        self._drop(pending)
        return True

    def _drop(self, pending: "PendingRead") -> None:
        """Release ``pending``'s request, once."""
        if pending.handle is not None:
            self._release(pending.handle)
            pending.handle = None

    def _release(self, handle: Any) -> None:
        def abandon(exc: Exception) -> None:
            # NIXL could not cancel an in-flight request: keep it alive so
            # its memory is not reused under it; close() retries.
            log.warning("NIXL could not release a transfer request (%s); retrying on close", exc)
            self._abandoned.append(handle)

        with nixl_errors(error=abandon):
            handle.release()


class PendingRead:
    """A READ in flight (:meth:`NixlEndpoint.post_read`)."""

    __slots__ = ("handle", "what", "deadline", "timeout", "remote", "state")

    def __init__(self, handle: Any, what: str, deadline: float, timeout: float, remote: str) -> None:
        self.handle, self.what, self.deadline, self.timeout, self.remote = handle, what, deadline, timeout, remote
        self.state = "PROC" if handle is not None else "DONE"


class ReadPipeline:
    """The READs of a stream's chunks from one peer, at most ``depth`` in
    flight, completed in the order posted (:meth:`NixlEndpoint.post_read`).

    Each post names the stream position its bytes complete (``end``);
    :meth:`poll` and :meth:`wait` return the oldest one's once it is done,
    so a caller publishes only bytes that are in place.
    """

    def __init__(self, endpoint: NixlEndpoint, remote: str, *, depth: int = 2) -> None:
        self.endpoint, self.remote, self.depth = endpoint, remote, depth
        self.inflight: collections.deque[tuple[PendingRead, int]] = collections.deque()

    @property
    def full(self) -> bool:
        return len(self.inflight) >= self.depth

    def post(self, remote_addr: int, local_addr: int, nbytes: int, end: int, *, timeout: float) -> None:
        pending = self.endpoint.post_read(self.remote, [(remote_addr, nbytes)], [(local_addr, nbytes)], timeout=timeout)
        self.inflight.append((pending, end))

    def poll(self) -> int | None:
        """The oldest READ's ``end`` if it is done now, else None."""
        pending, end = self.inflight[0]
        if not self.endpoint.poll_read(pending):
            return None
        self.inflight.popleft()
        return end

    def wait(self) -> int:
        """Poll the oldest READ until it is done (spinning briefly, then
        sleeping up to 1 ms between polls); its ``end``. Raises as
        :meth:`NixlEndpoint.poll_read` (past its own timeout too)."""
        return _wait(self.poll)

    def close(self) -> None:
        """Cancel what is still in flight."""
        while self.inflight:
            self.endpoint.cancel_read(self.inflight.popleft()[0])


_T = TypeVar("_T")


def _deadline(timeout: Any) -> float:
    """When a wait of ``timeout`` seconds from now ends."""
    if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
        raise ConfigurationError(f"timeout must be a positive, finite number of seconds; got {timeout!r}")
    return time.monotonic() + timeout


def _wait(poll: Callable[[], _T | None]) -> _T:
    """``poll()`` until it returns something: spinning for _SPIN_SECONDS,
    then sleeping a doubling pause between polls (``poll`` raises on its
    own deadline)."""
    spin_until = time.monotonic() + _SPIN_SECONDS
    pause = _FIRST_PAUSE_SECONDS
    while (out := poll()) is None:
        if time.monotonic() >= spin_until:
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE_SECONDS)
    return out
