"""``shm``: same-host transfers through the sender's memfd pool.

The receiver connects to the sender's abstract Unix socket (nothing on the
file system, nothing in /dev/shm), proves it is the same user (SO_PEERCRED),
and receives the pool's memfd over the socket (SCM_RIGHTS). It maps the pool
once per sender, privately (copy-on-write: a receiver that writes into a
zero-copy view changes only its own copy, never the sender's data), and
copies each block out with one copy, or hands out views of it.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import struct

import numpy as np
import torch

from .. import _protocol as P
from .._copy import CopyPlan, copy_bytes, vectored_io
from .._views import owned_view
from ..errors import AuthenticationError, ConfigurationError, ProtocolError
from ._base import Channel, Connection, ControlServer

__all__ = ["ShmServer", "ShmChannel"]

_UCRED = struct.Struct("3i")  # pid, uid, gid


class ShmServer(ControlServer):
    transport = "shm"

    def _listen(self) -> socket.socket:
        if self.ledger.pool.fd is None:
            raise ConfigurationError("the shm transport needs a CPU MemoryPool (a memfd); this pool is on " + str(self.ledger.pool.device))
        self._name = f"tensorferry-{os.getpid()}-{secrets.token_hex(6)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + self._name)  # abstract namespace: gone with the process
        sock.listen(64)
        return sock

    @property
    def address(self) -> str:
        return "@" + self._name

    def _authorize(self, sock: socket.socket) -> None:
        pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if uid != os.getuid() and uid != 0:
            raise AuthenticationError(f"process {pid} of user {uid} may not map this sender's pool")

    def _welcome(self, conn: Connection, hello: P.Hello) -> tuple[P.Welcome, list[int]]:
        welcome, _ = super()._welcome(conn, hello)
        return welcome, [self.ledger.pool.fd]


class ShmChannel(Channel):
    transport = "shm"
    supports_zero_copy = True
    reads_buffers = True

    def _connect(self, address: str, timeout: float) -> socket.socket:
        if not address.startswith("@"):
            raise ProtocolError(f"shm address {address!r} is not an abstract socket name")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect("\0" + address[1:])
        except OSError as exc:
            sock.close()
            from ..errors import PeerGoneError

            raise PeerGoneError(f"no sender listens at {address} (it exited, or is on another host: use tcp) ({exc})") from exc
        return sock

    def _on_welcome(self, welcome: P.Welcome, fds: list[int]) -> None:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"shm sender passed {len(fds)} file descriptors, expected 1")
        fd = fds[0]
        try:
            size = os.fstat(fd).st_size
            if size < welcome.pool_nbytes:
                raise ProtocolError(f"sender's pool file has {size:,} bytes, it claims {welcome.pool_nbytes:,}")
            self._mmap = mmap.mmap(fd, welcome.pool_nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        # Kept: many small runs are read from the file with preadv (read_buffers).
        os.set_inheritable(fd, False)
        self._fd: int | None = fd
        self.remote = torch.from_numpy(np.frombuffer(self._mmap, dtype=np.uint8))

    def read_into(self, ticket_id, piece, blocks, dests, *, deadline):
        # The blocks' copy plan: blocks adjacent on both sides are one copy.
        if not all(d.device.type == "cpu" for d in dests):
            for (off, n), dst in zip(blocks, dests):
                copy_bytes(dst, self.remote[off : off + n])
            return
        src = np.fromiter((off for off, _ in blocks), dtype=np.int64, count=len(blocks))
        nbytes = np.fromiter((n for _, n in blocks), dtype=np.int64, count=len(blocks))
        dst = np.fromiter(map(torch.Tensor.data_ptr, dests), dtype=np.int64, count=len(dests))
        CopyPlan.build(dst, src, nbytes).execute(src_base=self.remote.data_ptr())

    def read_buffers(self, ticket_id, piece, blocks, buffers, *, deadline):
        """The acquired blocks' bytes into byte ``buffers`` (covering the
        blocks back to back), read from the sender's pool file with preadv:
        a kept plan's many small targets in few system calls."""
        if len(blocks) == 1:
            vectored_io(os.preadv, self._fd, buffers, blocks[0][0])
            return
        # Several blocks: cut the list where each block ends (one buffer
        # may straddle a seam and is split in two).
        ends = np.cumsum(np.fromiter(map(len, buffers), dtype=np.int64, count=len(buffers)))
        first, at, head = 0, 0, None
        for off, n in blocks:
            stop = at + n
            last = int(np.searchsorted(ends, stop, side="left"))
            part = list(buffers[first : last + 1])
            if head is not None:
                part[0] = head
            cut = int(ends[last]) - stop  # bytes of the last buffer beyond this block
            head = None
            if cut:
                whole = part[-1]
                part[-1], head = whole[: len(whole) - cut], whole[len(whole) - cut :]
                first = last
            else:
                first = last + 1
            vectored_io(os.preadv, self._fd, part, off)
            at = stop

    def remote_views(self, blocks, on_release=None):
        # One storage per block, each its own owner of the mapping:
        # ``on_release`` runs when the last tensor sharing a block's storage
        # is collected (the receiver ties the release of the hold to it).
        return [owned_view(self._mmap, off, n, on_release) for off, n in blocks]

    def close(self) -> None:
        super().close()
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)
        # Views handed out keep the mapping alive; it is unmapped after them.
        self.remote = None
        # Unmap now if no view is alive: the mapping pins the sender's pool
        # memory, and Python's mmap holds a dup of the memfd until closed.
        # Zero-copy views export its buffer (BufferError): then the last of
        # them drops the mmap object, which unmaps and closes the fd.
        m, self._mmap = getattr(self, "_mmap", None), None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass
