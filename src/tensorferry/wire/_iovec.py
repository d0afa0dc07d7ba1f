"""Socket I/O of byte runs given by address: libc's ``sendmsg`` and
``recvmsg`` over an iovec array that numpy builds, ``IOV_MAX`` runs a call.

A sharded read is thousands of runs of a few KiB (a column slice of a
row-sharded matrix: a run a row). As memory views, each run is a Python
object on both ends, and each survives long enough to be promoted by the
cyclic GC: 16k views a get made a full collection (about 60 ms in a process
that imported torch) every get or two. Here a run is 16 bytes of an int64
array; the loop runs ``sendmsg``/``recvmsg`` through ctypes (without the
GIL) and resumes a short transfer by patching one iovec in place.

Over TLS (an ``SSLSocket`` has no ``sendmsg``/``recvmsg``) each run goes
through the socket alone, a view at a time.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import ssl
import time
from collections.abc import Callable

import numpy as np

from ..errors import PeerGoneError, TransferTimeoutError

__all__ = ["IOV_MAX", "is_tls", "recv_bounded", "recv_exact_into", "recv_runs", "recv_some_into", "send_runs", "transfer_failure"]

# Linux's IOV_MAX (UIO_MAXIOV): the most buffers one recvmsg_into, sendmsg,
# preadv, pwritev or process_vm_readv takes. The one definition.
IOV_MAX = 1024

# Never raise SIGPIPE at a receiver that hung up: the call fails with EPIPE.
_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
# A struct iovec on a 64-bit platform: (base, length), 16 bytes.
_IOVEC_NBYTES = 16
_RETRY = (errno.EAGAIN, errno.EWOULDBLOCK)


class _Msghdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32), ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t), ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_sendmsg, _recvmsg = _libc.sendmsg, _libc.recvmsg
for _f in (_sendmsg, _recvmsg):
    _f.argtypes = [ctypes.c_int, ctypes.POINTER(_Msghdr), ctypes.c_int]
    _f.restype = ctypes.c_ssize_t


def is_tls(sock: socket.socket) -> bool:
    """A TLS socket: no sendmsg/recvmsg (nor descriptors, nor MSG_PEEK)."""
    return isinstance(sock, ssl.SSLSocket)


def send_runs(sock: socket.socket, address: np.ndarray, nbytes: np.ndarray) -> None:
    """Send ``nbytes[i]`` bytes at ``address[i]`` of this process's memory,
    in order, back to back (sender side; straight from that memory, no
    copy). Each wait for room is bounded by the socket's timeout, as
    ``sendall``'s is. Runs of zero bytes are skipped.

    Raises:
        TransferTimeoutError: the receiver took nothing for the socket's timeout.
        PeerGoneError: the connection broke.
    """
    address, nbytes = _nonempty(address, nbytes)
    if is_tls(sock):
        done, total = 0, int(nbytes.sum())
        try:
            for a, n in zip(address.tolist(), nbytes.tolist()):
                sock.sendall(_view(a, n))
                done += n
        except (socket.timeout, TimeoutError) as exc:
            raise transfer_failure(False, done, total, wait_seconds=sock.gettimeout()) from exc
        except OSError as exc:
            raise transfer_failure(False, done, total, exc) from exc
        return
    timeout = sock.gettimeout()
    _move(False, sock, address, nbytes, lambda: None if timeout is None else time.monotonic() + timeout)


def recv_runs(sock: socket.socket, address: np.ndarray, nbytes: np.ndarray, *, deadline: float) -> None:
    """Fill ``nbytes[i]`` bytes at ``address[i]`` of this process's memory,
    in order, from the socket (receiver side; straight into that memory, no
    copy), by ``deadline`` (``time.monotonic()``). Runs of zero bytes are
    skipped. The caller owns that memory: nothing here checks the addresses.

    Raises:
        TransferTimeoutError: the deadline passed first; says how far it got.
        PeerGoneError: the sender hung up or the connection broke; says how far it got.
    """
    address, nbytes = _nonempty(address, nbytes)
    if is_tls(sock):
        done, total = 0, int(nbytes.sum())
        for a, n in zip(address.tolist(), nbytes.tolist()):
            recv_exact_into(sock, _view(a, n), deadline=deadline, done=done, total=total)
            done += n
        return
    # Non-blocking (a timeout set), so that the waits in _move bound it.
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    _move(True, sock, address, nbytes, lambda: deadline)


def recv_exact_into(sock: socket.socket, view: memoryview, *, deadline: float, done: int = 0, total: int | None = None,
                    relay: str = "") -> None:
    """Fill ``view`` from the socket, straight into its memory (no copies;
    receiver side), by ``deadline``. An error counts the bytes from
    ``done`` of ``total`` (a larger transfer this view is part of; default:
    the view alone) and names the peer: the relay at ``relay`` (a child's
    pull), else the sender."""
    n, at = len(view), 0
    total = n if total is None else total
    while at < n:
        at += recv_bounded(sock, lambda: sock.recv_into(view[at:], min(n - at, 1 << 26)), deadline, done + at, total, relay)


def recv_some_into(sock: socket.socket, view: memoryview, least: int, *, deadline: float, done: int = 0, total: int | None = None,
                   relay: str = "") -> int:
    """Receive at least ``least`` bytes into the front of ``view`` (all of it
    if shorter), and whatever more has arrived by then, up to its end; the
    bytes received. A relay's chunk loop: a backlog (a busy receiver) is
    taken in one call, not a chunk a call, while a chunk still waits for
    no more than itself. Errors as :func:`recv_exact_into`'s."""
    n, at = len(view), 0
    least = min(least, n)
    total = n if total is None else total
    while at < least:
        at += recv_bounded(sock, lambda: sock.recv_into(view[at:], min(n - at, 1 << 26)), deadline, done + at, total, relay)
    return at


def recv_bounded(sock: socket.socket, call: Callable[[], int], deadline: float, done: int, total: int, relay: str = "") -> int:
    """One receive call, ``call()`` (it returns the bytes received), with the
    socket's timeout at what is left until ``deadline``: the bytes, or the
    error of a transfer stopped after ``done`` of ``total`` (timed out,
    broken, or the peer hung up: the relay at ``relay``, else the sender)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise transfer_failure(True, done, total, relay=relay)
    sock.settimeout(left)
    try:
        k = call()
    except (socket.timeout, TimeoutError) as exc:
        raise transfer_failure(True, done, total, relay=relay) from exc
    except OSError as exc:
        raise transfer_failure(True, done, total, exc, relay=relay) from exc
    if k == 0:
        raise transfer_failure(True, done, total, hung_up=True, relay=relay)
    return k


def transfer_failure(
    receiving: bool, done: int, total: int, exc: OSError | None = None, *, hung_up: bool = False, wait_seconds: float | None = None,
    relay: str = "",
) -> Exception:
    """The error of a transfer stopped after ``done`` of ``total`` bytes:
    timed out (no ``exc``; a send after ``wait_seconds``, the socket's
    timeout, without room), broken (``exc``) or hung up; each says what
    to check or change. A receive's bytes came from the relay at ``relay``
    (a child's pull), else from the sender. Also that of protocol.py's
    byte helpers."""
    if receiving:
        # The peer: the relay at ``relay`` (a child's pull) or the sender.
        who, kind = (f"the relay at {relay}", "relay") if relay else ("the sender", "sender")
        if hung_up:
            gone = "Receiver (see its log)" if relay else "Sender (see its log), and its tickets went with it: get a new one once it is back"
            return PeerGoneError(f"{who} closed the connection after {done:,} of {total:,} bytes: its process exited or closed its {gone}")
        if exc is None:
            return TransferTimeoutError(f"timed out after receiving {done:,} of {total:,} bytes{f' from {who}' if relay else ''}: raise "
                                        f"get(timeout=) or Receiver(timeout=), or check that the {kind} runs and the link between you moves bytes")
        lead = f"the connection to {who}" if relay else "the sender's connection"
        return PeerGoneError(f"{lead} broke after {done:,} of {total:,} bytes ({exc}): check that the {kind}'s process runs (its log) "
                             "and the network between you")
    if exc is None and not hung_up:
        return TransferTimeoutError(f"timed out sending block bytes to the receiver, after {done:,} of {total:,} bytes: it read "
                                    f"nothing for {wait_seconds} s; check that its process runs and the link between you")
    return PeerGoneError(f"the receiver closed the connection during a send, after {done:,} of {total:,} bytes "
                         f"({exc or 'nothing sent'}): its get ended or its process exited; its error or log says why")


def _nonempty(address: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    address = np.asarray(address, dtype=np.int64).ravel()
    nbytes = np.asarray(nbytes, dtype=np.int64).ravel()
    keep = nbytes > 0
    return (address, nbytes) if keep.all() else (address[keep], nbytes[keep])


def _view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _move(receiving: bool, sock: socket.socket, address: np.ndarray, nbytes: np.ndarray, deadline: Callable[[], float | None]) -> None:
    """libc's recvmsg (``receiving``) or sendmsg over the runs until every
    byte moved; a short call resumes inside the run it stopped in. On a
    non-blocking descriptor (a socket with a timeout) each wait for the
    socket lasts until ``deadline()``."""
    count = int(nbytes.size)
    if not count:
        return
    call, flags = (_recvmsg, 0) if receiving else (_sendmsg, _MSG_NOSIGNAL)
    iov = np.empty((count, 2), dtype=np.uint64)
    iov[:, 0], iov[:, 1] = address, nbytes
    ends = np.cumsum(nbytes)
    total = int(ends[-1])
    fd = sock.fileno()
    msg = _Msghdr()
    poller = select.poll()
    poller.register(fd, select.POLLIN if receiving else select.POLLOUT)
    done = first = 0
    while done < total:
        msg.msg_iov = iov.ctypes.data + _IOVEC_NBYTES * first
        msg.msg_iovlen = min(IOV_MAX, count - first)
        k = call(fd, ctypes.byref(msg), flags)
        if k < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err not in _RETRY:
                raise transfer_failure(receiving, done, total, OSError(err, os.strerror(err)))
            until = deadline()
            left = None if until is None else until - time.monotonic()
            if (left is not None and left <= 0) or not poller.poll(None if left is None else max(1, int(left * 1000))):
                raise transfer_failure(receiving, done, total, wait_seconds=sock.gettimeout())
            continue
        if k == 0:
            raise transfer_failure(receiving, done, total, hung_up=True)
        done += k
        # The first run not wholly moved; if it moved in part, its rest.
        first = int(np.searchsorted(ends, done, side="right"))
        if first < count and ends[first] - done < nbytes[first]:
            iov[first, 0] = address[first] + (done - (ends[first] - nbytes[first]))
            iov[first, 1] = ends[first] - done
