"""Block bytes over a socket, straight into or out of their memory (no
copies): many buffers scatter-gather (:func:`recv_scatter_into`,
:func:`send_all_views`), and one buffer (``recv_exact_into``, made in
:mod:`_iovec`, which reads runs by address with it over TLS). Control frames are
:mod:`protocol`'s; runs by address are :mod:`_iovec`'s. The errors say how
far a transfer got and what to check (``_iovec.transfer_failure``)."""

from __future__ import annotations

import collections
import socket

from ._iovec import IOV_MAX, is_tls, recv_bounded, recv_exact_into, transfer_failure

__all__ = ["recv_exact_into", "recv_scatter_into", "send_all_views"]  # recv_exact_into: _iovec's


def _advance(pending: collections.deque, nbytes: int) -> None:
    """Drop ``nbytes`` from the front of a queue of buffers (a partial
    scatter-gather send or receive), trimming the first one left."""
    while nbytes:
        first = pending[0]
        if nbytes >= len(first):
            nbytes -= len(first)
            pending.popleft()
        else:
            pending[0] = first[nbytes:]
            nbytes = 0


# The buffers a recvmsg_into is first handed, and the fewest after that.
_FIRST_RECV_VIEWS = 64
_MIN_RECV_VIEWS = 16


def recv_scatter_into(sock: socket.socket, views: list[memoryview], *, deadline: float) -> None:
    """Fill ``views`` in order from the socket, scatter-gather (recvmsg_into),
    straight into their memory: many small tensors cost few system calls.

    Each call is handed about twice as many buffers as the last one filled
    (at most ``IOV_MAX``): a call returns what the socket holds (a few
    hundred KiB on loopback), and every buffer handed over costs a buffer
    request whether it is filled or not (a column slice's 8 KiB rows: 64 MiB
    received in 14.8 ms of CPU this way, 17.2 ms through a scratch buffer).
    """
    pending = collections.deque(v for v in views if len(v))
    total = sum(len(v) for v in pending)
    got, want = 0, _FIRST_RECV_VIEWS
    if is_tls(sock):  # no recvmsg_into over TLS: one buffer at a time
        for v in pending:
            recv_exact_into(sock, v, deadline=deadline, done=got, total=total)
            got += len(v)
        return
    while pending:
        batch = [pending[i] for i in range(min(want, len(pending)))]
        k = recv_bounded(sock, lambda: sock.recvmsg_into(batch)[0], deadline, got, total)
        got += k
        before = len(pending)
        _advance(pending, k)
        want = max(_MIN_RECV_VIEWS, min(IOV_MAX, 2 * (before - len(pending) + 1)))


def send_all_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter-gather send of memory views straight from pool memory
    (sender side)."""
    # sendmsg takes many buffers per call but may send only part of them;
    # advance through the list and resend the rest.
    pending = collections.deque(v for v in views if len(v))
    done, total = 0, sum(len(v) for v in pending)
    try:
        if is_tls(sock):  # no sendmsg over TLS: one buffer at a time
            for v in pending:
                sock.sendall(v)
                done += len(v)
            return
        while pending:
            batch = [pending[i] for i in range(min(IOV_MAX, len(pending)))]
            k = sock.sendmsg(batch)
            done += k
            _advance(pending, k)
    except socket.timeout as exc:
        raise transfer_failure(False, done, total, wait_seconds=sock.gettimeout()) from exc
    except OSError as exc:
        raise transfer_failure(False, done, total, exc) from exc
