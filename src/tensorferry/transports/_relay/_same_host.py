"""Same-host reads: how a child copies out of a relay on its own host
(process_vm_readv, else a read-only mapping of the relay's memfd), and its
record of which relays it reads how. See :mod:`tensorferry.transports._relay`."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import logging
import mmap
import os
import socket
import threading
import time

import numpy as np

from ...errors import AuthenticationError, ProtocolError, TransferError
from ...wire import protocol as P
from .._shm import vm_readv

__all__ = ["LEND_READ_NBYTES", "SameHostReads", "host_identity"]

log = logging.getLogger("tensorferry.transports")

# The most bytes a child copies out of a same-host relay in one
# process_vm_readv: a relay that already holds everything lends it in one
# Arrived, and a child that relays too passes each piece on as it lands
# (8 MiB: about 1 ms at memory speed, far below a link's chunk time).
LEND_READ_NBYTES = 8 << 20


@functools.lru_cache(maxsize=1)
def host_identity() -> bytes:
    """What a relay and a child compare to know they can read each other's
    memory by pid: the boot (a pid means nothing on another machine or after
    a reboot), the pid namespace (a pid means nothing in another one) and
    the network namespace (a host as the broadcast tree sees it: test hosts
    made of namespaces stay apart, as containers with their own network do)."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            parts.append(f.read().strip())
        for ns in ("pid", "net"):
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino).encode())
    except OSError:
        return b""  # no /proc: every relay is read as a stream
    return b"/".join(parts)


class SameHostReads:
    """A child's choice and record of how it reads relays on its own host.

    Args:
        enabled: copy out of a same-host relay's memory (``False``: take
            the tcp stream from every relay).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.memory_nbytes = 0  # copied out of same-host relays' memory, either way
        self.file_nbytes = 0  # of which out of a mapping of the relay's memfd
        self.stream_nbytes = 0  # taken as tcp streams from relays
        self.nixl_nbytes = 0  # READ with NIXL out of relays' exposed memory
        self.refused = ""  # why the last refused memory read was refused, if one was
        self._refused_at: set[str] = set()  # relays read as streams
        self._no_vm_at: set[str] = set()  # relays read through their file
        self._lock = threading.Lock()

    def wanted(self, address: str) -> bool:
        return self.enabled and address not in self._refused_at

    def vm_allowed(self, address: str) -> bool:
        return address not in self._no_vm_at

    def refuse_vm(self, address: str, reason: str) -> None:
        """process_vm_readv of this relay was refused: read it through its file."""
        self._note(self._no_vm_at, address, reason, logging.INFO, "through its shared memory file")

    def refuse(self, address: str, reason: str) -> None:
        """Neither memory read of this relay works: take its stream."""
        self._note(self._refused_at, address, reason, logging.WARNING, "over tcp")

    def _note(self, where: set[str], address: str, reason: str, level: int, how: str) -> None:
        """Record (and log, once per relay) why ``address`` is read ``how``."""
        with self._lock:
            if address not in where:
                where.add(address)
                self.refused = reason
                log.log(level, "reading the relay at %s %s: %s", address, how, reason)

    def count(self, memory: int = 0, stream: int = 0, file: int = 0, nixl: int = 0) -> None:
        with self._lock:
            self.memory_nbytes += memory
            self.file_nbytes += file
            self.stream_nbytes += stream
            self.nixl_nbytes += nixl


class _VmReadRefused(Exception):
    """The kernel would not let us read a same-host relay's memory."""


class _LentReader:
    """Copies ranges of a lent stream into ``buf``: by process_vm_readv
    while the kernel allows it (one copy, nothing to map or fault in), else
    out of a read-only mapping of the relay's memfd (no ptrace permission
    needed), fetched from its file socket on the first refusal."""

    def __init__(self, address: str, lend: P.Lend, buf: memoryview, reads: SameHostReads | None, timeout: float) -> None:
        self.address, self.lend, self.reads, self.timeout = address, lend, reads, timeout
        self.here = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
        self.vm = reads is None or reads.vm_allowed(address)
        self.mapping: mmap.mmap | None = None
        self.base = 0

    def copy(self, pos: int, k: int) -> None:
        if self.vm:
            try:
                vm_readv(self.lend.pid, np.array([self.here + pos]), np.array([self.lend.address + pos]), np.array([k]),
                         peer="relay", fix="reading it through its shared memory file instead")
                if self.reads is not None:
                    self.reads.count(memory=k)
                return
            except AuthenticationError as exc:
                self.vm = False
                if self.reads is not None:
                    self.reads.refuse_vm(self.address, str(exc))
                vm_refused = str(exc)
        else:
            vm_refused = "process_vm_readv was refused before"
        if self.mapping is None:
            self._map(vm_refused)
        ctypes.memmove(self.here + pos, self.base + pos, k)  # within the sealed size: checked in _map
        if self.reads is not None:
            self.reads.count(memory=k, file=k)

    def _map(self, vm_refused: str) -> None:
        """Fetch the relay's memfd and map it read-only, checked: sealed
        against shrinking (a read below its size can never fault) and at
        least the stream's size."""
        lend, where = self.lend, f"relay at {self.address}"
        if not lend.file.startswith("@") or not lend.key:
            raise _VmReadRefused(f"{vm_refused}; the {where} lends no shared memory file")
        fds: list[int] = []
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as us:
                us.settimeout(self.timeout)
                us.connect("\0" + lend.file[1:])
                P.send_msg(us, P.Claim(key=lend.key))
                reply = P.recv_msg(us, expect=(P.Welcome,), fds=fds, deadline=time.monotonic() + self.timeout)
        except (OSError, TransferError) as exc:
            for fd in fds:
                os.close(fd)
            raise _VmReadRefused(f"{vm_refused}; the {where} did not pass its memory file ({exc})") from exc
        if isinstance(reply, P.Failure) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            why = reply.message if isinstance(reply, P.Failure) else f"{len(fds)} file descriptors instead of 1"
            raise _VmReadRefused(f"{vm_refused}; the {where} did not pass its memory file ({why})")
        fd = fds[0]
        try:
            size = os.fstat(fd).st_size
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & fcntl.F_SEAL_SHRINK == 0:
                raise _VmReadRefused(f"{vm_refused}; the {where} passed a file that can shrink (it could fault our reads)")
            if size < lend.nbytes or reply.pool_nbytes != lend.nbytes:
                raise ProtocolError(f"{where} lends a {lend.nbytes:,}-byte stream in a {size:,}-byte file (it said {reply.pool_nbytes:,})")
            if lend.nbytes:
                self.mapping = mmap.mmap(fd, lend.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                view = np.frombuffer(self.mapping, dtype=np.uint8)
                self.base = int(view.ctypes.data)
                del view  # the address stays valid until the mapping is closed
        except OSError as exc:
            raise _VmReadRefused(f"{vm_refused}; could not map the {where}'s memory file ({exc})") from exc
        finally:
            os.close(fd)  # the mapping holds its own reference to the file

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
