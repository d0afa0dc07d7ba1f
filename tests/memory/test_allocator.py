"""Property tests of the allocator: best fit, atomic groups, coalescing."""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tensorferry.memory._allocator import Allocator, Block
from tensorferry.errors import PoolExhaustedError, TensorferryError

ALIGN = 16


def rounded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def best_fit_model(free: list[Block], sizes: list[int]) -> list[Block] | None:
    """Reference: sizes largest first (ties in order), each into the smallest
    free extent that holds it (lowest offset among equals), carved from its start."""
    free = list(free)
    out: dict[int, Block] = {}
    for i in sorted(range(len(sizes)), key=lambda i: -rounded(sizes[i])):
        need = rounded(sizes[i])
        fits = [e for e in free if e.nbytes >= need]
        if not fits:
            return None
        host = min(fits, key=lambda e: (e.nbytes, e.offset))
        free.remove(host)
        if host.nbytes > need:
            free.append(Block(host.offset + need, host.nbytes - need))
        out[i] = Block(host.offset, need)
    return [out[i] for i in range(len(sizes))]


def snapshot(alloc: Allocator):
    return alloc.stats(), sorted(alloc.free_extents()), alloc.allocated_extents()


def check_invariants(alloc: Allocator) -> None:
    cap = alloc.capacity_nbytes
    used = alloc.allocated_extents()
    free = sorted(alloc.free_extents(), key=lambda e: e.offset)
    for e in used + free:
        assert e.offset % ALIGN == 0 and e.nbytes % ALIGN == 0 and e.nbytes > 0
        assert 0 <= e.offset and e.offset + e.nbytes <= cap
    # Allocated and free extents tile [0, capacity) exactly: no overlap, no hole.
    tiles = sorted(used + free)
    pos = 0
    for e in tiles:
        assert e.offset == pos, (e, pos)
        pos += e.nbytes
    assert pos == cap
    # Free space is coalesced: no two free extents touch.
    for x, y in zip(free, free[1:]):
        assert x.offset + x.nbytes < y.offset
    s = alloc.stats()
    assert s.capacity_nbytes == cap
    assert s.free_nbytes == sum(e.nbytes for e in free)
    assert s.used_nbytes == cap - s.free_nbytes == sum(e.nbytes for e in used)
    assert s.largest_free_nbytes == max((e.nbytes for e in free), default=0)
    assert s.free_blocks == len(free)
    assert s.allocated_blocks == len(used)
    assert alloc.largest_free_nbytes() == s.largest_free_nbytes
    # largest_first really is largest first.
    sizes = [e.nbytes for e in alloc.free_extents()]
    assert sizes == sorted(sizes, reverse=True)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc = Allocator(4096, ALIGN)
        self.live: list[Block] = []

    @rule(size=st.integers(1, 1500))
    def allocate(self, size):
        before = snapshot(self.alloc)
        expect = best_fit_model(list(self.alloc.free_extents()), [size])
        if expect is None:
            with pytest.raises(PoolExhaustedError) as info:
                self.alloc.allocate(size)
            assert info.value.requested_nbytes == rounded(size)
            assert info.value.free_nbytes == before[0].free_nbytes
            assert info.value.largest_free_nbytes == before[0].largest_free_nbytes
            assert snapshot(self.alloc) == before
        else:
            got = self.alloc.allocate(size)
            assert got == expect[0]  # best fit, lowest offset
            self.live.append(got)

    @rule(sizes=st.lists(st.integers(1, 900), min_size=0, max_size=6))
    def allocate_group(self, sizes):
        before = snapshot(self.alloc)
        expect = best_fit_model(list(self.alloc.free_extents()), sizes)
        if expect is None:
            with pytest.raises(PoolExhaustedError) as info:
                self.alloc.allocate_group(sizes)
            assert info.value.requested_nbytes == sum(rounded(s) for s in sizes)
            assert info.value.free_nbytes == before[0].free_nbytes
            assert info.value.largest_free_nbytes == before[0].largest_free_nbytes
            # All or none: nothing of the group stayed allocated.
            assert snapshot(self.alloc) == before
        else:
            got = self.alloc.allocate_group(sizes)
            assert got == expect
            self.live.extend(got)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ext = data.draw(st.sampled_from(self.live))
        assert self.alloc.free(ext.offset) == ext.nbytes
        self.live.remove(ext)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def double_free_raises(self, data):
        ext = data.draw(st.sampled_from(self.live))
        self.alloc.free(ext.offset)
        self.live.remove(ext)
        before = snapshot(self.alloc)
        with pytest.raises(KeyError):
            self.alloc.free(ext.offset)
        assert snapshot(self.alloc) == before

    @rule(data=st.data())
    def reserve(self, data):
        free = sorted(self.alloc.free_extents(), key=lambda e: e.offset)
        if not free:
            return
        # Pieces of free extents, aligned, anywhere inside them.
        picks = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=3, unique=True))
        plan = []
        for host in picks:
            slots = host.nbytes // ALIGN
            start = data.draw(st.integers(0, slots - 1))
            length = data.draw(st.integers(1, slots - start))
            plan.append(Block(host.offset + start * ALIGN, length * ALIGN))
        spoil = data.draw(st.sampled_from(["none", "overlap_live", "misaligned", "duplicate"]))
        if spoil == "overlap_live" and self.live:
            plan.append(Block(self.live[0].offset, ALIGN))
        elif spoil == "misaligned":
            plan.append(Block(plan[0].offset + 8, ALIGN))
        elif spoil == "duplicate":
            plan.append(plan[0])
        else:
            spoil = "none"
        before = snapshot(self.alloc)
        if spoil == "none":
            self.alloc.reserve(plan)
            self.live.extend(plan)
            for e in plan:
                assert e in self.alloc.allocated_extents()
        else:
            # All or none: the extents taken before the bad one are returned.
            with pytest.raises(ValueError):
                self.alloc.reserve(plan)
            assert snapshot(self.alloc) == before

    @rule()
    def free_offset_never_allocated(self):
        before = snapshot(self.alloc)
        with pytest.raises(KeyError):
            self.alloc.free(8)  # never an extent start: not aligned
        assert snapshot(self.alloc) == before

    @invariant()
    def consistent(self):
        check_invariants(self.alloc)
        assert sorted(self.live) == self.alloc.allocated_extents()

    def teardown(self):
        # Freeing everything returns the allocator to one free block of full capacity.
        random.Random(len(self.live)).shuffle(self.live)
        for e in self.live:
            self.alloc.free(e.offset)
        assert list(self.alloc.free_extents()) == [Block(0, 4096)]
        s = self.alloc.stats()
        assert (s.used_nbytes, s.free_nbytes, s.free_blocks, s.allocated_blocks) == (0, 4096, 1, 0)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=60),
    seed=st.integers(0, 2**32 - 1),
)
def test_free_everything_in_any_order_coalesces_to_one_block(sizes, seed):
    alloc = Allocator(1 << 16, ALIGN)
    taken = []
    for s in sizes:
        try:
            taken.append(alloc.allocate(s))
        except PoolExhaustedError:
            pass
    check_invariants(alloc)
    rng = random.Random(seed)
    rng.shuffle(taken)
    for e in taken:
        alloc.free(e.offset)
        check_invariants(alloc)
    assert list(alloc.free_extents()) == [Block(0, 1 << 16)]


def test_best_fit_picks_the_smallest_fitting_extent():
    alloc = Allocator(1024, ALIGN)
    # Free extents of 64 @0, 32 @128, 48 @256, 32 @384, and the tail.
    a, g1, b, g2, c, g3, d, rest = [alloc.allocate(n) for n in (64, 64, 32, 96, 48, 80, 32, 608)]
    for e in (a, b, c, d):
        alloc.free(e.offset)
    free = {e.offset: e.nbytes for e in alloc.free_extents()}
    assert free == {0: 64, 128: 32, 256: 48, 384: 32}
    assert alloc.allocate(40) == Block(256, 48)  # 48 is the smallest >= 40
    assert alloc.allocate(20) == Block(128, 32)  # two 32s: the lower offset
    assert alloc.allocate(32) == Block(384, 32)
    assert alloc.allocate(1) == Block(0, 16)  # carved from the start, rest stays free
    assert {e.offset: e.nbytes for e in alloc.free_extents()} == {16: 48}


def test_group_is_atomic_and_placed_largest_first():
    alloc = Allocator(256, ALIGN)
    x = alloc.allocate(64)
    alloc.allocate(32)
    alloc.free(x.offset)  # free: 64 @0, 160 @96
    before = snapshot(alloc)
    with pytest.raises(PoolExhaustedError) as info:
        alloc.allocate_group([60, 150, 20])  # 150 -> @96 (160), 64 -> @0, then 32 fits nowhere
    e = info.value
    assert isinstance(e, MemoryError) and isinstance(e, TensorferryError)
    assert (e.requested_nbytes, e.free_nbytes, e.largest_free_nbytes, e.capacity_nbytes) == (64 + 160 + 32, 224, 160, 256)
    msg = str(e)
    for number in ("256", "224", "160"):
        assert number in msg
    assert "largest free block" in msg and "nothing was allocated" in msg
    assert snapshot(alloc) == before
    got = alloc.allocate_group([60, 150])
    assert got == [Block(0, 64), Block(96, 160)]
    assert alloc.allocate_group([]) == []


def test_reserve_atomic_and_exact():
    alloc = Allocator(512, ALIGN)
    live = alloc.allocate(64)  # [0, 64)
    before = snapshot(alloc)
    with pytest.raises(ValueError, match="not entirely free"):
        alloc.reserve([Block(128, 64), Block(256, 32), Block(32, 64)])
    assert snapshot(alloc) == before
    with pytest.raises(ValueError, match="multiple"):
        alloc.reserve([Block(128, 64), Block(200, 16)])
    assert snapshot(alloc) == before
    with pytest.raises(ValueError):
        alloc.reserve([Block(480, 64)])  # runs past the end
    assert snapshot(alloc) == before
    alloc.reserve([Block(128, 64), Block(256, 32)])  # middles of the free extent
    assert alloc.allocated_extents() == [live, Block(128, 64), Block(256, 32)]
    check_invariants(alloc)
    for e in alloc.allocated_extents():
        alloc.free(e.offset)
    assert list(alloc.free_extents()) == [Block(0, 512)]


def test_errors_and_edges():
    with pytest.raises(ValueError):
        Allocator(100, 3)
    with pytest.raises(ValueError):
        Allocator(-1)
    alloc = Allocator(100, ALIGN)
    assert alloc.capacity_nbytes == 96  # rounded down to the alignment
    for bad in (0, -5):
        with pytest.raises(ValueError):
            alloc.allocate(bad)
        with pytest.raises(ValueError):
            alloc.allocate_group([16, bad])
    assert alloc.stats().used_nbytes == 0
    with pytest.raises(PoolExhaustedError):
        alloc.allocate(97)
    e = alloc.allocate(96)
    assert e == Block(0, 96)
    with pytest.raises(PoolExhaustedError) as info:
        alloc.allocate(1)
    assert (info.value.free_nbytes, info.value.largest_free_nbytes) == (0, 0)
    alloc.free(0)
    with pytest.raises(KeyError):
        alloc.free(0)
    empty = Allocator(0)
    with pytest.raises(PoolExhaustedError):
        empty.allocate(1)
    assert empty.stats().free_blocks == 0


def test_threads_allocate_and_free_concurrently():
    alloc = Allocator(1 << 20, ALIGN)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(2000):
                if mine and rng.random() < 0.5:
                    alloc.free(mine.pop(rng.randrange(len(mine))).offset)
                else:
                    try:
                        mine.append(alloc.allocate(rng.randint(1, 4096)))
                    except PoolExhaustedError:
                        pass
            for e in mine:
                alloc.free(e.offset)
        except Exception as exc:  # reported below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert list(alloc.free_extents()) == [Block(0, 1 << 20)]


def test_fragmented_free_list_stays_fast():
    # 20k free fragments: best fit and coalescing must not scan them all per call
    # (a linear scan here would take seconds).
    import time

    alloc = Allocator(16 * 40_000, ALIGN)
    ext = [alloc.allocate(16) for _ in range(40_000)]
    for e in ext[::2]:
        alloc.free(e.offset)
    t0 = time.perf_counter()
    for _ in range(5000):
        x = alloc.allocate(16)
        alloc.free(x.offset)
    assert time.perf_counter() - t0 < 2.0
    for e in ext[1::2]:
        alloc.free(e.offset)
    assert alloc.stats().free_blocks == 1


def test_allocator_is_pure_python():
    """The allocator imports only the standard library and the layers below
    memory (the memory package itself loads torch for the pool)."""
    import ast

    import tensorferry.memory._allocator as allocator

    tree = ast.parse(open(allocator.__file__).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level and n.module}
    relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert imported <= set(sys.stdlib_module_names) | {"__future__", "numpy"}, imported
    assert relative <= {"errors", "wire", "wire.packing"}, relative


def test_free_soon_defers_only_on_the_thread_inside():
    """free_soon is for finalizers: on the thread holding the lock it waits
    for that thread to leave (no self-deadlock); elsewhere it frees now."""
    a = Allocator(1024)
    x, y = a.allocate(64), a.allocate(64)
    with a._locked():
        a.free_soon(x.offset)  # free() here would wait for this thread forever
        assert a._allocated.get(x.offset) == 64, "freed in the middle of a locked section"
    assert a.allocated_extents() == [y]
    t = threading.Thread(target=a.free_soon, args=(y.offset,))
    t.start()
    t.join(timeout=5.0)
    assert a.allocated_extents() == []
    a.free_soon(y.offset)  # already free: ignored
    assert a.stats().free_nbytes == 1024 and a.stats().free_blocks == 1
