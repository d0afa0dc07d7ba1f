"""tensorferry as a Ray Direct Transport: ``tensor_transport="tensorferry"``.

Ray creates one :class:`TensorferryTransport` per process with no arguments,
so everything it needs is read from the environment (see :func:`settings`)
and created lazily: the source actor's pool segments (each a Sender over shm,
with tcp beside it on the same pool; see ``_segments``) and the destination
actor's Receiver.

One-sided: Ray never calls ``send_multiple_tensors``. On the source, Ray
calls ``extract_tensor_transport_metadata`` right after the method returns;
that packs the tensors once and puts a ticket for any number of readers in
Ray's metadata. The destination's ``recv_multiple_tensors`` redeems it over
shm when both actors share a node, tcp otherwise. ``garbage_collect`` (the
ref went out of scope) discards the ticket; blocks are freed as soon as the
reads in flight finish. A destination that dies mid-read drops its
connection, which releases its hold.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, List, Optional

from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from ..transports import channel_class
from ._kept import KeptPlan
from ._settings import Settings, settings

__all__ = ["TensorferryTransport", "TensorferryTransportMetadata", "TensorMeta", "Settings", "settings", "NAME"]

NAME = "tensorferry"

# Ray's own metadata classes, by the transport that makes them: named in the
# error when one of them reaches this transport.
_RAY_METADATA = {
    "NixlTransportMetadata": "nixl",
    "CollectiveTransportMetadata": "gloo or nccl",
    "CudaIpcTransportMetadata": "cuda_ipc",
}


class TensorMeta(Sequence):
    """Ray's ``tensor_meta`` (each tensor's shape and dtype), carried as the
    encoded layout the ticket holds anyway.

    Ray pickles an object's metadata each time it passes it on (source to
    owner, owner to destination, owner to source at release): as a list of
    ``(torch.Size, torch.dtype)`` that is 150 KB and 0.05-0.14 s of pickling
    for 10k tensors per pass, and 5-25 ms of Python to build on the source.
    This pickles as the layout's bytes; Ray reads it (``len``, and shapes
    only for ``target_buffers``) through the sequence protocol, decoded on
    first use.
    """

    __slots__ = ("layout_bytes", "_count", "_items")

    def __init__(self, layout_bytes: bytes, count: int) -> None:
        self.layout_bytes = layout_bytes
        self._count = count
        self._items: list | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: Any) -> Any:
        if self._items is None:
            import torch

            from ..tensors import torch_dtype
            from ..wire import Layout

            layout = Layout.from_bytes(self.layout_bytes)  # checked: it crossed processes
            self._items = [(torch.Size(shape), torch_dtype(int(code))) for shape, code in zip(layout.shapes(), layout.dtype_codes)]
        return self._items[i]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return f"TensorMeta({self._count:,} tensors)"

    def __reduce__(self) -> tuple:
        return (TensorMeta, (self.layout_bytes, self._count))


@dataclass
class TensorferryTransportMetadata(TensorTransportMetadata):
    """Ray's metadata plus our tickets: one per transport the source serves."""

    tickets: dict = field(default_factory=dict)  # transport name -> ticket bytes
    node_id: str = ""
    nbytes: int = 0  # the packed object's bytes


# The node id, with the core worker it was read through: a driver may shut Ray
# down and init a new cluster, whose node differs; a worker's never changes.
_NODE_ID: tuple[object, str] | None = None


def _node_id() -> str:
    """This process's Ray node, asked once per Ray session of the process."""
    global _NODE_ID
    import ray

    session = getattr(ray._private.worker.global_worker, "core_worker", None)
    if _NODE_ID is None or _NODE_ID[0] is not session:
        _NODE_ID = (session, ray.get_runtime_context().get_node_id())
    return _NODE_ID[1]


class _Process:
    """This process's pool segments (source side) and Receiver, made on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.segments: Any = None
        self.receiver: Any = None
        self.tickets: dict[str, tuple[Any, Any]] = {}  # obj_id -> (Sender, Ticket) (source side)
        self.gets_by_transport: dict[str, int] = {}  # destination side: which path each get took
        self.settings = settings()
        self.kept = KeptPlan()  # source side: the plan of the tensors sent last

    def get_segments(self) -> Any:
        with self.lock:
            if self.segments is None:
                from ..sender import Sender
                from ._segments import Segments

                s = self.settings
                primary = "nixl" if s.transport == "nixl" else ("tcp" if s.transport == "tcp" else "shm")
                extra = ("tcp",) if primary == "shm" and s.transport == "auto" else ()

                def make(capacity_nbytes: int) -> Any:
                    return Sender(primary, capacity_nbytes=capacity_nbytes, host=s.host, token=s.token or None, extra_transports=extra)

                self.segments = Segments(make, s.pool_nbytes, s.pool_max_nbytes)
            return self.segments

    def get_receiver(self) -> Any:
        with self.lock:
            if self.receiver is None:
                from ..receiver import Receiver

                pool = None
                if self.settings.recv_pool_nbytes > 0:
                    from ..memory import MemoryPool

                    pool = MemoryPool(self.settings.recv_pool_nbytes, prefault=True)
                self.receiver = Receiver(pool=pool, token=self.settings.token or None, timeout=self.settings.timeout_seconds)
            return self.receiver


_PROCESS: _Process | None = None
_PROCESS_LOCK = threading.Lock()


def _process() -> _Process:
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            _PROCESS = _Process()
        return _PROCESS


class TensorferryTransport(TensorTransportManager):
    """Ray's transport manager interface over tensorferry's Sender/Receiver."""

    def tensor_transport_backend(self) -> str:
        return NAME.upper()

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        # Every wait of a get has a timeout and a dead sender breaks the
        # connection at once, so an aborted transfer never blocks either side.
        return True

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        # Runs on every .remote() of an RDT method: no blocking round trip.
        # An actor without tensorferry fails at extract time with a clear
        # ImportError in its task error.
        return True

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: List[Any]) -> TensorferryTransportMetadata:
        import torch

        tensors = rdt_object if type(rdt_object) is list else list(rdt_object)
        device = tensors[0].device.type if tensors else None
        proc = _process()
        segments = proc.get_segments()
        if device == "cuda":
            torch.cuda.synchronize()
        # One shot, never streamed: a ticket for any number of readers keeps
        # every piece until garbage_collect, so the pieces after the first
        # pool-full would never be packed and readers would hang. An object
        # that fits in no segment gets a new one instead. The same tensors
        # as last time replay the kept plan (no per-tensor work).
        sender, ticket = proc.kept.put(segments, tensors)
        tickets = {ticket.transport: ticket.to_bytes()}
        for name in sender.servers:
            if name != ticket.transport:
                tickets[name] = sender.ticket_for(ticket, name).to_bytes()
        with proc.lock:
            proc.tickets[obj_id] = (sender, ticket)
        return TensorferryTransportMetadata(
            tensor_meta=TensorMeta(ticket.layout_bytes, len(tensors)),
            tensor_device=device,
            tickets=tickets,
            node_id=_node_id(),
            nbytes=ticket.total_nbytes,
        )

    def get_communicator_metadata(self, src_actor: Any, dst_actor: Any, backend: Optional[str] = None) -> CommunicatorMetadata:
        return CommunicatorMetadata()

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorferryTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[List[Any]] = None,
    ) -> List[Any]:
        from ..errors import TransferError
        from ..wire import Ticket

        meta = tensor_transport_metadata
        if not isinstance(meta, TensorferryTransportMetadata):
            kind = type(meta)
            made_by = _RAY_METADATA.get(kind.__name__)
            source = f"Ray's {made_by} transport" if made_by else f"{kind.__module__}.{kind.__qualname__}"
            raise TransferError(
                f"object {obj_id} reached tensorferry's Ray transport with metadata of another transport "
                f"({kind.__name__}, made by {source}); return it with @ray.method(tensor_transport=\"tensorferry\") "
                f"(or ray.put(..., _tensor_transport=\"tensorferry\")) to send it through tensorferry, or read it "
                "through the transport that produced it"
            )
        if not meta.tickets:
            return []
        proc = _process()
        same_node = meta.node_id == _node_id()
        order = ("shm", "tcp", "nixl") if same_node else ("tcp", "nixl")
        name = next((n for n in order if n in meta.tickets), None)
        if name is None:
            raise TransferError(
                f"no usable ticket for object {obj_id}: the source serves {sorted(meta.tickets)} "
                f"and is on {'this' if same_node else 'another'} node; set TENSORFERRY_RAY_TRANSPORT=auto"
            )
        ticket = Ticket.from_bytes(meta.tickets[name])
        receiver = proc.get_receiver()
        zero_copy = proc.settings.zero_copy and channel_class(name).maps_sender_memory and not target_buffers
        if target_buffers:
            receiver.get(ticket, into=list(target_buffers))
            result = list(target_buffers)
        else:
            result = list(receiver.get(ticket, zero_copy=zero_copy))
        with proc.lock:
            proc.gets_by_transport[name] = proc.gets_by_transport.get(name, 0) + 1
        return result

    def send_multiple_tensors(self, tensors: List[Any], tensor_transport_metadata: Any, communicator_metadata: Any) -> None:
        raise NotImplementedError("tensorferry is one-sided: the destination pulls")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: List[Any]) -> None:
        proc = _process()
        with proc.lock:
            held = proc.tickets.pop(obj_id, None)
        if held is not None and proc.segments is not None:
            proc.segments.discard(*held)

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        # Nothing to undo on either side: a destination that failed dropped
        # (or will drop) its connection, which releases its hold; the source
        # keeps serving the object to other readers until garbage_collect.
        return None
