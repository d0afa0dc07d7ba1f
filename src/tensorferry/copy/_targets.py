"""Receiver side: received bytes into the caller's tensors (``into=``).

Dense host targets are written by address through a :class:`CopyPlan`;
the rest (strided, conjugated, negated, on a device) get a staged buffer
or a typed view and torch's ``copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from ..tensors import data_ptrs
from ._plan import CopyPlan

__all__ = ["StagedCopy", "copy_staged", "dense_host_mask", "fill_aliases", "stage_rest", "staged_addresses", "target_addresses"]

_get_is_cpu = attrgetter("is_cpu")


def dense_host_mask(targets: Sequence[torch.Tensor]) -> np.ndarray:
    """Which targets can be written by address: contiguous host tensors
    that are neither conjugated nor negated views (one pass per attribute)."""
    count = len(targets)
    ok = np.fromiter(map(torch.Tensor.is_contiguous, targets), dtype=bool, count=count)
    ok &= ~np.fromiter(map(torch.Tensor.is_neg, targets), dtype=bool, count=count)
    if any(map(torch.Tensor.is_complex, targets)):
        ok &= ~np.fromiter(map(torch.Tensor.is_conj, targets), dtype=bool, count=count)
    ok &= np.fromiter(map(_get_is_cpu, targets), dtype=bool, count=count)
    return ok


def target_addresses(targets: Sequence[torch.Tensor], ok: np.ndarray) -> np.ndarray:
    """int64 address of each target where ``ok`` (written by address), 0 elsewhere."""
    dst = np.zeros(len(targets), dtype=np.int64)
    if ok.any():
        dst[ok] = data_ptrs(targets)[ok]
    return dst


def staged_addresses(targets: Sequence[torch.Tensor], nbytes: np.ndarray) -> tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Where each target's bytes land: its own address where it can be
    written by address, else a host buffer of its own (``nbytes[i]``), and
    the ``(buffer, target)`` pairs :func:`copy_staged` finishes with."""
    ok = dense_host_mask(targets) if len(targets) else np.zeros(0, dtype=bool)
    dst = target_addresses(targets, ok)
    return dst, stage_rest(targets, nbytes, ok, dst)


def stage_rest(targets: Sequence[torch.Tensor], nbytes: np.ndarray, ok: np.ndarray, dst: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A host buffer for each target not written by address (``~ok``), its
    address put in ``dst``; the ``(buffer, target)`` pairs of :func:`copy_staged`."""
    fixups: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in np.flatnonzero(~ok & (np.asarray(nbytes) > 0)).tolist():
        staged = torch.empty(int(nbytes[i]), dtype=torch.uint8)
        dst[i] = staged.data_ptr()
        fixups.append((staged, targets[i]))
    return fixups


class StagedCopy:
    """Copies a byte stream that arrives a chunk at a time into its targets.

    The stream is the concatenation of an object's blocks (``block_nbytes``,
    tensor ``i`` at byte ``offsets[i]`` of block ``b`` for ``bounds[b] <= i
    < bounds[b + 1]``). Each call ``(pos, k, base)`` says that the ``k``
    bytes at host address ``base`` are stream bytes ``[pos, pos + k)``; the
    parts of every tensor in that range are copied by address, neighbours
    merged, as one (parallel) copy. Targets that cannot be written by
    address get a host buffer each, copied into them by :meth:`finish`.
    No view of any chunk is made, and no tensor object per call.
    """

    def __init__(self, block_nbytes: Sequence[int], bounds: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, targets: Sequence[torch.Tensor]) -> None:
        block_start = np.zeros(len(block_nbytes), dtype=np.int64)
        if len(block_nbytes) > 1:
            block_start[1:] = np.cumsum(np.asarray(block_nbytes, dtype=np.int64))[:-1]
        block_of = np.repeat(np.arange(len(block_nbytes)), np.diff(np.asarray(bounds, dtype=np.int64)))
        start = block_start[block_of] + np.asarray(offsets, dtype=np.int64)
        n = np.asarray(nbytes, dtype=np.int64)
        dst, self._fixups = staged_addresses(targets, n)
        # In stream coordinates: sources ascend (tensors never overlap).
        self.plan = CopyPlan.build(dst, start, n)

    @classmethod
    def into_blocks(cls, dests: Sequence[torch.Tensor]) -> "StagedCopy":
        """A stream of whole blocks into ``dests`` (1-D uint8, one per block, in order)."""
        sizes = np.array([d.numel() for d in dests], dtype=np.int64)
        return cls(sizes.tolist(), np.arange(sizes.size + 1), np.zeros(sizes.size, dtype=np.int64), sizes, dests)

    def __call__(self, pos: int, k: int, base: int) -> None:
        self.plan.execute_window(pos, pos + k, 0, base - pos)

    def finish(self) -> None:
        """Copy the staged bytes of targets that could not be written by address."""
        copy_staged(self._fixups)


def fill_aliases(layout: Any, targets: Sequence[torch.Tensor]) -> None:
    """into= targets of tensors sent once under two names (tied weights):
    the bytes landed in the first target; a second one that is not the
    same view (untied on this side) gets a copy of it."""
    for dup, orig in layout.aliases.tolist():
        a, b = targets[dup], targets[orig]
        if a is b or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.device == b.device):
            continue
        with _writable([a]):
            a.copy_(b)


def copy_staged(fixups: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``target.copy_(staged bytes)`` for each (1-D uint8 staged, target) pair;
    targets may be parameters that require grad."""
    with _writable([t for _, t in fixups]):
        for staged, t in fixups:
            t.copy_(staged.view(t.dtype).view(t.shape))


def _writable(targets: Sequence[torch.Tensor]) -> Any:
    """The mode in-place copies into ``targets`` run in: no_grad, or where
    one was made under torch.inference_mode() (which refuses in-place writes
    outside it) inference_mode, in which writes into the others still bump
    their version counters."""
    return torch.inference_mode() if any(t.is_inference() for t in targets) else torch.no_grad()
