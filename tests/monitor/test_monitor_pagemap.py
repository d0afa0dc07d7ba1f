"""Exact figures from pagemap against the kernel's own smaps_rollup, on real
processes: 2 GiB of 4 KiB pages, THP, copy-on-write children before and after
writing, MAP_SHARED anonymous memory, /dev/shm, memfd, hugetlbfs, a process
mapping and unmapping while walked; and the races (exit mid-walk, mappings
added mid-walk, mappings that keep changing, kernel threads)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from monitor_helpers import kernel_thread_pid, rollup_truth

from tensorferry.errors import ConfigurationError, NoSuchProcess
from tensorferry.monitor import sample
from tensorferry.monitor._pagemap import (
    LOCK_BURST_SECONDS,
    LOCK_GAP_SECONDS,
    PagemapWalk,
    WalkUnstable,
    slice_nbytes_for_stall,
)
from tensorferry.monitor._pagemap_maps import subtract as _subtract
from tensorferry.monitor._pagemap_maps import union as _union
from tensorferry.monitor._procfs import ProcfsBackend

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
ROOT = os.geteuid() == 0

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="no /proc/PID/pagemap here")


def walk(backend: ProcfsBackend, pid: int, slice_nbytes: int = 64 * MIB):
    w = backend.start_walk(pid, slice_nbytes=slice_nbytes)
    assert w is not None
    while not w.step():
        pass
    return w


def assert_agrees(pid: int, *, slice_nbytes: int = 64 * MIB, tolerance: float = 0.01) -> tuple[int, int | None]:
    """pagemap's USS and PSS within ``tolerance`` (or 256 KiB) of smaps_rollup read right after."""
    b = ProcfsBackend()
    e = walk(b, pid, slice_nbytes).result
    truth = rollup_truth(pid)
    uss = truth["Private_Clean"] + truth["Private_Dirty"]
    assert e is not None and e.source == "pagemap"
    assert abs(e.uss_bytes - uss) <= max(tolerance * uss, 256 * 1024), (e, truth)
    if ROOT:
        assert e.pss_bytes is not None
        assert abs(e.pss_bytes - truth["Pss"]) <= max(tolerance * truth["Pss"], 256 * 1024), (e, truth)
    else:
        assert e.pss_bytes is None
    return e.uss_bytes, e.pss_bytes


def test_two_gib_of_small_pages_in_many_slices(start_target) -> None:
    t = start_target("big", "2048")
    b = ProcfsBackend()
    w = walk(b, t.pid, slice_nbytes=256 * MIB)
    assert w.steps >= 8  # 2 GiB in 256 MiB slices, plus the opening and closing reads
    uss, _ = assert_agrees(t.pid)
    assert uss >= 2048 * MIB


def test_dense_and_sparse_memory_side_by_side(start_target) -> None:
    """64 MiB touched whole, then 1 MiB regions with one page touched each:
    the walk reads on without PAGEMAP_SCAN through dense memory and goes
    back to scanning where a read finds it sparse; no page is skipped or
    counted twice at the changes."""
    t = start_target("big", "64")
    t.proc.stdin.write("grow 0.05\nmap 1\n")  # type: ignore[union-attr]
    t.proc.stdin.flush()  # type: ignore[union-attr]
    assert t.proc.stdout.readline().strip() == "{}"  # type: ignore[union-attr]
    assert t.proc.stdout.readline().strip() == "{}"  # type: ignore[union-attr]  # grow has ended
    with open(f"/proc/{t.pid}/status") as f:
        status = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if v.strip().endswith("kB")}
    # Sparse: at least 64 MiB more mapped than resident, beside the dense 64 MiB.
    assert status["VmSize"] - status["VmRSS"] >= 64 * MIB, status
    for slice_nbytes in (2 * MIB, 64 * MIB, 1 << 40):
        assert_agrees(t.pid, slice_nbytes=slice_nbytes)


def test_thp_backed_memory(start_target) -> None:
    t = start_target("thp", "256")
    truth = rollup_truth(t.pid)
    if truth.get("AnonHugePages", 0) < 128 * MIB:
        pytest.skip("transparent huge pages not given here (THP disabled or memory fragmented)")
    uss, _ = assert_agrees(t.pid)
    assert uss >= 256 * MIB


@pytest.mark.parametrize("write_mib", [0, 48])
def test_forked_children_share_copy_on_write_before_and_after_writes(start_target, write_mib: int) -> None:
    t = start_target("cow", "96", str(write_mib))
    child = int(t.facts["child"])
    child_uss, child_pss = assert_agrees(child)
    parent_uss, _ = assert_agrees(t.pid)
    # Shared pages are nobody's USS; the child's writes made its own copies.
    assert write_mib * MIB <= child_uss <= (write_mib + 16) * MIB
    assert parent_uss >= (write_mib - 1) * MIB
    if ROOT:
        assert child_pss is not None
        shared = (96 - write_mib) * MIB
        assert child_pss >= child_uss + shared // 2 - 4 * MIB


def test_shared_anonymous_memory_of_forked_workers(start_target) -> None:
    t = start_target("sharedanon", "64")
    child = int(t.facts["child"])
    for pid in (t.pid, child):
        uss, pss = assert_agrees(pid)
        # Mapped by both: in neither's USS, half of it in each one's PSS.
        assert uss < 32 * MIB
        if ROOT:
            assert pss is not None and pss >= uss + 30 * MIB


def test_dev_shm_one_mapper_then_two(start_target) -> None:
    name = f"tensorferry-test-{uuid.uuid4().hex}"
    try:
        a = start_target("shm", name, "64")
        alone, _ = assert_agrees(a.pid)
        assert alone >= 64 * MIB  # the only mapper: private, as smaps counts it
        start_target("shm", name, "64")
        shared, pss = assert_agrees(a.pid)
        assert shared <= alone - 60 * MIB
        if ROOT:
            assert pss is not None and pss >= shared + 30 * MIB
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_memfd_mapper(start_target) -> None:
    t = start_target("memfd", "64")
    uss, _ = assert_agrees(t.pid)
    assert uss >= 64 * MIB


def hugepages_free() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("HugePages_Free:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(hugepages_free() < 4, reason="needs 4 free huge pages (vm.nr_hugepages)")
def test_hugetlbfs_pages_are_left_out_as_smaps_rollup_does(start_target) -> None:
    t = start_target("hugetlb", "8")
    truth = rollup_truth(t.pid)
    assert truth["Private_Hugetlb"] >= 8 * MIB  # smaps_rollup reports them apart
    uss, pss = assert_agrees(t.pid)
    assert uss < truth["Rss"] + 1 * MIB


def test_process_mapping_and_unmapping_while_walked(start_target) -> None:
    t = start_target("big", "256")
    t.proc.stdin.write("churn 3\n")  # type: ignore[union-attr]
    t.proc.stdin.flush()  # type: ignore[union-attr]
    b = ProcfsBackend()
    walks = 0
    results = []
    try:
        for _ in range(5):
            try:
                results.append(walk(b, t.pid, slice_nbytes=16 * MIB).result)
            except WalkUnstable:
                continue
            walks += 1
    finally:
        t.proc.stdout.readline()  # type: ignore[union-attr]
    assert walks >= 1
    truth = rollup_truth(t.pid)
    uss = truth["Private_Clean"] + truth["Private_Dirty"]
    # The loop maps and unmaps 256 KiB: each walk sees it there or not.
    for e in results:
        assert abs(e.uss_bytes - uss) <= max(0.01 * uss, MIB), (e, truth)


def test_mapping_added_mid_walk_is_walked_too(start_target) -> None:
    t = start_target("big", "64")
    b = ProcfsBackend()
    w = b.start_walk(t.pid, slice_nbytes=2 * MIB)
    assert w is not None
    w.step()
    t.proc.stdin.write("map 32\n")  # type: ignore[union-attr]
    t.proc.stdin.flush()  # type: ignore[union-attr]
    assert t.proc.stdout.readline().strip() == "{}"  # type: ignore[union-attr]
    while not w.step():
        pass
    truth = rollup_truth(t.pid)
    uss = truth["Private_Clean"] + truth["Private_Dirty"]
    assert w.result is not None and w.result.uss_bytes >= 96 * MIB
    assert abs(w.result.uss_bytes - uss) <= 256 * 1024


def test_mappings_that_keep_changing_give_no_figure(start_target) -> None:
    """A process that maps more every time the walk re-reads ``maps``: the
    walk gives up (no figure) instead of chasing it. Deterministic: the
    target maps 16 MiB before the step that reads the last slice of each
    round (that step re-reads ``maps``), whatever the machine's speed."""
    t = start_target("sleep")
    b = ProcfsBackend()
    slice_nbytes = 4 * MIB
    try:
        w = b.start_walk(t.pid, slice_nbytes=slice_nbytes)
        assert w is not None
        rounds = 0
        mapped_this_round = False
        last_remaining = w.remaining_nbytes
        with pytest.raises(WalkUnstable) as info:
            while True:
                remaining = w.remaining_nbytes
                if remaining > last_remaining:
                    mapped_this_round = False  # the walk queued what we mapped
                last_remaining = remaining
                if remaining <= slice_nbytes and not mapped_this_round:
                    rounds += 1
                    assert rounds < 10, "the walk never gave up"
                    t.proc.stdin.write("map 16\n")  # type: ignore[union-attr]
                    t.proc.stdin.flush()  # type: ignore[union-attr]
                    assert t.proc.stdout.readline().strip() == "{}"  # type: ignore[union-attr]
                    mapped_this_round = True
                if w.step():
                    break
        assert info.value.changed_nbytes >= 16 * MIB
        assert w.done and w.result is None
    finally:
        os.kill(t.pid, signal.SIGKILL)


def test_exit_mid_walk_raises_no_such_process(start_target) -> None:
    t = start_target("big", "64")
    b = ProcfsBackend()
    w = b.start_walk(t.pid, slice_nbytes=2 * MIB)
    assert w is not None
    w.step()
    os.kill(t.pid, signal.SIGKILL)
    t.proc.wait(10)
    with pytest.raises(NoSuchProcess):
        while not w.step():
            pass
    assert w.done and w.result is None
    with pytest.raises(NoSuchProcess):
        b.start_walk(t.pid, slice_nbytes=2 * MIB)


def test_kernel_thread_walk_is_done_without_figures() -> None:
    w = ProcfsBackend().start_walk(kernel_thread_pid(), slice_nbytes=2 * MIB)
    assert w is not None and w.done and w.result is None and w.kernel_thread


def test_sample_exact_uses_pagemap(start_target) -> None:
    t = start_target("big", "64")
    s = sample(t.pid, exact=True)
    assert s.uss_source == "pagemap"
    assert s.uss_bytes is not None and s.uss_bytes >= 64 * MIB
    off = ProcfsBackend(pagemap=False)
    assert sample(t.pid, exact=True, backend=off).uss_source == "smaps_rollup"


def test_walk_pauses_between_lock_bursts_and_is_not_charged_for_them(start_target) -> None:
    """512 MiB of present 4 KiB pages: reading their pagemap takes the target's
    lock for milliseconds in all (~25 ns a page), so the walk pauses between
    bursts (a writer waiting for the lock gets it then), at most once per
    LOCK_BURST_SECONDS of its own time. The pauses are in each step's length
    but not in what the walk charges (they cost no CPU), and the figures are
    unchanged by them."""
    t = start_target("big", "512")
    w = ProcfsBackend().start_walk(t.pid, slice_nbytes=64 * MIB)
    assert w is not None
    opening = w.cost_seconds
    steps = []  # (charged, paused, wall) per step
    done = False
    while not done:
        charged, paused = w.cost_seconds, w.gap_seconds
        t0 = time.perf_counter()
        done = w.step()
        steps.append((w.cost_seconds - charged, w.gap_seconds - paused, time.perf_counter() - t0))
    assert w.gaps >= 2, (w.gaps, w.cost_seconds)
    assert w.gaps <= w.cost_seconds / LOCK_BURST_SECONDS + 1, (w.gaps, w.cost_seconds)
    assert w.gap_seconds >= w.gaps * LOCK_GAP_SECONDS
    for charged, paused, wall in steps:
        assert charged + paused <= wall
    # A step's length is what it charged plus its pauses, to the last bit.
    assert w.max_step_seconds == pytest.approx(max(opening, *(c + p for c, p, _ in steps)), abs=1e-9)
    truth = rollup_truth(t.pid)
    assert w.result is not None
    assert abs(w.result.uss_bytes - (truth["Private_Clean"] + truth["Private_Dirty"])) <= 256 * 1024


def adaptive_walk(pid: int, *, first_slice_nbytes: int, step_limit_seconds: float):
    w = ProcfsBackend().start_walk(pid, slice_nbytes=first_slice_nbytes, step_limit_seconds=step_limit_seconds)
    assert w is not None
    while not w.step():
        pass
    return w


def test_slices_shrink_when_steps_are_slower_than_the_limit(start_target) -> None:
    """A 1 µs step limit: every real step (a syscall at least) is slower than
    the half of it aimed at, so after the first 64 MiB slice every slice is
    the 2 MiB minimum, and every PAGEMAP_SCAN call is held to its minimum.
    The figures still agree with smaps_rollup."""
    t = start_target("big", "128")
    w = adaptive_walk(t.pid, first_slice_nbytes=64 * MIB, step_limit_seconds=1e-6)
    first, *rest = w.slice_history
    assert first == 64 * MIB // PAGE
    assert rest and max(rest) <= 2 * MIB // PAGE
    # 128 MiB in 2 MiB slices after the first.
    assert w.steps >= 32
    if w.scan_calls:
        assert w.scan_pages == 2 * MIB // PAGE
        assert w.scan_max_present == 512
    truth = rollup_truth(t.pid)
    assert w.result is not None
    assert abs(w.result.uss_bytes - (truth["Private_Clean"] + truth["Private_Dirty"])) <= 256 * 1024


def test_slices_grow_at_most_twice_per_step(start_target) -> None:
    """A limit no step comes near (1000 s): from a 2 MiB first slice each
    step may read at most twice the one before, and the slices do grow."""
    t = start_target("big", "128")
    w = adaptive_walk(t.pid, first_slice_nbytes=2 * MIB, step_limit_seconds=1000.0)
    history = w.slice_history
    assert all(pages <= (2 * MIB // PAGE) << i for i, pages in enumerate(history)), history
    assert max(history) > 2 * MIB // PAGE
    truth = rollup_truth(t.pid)
    assert w.result is not None
    assert abs(w.result.uss_bytes - (truth["Private_Clean"] + truth["Private_Dirty"])) <= 256 * 1024


def test_step_limit_must_be_positive(start_target) -> None:
    t = start_target("sleep")
    with pytest.raises(ConfigurationError, match=r"step_limit_seconds.*must be > 0"):
        ProcfsBackend().start_walk(t.pid, slice_nbytes=2 * MIB, step_limit_seconds=0)


def test_slice_follows_the_stall_limit() -> None:
    assert slice_nbytes_for_stall(0.02) > slice_nbytes_for_stall(0.002) >= 2 * MIB
    assert slice_nbytes_for_stall(1e-9) == 2 * MIB
    assert slice_nbytes_for_stall(0.02) % (2 * MIB) == 0
    with pytest.raises(ConfigurationError, match=r"max_stall_seconds=0: must be > 0"):
        slice_nbytes_for_stall(0)


def test_range_arithmetic() -> None:
    walked = [(0, 10), (20, 30)]
    assert _subtract([(0, 40)], walked) == [(10, 20), (30, 40)]
    assert _subtract([(5, 8), (25, 35)], walked) == [(30, 35)]
    assert _subtract(walked, walked) == []
    assert _union(walked, [(10, 20), (50, 60)]) == [(0, 30), (50, 60)]
