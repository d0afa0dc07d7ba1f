"""``WeightSync``: the driver's side of an RL weight sync over Ray.

The driver calls the trainer actors and the workers through
``actor.__ray_call__`` with the functions of :mod:`._weights` (publish a
version, update a worker to it), so user actor classes need no mixin.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from ._weights import SyncReport, _actor_prepare, _actor_publish, _actor_update, _actor_latest, _default_source

__all__ = ["WeightSync"]


class WeightSync:
    """Driver side: sync one trainer actor's weights to N worker actors.

    Args:
        trainer: the trainer actor handle, or a list of them: one per rank
            of a sharded trainer, each publishing its own shards (DTensors
            or ``Box``es in its state dict); each worker then pulls only
            its targets' bytes, from the ranks that hold them.
        workers: the worker actor handles.
        state_dict: ``fn(trainer_self) -> state dict or module`` (default
            ``self.model``, or the actor itself if it is a module, else its
            ``state_dict()``).
        targets: ``fn(worker_self) -> tensors (or a module) to update in
            place``, nested as the trainer's (default as for ``state_dict``).
        timeout: seconds for each publish and each worker's update.
        capacity_nbytes: the trainer's pool size (default: room for two
            versions).
        dtype: send floating-point weights as this dtype (e.g.
            ``torch.bfloat16`` from an fp32 trainer to bf16 workers: half
            the bytes); the workers' targets must be of it.
        fanout: workers on other nodes than the trainer's relay each
            version to each other over tcp (``Sender.put(fanout=)``): the
            trainer's link carries ``fanout`` copies instead of one per
            worker. Workers on the trainer's node read its pool (shm).
            With a list of trainers, the workers that read the same slices
            of a rank relay them to each other (replicas of one
            tensor-parallel group: each rank's link carries ``fanout``
            copies of each distinct slice set).
        delta: the trainer keeps the version it last sent (one more copy of
            it in its pool) and workers that hold it read only what changed
            (``Sender.plan(delta=True)``, ``docs/delta.md``); a worker that
            joins late or missed a sync reads the whole version. With
            ``fanout``, the relays pass the delta on. With a list of
            trainers, each keeps its own, and a worker reads of each
            trainer's delta only the records of the chunks its slices
            touch (``docs/sharded.md``); with ``fanout`` too, workers of
            the same slices pass those records on to each other.

    Both sides keep plans (``Sender.plan``, ``Receiver.plan``) made on the
    first sync: later syncs move bytes with no work per tensor. A plan is
    made again when the trainer's or a worker's parameters are replaced
    (``load_state_dict(assign=True)``, ``module.to()``) or the layout changes.

    Creating it sends the trainer a call that makes and prefaults its pool
    (1.3-1.4 s for two ~1 GiB versions on 2 busy cores) in the background; the
    first [``sync``][tensorferry.ray.WeightSync.sync] waits for
    that call if it has not finished, and raises what it raised.
    """

    def __init__(
        self,
        trainer: Any,
        workers: Sequence[Any] = (),
        *,
        state_dict: Callable[[Any], Any] = _default_source,
        targets: Callable[[Any], Any] = _default_source,
        timeout: float = 120.0,
        capacity_nbytes: int | None = None,
        dtype: Any = None,
        fanout: int | None = None,
        delta: bool = False,
    ) -> None:
        import torch

        from ..errors import ConfigurationError

        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigurationError(f"WeightSync(dtype={dtype!r}): expected a floating-point torch dtype such as torch.bfloat16")
        if fanout is not None and (isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1):
            raise ConfigurationError(f"WeightSync(fanout={fanout!r}): expected a whole number from 1 (a chain) up, or None")
        self.trainers = list(trainer) if isinstance(trainer, (list, tuple)) else [trainer]
        self._sharded = isinstance(trainer, (list, tuple))
        if self._sharded and not self.trainers:
            raise ConfigurationError("WeightSync(a list of trainers): give at least one trainer")
        self.dtype = dtype
        self.fanout = fanout
        self.delta = bool(delta)
        self.trainer = self.trainers[0]
        self.workers = list(workers)
        self._state_dict = state_dict
        self._targets = targets
        self.timeout = timeout
        self.capacity_nbytes = capacity_nbytes
        self.version = 0
        # The trainer makes and prefaults its pool now, while the driver goes
        # on; the first sync waits for it (and raises what it raised).
        self._prepared: Any = [t.__ray_call__.remote(_actor_prepare, state_dict, capacity_nbytes) for t in self.trainers]

    def _wait_prepared(self) -> None:
        import ray

        if self._prepared is not None:
            ray.get(self._prepared)
            self._prepared = None

    def _versions(self, refs: list) -> Any:
        """What workers update from: the one trainer's version, or the list of every trainer's."""
        import ray

        versions = ray.get(refs)
        return versions if self._sharded else versions[0]

    def sync(self) -> SyncReport:
        """Publish a new version and wait until every worker holds it."""
        import ray

        self._wait_prepared()
        t0 = time.monotonic()
        published = [t.__ray_call__.remote(_actor_publish, self._state_dict, self.timeout, self.capacity_nbytes, self.dtype, self.fanout, self.delta)
                     for t in self.trainers]
        version = self._versions(published)  # raises what a publish raised, before any worker is called
        # One trainer: the workers get the trainer's own object, by ref. A
        # version's tickets carry the whole layout (two tickets of 275 KB
        # for the benchmark's 100k tensors); passed by value, the driver
        # would pickle it again for every worker and Ray would put each copy
        # in its object store (arguments over 100 KB go there).
        arg = version if self._sharded else published[0]
        refs = [w.__ray_call__.remote(_actor_update, arg, self._targets, self.timeout) for w in self.workers]
        worker_seconds = ray.get(refs)
        seconds = time.monotonic() - t0
        first = version[0] if self._sharded else version
        self.version = first.version
        return SyncReport(
            version=first.version,
            seconds=seconds,
            pack_seconds=max(v.pack_seconds for v in version) if self._sharded else version.pack_seconds,
            # Sharded: what the trainers published (each worker reads its part of it).
            nbytes=sum(v.nbytes for v in version) if self._sharded else version.nbytes * len(self.workers),
            worker_seconds=list(worker_seconds),
            num_workers=len(self.workers),
            # Sharded: every trainer's delta (each worker reads its part of them).
            delta_nbytes=sum(v.delta_nbytes for v in version) if self._sharded else version.delta_nbytes,
            changed=sum(v.changed for v in version) if self._sharded else version.changed,
        )

    def add_worker(self, worker: Any) -> float | None:
        """Add a worker that joins late; it gets the latest version now.

        Runs on the driver and blocks until the worker's update returns.
        Nothing is published: the worker reads the version the trainer
        (every trainer of a list) published last. Called before any sync,
        it first waits for the trainer's pool to be made, as the first
        sync does. Errors raised in an actor reach the driver as Ray's
        ``RayTaskError``, which is also an instance of the error's own
        class.

        Args:
            worker: the worker actor handle. It is appended to ``workers``
                before anything else, so every later
                [``sync``][tensorferry.ray.WeightSync.sync]
                updates it too, even when this call returns None or fails.
                Its weights are found by the ``targets`` function, as for
                the other workers, and updated in place within ``timeout``
                seconds.

        Returns:
            Seconds its update took, measured in the worker (its get,
                including the copy into its weights), or None if nothing
                was published yet (with a list of trainers: if any of them
                has published nothing); it then gets the next sync's
                version.

        Raises:
            TransferTimeoutError: the worker's get did not finish within
                ``timeout`` seconds.
            TransferError: the worker could not read the version (e.g.
                ``PeerGoneError``: the trainer went away).
            LayoutMismatchError: the worker's weights do not match the
                trainer's (a dtype that differs is named, with the fix).
        """
        import ray

        self.workers.append(worker)
        self._wait_prepared()
        version = self._versions([t.__ray_call__.remote(_actor_latest) for t in self.trainers])
        if version is None or self._sharded and any(v is None for v in version):
            return None
        return ray.get(worker.__ray_call__.remote(_actor_update, version, self._targets, self.timeout))
