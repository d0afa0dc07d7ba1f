"""The memory layer: the bytes tensorferry owns, and how tensors are seen in them.

Owns free-space bookkeeping (``_allocator``), the memory taken from the
system (``_system``: memfd mappings, huge pages, device buffers), the
:class:`MemoryPool` (``_pool``: reserve, lease, place, pack), what a pool
hands out (``_packed``: :class:`Packed`, :class:`PoolStats`), views of
received or pooled bytes (``_views``) and the receiver's cache of result
memory (``_recv_cache``).

May import: the wire, tensors and copy layers, :mod:`tensorferry.errors`
and :mod:`tensorferry.monitor` (a pool registers itself as a source of the
monitor's pool figures). Never plans, execution, transports or the user API.
"""

from __future__ import annotations

from ._allocator import Allocator, AllocatorStats, Block
from ._pool import DEFAULT_CAPACITY_NBYTES, Lease, MemoryPool, Packed, PoolStats
from ._recv_cache import CACHE_ENV, DEFAULT_IDLE_SECONDS, CacheStats, ReceiveCache, cap_nbytes, idle_seconds
from ._system import host_mapping, huge_pages_off, new_host_bytes, shared_host_mapping
from ._views import build_views, owned_view, unpack

__all__ = [
    "Allocator", "AllocatorStats", "Block",
    "DEFAULT_CAPACITY_NBYTES", "Lease", "MemoryPool", "Packed", "PoolStats",
    "CACHE_ENV", "DEFAULT_IDLE_SECONDS", "CacheStats", "ReceiveCache", "cap_nbytes", "idle_seconds",
    "huge_pages_off", "host_mapping", "new_host_bytes", "shared_host_mapping",
    "build_views", "owned_view", "unpack",
]
