"""Trainer ranks' boxes from vLLM's ``ParamMeta`` placements, against ``torch.chunk``.

DTensor cuts a ``Shard(d)`` dimension as ``torch.chunk`` does, mesh
dimension after mesh dimension. Proves, for random global shapes (uneven
sizes, empty pieces), 1-D and 2-D meshes and any placements, that the box
``local_offsets`` computes for every owner holds exactly that owner's
piece of the global tensor, and that the pieces tile it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _vllm_support

_vllm_support.skip_without_vllm()

from tensorferry.vllm._sources import installed_release  # noqa: E402

if not installed_release().placements:
    pytest.skip(
        "this vLLM release's ParamMeta declares no placements (vLLM 0.32); its sharded trainers take torch's DTensor "
        "placements instead (tests/vllm_engine/test_fsdp.py)",
        allow_module_level=True,
    )

from vllm.distributed.weight_transfer import ParamMeta, Replicate, Shard  # noqa: E402

from tensorferry.errors import ConfigurationError  # noqa: E402
from tensorferry.vllm._placements import local_offsets  # noqa: E402


def _piece(full: torch.Tensor, mesh_shape: tuple[int, ...], placements: tuple, coords: tuple[int, ...]) -> torch.Tensor:
    """What DTensor's local tensor is: each Shard(d) of the mesh, in order, a torch.chunk of what is left."""
    piece = full
    for size, placement, coord in zip(mesh_shape, placements, coords):
        if isinstance(placement, Shard):
            chunks = torch.chunk(piece, size, dim=placement.dim)
            piece = chunks[coord] if coord < len(chunks) else piece.narrow(placement.dim, piece.shape[placement.dim], 0)
    return piece


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    mesh_shape=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    data=st.data(),
)
def test_boxes_hold_exactly_each_owners_piece(shape: list[int], mesh_shape: list[int], data) -> None:
    shape_t, mesh_t = tuple(shape), tuple(mesh_shape)
    placements = tuple(
        data.draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(len(shape))])) for _ in mesh_t
    )
    owners = tuple(range(10, 10 + len(list(itertools.product(*map(range, mesh_t))))))  # ranks need not start at 0
    meta = ParamMeta("w", torch.float32, shape_t, owners=owners, mesh_shape=mesh_t, placements=placements)
    full = torch.arange(torch.Size(shape_t).numel(), dtype=torch.float32).reshape(shape_t)
    covered = torch.zeros(shape_t, dtype=torch.int64)
    for flat, coords in enumerate(itertools.product(*map(range, mesh_t))):
        offsets, local_shape = local_offsets(meta, owners[flat])
        want = _piece(full, mesh_t, placements, coords)
        assert local_shape == tuple(want.shape)
        region = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape))
        assert torch.equal(full[region], want)
        covered[region] += 1
    replicas = 1
    for size, placement in zip(mesh_t, placements):
        replicas *= 1 if isinstance(placement, Shard) else size
    assert bool((covered == replicas).all())  # the pieces tile the tensor, once per replica


def test_a_rank_that_owns_no_piece_is_named() -> None:
    meta = ParamMeta("w", torch.float32, (4, 4), owners=(0, 1), mesh_shape=(2,), placements=(Shard(0),))
    with pytest.raises(ConfigurationError, match="rank 5 is not among its owners"):
        local_offsets(meta, 5)
