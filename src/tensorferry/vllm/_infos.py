"""The plain-data infos of the tensorferry backend: what the trainer says
at the handshake and each round, JSON-safe (vLLM's HTTP client sends them
as JSON bodies; its Ray client as dataclasses of the same dicts).

* :class:`TensorferryTrainerInitInfo`: the trainer's choices (every field
  but ``rank`` has a default that works on one host).
* :class:`TensorferryInitInfo`: what rank 0 sends every worker once
  (``init_weight_transfer_engine``): how to reach the trainer's senders.
* :class:`TensorferryUpdateInfo`: one round: the tickets of every trainer
  rank, base64 (a few KB: the layout of every tensor, no tensor data).

Checked on construction; a value that cannot work is a
``ConfigurationError`` naming the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo, WeightTransferUpdateInfo

from ..errors import ConfigurationError

__all__ = ["TRANSPORTS", "DTYPES", "TensorferryTrainerInitInfo", "TensorferryInitInfo", "TensorferryUpdateInfo"]

TRANSPORTS = ("shm", "tcp", "nixl")
# Names of the floating-point dtypes a trainer may cast to (torch attribute names).
DTYPES = ("float32", "float16", "bfloat16", "float64")


def _check_transport(owner: str, transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ConfigurationError(
            f"{owner}(transport={transport!r}): choose one of {', '.join(TRANSPORTS)} "
            "(shm on one host, tcp across hosts, nixl for RDMA)"
        )


def _check_seconds(owner: str, seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ConfigurationError(f"{owner}(timeout_seconds={seconds!r}): expected a number of seconds above 0")


def _check_count(owner: str, name: str, value: int | None, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        none = " or None" if allow_none else ""
        raise ConfigurationError(f"{owner}({name}={value!r}): expected a whole number from 1 up{none}")


@dataclass
class TensorferryTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: ``TensorferryTrainerInitInfo(rank=r)`` on each rank.

    Every rank makes its own with the same values but ``rank``;
    ``WeightTransferTrainerFactory.trainer_init`` reads ``backend`` from it.
    """

    backend: ClassVar[str] = "tensorferry"

    world_size: int = 1
    """Trainer ranks. With more than one, each rank puts its own shards
    (``WeightSource.iter_local``: DTensor local shards, boxed by the
    metadata's placements) and ``torch.distributed`` must be initialised:
    ranks trade tickets over a gloo group made at ``trainer_init``."""
    transport: str = "shm"
    """``shm`` (workers on the trainer's host), ``tcp`` or ``nixl``."""
    host: str = "127.0.0.1"
    """Where each rank's tcp/nixl server listens (its address as workers
    reach it; loopback by default)."""
    token: str = ""
    """Shared secret of the senders and workers (required off loopback);
    rank 0 sends it to the workers in the init info."""
    dtype: str | None = None
    """Send floating-point weights as this dtype (``"bfloat16"`` from an
    fp32 trainer to a bf16 engine: half the bytes); None: as they are."""
    delta: bool = False
    """Workers holding the previous round read only what changed
    (``Sender.plan(delta=True)``); one trainer rank only."""
    fanout: int | None = None
    """Workers relay each round to each other (tcp, nixl): each rank's
    link carries ``fanout`` copies, not one a worker."""
    readers: int | None = None
    """Worker processes reading each round (every tensor-parallel rank of
    every replica). None: each round is served until vLLM's
    ``update_weights`` returns, however many read it; a number also waits
    until that many have released it."""
    capacity_nbytes: int | None = None
    """Each rank's pool; default: room for its weights (twice with
    ``delta``) and 64 MiB."""
    timeout_seconds: float = 120.0
    """Each worker's get, and a ``readers`` wait."""
    worker_host: str = "127.0.0.1"
    """Where relaying workers listen (``fanout``): the workers' address."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_count(owner, "world_size", self.world_size, allow_none=False)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ConfigurationError(f"{owner}(rank={self.rank!r}): expected 0 <= rank < world_size={self.world_size}")
        _check_transport(owner, self.transport)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigurationError(f"{owner}(dtype={self.dtype!r}): choose one of {', '.join(DTYPES)}, or None to send as held")
        _check_count(owner, "fanout", self.fanout, allow_none=True)
        _check_count(owner, "readers", self.readers, allow_none=True)
        _check_count(owner, "capacity_nbytes", self.capacity_nbytes, allow_none=True)
        _check_seconds(owner, self.timeout_seconds)
        if self.fanout is not None and self.transport == "shm":
            raise ConfigurationError(
                f"{owner}(fanout={self.fanout}, transport='shm'): shm workers read the trainer's memory and need no relay; "
                "use transport='tcp' or 'nixl' with fanout, or leave fanout None"
            )
        if self.delta and self.world_size > 1:
            raise ConfigurationError(
                f"{owner}(delta=True, world_size={self.world_size}): sharded workers read byte ranges of each rank's whole "
                "round, not deltas; leave delta False with several trainer ranks"
            )


@dataclass
class TensorferryInitInfo(WeightTransferInitInfo):
    """Worker-side init info, sent by trainer rank 0 (as a dict) at the handshake."""

    transport: str = "shm"
    """The transport of the trainer's tickets."""
    token: str = ""
    """The senders' shared secret."""
    relay: bool = False
    """Make the receiver a relay (the trainer puts with ``fanout``)."""
    host: str = "127.0.0.1"
    """Where a relaying receiver listens."""
    timeout_seconds: float = 120.0
    """Each get."""
    sources: int = 1
    """Trainer ranks: the tickets every round carries."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_transport(owner, self.transport)
        _check_seconds(owner, self.timeout_seconds)
        _check_count(owner, "sources", self.sources, allow_none=False)


@dataclass
class TensorferryUpdateInfo(WeightTransferUpdateInfo):
    """One round: a ticket of every trainer rank (``Ticket.to_bytes()``, base64), in rank order."""

    tickets: list[str] = field(default_factory=list)
    """Each trainer rank's ticket (``Ticket.to_bytes()``, base64), rank 0 first."""
    round: int = 0
    """The trainer's round count (1 for the first), for messages and logs."""

    def __post_init__(self) -> None:
        if not self.tickets or not all(isinstance(t, str) for t in self.tickets):
            raise ConfigurationError(
                f"TensorferryUpdateInfo(tickets=...): expected a list of base64 ticket strings, one a trainer rank; "
                f"got {type(self.tickets).__name__} of {len(self.tickets) if isinstance(self.tickets, list) else '?'}: "
                "send what TensorferryTrainerWeightTransferEngine.send_weights makes"
            )


# A trainer that makes a TensorferryTrainerInitInfo hands it to vLLM's
# WeightTransferTrainerFactory, which only knows the backends registered in
# its process: a trainer process loads no vLLM plugins, so using this
# module registers them (as the entry point does in vLLM's processes).
from . import register  # noqa: E402

register()
