"""The byte-copy layer: parallel split, tensor pairs, the thread setting, fork."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from tensorferry import ConfigurationError
from tensorferry import _copy


def _runs(rng: np.random.Generator, count: int, mean: int):
    """Source and destination buffers cut into ``count`` runs of odd sizes, in shuffled order."""
    lengths = rng.integers(1, 2 * mean, size=count).astype(np.int64)
    total = int(lengths.sum())
    src = torch.from_numpy(rng.integers(0, 256, size=total, dtype=np.uint8))
    dst = torch.zeros(total, dtype=torch.uint8)
    offs = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    # Destinations in another order than sources: runs are independent.
    perm = rng.permutation(count)
    dst_offs = np.concatenate([[0], np.cumsum(lengths[perm])[:-1]])
    dst_of = np.empty(count, dtype=np.int64)
    dst_of[perm] = dst_offs
    return src, dst, offs, dst_of, lengths


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_memmove_runs_copies_every_byte_to_its_place(monkeypatch, threads):
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", threads)
    rng = np.random.default_rng(int(threads))
    src, dst, offs, dst_of, lengths = _runs(rng, 150, 200_001)  # ~30 MB: above the parallel threshold
    assert int(lengths.sum()) >= _copy._PARALLEL_MIN_NBYTES
    _copy.memmove_runs(dst_of + dst.data_ptr(), offs + src.data_ptr(), lengths)
    s, d = src.numpy(), dst.numpy()
    for o, do, n in zip(offs.tolist(), dst_of.tolist(), lengths.tolist()):
        assert np.array_equal(d[do : do + n], s[o : o + n])


def test_parts_cover_each_byte_once_in_balanced_page_aligned_parts():
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 3_000_000, size=37).astype(np.int64)
    src = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) + 10**9
    dst = src + 10**10
    total = int(lengths.sum())
    for k in (2, 3, 4, 7):
        parts = _copy._parts(dst, src, lengths, k)
        assert len(parts) == k
        covered = []
        for d, s, n in parts:
            assert all(x > 0 for x in n)
            assert [a - b for a, b in zip(d, s)] == [10**10] * len(d)
            covered.extend(zip(s, n))
        # Together the parts are exactly the runs' bytes, each once.
        covered.sort()
        pos = 10**9
        for s, n in covered:
            assert s == pos
            pos += n
        assert pos == 10**9 + total
        sizes = [sum(n) for _, _, n in parts]
        assert max(sizes) - min(sizes) <= _copy._PART_ALIGNMENT * k
        # Each part after the first starts on a page of the concatenation.
        starts = np.cumsum(sizes)[:-1]
        assert all(int(x) % _copy._PART_ALIGNMENT == 0 for x in starts)


def test_copy_tensors_mixes_raw_strided_and_converted_pairs(monkeypatch):
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", "2")
    g = torch.Generator().manual_seed(3)
    block = torch.randn(6_000_000, generator=g)  # 24 MB: one storage, views in a row
    srcs = [block[:2_000_000].view(1000, 2000), block[2_000_000:5_000_000], block[5_000_000:5_000_010]]
    srcs.append(torch.randn(300, 400, generator=g).t())  # strided
    srcs.append(torch.randn(1000, generator=g, dtype=torch.float64))  # another dtype than its target
    srcs.append(torch.empty(0))
    dsts = [torch.empty(1000, 2000), torch.empty(3_000_000), torch.empty(10), torch.empty(400, 300), torch.empty(1000), torch.empty(0)]
    want = [s.to(d.dtype).clone() for s, d in zip(srcs, dsts)]
    _copy.copy_tensors(dsts, srcs)
    for d, w in zip(dsts, want):
        assert torch.equal(d, w)


def test_copy_tensors_merges_neighbours_and_keeps_parameters_grad_free():
    src = torch.arange(1 << 22, dtype=torch.float32)
    dst = torch.nn.Parameter(torch.zeros(1 << 22))
    halves_src = [src[: 1 << 21], src[1 << 21 :]]
    halves_dst = [dst[: 1 << 21], dst[1 << 21 :]]
    _copy.copy_tensors(halves_dst, halves_src)
    assert torch.equal(dst.detach(), src)
    assert dst.grad is None and dst.requires_grad


@pytest.mark.parametrize("value", ["0", "-2", "many", "1000"])
def test_bad_thread_setting_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", value)
    with pytest.raises(ConfigurationError, match="TENSORFERRY_COPY_THREADS"):
        _copy.copy_threads()


def test_default_threads_follow_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.delenv("TENSORFERRY_COPY_THREADS", raising=False)
    import os

    assert _copy.copy_threads() == max(1, min(4, len(os.sched_getaffinity(0))))


def _child_copies(q):
    # numpy buffers: a forked child must not enter a torch (OpenMP) parallel
    # region the parent already used, which hangs in libgomp, not here.
    src = np.random.default_rng(1).integers(0, 256, size=40 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    _copy.copy_bytes(torch.from_numpy(dst), torch.from_numpy(src))
    q.put(bool(np.array_equal(dst, src)))


def test_a_forked_child_copies_in_parallel_after_the_parent_did(monkeypatch):
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", "2")
    src = np.ones(40 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    _copy.copy_bytes(torch.from_numpy(dst), torch.from_numpy(src))
    assert _copy._pool is not None  # the parent's pool now has a live thread
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_copies, args=(q,))
    p.start()
    try:
        assert q.get(timeout=60) is True
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
