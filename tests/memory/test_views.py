"""_views: received or pooled bytes back into tensors (``unpack``,
``build_views``) and the release tied to a storage (``owned_view``).

Objects are packed by a real ``MemoryPool``; the receiver's side is played
as a receiver plays it: the blocks cloned into memory of its own and the
layout decoded from its bytes. Every view is checked bitwise, for where it
lies (inside its block, at a multiple of its element size) and for being a
view (a write into the block shows through it).
"""

from __future__ import annotations

import gc
import mmap
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _transfer_helpers import COMPLEX_HALF_WARNING, DTYPES, assert_same, make_tensor
from tensorferry import Layout, LayoutMismatchError, MemoryPool, unpack
from tensorferry.wire import packing
from tensorferry.memory import _views
from tensorferry.memory._views import build_views, owned_view

pytestmark = pytest.mark.filterwarnings(COMPLEX_HALF_WARNING)


@pytest.fixture
def pool():
    with MemoryPool(1 << 20) as p:
        yield p


def received(pool: MemoryPool, packed) -> tuple[list[torch.Tensor], Layout]:
    """What a receiver holds for ``packed``: its own copy of every block, and
    the layout decoded from the sender's bytes."""
    return [pool.view(b).clone() for b in packed.blocks], Layout.from_bytes(packed.layout.to_bytes())


def unpacked_as_received(pool: MemoryPool, obj):
    """``obj`` packed by ``pool``, then unpacked as a receiver does, and
    checked: equal to ``obj`` bitwise, every view inside a block, aligned.
    Returns the result, the receiver's blocks, and the ``Packed`` to release."""
    packed = pool.pack(obj)
    blocks, layout = received(pool, packed)
    got = unpack(blocks, layout)
    assert_same(got, obj)
    assert_views_of(blocks, flat_leaves(got))
    return got, blocks, packed


def flat_leaves(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in flat_leaves(v)]
    return [t for v in obj for t in flat_leaves(v)]


def assert_views_of(blocks: list[torch.Tensor], views: list[torch.Tensor]) -> None:
    """Every non-empty view lies inside one of ``blocks``, on a multiple of
    its element size, and is a view: flipping its first byte in the block
    changes it."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in blocks]
    for i, v in enumerate(views):
        if v.numel() == 0:
            continue
        at = v.data_ptr()
        (b,) = [k for k, (lo, hi) in enumerate(spans) if lo <= at and at + v.nbytes <= hi]
        assert at % v.element_size() == 0, (i, v.dtype, at)
        first = at - spans[b][0]
        before = v.clone()
        blocks[b][first] ^= 0xFF
        assert not torch.equal(v.reshape(-1).view(torch.uint8)[:1], before.reshape(-1).view(torch.uint8)[:1]), i
        blocks[b][first] ^= 0xFF


# -- unpack: the edge cases of EDGE_CASES.md that concern views ----------------------


def test_every_dtype_interleaved_after_a_one_byte_tensor(pool):
    """A 1-byte tensor, then every wire dtype (float64, complex128, bool,
    bfloat16, the float8 variants...), each twice in a row and once more
    shuffled: every view is aligned to its dtype and holds its bytes."""
    g = torch.Generator().manual_seed(3)
    order = [torch.uint8] + [d for d in DTYPES for _ in range(2)]
    random.Random(3).shuffle(order[1:])
    obj = [make_tensor(g, d, (3, 1 + i % 4)) for i, d in enumerate(order)]
    _, _, packed = unpacked_as_received(pool, obj)
    packed.release()


def test_zero_size_and_zero_dim_tensors_and_an_empty_object(pool):
    obj = {
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, dtype=torch.int16),
        "empty_2d": torch.zeros(4, 0, 3, dtype=torch.complex64),
        "bool_scalar": torch.tensor(True),
        "after": torch.arange(5, dtype=torch.int64),
        "nested": {"none": [], "also_empty": torch.empty(0, 7, dtype=torch.bfloat16)},
    }
    got, _, packed = unpacked_as_received(pool, obj)
    assert got["scalar"].dim() == 0 and got["empty_2d"].shape == (4, 0, 3)
    packed.release()
    for nothing in ([], {}, (), [torch.empty(0)], {"a": [], "b": {}}):
        packed = pool.pack(nothing)
        assert packed.blocks == ()
        assert_same(unpack([], Layout.from_bytes(packed.layout.to_bytes())), nothing)
        packed.release()


def test_tied_tensors_come_back_as_one_tensor(pool):
    w = torch.randn(6, 4)
    obj = {"embed": w, "norm": torch.ones(4, dtype=torch.bfloat16), "lm_head": w, "again": [w, torch.tensor(1)]}
    got, blocks, packed = unpacked_as_received(pool, obj)
    assert packed.layout.aliases.size
    assert got["lm_head"] is got["embed"] and got["again"][0] is got["embed"]
    # Sent once: the block holds w's bytes one time.
    assert sum(b.numel() for b in blocks) < 2 * w.nbytes
    packed.release()


def test_views_over_several_blocks_of_a_fragmented_pool():
    with MemoryPool(16 << 10) as pool:
        holes = [pool.pack(torch.zeros(256)) for _ in range(16)]  # 1 KiB each
        for p in holes[::2]:
            p.release()
        g = torch.Generator().manual_seed(5)
        obj = [make_tensor(g, d, (40,)) for d in (torch.float32, torch.uint8, torch.float64, torch.int16) * 5]
        _, blocks, packed = unpacked_as_received(pool, obj)
        assert len(blocks) > 1
        packed.release()


def test_received_views_are_zero_copy(pool):
    obj = {"a": torch.arange(10, dtype=torch.float32), "b": torch.arange(4, dtype=torch.int64).view(2, 2)}
    packed = pool.pack(obj)
    local = pool.unpack(packed)
    lo, hi = pool.data_ptr, pool.data_ptr + pool.stats().capacity_nbytes
    assert all(lo <= t.data_ptr() < hi for t in local.values())
    blocks = [pool.view(b).clone() for b in packed.blocks]
    remote = unpack(blocks, packed.layout)
    blocks[0].view(torch.float32)[0] = 42.0  # the receiver's memory, seen through the view
    assert remote["a"][0] == 42.0
    packed.release()


@pytest.mark.gpu
def test_unpack_of_cuda_blocks_gives_cuda_views(pool):
    """Blocks received into device memory: the views, the zero-size ones
    too, are on the blocks' device."""
    obj = {"w": torch.randn(3, 4), "none": torch.empty(0, 2, dtype=torch.float16), "step": torch.tensor(7)}
    packed = pool.pack(obj)
    blocks, layout = received(pool, packed)
    got = unpack([b.cuda() for b in blocks], layout)
    assert {t.device.type for t in got.values()} == {"cuda"}
    assert_same({k: t.cpu() for k, t in got.items()}, obj)
    packed.release()


def test_unpack_of_a_packed_needs_no_layout_and_anything_else_does(pool):
    obj = [torch.arange(6.0), torch.ones(2, dtype=torch.int8)]
    packed = pool.pack(obj)
    assert_same(unpack(packed), obj)
    with pytest.raises(LayoutMismatchError, match="needs a layout"):
        unpack([pool.view(b) for b in packed.blocks])
    packed.release()


def test_unpack_rejects_misaligned_and_wrong_blocks(pool):
    obj = [torch.arange(5, dtype=torch.float64), torch.arange(3, dtype=torch.uint8)]
    packed = pool.pack(obj)
    layout = Layout.from_bytes(packed.layout.to_bytes())
    (blk,) = [pool.view(b).clone() for b in packed.blocks]
    room = torch.empty(blk.numel() + 32, dtype=torch.uint8)
    start = (-room.data_ptr()) % 16 + 1  # one byte past a 16-byte boundary
    misaligned = room[start : start + blk.numel()]
    misaligned.copy_(blk)
    with pytest.raises(LayoutMismatchError, match="16-byte boundary") as info:
        unpack([misaligned], layout)
    assert "MemoryPool" in str(info.value) or "torch.empty" in str(info.value)  # the fix
    with pytest.raises(LayoutMismatchError, match="uint8"):
        unpack([blk.view(torch.float64) if blk.numel() % 8 == 0 else blk.float()], layout)
    with pytest.raises(LayoutMismatchError, match="1-D"):
        unpack([blk.view(1, -1)], layout)
    with pytest.raises(LayoutMismatchError, match="block 0 has 42 bytes"):
        unpack([blk[:-1]], layout)
    with pytest.raises(LayoutMismatchError):
        unpack([blk, blk], layout)
    with pytest.raises(LayoutMismatchError):
        unpack([], layout)
    assert_same(unpack([blk], layout), obj)
    packed.release()


_SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(st.tuples(st.sampled_from(DTYPES), _SHAPES, st.booleans()), min_size=1, max_size=24),
    seed=st.integers(0, 2**16),
)
def test_unpack_gives_back_any_mix_of_dtypes_shapes_and_ties(specs, seed):
    """Any list of tensors of any wire dtype and shape (zero-size and 0-d
    among them), some entries a repeat of an earlier tensor (tied): the
    views equal the originals bitwise, ties are one tensor (zero-size ones
    excepted: they hold no bytes, and come back as equal empty tensors),
    every view is aligned inside its block."""
    g = torch.Generator().manual_seed(seed)
    obj: list[torch.Tensor] = []
    for dtype, shape, tie in specs:
        obj.append(obj[seed % len(obj)] if tie and obj else make_tensor(g, dtype, shape))
    with MemoryPool(1 << 20) as pool:
        got, _, packed = unpacked_as_received(pool, obj)
        for i, t in enumerate(obj):
            for j in range(i):
                if obj[j] is t and t.numel():
                    assert got[i] is got[j], (i, j)
        del got
        packed.release()


# -- build_views: each way of cutting a block gives the same views ---------------------


def _blocks_and_groups(pool: MemoryPool, obj) -> tuple[list[torch.Tensor], Layout, packing.BlockGroups, object]:
    packed = pool.pack(obj)
    blocks, layout = received(pool, packed)
    groups = packing.group_by_block(layout.nbytes, layout.alignments, [b.numel() for b in blocks])
    return blocks, layout, groups, packed


@pytest.mark.parametrize(
    "make",
    [
        lambda: [torch.arange(i + 1, dtype=torch.float32) for i in range(50)],  # 1-D run: one split
        lambda: [torch.randn(3, 4) for _ in range(30)],  # equal shapes: one view(k, ...).unbind
        lambda: [t for _ in range(20) for t in (torch.randn(5, 2), torch.randn(5))],  # lone shapes: weight, bias
        lambda: [torch.randn(2, 2), torch.empty(0, 2), torch.randn(2, 2), torch.tensor(1.0), torch.randn(2, 2)],
    ],
    ids=["one-d-run", "equal-shapes", "weight-bias", "skips-inside-a-run"],
)
def test_build_views_cuts_runs_into_the_sent_tensors(pool, make):
    obj = make()
    blocks, layout, groups, packed = _blocks_and_groups(pool, obj)
    views = build_views(blocks, layout, groups)
    assert_same(views, obj)
    assert_views_of(blocks, views)
    packed.release()


def test_build_views_of_no_blocks_makes_empty_tensors(pool):
    layout = pool.pack([torch.empty(0, 3, dtype=torch.float16), torch.empty(0)]).layout
    groups = packing.group_by_block(layout.nbytes, layout.alignments, [])
    views = build_views([], layout, groups)
    assert [(v.dtype, tuple(v.shape), v.device.type) for v in views] == [(torch.float16, (0, 3), "cpu"), (torch.float32, (0,), "cpu")]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unpack_of_interleaved_dtypes_is_the_same_cut_by_dtype_or_run_by_run(monkeypatch, seed):
    """A state dict whose dtypes change every tensor or two (weight, bias, a
    bf16 norm, an int64 step: a run each) is cut by dtype; the views must be
    exactly what the run-by-run cut makes: dtypes, shapes, values, and the
    same addresses. Zero-size tensors, 0-d tensors and one tensor under two
    names sit among them."""
    rng = random.Random(seed)
    kinds = [((7, 5), torch.float32), ((5,), torch.float32), ((3,), torch.bfloat16), ((), torch.int64),
             ((2, 3), torch.float64), ((9,), torch.bool), ((4,), torch.int8), ((2,), torch.complex64), ((0, 3), torch.float32)]
    obj = {}
    for i in range(400):
        shape, dtype = rng.choice(kinds)
        obj[f"t{i}"] = (torch.randn(shape) * 50).to(dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
    obj["tied"] = obj["t3"]
    calls = []
    real = _views._views_by_dtype
    monkeypatch.setattr(_views, "_views_by_dtype", lambda *a: calls.append(1) or real(*a))
    with MemoryPool(1 << 20) as pool:
        packed = pool.pack(obj)
        by_dtype = pool.unpack(packed)
        assert calls  # the block was cut by dtype
        monkeypatch.setattr(_views, "_MANY_RUNS", 1 << 62)  # never: run by run
        by_run = pool.unpack(packed)
        assert list(by_dtype) == list(obj) == list(by_run)
        for k, want in obj.items():
            a, b = by_dtype[k], by_run[k]
            assert a.dtype == b.dtype == want.dtype and a.shape == b.shape == want.shape, k
            assert torch.equal(a, want) and torch.equal(b, want), k
            assert a.numel() == 0 or a.data_ptr() == b.data_ptr(), k
        assert by_dtype["tied"] is by_dtype["t3"]
        del by_dtype, by_run
        packed.release()


# -- owned_view: a release tied to the storage, not to one tensor --------------------


def test_owned_view_is_the_buffer_and_releases_once_after_its_last_view():
    buf = mmap.mmap(-1, 4096)
    released = []
    view = owned_view(buf, 256, 1024, lambda: released.append(1))
    assert view.dtype == torch.uint8 and view.shape == (1024,)
    view[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert buf[256:260] == bytes([1, 2, 3, 4]) and buf[255] == 0
    typed = view[16:32].view(torch.float32)  # another tensor on the same storage
    derived = torch.as_strided(view, (4,), (2,), 100)
    del view
    gc.collect()
    assert released == []
    del typed
    gc.collect()
    assert released == []
    derived.fill_(9)
    assert buf[356:364:2] == bytes([9] * 4)
    del derived
    gc.collect()
    assert released == [1]
    gc.collect()
    assert released == [1]
    buf.close()


def test_owned_view_without_a_callback_and_of_bytes_read_into_a_bytearray():
    data = bytearray(range(64))
    view = owned_view(data, 8, 16)
    assert view.tolist() == list(range(8, 24))
    view.zero_()
    assert data[8:24] == bytes(16) and data[24] == 24
    assert np.shares_memory(view.numpy(), np.frombuffer(data, dtype=np.uint8))
