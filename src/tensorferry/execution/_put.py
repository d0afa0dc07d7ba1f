"""How a put executes: the one decision, from the plan and what the servers can do.

Sender side. Every put executes a plan (kept or one-shot); this module
chooses, once per put, how its bytes reach the readers:

* ``empty``: nothing to move (a ticket with no blocks);
* ``resident``: the whole object placed in the pool now;
* ``streamed``: the pool is short, so the object goes in pieces of its
  one-block layout, each packed (a window of the plan's runs) as readers
  free the pool;
* ``sourced``: ``snapshot=False``, pieces served from the tensors' own
  memory (needs a server that ``serves_source_memory``).

A broadcast (``fanout``) is an option of resident: one block (relays pass
on one stream) and a :class:`~tensorferry._broadcast.Tree` of who pulls
from whom, or with ``trees`` the :class:`~tensorferry._trees.Trees` of
who pulls each half (needs a server that ``broadcasts``). The choice is made from
the capabilities servers declare, never from a transport's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigurationError, PoolExhaustedError
from ..plans import SendPlan
from ._broadcast import Tree
from ._trees import Trees, relay_tree
from ._ledger import Piece

__all__ = ["Execution", "PutOptions", "choose"]


@dataclass(frozen=True)
class PutOptions:
    """What a put asked for (checked by ``Sender.put``)."""

    readers: int
    """Reader slots of every piece."""
    one_shot: bool
    """Raise instead of streaming when the object does not fit."""
    snapshot: bool
    """Copy into the pool (``True``) or serve the tensors' own memory."""
    fanout: int | None
    """A broadcast: the most receivers the sender (and each relay) serves."""
    trees: bool
    """A broadcast in two complementary binary trees, each carrying half."""
    piece_nbytes: int
    """Size of streamed and sourced pieces."""


@dataclass
class Execution:
    """How one put moves its bytes: what the ticket says and the ledger serves."""

    kind: Literal["empty", "resident", "streamed", "sourced"]
    pieces: list[Piece]
    blocks: list[tuple[int, int]]  # the ticket's blocks (resident)
    piece_nbytes: int  # the ticket's piece size (0: resident)
    pack: Callable[[int, int], Any] | None = None  # streamed: packs a piece later
    tree: Tree | Trees | None = None

    @property
    def num_pieces(self) -> int:
        return max(1, len(self.pieces)) if self.piece_nbytes else 1


def choose(plan: SendPlan, opts: PutOptions, servers: Iterable[Any]) -> Execution:
    """Decide how ``plan`` is put and do what must happen now: place a
    resident object, build a sourced plan's buffers. Called by ``Sender.put``
    after it checked the arguments and the plan.

    Args:
        plan: the kept plan put, or the one-shot plan of a fresh object.
        opts: the put's options.
        servers: the sender's servers (their class attributes say what
            they can do).

    Raises:
        ConfigurationError: ``snapshot=False`` or ``fanout`` that no server
            of this sender can serve, or a plan ``snapshot=False`` cannot serve.
        PoolExhaustedError: it does not fit and may not stream (``one_shot``,
            ``fanout``); nothing held.
        PlanStaleError: a kept plan's tensor moved.
    """
    servers = list(servers)
    total = plan.total_nbytes
    if opts.fanout is not None and not opts.snapshot:
        raise ConfigurationError(
            "put(fanout=...) broadcasts a snapshot in the pool through relaying receivers over tcp or nixl, and snapshot=False serves "
            "the tensors themselves: use snapshot=True"
        )
    if not opts.snapshot:
        if not any(s.serves_source_memory for s in servers):
            raise ConfigurationError(
                "put(plan, snapshot=False) serves the tensors' own memory, which the tcp transport sends and shm "
                f"readers copy (process_vm_readv); this sender serves {', '.join(s.transport for s in servers)}: use snapshot=True"
            )
        if total:
            size = opts.piece_nbytes
            pieces = [Piece(voffset=p.lo, nbytes=p.hi - p.lo, readers=opts.readers, packed=p) for p in plan.sourced_pieces(size)]
            return Execution("sourced", pieces, [], size)
    if opts.fanout is not None and not any(s.broadcasts for s in servers):
        raise ConfigurationError(
            f"put(fanout=...) broadcasts through relaying receivers over tcp or nixl; this sender serves "
            f"{', '.join(s.transport for s in servers)}: use a tcp or nixl Sender"
        )
    if not total:
        return Execution("empty", [], [], 0)
    try:
        packed = plan.place(one_block=opts.fanout is not None)
    except PoolExhaustedError as exc:
        if opts.fanout is not None:
            raise PoolExhaustedError(
                exc.requested_nbytes, exc.free_nbytes, exc.largest_free_nbytes, exc.capacity_nbytes,
                detail="put(fanout=...) sends the object as one block of the free pool (relays pass on one stream; "
                "it is not streamed in pieces): wait for older tickets' readers (wait_released, discard), make the Sender "
                f"with capacity_nbytes of at least {exc.requested_nbytes:,}, or put without fanout",
            ) from exc
        if opts.one_shot:
            raise
        size = opts.piece_nbytes
        pieces = [Piece(voffset=s, nbytes=min(size, total - s), readers=opts.readers) for s in range(0, total, size)]
        return Execution("streamed", pieces, [], size, pack=plan.piece_packer())
    blocks = [(b.offset, b.nbytes) for b in packed.blocks]
    piece = Piece(voffset=0, nbytes=sum(n for _, n in blocks), readers=opts.readers, packed=packed)
    return Execution("resident", [piece], blocks, 0, tree=relay_tree(opts.fanout, opts.trees, opts.readers))
