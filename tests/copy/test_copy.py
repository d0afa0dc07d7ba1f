"""The byte-copy layer: parallel split, tensor pairs, the thread setting, fork."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from tensorferry import ConfigurationError, TransferError
from tensorferry import copy as _copy
from tensorferry.copy import _convert, _memmove, _threads


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
    assert int(lengths.sum()) >= _threads.PARALLEL_MIN_NBYTES
    _copy.memmove_runs(dst_of + dst.data_ptr(), offs + src.data_ptr(), lengths)
    s, d = src.numpy(), dst.numpy()
    for o, do, n in zip(offs.tolist(), dst_of.tolist(), lengths.tolist()):
        assert np.array_equal(d[do : do + n], s[o : o + n])


@pytest.mark.parametrize("threads", ["1", "2"])
def test_many_small_runs_at_odd_addresses_land_exactly(monkeypatch, copies, threads):
    # 40k runs of 1 to 1,500 bytes (30 MB: a streaming batch, split over
    # threads), at odd offsets on both sides, so the streaming stores' heads
    # and tails are exercised; the bytes between runs stay untouched.
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", threads)
    rng = np.random.default_rng(11)
    src, _, offs, dst_of, lengths = _runs(rng, 40_000, 750)
    gaps = rng.integers(0, 9, size=lengths.size)
    dst_of = dst_of + np.cumsum(gaps)[np.argsort(np.argsort(dst_of))]  # a gap before each run, in destination order
    dst = torch.full((int((dst_of + lengths).max()) + 16,), 0xAB, dtype=torch.uint8)
    assert int(lengths.sum()) >= _memmove._STREAM_MIN_NBYTES
    _copy.memmove_runs(dst_of + dst.data_ptr() + 3, offs + src.data_ptr() + 0, lengths)
    want = np.full(dst.numel(), 0xAB, dtype=np.uint8)
    s = src.numpy()
    for o, do, n in zip(offs.tolist(), dst_of.tolist(), lengths.tolist()):
        want[do + 3 : do + 3 + n] = s[o : o + n]
    assert np.array_equal(dst.numpy(), want)


def test_streamed_runs_of_every_length_near_a_four_page_chunk_land_exactly(copies):
    # A streamed run goes four pages at a time, then line by line, then byte
    # by byte: lengths on and beside each of those edges, at destination
    # offsets across a cache line, with guard bytes around every run.
    chunk = 4 * 4096
    sizes = [1024, 1087, chunk - 1, chunk, chunk + 1, chunk + 64, 2 * chunk - 63, 3 * chunk + 4095, 8 * chunk + 17]
    heads = [0, 1, 15, 16, 33, 63]
    lengths = np.array([n for n in sizes for _ in heads], dtype=np.int64)
    total = int(lengths.sum())
    assert total < _memmove._STREAM_MIN_NBYTES  # below it, memmove_runs would not stream: repeat the runs until over
    reps = _memmove._STREAM_MIN_NBYTES // total + 1
    lengths = np.tile(lengths, reps)
    head_of = np.tile(np.array([h for _ in sizes for h in heads], dtype=np.int64), reps)
    src = torch.from_numpy(np.random.default_rng(5).integers(0, 256, size=int(lengths.sum()), dtype=np.uint8))
    offs = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    slot = ((lengths + 64 + 128 + 63) // 64) * 64  # a line-aligned slot a run, room for its head and guards
    dst_of = np.concatenate([[0], np.cumsum(slot)[:-1]]) + 64 + head_of
    dst = torch.full((int(slot.sum()) + 256,), 0xAB, dtype=torch.uint8)
    base = (dst.data_ptr() + 63) // 64 * 64 - dst.data_ptr()  # line-aligned slots in the buffer
    _copy.memmove_runs(dst_of + base + dst.data_ptr(), offs + src.data_ptr(), lengths)
    want = np.full(dst.numel(), 0xAB, dtype=np.uint8)
    s = src.numpy()
    for o, do, n in zip(offs.tolist(), (dst_of + base).tolist(), lengths.tolist()):
        want[do : do + n] = s[o : o + n]
    assert np.array_equal(dst.numpy(), want)


@pytest.mark.parametrize("apart", [0, 1, 64, 200, 1023, 1024, 2048, 4032, 4095])
def test_streamed_runs_land_exactly_at_every_distance_within_a_page(copies, apart):
    # How far the destination lies past the source within a page picks the
    # streamed loop (four pages at a time from 1 KiB apart, else line by
    # line: see stream_copy): runs long and short, on both sides of that
    # edge, each at its own head offset, with guard bytes around each.
    page = 4096
    sizes = [5 * page + 77, 4 * page, 3 * page + 5, 40 << 10, 9 * page + 4000]
    heads = [0, 7, 63]
    lengths = np.tile(np.array([n for n in sizes for _ in heads], dtype=np.int64), 40)  # over the streaming threshold
    head_of = np.tile(np.array([h for _ in sizes for h in heads], dtype=np.int64), 40)
    assert int(lengths.sum()) >= _memmove._STREAM_MIN_NBYTES
    slot = (lengths + 2 * page + page - 1) // page * page  # page-aligned slots on both sides, room for guards
    starts = np.concatenate([[0], np.cumsum(slot)[:-1]])
    src = torch.from_numpy(np.random.default_rng(apart).integers(0, 256, size=int(slot.sum()) + 2 * page, dtype=np.uint8))
    dst = torch.full((int(slot.sum()) + 3 * page,), 0xAB, dtype=torch.uint8)
    src_base = (src.data_ptr() + page - 1) // page * page - src.data_ptr()
    dst_base = (dst.data_ptr() + page - 1) // page * page - dst.data_ptr()
    src_of = src_base + starts + head_of
    dst_of = dst_base + starts + head_of + apart
    assert set(((dst_of + dst.data_ptr() - src_of - src.data_ptr()) % page).tolist()) == {apart}
    _copy.memmove_runs(dst_of + dst.data_ptr(), src_of + src.data_ptr(), lengths)
    want = np.full(dst.numel(), 0xAB, dtype=np.uint8)
    s = src.numpy()
    for so, do, n in zip(src_of.tolist(), dst_of.tolist(), lengths.tolist()):
        want[do : do + n] = s[so : so + n]
    assert np.array_equal(dst.numpy(), want)


def test_overlapping_runs_copy_as_memmove_in_order(copies):
    # A run whose source and destination overlap (moved within one buffer,
    # a streaming-size batch) and two runs writing the same bytes: memmove
    # semantics, and the later run wins.
    buf = torch.from_numpy(np.random.default_rng(3).integers(0, 256, size=24 << 20, dtype=np.uint8))
    ref = buf.numpy().copy()
    base = buf.data_ptr()
    n = 20 << 20
    _copy.memmove_runs(np.array([base + 4097, base + 100, base + 100]), np.array([base + 1, base + 0, base + 5000]), np.array([n, 64, 64]))
    ref[4097 : 4097 + n] = ref[1 : 1 + n].copy()
    ref[100:164] = ref[5000:5064]
    assert np.array_equal(buf.numpy(), ref)


def test_parts_cover_each_byte_once_in_balanced_page_aligned_parts():
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 3_000_000, size=37).astype(np.int64)
    src = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) + 10**9
    dst = src + 10**10
    total = int(lengths.sum())
    for k in (2, 3, 4, 7):
        parts = _memmove._parts(dst, src, lengths, k)
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
        assert max(sizes) - min(sizes) <= _memmove._PART_ALIGNMENT * k
        # Each part after the first starts on a page of the concatenation.
        starts = np.cumsum(sizes)[:-1]
        assert all(int(x) % _memmove._PART_ALIGNMENT == 0 for x in starts)


def _packed(specs, seed=3):
    """Two blocks holding tensors of ``specs`` (dtype, shape) back to back, 16-aligned."""
    g = torch.Generator().manual_seed(seed)
    half = (len(specs) + 1) // 2
    blocks, offsets, nbytes, bounds, views = [], [], [], [0], []
    for part in (specs[:half], specs[half:]):
        sizes = [torch.empty(shape, dtype=dt).nbytes for dt, shape in part]
        offs = np.concatenate([[0], np.cumsum([-(-n // 16) * 16 for n in sizes])]).astype(np.int64)
        blk = torch.zeros(int(offs[-1]) or 16, dtype=torch.uint8)
        blocks.append(blk)
        for (dt, shape), o, n in zip(part, offs.tolist(), sizes):
            v = blk[o : o + n].view(dt).view(shape)
            # Values, not random bytes: no NaN to compare unequal to itself.
            if dt.is_floating_point or dt.is_complex:
                v.copy_(torch.randn(shape, generator=g, dtype=torch.float32 if not dt.is_complex else dt).to(dt))
            else:
                v.copy_(torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dt))
            views.append(v)
        offsets.extend(offs[:-1].tolist())
        nbytes.extend(sizes)
        bounds.append(bounds[-1] + len(part))
    return blocks, np.array(bounds), np.array(offsets, dtype=np.int64), np.array(nbytes, dtype=np.int64), views


def _copy_out(blocks, bounds, offsets, nbytes, targets):
    """The blocks, as one stream, into ``targets`` the way a receiver copies
    out (a StagedCopy: addresses or staged buffers, one copy plan)."""
    sink = _copy.StagedCopy([b.numel() for b in blocks], bounds, offsets, nbytes, targets)
    pos = 0
    for b in blocks:
        sink(pos, b.numel(), b.data_ptr())
        pos += b.numel()
    sink.finish()


def test_copy_out_fills_dense_strided_conjugated_and_empty_targets(monkeypatch):
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", "2")
    specs = [
        (torch.float32, (1000, 2000)), (torch.float32, (3_000_000,)), (torch.int64, (5,)),
        (torch.float32, (400, 300)), (torch.complex64, (64, 64)), (torch.float64, (0, 3)),
        (torch.float32, (2_000_000,)), (torch.bfloat16, (7, 11)),
    ]
    blocks, bounds, offsets, nbytes, views = _packed(specs)
    assert int(nbytes.sum()) >= _threads.PARALLEL_MIN_NBYTES
    targets = [
        torch.nn.Parameter(torch.zeros(1000, 2000)),
        torch.zeros(3_000_000),
        torch.zeros(5, dtype=torch.int64),
        torch.zeros(300, 400).t(),  # strided: copied value by value
        torch.zeros(64, 64, dtype=torch.complex64).conj(),  # conjugate bit: bytes are not values
        torch.zeros(0, 3, dtype=torch.float64),
        torch.zeros(2_000_000)._neg_view(),  # negative bit
        torch.zeros(7, 11, dtype=torch.bfloat16),
    ]
    want = [v.clone() for v in views]
    _copy_out(blocks, bounds, offsets, nbytes, targets)
    for i, (t, w) in enumerate(zip(targets, want)):
        assert torch.equal(t.detach().resolve_conj().resolve_neg(), w), i
    assert targets[0].grad is None and targets[0].requires_grad


def test_copy_out_writes_a_target_given_twice_in_order(monkeypatch):
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", "2")
    blocks, bounds, offsets, nbytes, views = _packed([(torch.float32, (3_000_000,))] * 4, seed=5)
    same = torch.zeros(3_000_000)
    targets = [torch.zeros(3_000_000), same, torch.zeros(3_000_000), same]
    _copy_out(blocks, bounds, offsets, nbytes, targets)
    # The later copy wins, as with a loop of copy_ (no race between threads).
    assert torch.equal(same, views[3]) and torch.equal(targets[0], views[0]) and torch.equal(targets[2], views[2])


def test_copy_plan_joins_runs_that_continue_on_both_sides():
    dst = np.array([100, 110, 200, 230, 240], dtype=np.int64)
    src = np.array([0, 10, 20, 40, 43], dtype=np.int64)
    n = np.array([10, 5, 20, 3, 0], dtype=np.int64)
    plan = _copy.CopyPlan.build(dst, src, n)
    # 0 and 1 continue each other on both sides; 2 continues 1 only at the
    # source; the empty one takes no run.
    assert plan.dst.tolist() == [100, 200, 230] and plan.src.tolist() == [0, 20, 40] and plan.nbytes.tolist() == [15, 20, 3]
    assert plan.heads.tolist() == [0, 2, 3] and plan.elementwise.size == 0
    # Not raw: listed apart, never merged, never copied by address.
    plan = _copy.CopyPlan.build(dst, src, n, raw=np.array([True, False, True, True, True]))
    assert plan.nbytes.tolist() == [10, 20, 3] and plan.elementwise.tolist() == [1]
    # A break where something else changes.
    plan = _copy.CopyPlan.build(dst, src, n, breaks=np.array([False, True, False, False, False]))
    assert plan.nbytes.tolist() == [10, 5, 20, 3]


def test_copy_plan_windows_copy_each_byte_once():
    """A stream's plan executed a window at a time writes what one
    execution writes, wherever the windows cut the runs."""
    src_buf = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    out_once = torch.zeros(32768, dtype=torch.uint8)
    out_win = torch.zeros(32768, dtype=torch.uint8)
    rng = np.random.default_rng(5)
    n = rng.integers(0, 300, 60)
    start = np.concatenate(([0], np.cumsum(n)[:-1]))  # stream positions
    order = rng.permutation(60)
    dst_off = np.zeros(60, dtype=np.int64)
    dst_off[order] = np.concatenate(([0], np.cumsum(n[order])[:-1]))
    plan = _copy.CopyPlan.build(dst_off, start, n)
    plan.execute(out_once.data_ptr(), src_buf.data_ptr())
    total = int(n.sum())
    for lo in range(0, total, 97):
        hi = min(lo + 97, total)
        plan.execute_window(lo, hi, out_win.data_ptr(), src_buf.data_ptr())
    assert torch.equal(out_once, out_win)
    assert torch.equal(out_once[int(dst_off[order[1]]) : int(dst_off[order[1]] + n[order[1]])],
                       src_buf[int(start[order[1]]) : int(start[order[1]] + n[order[1]])])


def test_nested_parallel_copies_never_wait_for_a_free_thread(monkeypatch):
    """Every copy thread busy with a copy that itself splits in parts: the
    waits run the parts nobody started, so it finishes instead of hanging."""
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", "4")
    monkeypatch.setattr(_threads, "PARALLEL_MIN_NBYTES", 1 << 16)
    monkeypatch.setattr(_memmove, "_PARALLEL_MIN_MEAN_RUN", 1 << 10)
    srcs = [torch.randint(0, 255, (1 << 18,), dtype=torch.uint8) for _ in range(3 * _threads._POOL_THREADS)]
    dsts = [torch.zeros_like(s) for s in srcs]

    def one(i: int) -> None:
        _copy.copy_bytes(dsts[i], srcs[i])

    _copy.run_parts(one, [(i,) for i in range(len(srcs))])
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


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
    assert _threads._pool is not None  # the parent's pool now has a live thread
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


def test_vectored_io_resumes_short_transfers_where_they_stopped(tmp_path):
    import os

    data = bytes(range(256)) * 40
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        sizes = [1, 7, 300, 0, 2048, 5, 999, 3000, 1]
        bufs = [memoryview(bytearray(n)) for n in sizes]

        def short_preadv(fd, buffers, offset):
            # At most 500 bytes a call: cuts buffers in the middle and at seams.
            want, out = 500, []
            for b in buffers:
                if want <= 0:
                    break
                out.append(b[: min(len(b), want)])
                want -= len(out[-1])
            return os.preadv(fd, out, offset)

        short_preadv.__name__ = "preadv"
        _copy.vectored_io(short_preadv, fd, bufs, 17)
        assert b"".join(bytes(b) for b in bufs) == data[17 : 17 + sum(sizes)]
        with pytest.raises(TransferError, match="moved 0 bytes"):
            _copy.vectored_io(os.preadv, fd, [memoryview(bytearray(100))], len(data))  # past the end
    finally:
        os.close(fd)


def test_a_large_vectored_transfer_runs_in_parts_that_cover_each_byte_once(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", "3")
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 40_000, size=3000)  # ~60 MB in 3000 buffers: split three ways
    data = rng.integers(0, 256, size=int(sizes.sum()) + 123, dtype=np.uint8)
    fd = os.memfd_create("vectored-test")
    try:
        os.ftruncate(fd, data.size)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        src = [memoryview(data[123 + a : 123 + b]) for a, b in zip(bounds[:-1], bounds[1:])]
        _copy.vectored_io(os.pwritev, fd, src, 123)
        assert os.pread(fd, 123, 0) == bytes(123)  # nothing before the offset
        back = np.zeros(int(sizes.sum()), dtype=np.uint8)
        dst = [memoryview(back[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        _copy.vectored_io(os.preadv, fd, dst, 123)
        assert np.array_equal(back, data[123:])
    finally:
        os.close(fd)


def _f32_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.float32))


def _f16c() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " f16c" in line for line in f)
    except OSError:
        return False


@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conversions_match_torch_bit_for_bit(monkeypatch, copies, threads, dtype):
    # Random bit patterns (NaNs of every payload, denormals, infinities among
    # them) and every special class, in pairs of odd lengths at unaligned
    # addresses on both sides; 9M values: a streaming batch split over the
    # threads. A float64 pair goes to torch either way.
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", threads)
    rng = np.random.default_rng(21)
    special = np.array(_convert._PROBE_BITS, dtype=np.uint32)
    bits = rng.integers(0, 1 << 32, size=9_000_100, dtype=np.uint32)
    bits[rng.integers(0, bits.size, size=50_000)] = rng.choice(special, size=50_000)
    bits[: special.size] = special
    bits[-special.size :] = special
    src = _f32_bits(bits)
    lengths = [7_000_001, 31, 1, 1_999_977]
    out = torch.full((bits.size + 64,), 0x5A5A, dtype=torch.int16)
    pairs, want, pos, at = [], [], 1, 0
    for n in lengths:
        s = src[at + 3 : at + 3 + n]  # 12 bytes past the source's alignment
        pairs.append((out[pos : pos + n].view(dtype), s))
        want.append((pos, s.to(dtype).view(torch.int16)))
        pos, at = pos + n + 5, at + n + 3
    f64 = torch.from_numpy(rng.standard_normal(1000))
    pairs.append((torch.empty(1000, dtype=dtype), f64))
    to_torch = []
    convert_torch = _convert._convert_torch
    monkeypatch.setattr(_convert, "_convert_torch", lambda p: (to_torch.extend(p), convert_torch(p)))
    _copy.copy_converting(pairs)
    expect = torch.full_like(out, 0x5A5A)  # the gaps between pairs untouched
    for p, w in want:
        expect[p : p + w.numel()] = w
    assert torch.equal(out, expect)
    assert torch.equal(pairs[-1][0].view(torch.int16), f64.to(dtype).view(torch.int16))
    native = copies == "c-loop" and (dtype == torch.bfloat16 or _f16c())
    assert dtype in _convert._native_conversions() if native else dtype not in _convert._native_conversions()
    assert len(to_torch) == (1 if native else len(pairs))


def test_convert_runs_at_odd_addresses_and_bases(c_loop):
    # Directly, where torch makes no tensor: a destination at an odd byte
    # address (never streamed), and runs given as offsets plus base addresses.
    rng = np.random.default_rng(4)
    src = _f32_bits(rng.integers(0, 1 << 32, size=300_001, dtype=np.uint32))
    raw = torch.zeros(2 * src.numel() + 64, dtype=torch.uint8)
    nan = _convert._native_conversions()[torch.bfloat16][1]
    d = np.array([1, 2 * 200_000 + 9], dtype=np.int64)
    s = np.array([0, 4 * 200_000], dtype=np.int64)
    n = np.array([200_000, 100_001], dtype=np.int64)
    _copy._native.loop.convert_runs(d.ctypes.data, s.ctypes.data, n.ctypes.data, 2, _copy._native.loop.BFLOAT16, True, raw.data_ptr(), src.data_ptr(), nan)
    want = src.to(torch.bfloat16).view(torch.uint8).numpy()
    got = raw.numpy()
    assert np.array_equal(got[1 : 1 + 400_000], want[:400_000])
    assert np.array_equal(got[400_009 : 400_009 + 200_002], want[400_000:])
    assert got[0] == 0 and not got[400_001:400_009].any() and not got[600_011:].any()
    with pytest.raises(ValueError, match="kind 7"):
        _copy._native.loop.convert_runs(d.ctypes.data, s.ctypes.data, n.ctypes.data, 0, 7, False)


_SCALAR_TORCH = """
import numpy as np, torch
import tensorferry.copy as _copy
from tensorferry.copy import _convert
src = torch.from_numpy(np.array([0x7fa5a5a5, 0xffc00000, 0x3f808000, 0x7f7f8000] * 40000, dtype=np.uint32).view(np.float32))
dst = torch.empty(src.numel(), dtype=torch.bfloat16)
_copy.copy_converting([(dst, src)])
kinds = _convert._native_conversions()
print(hex(kinds[torch.bfloat16][1]), torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16)))
"""


def test_bfloat16_nan_follows_torch_kernel_of_the_process(c_loop):
    # torch's scalar kernel (ATEN_CPU_CAPABILITY=default) writes NaN as
    # 0x7fc0, its vectorised ones as 0xffff: the C loop learns which.
    import os
    import subprocess
    import sys

    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", _SCALAR_TORCH], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0x7fc0", "True"]


def test_a_copy_plan_reuses_its_windows_batches_at_other_base_addresses(monkeypatch, copies):
    # A kept plan copies the same windows every sync, from wherever the
    # stream is this time: the batches are made once per window, and each
    # run moves from the new bases (offsets in the plan, addresses given).
    monkeypatch.setenv("TENSORFERRY_COPY_THREADS", "2")
    rng = np.random.default_rng(5)
    src_a, _, offs, dst_of, lengths = _runs(rng, 3_000, 6_000)  # 18 MB: parallel, streaming
    total = int(lengths.sum())
    src_b = torch.from_numpy(rng.integers(0, 256, size=total, dtype=np.uint8))
    plan = _copy.CopyPlan.build(dst_of, offs, lengths)
    for src in (src_a, src_b, src_a):
        dst = torch.zeros(total, dtype=torch.uint8)
        assert plan.execute_window(0, total, dst.data_ptr(), src.data_ptr()) == plan.num_runs
        want = np.zeros(total, dtype=np.uint8)
        s = src.numpy()
        for o, do, n in zip(offs.tolist(), dst_of.tolist(), lengths.tolist()):
            want[do : do + n] = s[o : o + n]
        assert np.array_equal(dst.numpy(), want)
    assert len(plan._batches) == 1


def test_the_c_loops_refuse_negative_lengths_and_a_nan_that_is_not_16_bits(c_loop):
    # Lengths a size_t would read as huge, refused before any byte moves.
    m = _copy._native.loop
    buf = torch.arange(16, dtype=torch.float32)
    keep = buf.clone()
    at = np.array([buf.data_ptr()], dtype=np.int64)
    bad = np.array([-1], dtype=np.int64)
    with pytest.raises(ValueError, match=r"nbytes\[0\] is -1"):
        m.copy_runs(at.ctypes.data, at.ctypes.data, bad.ctypes.data, 1, False)
    with pytest.raises(ValueError, match=r"nelems\[0\] is -1"):
        m.convert_runs(at.ctypes.data, at.ctypes.data, bad.ctypes.data, 1, m.BFLOAT16, False)
    one = np.array([4], dtype=np.int64)
    for nan in (-1, 1 << 16, 1 << 32):
        with pytest.raises((ValueError, OverflowError), match="16 bits|too large|overflow"):
            m.convert_runs(at.ctypes.data, at.ctypes.data, one.ctypes.data, 1, m.BFLOAT16, False, 0, 0, nan)
    with pytest.raises(TransferError, match="negative byte counts"):
        _copy.memmove_runs(at, at, bad)
    assert torch.equal(buf, keep)
