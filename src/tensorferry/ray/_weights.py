"""Weight sync for RL: one trainer actor publishes versions, N workers pull them.

The trainer packs its ``state_dict`` once per version into its pool; every
worker pulls the same packed bytes and copies them into its own parameters
in place (``into=``): no per-worker packing, no pickling, no new memory on
the workers. A new version is packed while workers still read the old one
when the pool has room; otherwise the old version is retired and the
trainer waits for its readers to finish (backpressure). Workers that join
late get the latest version.

The driver runs the protocol through ``actor.__ray_call__``, so user actor
classes need no mixin: they only say where their weights are (by default
``self.model.state_dict()``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, NamedTuple

__all__ = ["WeightVersion", "SyncReport", "prepare", "publish", "update"]


class WeightVersion(NamedTuple):
    """A published version: what a worker needs to pull it."""

    version: int
    tickets: dict  # transport -> ticket bytes
    node_id: str
    nbytes: int
    num_tensors: int
    pack_seconds: float
    # Workers on other nodes relay it to each other (a chain for 1, a tree
    # for more); None: each pulls from the trainer.
    fanout: int | None = None
    # A delta plan's: the bytes of the delta a worker holding the previous
    # version reads (0: none), and the elements that changed.
    delta_nbytes: int = 0
    changed: int = 0


class SyncReport(NamedTuple):
    """What one [``WeightSync.sync``][tensorferry.ray.WeightSync.sync]
    did: every worker updated to a new version.

    Attributes:
        version: the version now on every worker (1 for the first sync;
            ``WeightSync.version`` says the same).
        seconds: the whole sync as the driver saw it: from asking the
            trainer to publish until the last worker's update returned
            (Ray's calls included).
        pack_seconds: the trainer's part: copying its weights into its
            pool (with the plan's check, a plan made on the first sync or
            after parameters were replaced, and a wait for readers of old
            versions when the pool holds no room for another).
        worker_seconds: each worker's update, in the order of
            ``WeightSync.workers``: its get, including the copy into its own
            weights in place (measured in the worker; Ray's call around it
            is not included).
        nbytes: bytes received by all workers together without deltas (the
            packed version, after ``dtype=``, times ``num_workers``); with a
            list of trainers, the bytes they published together (each
            worker reads only its part).
        num_workers: the workers updated.
        delta_nbytes: ``WeightSync(delta=True)``: the delta a worker that
            held the previous version read instead of the whole version
            (0: no delta this sync; workers that did not hold it read the
            whole); with a list of trainers, their deltas together (each
            worker reads the records of its slices).
        changed: ``delta=True``: elements that changed since the previous
            version (all of them when it was not compared; with a list of
            trainers, on all of them together).
    """

    version: int
    seconds: float
    pack_seconds: float
    worker_seconds: list
    nbytes: int
    num_workers: int
    delta_nbytes: int = 0
    changed: int = 0


def _default_source(actor: Any) -> Any:
    """What the default syncs: ``actor.model`` (or the actor) when it is a
    module, planned over its state dict and checked for replaced parameters
    on every version; else what :func:`_default_state_dict` finds."""
    import torch

    model = getattr(actor, "model", None)
    if isinstance(model, torch.nn.Module):
        return model
    if isinstance(actor, torch.nn.Module):
        return actor
    return _default_state_dict(actor)


def _default_state_dict(actor: Any) -> Any:
    model = getattr(actor, "model", None)
    if model is not None and hasattr(model, "state_dict"):
        return model.state_dict()
    if hasattr(actor, "state_dict"):
        return actor.state_dict()
    from ..errors import ConfigurationError

    raise ConfigurationError(
        f"{type(actor).__name__} has no .model.state_dict() or .state_dict(); "
        "pass state_dict=lambda actor: ... to WeightSync"
    )


class _Publisher:
    def __init__(self, capacity_nbytes: int) -> None:
        from ..sender import Sender
        from ._settings import settings

        s = settings()
        # Prefaulted: every version is written into this pool, and page faults
        # on the first publishes would otherwise cost more than the copy.
        self.sender = Sender(
            "shm", capacity_nbytes=capacity_nbytes, host=s.host, token=s.token or None, extra_transports=("tcp",), prefault=True
        )
        self.latest: Any = None
        self.latest_version: WeightVersion | None = None
        self.plan: Any = None  # the SendPlan of what was published last
        self.version = 0
        self.lock = threading.Lock()


_PUBLISHER: _Publisher | None = None
_RECEIVER: Any = None
_RECV_PLAN: Any = None  # the worker's RecvPlan of the last update
_STATE_LOCK = threading.Lock()


def _state_nbytes(state_dict: Any) -> tuple[int, int]:
    """Bytes of tensor data and number of tensors in ``state_dict`` (or a module's)."""
    import torch

    from ..tensors import flatten

    if isinstance(state_dict, torch.nn.Module):
        state_dict = state_dict.state_dict()
    leaves, *_ = flatten(state_dict)
    return sum(t.numel() * t.element_size() for t in leaves), len(leaves)


def _publisher(nbytes: int, capacity_nbytes: int | None) -> _Publisher:
    global _PUBLISHER
    with _STATE_LOCK:
        if _PUBLISHER is None:
            # Room for two versions: the next packs while the last is read.
            _PUBLISHER = _Publisher(capacity_nbytes or 2 * nbytes + (64 << 20))
        return _PUBLISHER


def publish(state_dict: Any, *, timeout: float = 120.0, capacity_nbytes: int | None = None, dtype: Any = None, fanout: int | None = None,
            delta: bool = False) -> WeightVersion:
    """Send the current weights as the next version (runs in the trainer process).

    The first version plans ``state_dict`` (a module or a nesting of
    tensors; ``Sender.plan``); later versions replay that plan, with no
    work per tensor, as long as ``state_dict`` is the planned module or
    made of the same memory (a fresh ``state_dict()`` of the same model);
    otherwise, or when a parameter was replaced, it plans again.

    Args:
        state_dict: the weights: a module or a nesting of tensors.
        timeout: the most seconds to wait for room in the pool for this
            version, while readers of older versions hold it (default 120).
        capacity_nbytes: the pool this process makes on its first publish,
            in bytes (default: twice the weights' bytes plus 64 MiB, room
            for two versions); later publishes keep that pool.
        dtype: send floating-point tensors as this dtype (e.g. bfloat16).
        fanout: workers on other nodes pull over tcp through each other
            (``Sender.put(fanout=)``): the trainer sends this many copies.
        delta: a delta plan (``Sender.plan(delta=True)``): workers holding
            the previous version read what changed since it.

    Raises:
        PoolExhaustedError: the state dict does not fit even in an empty pool.
        TransferTimeoutError: readers of older versions held the pool too long.
    """
    import ray

    from ..errors import PlanStaleError, PoolExhaustedError, TransferTimeoutError

    pub = _PUBLISHER if _PUBLISHER is not None else _publisher(_state_nbytes(state_dict)[0], capacity_nbytes)
    deadline = time.monotonic() + timeout
    t0 = time.perf_counter()
    with pub.lock:
        plan = pub.plan
        if plan is None or plan.dtype != dtype or (plan.delta is not None) != delta or not (plan.source is state_dict or plan.matches(state_dict)):
            plan = pub.plan = pub.sender.plan(state_dict, dtype=dtype, delta=delta)
        if plan.delta is not None and pub.latest is not None:
            # The last version is served from the plan's kept version: retired
            # first (its workers have it), so this put can compare with it.
            pub.sender.discard(pub.latest)
            pub.latest = None
        while True:
            # The k-th publish's ticket says version k on every trainer, even
            # after a plan was made again: a worker of several trainers
            # takes one version of each (a sharded get checks it).
            plan.puts = pub.version
            try:
                ticket = pub.sender.put(plan, readers=None, one_shot=True, fanout=fanout)
                break
            except PlanStaleError:
                plan = pub.plan = pub.sender.plan(state_dict, dtype=dtype, delta=delta)  # a parameter was replaced
                continue
            except PoolExhaustedError:
                if pub.latest is None and pub.sender.pool.stats().used_nbytes == 0:
                    raise
                if pub.latest is not None:
                    # No room for two versions: retire the last one; its
                    # blocks return as soon as its readers finish.
                    pub.sender.discard(pub.latest)
                    pub.latest = None
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(
                        f"version {pub.version + 1} could not be packed within {timeout} s: readers of older versions still hold the pool"
                    ) from None
                time.sleep(0.002)
        pack_seconds = time.perf_counter() - t0
        old, pub.latest = pub.latest, ticket
        if old is not None:
            pub.sender.discard(old)
        pub.version += 1
        tickets = {name: pub.sender.ticket_for(ticket, name).to_bytes() for name in pub.sender.servers}
        pub.latest_version = WeightVersion(
            version=pub.version,
            tickets=tickets,
            node_id=ray.get_runtime_context().get_node_id(),
            nbytes=plan.layout.total_nbytes,
            num_tensors=plan.num_tensors,
            pack_seconds=pack_seconds,
            fanout=fanout,
            delta_nbytes=ticket.delta.nbytes if ticket.delta is not None and ticket.delta.base else 0,
            changed=ticket.delta.changed if ticket.delta is not None else 0,
        )
        return pub.latest_version


def latest() -> WeightVersion | None:
    """The latest version published in this process (trainer side)."""
    return None if _PUBLISHER is None else _PUBLISHER.latest_version


def update(version: WeightVersion | list[WeightVersion], targets: Any, *, timeout: float = 120.0) -> float:
    """Pull ``version`` into ``targets`` in place (runs in a worker process).

    ``targets`` is a module or a nesting of tensors. The first update plans
    it (``Receiver.plan``); later ones replay that plan while the layout is
    the same and ``targets`` is the planned module or made of the same
    memory; otherwise it plans again. A list of versions (one of every
    trainer rank, each publishing its shards) is a sharded get: ``targets``
    may hold DTensors and ``Box``es, and only their bytes are read, from
    the trainers that hold them (a ``ShardedPlan``).

    Args:
        version: what [``publish``][tensorferry.ray.publish] returned,
            or a list of them, one of every trainer rank.
        targets: the module or tensors to update in place.
        timeout: seconds for the get (default 120).

    Returns:
        Seconds the get took.
    """
    global _RECV_PLAN
    import ray

    from ..errors import PlanStaleError
    from ..transports import channel_class
    from ..wire import Ticket

    if isinstance(version, list):  # (a WeightVersion is a tuple itself)
        return _update_sharded(version, targets, timeout)
    same_node = version.node_id == ray.get_runtime_context().get_node_id()
    name = "shm" if same_node and "shm" in version.tickets else "tcp"
    receiver = _receiver(version.fanout is not None and channel_class(name).relays)
    t0 = time.perf_counter()
    ticket = Ticket.from_bytes(version.tickets[name])
    plan = _RECV_PLAN
    if plan is None or plan.layout_bytes != ticket.layout_bytes or not (plan.result is targets or plan.matches(targets)):
        plan = _RECV_PLAN = _plan(receiver, ticket, targets)
    try:
        receiver.get(ticket, into=plan, timeout=timeout)
    except PlanStaleError:
        # A parameter was replaced since the plan: plan the module as it is now.
        plan = _RECV_PLAN = _plan(receiver, ticket, targets)
        receiver.get(ticket, into=plan, timeout=timeout)
    return time.perf_counter() - t0


def _update_sharded(versions: list[WeightVersion], targets: Any, timeout: float) -> float:
    """``update`` of one version of every trainer: each ticket by shm from
    a trainer of this node, else tcp; the kept ShardedPlan replayed while
    its targets and the tickets' layouts stay."""
    global _RECV_PLAN
    import ray

    from ..errors import LayoutMismatchError, PlanStaleError
    from ..plans import ShardedPlan
    from ..wire import Ticket

    node = ray.get_runtime_context().get_node_id()
    names = ["shm" if v.node_id == node and "shm" in v.tickets else "tcp" for v in versions]
    tickets = [Ticket.from_bytes(v.tickets[name]) for v, name in zip(versions, names)]
    receiver = _receiver(any(v.fanout is not None and name == "tcp" for v, name in zip(versions, names)))
    t0 = time.perf_counter()
    plan = _RECV_PLAN
    if not isinstance(plan, ShardedPlan) or plan.result is not targets:
        plan = _RECV_PLAN = receiver.plan(tickets, into=targets)
    try:
        receiver.get(tickets, into=plan, timeout=timeout)
    except (PlanStaleError, LayoutMismatchError):
        # Targets replaced, or another layout (a trainer planned again): plan
        # as things are now (what cannot match raises here again, named).
        plan = _RECV_PLAN = receiver.plan(tickets, into=targets)
        receiver.get(tickets, into=plan, timeout=timeout)
    return time.perf_counter() - t0


def _receiver(relaying: bool) -> Any:
    """This worker's receiver (made once; made again, relaying, when a sync
    first asks for relays)."""
    global _RECEIVER, _RECV_PLAN
    from ..receiver import Receiver
    from ._settings import settings

    with _STATE_LOCK:
        if relaying and _RECEIVER is not None and not _RECEIVER.relay_address:
            _RECEIVER.close()  # made before this sync asked for relays
            _RECEIVER = _RECV_PLAN = None
        if _RECEIVER is None:
            s = settings()
            # A relaying worker listens where the trainer's tcp server does
            # (TENSORFERRY_RAY_HOST: the node's address on a real cluster).
            _RECEIVER = Receiver(token=s.token or None, timeout=s.timeout_seconds, relay=relaying, host=s.host)
        return _RECEIVER


def _plan(receiver: Any, ticket: Any, targets: Any) -> Any:
    """``receiver.plan(ticket, into=targets)``; a dtype that differs is
    named in WeightSync's terms (the user never wrote the ``into=``)."""
    from ..errors import LayoutMismatchError

    try:
        return receiver.plan(ticket, into=targets)
    except LayoutMismatchError:
        message = _dtype_mismatch(ticket.layout, targets)
        if message is None:
            raise
        raise LayoutMismatchError(message) from None  # the into= message would name what the user never wrote


def _dtype_mismatch(layout: Any, targets: Any) -> str | None:
    """The WeightSync message for a worker whose weights differ in dtype
    from what the trainer sends (``layout``), or None if none does.
    Worker side; runs only when planning failed."""
    import torch

    from ..tensors import flatten, torch_dtype

    sd = targets.state_dict() if isinstance(targets, torch.nn.Module) else targets
    try:
        leaves, *_ = flatten(sd)
    except Exception:  # noqa: BLE001 - the planner's own message says what is wrong
        return None
    sent = [torch_dtype(int(c)) for c in layout.dtype_codes]
    if len(leaves) != len(sent):
        return None
    differ = [i for i, (t, d) in enumerate(zip(leaves, sent)) if t.dtype != d]
    if not differ:
        return None
    names = list(sd.keys()) if isinstance(sd, dict) and len(sd) == len(leaves) else None
    i = differ[0]
    name = repr(names[i]) if names else f"#{i}"
    want, have = sent[i], leaves[i].dtype
    fix = f"make the workers' weights {want} (e.g. model.to({want}) before the first sync)"
    if want.is_floating_point and have.is_floating_point:
        fix += f", or have the trainer send {have}: WeightSync(trainer, workers, dtype={have})"
    more = f" ({len(differ):,} tensors differ in dtype)" if len(differ) > 1 else ""
    return (
        f"WeightSync: the trainer sends tensor {name} as {want}, but this worker's copy of it is {have}{more}; "
        f"workers are updated in place, so the dtypes must agree: {fix}"
    )


def prepare(state_dict: Any, *, capacity_nbytes: int | None = None) -> None:
    """Make the publisher's pool now, prefaulted (runs in the trainer process).

    Its pages are what makes the first version slow otherwise (1-2 s here
    for the default room of two ~1 GiB versions); :class:`WeightSync` calls
    it when it is created. Copies nothing; a second call changes nothing.
    """
    nbytes, _ = _state_nbytes(state_dict)
    _publisher(nbytes, capacity_nbytes)


def _actor_prepare(actor: Any, state_dict_fn: Callable, capacity_nbytes: int | None) -> None:
    prepare(state_dict_fn(actor), capacity_nbytes=capacity_nbytes)


def _actor_publish(actor: Any, state_dict_fn: Callable, timeout: float, capacity_nbytes: int | None, dtype: Any = None, fanout: int | None = None,
                   delta: bool = False) -> WeightVersion:
    return publish(state_dict_fn(actor), timeout=timeout, capacity_nbytes=capacity_nbytes, dtype=dtype, fanout=fanout, delta=delta)


def _actor_latest(actor: Any) -> WeightVersion | None:
    return latest()


def _actor_update(actor: Any, version: WeightVersion, targets_fn: Callable, timeout: float) -> float:
    return update(version, targets_fn(actor), timeout=timeout)
