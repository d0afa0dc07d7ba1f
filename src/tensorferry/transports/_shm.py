"""``shm``: same-host transfers through the sender's memfd pool.

The receiver connects to the sender's abstract Unix socket (nothing on the
file system, nothing in /dev/shm), proves it is the same user (SO_PEERCRED),
and receives the pool's memfd over the socket (SCM_RIGHTS). It maps the pool
once per sender, privately (copy-on-write: a receiver that writes into a
zero-copy view changes only its own copy, never the sender's data), and
copies each block out with one copy, or hands out views of it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
import socket

import numpy as np
import torch

from ..copy import CopyPlan, copy_bytes, vectored_io
from ..errors import AuthenticationError, ConfigurationError, ProtocolError
from ..memory import owned_view
from ..wire import protocol as P
from ._base import Connection, ControlServer, check_same_user
from ._channel import Channel
from ._ranges import block_ranges

__all__ = ["ShmServer", "ShmChannel"]


class ShmServer(ControlServer):
    transport = "shm"
    serves_source_memory = True  # readers copy a sourced piece out with process_vm_readv
    same_host_only = True

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
        check_same_user(sock, "map this sender's pool")

    def _welcome(self, conn: Connection, hello: P.Hello) -> tuple[P.Welcome, list[int]]:
        welcome, _ = super()._welcome(conn, hello)
        return welcome, [self.ledger.pool.fd]

    def _handle_extra(self, conn: Connection, msg) -> bool:
        if not isinstance(msg, P.Sources):
            return False
        held = self._held(conn, msg)
        if held is None:
            return True
        runs = held.runs()
        if runs is None:
            P.send_msg(conn.sock, P.Failure(kind="not-sourced", message=f"ticket {msg.ticket_id} piece {msg.piece} is in the pool (not a snapshot=False piece): map it"))
            return True
        pos, addr, n = (np.ascontiguousarray(a, dtype="<i8").tobytes() for a in runs)
        P.send_msg(conn.sock, P.SourceRuns(pid=os.getpid(), pos=pos, address=addr, nbytes=n))
        return True


def _intersect(a_pos: np.ndarray, a_addr: np.ndarray, a_len: np.ndarray, b_pos: np.ndarray, b_addr: np.ndarray, b_len: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two lists of runs over one byte stream (position, address, length,
    positions ascending, runs apart): the pieces both cover, as (address in
    a, address in b, length). O(runs), vectorised."""
    cuts = np.unique(np.concatenate([a_pos, a_pos + a_len, b_pos, b_pos + b_len]))
    if cuts.size < 2:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    lo, hi = cuts[:-1], cuts[1:]
    ia = np.searchsorted(a_pos, lo, side="right") - 1
    ib = np.searchsorted(b_pos, lo, side="right") - 1
    ok = (ia >= 0) & (ib >= 0)
    ia_c, ib_c = np.maximum(ia, 0), np.maximum(ib, 0)
    ok &= (lo < a_pos[ia_c] + a_len[ia_c]) & (lo < b_pos[ib_c] + b_len[ib_c])
    lo, hi, ia, ib = lo[ok], hi[ok], ia[ok], ib[ok]
    return a_addr[ia] + (lo - a_pos[ia]), b_addr[ib] + (lo - b_pos[ib]), hi - lo


_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.restype = ctypes.c_ssize_t
_process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]


def vm_readv(pid: int, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray, *, peer: str = "sender", fix: str = "use tcp or snapshot=True") -> None:
    """Copy ``nbytes[i]`` bytes from ``remote[i]`` in process ``pid`` to
    ``local[i]`` here, 1024 runs a system call (the kernel copies; no
    shared memory needed: same user, ptrace access). ``peer`` names the
    process and ``fix`` the remedy in the errors.

    Raises:
        PeerGoneError: the process is gone, or its memory there is gone.
        AuthenticationError: this process may not read the other's memory.
    """
    from ..errors import PeerGoneError

    count = int(nbytes.size)
    liov = np.empty((count, 2), dtype=np.uint64)
    riov = np.empty((count, 2), dtype=np.uint64)
    liov[:, 0], liov[:, 1] = local, nbytes
    riov[:, 0], riov[:, 1] = remote, nbytes
    for i in range(0, count, P.IOV_MAX):
        k = min(P.IOV_MAX, count - i)
        want = int(nbytes[i : i + k].sum())
        got = _process_vm_readv(pid, liov.ctypes.data + 16 * i, k, riov.ctypes.data + 16 * i, k, 0)
        if got != want:
            err = ctypes.get_errno()
            if got < 0 and err == errno.EPERM:
                raise AuthenticationError(f"process_vm_readv of {peer} process {pid}: not permitted (another user, or ptrace restricted); {fix}")
            raise PeerGoneError(f"process_vm_readv of {peer} process {pid} moved {got} of {want:,} bytes ({os.strerror(err) if got < 0 else 'short'}): its memory there is gone")


class ShmChannel(Channel):
    transport = "shm"
    maps_sender_memory = True
    receives_into_buffers = True  # preadv of the pool's file
    reads_source_runs = True
    reads_ranges = True

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
        # Acquired snapshot=False pieces: (pid, positions, addresses, lengths).
        self._sourced: dict[tuple[int, int], tuple[int, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.remote = torch.from_numpy(np.frombuffer(self._mmap, dtype=np.uint8))

    def acquire(self, ticket_id, piece, *, timeout, digest, relay="", failed_source="", ranges=b""):
        located = super().acquire(ticket_id, piece, timeout=timeout, digest=digest, relay=relay, failed_source=failed_source, ranges=ranges)
        if located.sourced:
            self._sourced[(ticket_id, piece)] = self._source_runs(ticket_id, piece, timeout)
        else:
            self._sourced.pop((ticket_id, piece), None)
        return located

    def is_sourced(self, ticket_id: int, piece: int) -> bool:
        return (ticket_id, piece) in self._sourced

    def release(self, ticket_id, piece, *, timeout):
        self._sourced.pop((ticket_id, piece), None)
        return super().release(ticket_id, piece, timeout=timeout)

    def _source_runs(self, ticket_id: int, piece: int, timeout: float) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Where a snapshot=False piece's bytes are in the sender (checked)."""
        reply = self.request(P.Sources(ticket_id=ticket_id, piece=piece), P.SourceRuns, timeout=timeout)
        pos, addr, n = (np.frombuffer(b, dtype="<i8").astype(np.int64) for b in (reply.pos, reply.address, reply.nbytes))
        if not pos.size == addr.size == n.size or (n <= 0).any() or (pos < 0).any() or (pos.size > 1 and (pos[1:] < pos[:-1] + n[:-1]).any()):
            raise ProtocolError(f"sender described its snapshot=False piece with {pos.size} malformed runs")
        return reply.pid, pos, addr, n

    def read_runs(self, ticket_id: int, piece: int, pos: np.ndarray, address: np.ndarray, nbytes: np.ndarray, *, deadline: float) -> None:
        """Bytes of an acquired snapshot=False piece (``pos``: positions in
        the piece) into local runs, straight from the sender's tensors: the
        two cuttings intersected, then process_vm_readv, 1024 runs a call."""
        pid, r_pos, r_addr, r_n = self._sourced[(ticket_id, piece)]
        local, remote, length = _intersect(pos, address, nbytes, r_pos, r_addr, r_n)
        vm_readv(pid, local, remote, length)

    def read_into(self, ticket_id, piece, blocks, dests, *, deadline):
        if (ticket_id, piece) in self._sourced:
            # The destinations and the blocks (ranges of the piece) both cut
            # the concatenation of the blocks: their intersection says which
            # piece position each destination byte takes.
            d_len = np.fromiter(map(torch.Tensor.numel, dests), dtype=np.int64, count=len(dests))
            d_addr = np.fromiter(map(torch.Tensor.data_ptr, dests), dtype=np.int64, count=len(dests))
            b_off = np.array([off for off, _ in blocks], dtype=np.int64)
            b_len = np.array([n for _, n in blocks], dtype=np.int64)
            addr, pos, n = _intersect(np.cumsum(d_len) - d_len, d_addr, d_len, np.cumsum(b_len) - b_len, b_off, b_len)
            self.read_runs(ticket_id, piece, pos, addr, n, deadline=deadline)
            return
        # The blocks' copy plan: blocks adjacent on both sides are one copy.
        if not all(d.device.type == "cpu" for d in dests):
            for (off, n), dst in zip(blocks, dests):
                copy_bytes(dst, self.remote[off : off + n])
            return
        src = np.fromiter((off for off, _ in blocks), dtype=np.int64, count=len(blocks))
        nbytes = np.fromiter((n for _, n in blocks), dtype=np.int64, count=len(blocks))
        dst = np.fromiter(map(torch.Tensor.data_ptr, dests), dtype=np.int64, count=len(dests))
        CopyPlan.build(dst, src, nbytes).execute(src_base=self.remote.data_ptr())

    def read_ranges(self, ticket_id, piece, blocks, pos, address, nbytes, *, deadline):
        """Ranges of the mapped pool by address (of the sender's tensors,
        a snapshot=False piece, by process_vm_readv)."""
        if (ticket_id, piece) in self._sourced:
            self.read_runs(ticket_id, piece, pos, address, nbytes, deadline=deadline)
            return
        off, addr, n = block_ranges(blocks, pos, address, nbytes)
        CopyPlan.build(addr, off, n).execute(src_base=self.remote.data_ptr())

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
