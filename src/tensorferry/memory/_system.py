"""Memory taken from the system: pool buffers and new host bytes.

* :func:`pool_buffer`: a pool's one buffer (a memfd mapping on CPU, a
  device tensor on CUDA), with the numbers in the error when refused.
* :func:`new_host_bytes`: a receiver's new destination memory, with
  transparent huge pages asked for when large; :func:`host_mapping`, the
  mapping under it (the receive cache keeps such mappings), or
  :func:`shared_host_mapping`, a sealed memfd's (a relay's receive memory,
  which children on its host map).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import weakref

import numpy as np
import torch

from ..errors import BackendUnavailableError, ConfigurationError, PoolCreationError

__all__ = ["SHARED_SEALS", "huge_pages_off", "host_mapping", "new_host_bytes", "pool_buffer", "pool_device", "shared_host_mapping"]

# New host memory of at least this size gets its own mapping with huge pages
# (TENSORFERRY_HUGE_PAGES=0: never).
_HUGE_MIN_NBYTES = 8 << 20
_HUGE_ENV = "TENSORFERRY_HUGE_PAGES"
# What a shared mapping's file is sealed with: its size is fixed (a reader
# that mapped it can never touch a page past its end, so never a SIGBUS),
# and the seals themselves are.
SHARED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def pool_buffer(capacity_nbytes: int, device: torch.device, *, prefault: bool, name: str) -> tuple[torch.Tensor, int | None, mmap.mmap | None]:
    """A pool's buffer: on CPU a memfd (shareable by its fd, freed by the
    kernel with its last holder, never in /dev/shm) mapped shared; on CUDA
    one device tensor. Returns ``(buffer, fd, mapping)``.

    Raises:
        PoolCreationError: the host or the device refused the memory; the
            message gives the numbers.
    """
    fd: int | None = None
    mm: mmap.mmap | None = None
    if device.type == "cpu":
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except OSError as exc:
            raise PoolCreationError(capacity_nbytes, "cpu", f"memfd_create failed ({exc})") from exc
        try:
            os.ftruncate(fd, capacity_nbytes)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
            mm = mmap.mmap(fd, capacity_nbytes, flags=flags)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise PoolCreationError(capacity_nbytes, "cpu", f"{exc.strerror or exc}; {_host_memory()}") from exc
            raise
        return torch.frombuffer(mm, dtype=torch.uint8), fd, mm
    try:
        buffer = torch.empty(capacity_nbytes, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError as exc:
        free, total = torch.cuda.mem_get_info(device)
        raise PoolCreationError(capacity_nbytes, str(device), f"the device has {free:,} of {total:,} bytes free") from exc
    if prefault:
        buffer.zero_()
    return buffer, None, None


def pool_device(device: str | torch.device) -> torch.device:
    """The pool's device, checked: CPU, or a CUDA device this process can use."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(f"MemoryPool(device={device!r}) is not a device; use 'cpu' or 'cuda[:N]'") from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigurationError(f"MemoryPool(device={device!r}): a pool lives on 'cpu' or a CUDA device, not {dev.type}")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise BackendUnavailableError(
            f"MemoryPool(device={device!r}): {why}; use device='cpu', or a CUDA build of torch on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigurationError(f"MemoryPool(device={device!r}): this machine has {count} CUDA device(s), 0 to {count - 1}")
    return dev


def _host_memory() -> str:
    """What the host has, for the message of a refused pool mapping."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    free = os.sysconf("SC_AVPHYS_PAGES") * page
    return f"this host has {total:,} bytes of memory, {free:,} of them free"




def new_host_bytes(nbytes: int) -> torch.Tensor:
    """A new 1-D uint8 host tensor of ``nbytes`` (contents undefined).

    New memory costs a page fault per page on its first write, and at 4 KiB
    a page that is most of the cost of receiving into it: copying 1 GiB into
    ``torch.empty`` memory took 556 ms here, against 96 ms into memory
    already touched. A large one is therefore its own anonymous mapping
    with transparent huge pages asked for (``MADV_HUGEPAGE``; most kernels
    give them only to mappings that ask): faults of 2 MiB, and the same copy
    took 253 ms. The mapping goes back to the kernel when the last tensor
    sharing its storage is collected.

    Where the kernel compacts memory synchronously for such mappings
    (``/sys/kernel/mm/transparent_hugepage/defrag`` says ``madvise``) and
    memory is fragmented, a fault may wait for that compaction; set
    ``TENSORFERRY_HUGE_PAGES=0`` to get plain ``torch.empty`` memory.
    """
    if nbytes < _HUGE_MIN_NBYTES or not hasattr(mmap, "MADV_HUGEPAGE") or huge_pages_off():
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.from_numpy(np.frombuffer(host_mapping(nbytes), dtype=np.uint8))


def host_mapping(nbytes: int) -> mmap.mmap:
    """A new private anonymous mapping of ``nbytes`` (page-aligned, not yet
    faulted in), with transparent huge pages asked for from
    ``_HUGE_MIN_NBYTES`` on unless ``TENSORFERRY_HUGE_PAGES=0``.

    It is unmapped when the mmap object and every buffer exported from it
    (numpy arrays, the tensors sharing their storage) are gone.
    """
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= _HUGE_MIN_NBYTES and hasattr(mmap, "MADV_HUGEPAGE") and not huge_pages_off():
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # no transparent huge pages here: plain pages, still correct
    return m


def shared_host_mapping(nbytes: int, name: str) -> tuple[mmap.mmap, int]:
    """A new shared mapping of ``nbytes`` backed by a memfd sealed at that
    size (:data:`SHARED_SEALS`); returns ``(mapping, fd)``. Other processes
    given the fd (SCM_RIGHTS) map the same pages. The fd is closed once the
    mapping object is collected (after every buffer exported from it): it
    stays valid as long as the memory does.

    Shared memory (shmem) gets huge pages only where
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows them, so a
    first write may fault 4 KiB pages; the receive cache keeps these
    mappings faulted in for the next gets.

    Raises:
        PoolCreationError: the host refused the memfd or the mapping.
    """
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise PoolCreationError(nbytes, "cpu", f"memfd_create failed ({exc})") from exc
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SHARED_SEALS)
        m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError):
            raise PoolCreationError(nbytes, "cpu", f"{exc.strerror or exc}; {_host_memory()}") from exc
        raise
    weakref.finalize(m, os.close, fd)
    if nbytes >= _HUGE_MIN_NBYTES and hasattr(mmap, "MADV_HUGEPAGE") and not huge_pages_off():
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # shmem without huge pages: plain pages, still correct
    return m, fd


def huge_pages_off() -> bool:
    raw = os.environ.get(_HUGE_ENV, "").strip()
    if raw in ("", "1"):
        return False
    if raw == "0":
        return True
    raise ConfigurationError(f"{_HUGE_ENV}={raw!r}: expected 1 (ask for transparent huge pages for new memory, the default) or 0 (never)")
