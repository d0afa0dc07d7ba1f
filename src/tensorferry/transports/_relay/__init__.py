"""Relays: a receiver that passes on what it has received (tcp, nixl).

A broadcast ticket (``Sender.put(..., fanout=k)``) is pulled by most
receivers from another receiver rather than from the sender (see
``tensorferry._broadcast``). A receiver made with ``relay=True`` keeps a
:class:`RelayBook` of the tickets it receives: each one's stream (the
ticket's one block, as it arrives, chunk by chunk) and how much of it has
arrived (of a two-tree broadcast, ``put(trees=True)``, each half apart:
its halves, :func:`stripe_bounds`, arrive from two parents at once). Its
:class:`RelayServer` answers children's :class:`Pull` requests (a byte
range: the stream, or one half) from that stream while the rest still
comes in (pipelined by chunks), so a chain of relays moves the object
about as fast as one link.

A child on the relay's own host (same boot, network and pid namespace:
:func:`host_identity`) does not take a stream: the relay lends it its
receive memory (:class:`~tensorferry._protocol.Lend`: pid and address,
and the memfd the memory is, passed over an abstract Unix socket), then
says how far the bytes have arrived, and the child copies each new range
itself, so a host's link carries the object once however many receivers
it has. It copies with ``process_vm_readv`` (one kernel copy, nothing to
map) where the kernel lets it; where not (Yama's ``ptrace_scope`` 1, the
default on Ubuntu, between sibling processes; a non-dumpable relay) it
maps the relay's memfd read-only and copies out of the mapping, which
needs no ptrace permission, only the same user. Only where neither works
does the child say why once and take the stream.

A nixl child on another host does not take a stream either: the relay
registers the ticket's receive memory with a NIXL agent of its own (the
exposer, which serves READs) and answers its Pull with
:class:`~tensorferry._protocol.Exposed` (the agent's metadata and the
address), then Arrived frames as for a lend; the child READs each new range
one-sided, as it READs the sender's pool.

:func:`pull` is the child's side. A relay that dies or stalls shows up in
the child as a broken or silent connection; the child then asks the sender
for another source and resumes from the bytes it has.

Modules: ``_book`` (what a relay holds: :class:`RelayBook`), ``_server``
(:class:`RelayServer`), ``_links`` (a child's kept connections to relays:
:class:`RelayLinks`), ``_same_host`` (:class:`SameHostReads` and the copy
out of a same-host relay's memory), ``_pull`` (the child's side: :func:`pull`).
"""

from __future__ import annotations

from ._book import CHUNK_NBYTES, MIN_CHUNK_NBYTES, RelayBook, chunk_nbytes_for, half_chunk_nbytes, stripe_bounds
from ._links import RelayLinks
from ._pull import pull
from ._same_host import LEND_READ_NBYTES, SameHostReads, host_identity
from ._server import RelayServer

__all__ = ["CHUNK_NBYTES", "LEND_READ_NBYTES", "MIN_CHUNK_NBYTES", "RelayBook", "RelayLinks", "RelayServer", "SameHostReads", "chunk_nbytes_for", "half_chunk_nbytes", "host_identity",
           "pull", "stripe_bounds"]
