"""Property tests of the wire contract: tensorferry.wire.packing, sender and receiver as a pair."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorferry.wire import packing as L
from tensorferry.errors import ConfigurationError, LayoutMismatchError, TensorferryError, TicketError

ALIGNMENTS = (1, 2, 4, 8, 16)


# -- plain sequential references -------------------------------------------------


def ref_packed_offsets(nbytes, alignments):
    """One tensor after another, each at the next multiple of its alignment;
    a zero-size tensor sits at the cursor, unaligned, and moves nothing."""
    cur = 0
    out = []
    for n, a in zip(nbytes, alignments):
        n, a = int(n), int(a)
        if n == 0:
            out.append(cur)
            continue
        cur = (cur + a - 1) // a * a
        out.append(cur)
        cur += n
    return out, cur


def ref_group_by_block(nbytes, alignments, blocks):
    """Greedy receiver: each block takes every tensor whose packed end is <= its size."""
    count = len(nbytes)
    start = 0
    bounds = [0]
    offsets = [0] * count
    for b, want in enumerate(blocks):
        if want <= 0:
            return None
        last = b == len(blocks) - 1
        cur = 0
        i = start
        while i < count:
            n, a = int(nbytes[i]), int(alignments[i])
            pos = cur if n == 0 else (cur + a - 1) // a * a
            if pos + n > want:
                break
            offsets[i] = pos
            cur = pos + n
            i += 1
        if cur != want or (last and i != count):
            return None
        start = i
        bounds.append(start)
    if start != count:
        if not blocks and not any(nbytes):
            return [0], offsets
        return None
    return bounds, offsets


def ref_merge_touching(offsets, lengths):
    runs = []  # [offset, length, first index]
    for i, (o, n) in enumerate(zip(offsets, lengths)):
        if runs and runs[-1][0] + runs[-1][1] == o:
            runs[-1][1] += n
        else:
            runs.append([o, n, i])
    return [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]


# -- strategies -------------------------------------------------------------------

# A tensor as (alignment, numel): its bytes are numel * alignment, as for a real dtype.
tensor_st = st.tuples(st.sampled_from(ALIGNMENTS), st.one_of(st.just(0), st.integers(1, 40), st.integers(1, 5000)))
tensors_st = st.lists(tensor_st, max_size=150)


def as_arrays(tensors):
    a = np.array([t[0] for t in tensors], dtype=np.int64)
    n = np.array([t[0] * t[1] for t in tensors], dtype=np.int64)
    return n, a


# -- align_up ---------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(value=st.integers(0, 1 << 62), shift=st.integers(0, 20))
def test_align_up_is_the_next_multiple(value, shift):
    a = 1 << shift
    got = L.align_up(value, a)
    assert got % a == 0
    assert value <= got < value + a


def test_align_up_on_arrays_and_edges():
    v = np.array([0, 1, 15, 16, 17, 31, 33], dtype=np.int64)
    np.testing.assert_array_equal(L.align_up(v, 16), [0, 16, 16, 16, 32, 32, 48])
    np.testing.assert_array_equal(L.align_up(v, np.array([1, 2, 4, 8, 16, 1, 2])), [0, 2, 16, 16, 32, 31, 34])
    assert L.align_up(0, 1) == 0
    assert L.align_up(7, 1) == 7
    with pytest.raises(ValueError, match="positive"):
        L.align_up(5, 0)


# -- packed_offsets ---------------------------------------------------------------


def check_packing(n, a, offsets, total):
    assert offsets.dtype == np.int64
    assert isinstance(total, int)
    ref_off, ref_total = ref_packed_offsets(n, a)
    # Minimal: exactly the sequential loop, so no byte of padding too many.
    assert offsets.tolist() == ref_off
    assert total == ref_total
    cur = 0
    for o, size, al in zip(offsets.tolist(), n.tolist(), a.tolist()):
        if size == 0:
            assert o == cur  # at the cursor
            continue
        assert o % al == 0
        assert o >= cur  # in order, no overlap
        assert o - cur < al  # less than one alignment of padding
        cur = o + size
    assert total == cur  # no trailing pad


@settings(max_examples=300, deadline=None)
@given(tensors=tensors_st)
def test_packed_offsets_matches_sequential_reference(tensors):
    n, a = as_arrays(tensors)
    off, total = L.packed_offsets(n, a)
    check_packing(n, a, off, total)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.sampled_from(ALIGNMENTS), st.integers(0, 1 << 40)), max_size=100),
)
def test_packed_offsets_arbitrary_byte_counts_and_huge_sizes(sizes):
    # Sizes that are not multiples of the alignment, and sizes near 2^40:
    # the contract is still the sequential loop, in exact integers.
    a = np.array([s[0] for s in sizes], dtype=np.int64)
    n = np.array([s[1] for s in sizes], dtype=np.int64)
    off, total = L.packed_offsets(n, a)
    check_packing(n, a, off, total)


def test_packed_offsets_small_cases():
    off, total = L.packed_offsets([], [])
    assert off.tolist() == [] and total == 0
    # uint8, then float64 needs 7 bytes of padding, complex128 needs 16-alignment.
    off, total = L.packed_offsets([1, 8, 16, 1, 2], [1, 8, 16, 1, 2])
    assert off.tolist() == [0, 8, 16, 32, 34] and total == 36
    # Zero-size tensors: at the cursor, unaligned, not moving it.
    off, total = L.packed_offsets([1, 0, 0, 8, 0], [1, 16, 8, 8, 16])
    assert off.tolist() == [0, 1, 1, 8, 16] and total == 16
    # Only zero-size tensors (regression: this raised IndexError).
    off, total = L.packed_offsets([0, 0, 0], [1, 8, 16])
    assert off.tolist() == [0, 0, 0] and total == 0
    # Leading zero-size tensors sit at 0.
    off, total = L.packed_offsets([0, 4], [16, 4])
    assert off.tolist() == [0, 0] and total == 4


def test_packed_offsets_rejects_bad_input():
    with pytest.raises(ValueError, match="entries"):
        L.packed_offsets([1, 2], [1])
    with pytest.raises(ValueError, match="non-negative"):
        L.packed_offsets([4, -1], [4, 1])
    for bad in (0, 3, 32, -2):
        with pytest.raises(ValueError, match="powers of two"):
            L.packed_offsets([4, 4], [4, bad])
    with pytest.raises(ValueError, match="one-dimensional"):
        L.packed_offsets([[1]], [[1]])
    with pytest.raises(ValueError, match="integers"):
        L.packed_offsets([1.5], [1])
    # A caller's bad argument is a ConfigurationError: a TensorferryError
    # (not a peer's TicketError or LayoutMismatchError) and still a ValueError.
    with pytest.raises(ConfigurationError) as info:
        L.packed_offsets([1], [3])
    assert isinstance(info.value, ValueError) and isinstance(info.value, TensorferryError)
    assert not isinstance(info.value, (TicketError, LayoutMismatchError))


def test_padded_path_chunk_boundaries():
    # Counts around the 64-tensor chunk of the vectorized scan.
    rng = np.random.default_rng(1)
    for count in (1, 2, 63, 64, 65, 127, 128, 129, 1000):
        a = rng.choice(np.array(ALIGNMENTS), size=count)
        n = a * rng.integers(1, 20, size=count)
        n[0] = 1  # makes padding certain
        off, total = L._scan_offsets(n.astype(np.int64), a.astype(np.int64))
        ref_off, ref_total = ref_packed_offsets(n, a)
        assert off.tolist() == ref_off and total == ref_total, count
        off2, total2 = L.packed_offsets(n, a)
        assert off2.tolist() == ref_off and total2 == ref_total


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    count=st.integers(1, 10_000),
    max_align=st.sampled_from([2, 4, 8, 16]),
    unaligned=st.booleans(),
)
def test_padded_path_mixed_alignments_up_to_10k(seed, count, max_align, unaligned):
    rng = np.random.default_rng(seed)
    choices = np.array([x for x in ALIGNMENTS if x <= max_align], dtype=np.int64)
    a = rng.choice(choices, size=count)
    numel = rng.integers(1, 300, size=count)
    # Either element-multiple sizes (real tensors) or any byte count.
    n = rng.integers(1, 3000, size=count).astype(np.int64) if unaligned else (a * numel).astype(np.int64)
    ref_off, ref_total = ref_packed_offsets(n, a)
    off, total = L._scan_offsets(n, a)
    assert off.tolist() == ref_off and total == ref_total
    off, total = L.packed_offsets(n, a)
    assert off.tolist() == ref_off and total == ref_total


def test_fast_path_no_padding():
    # float32 parameters: one cumulative sum, offsets are plain prefix sums.
    n = np.arange(1, 1001, dtype=np.int64) * 4
    a = np.full(1000, 4, dtype=np.int64)
    off, total = L.packed_offsets(n, a)
    assert off.tolist() == np.concatenate([[0], np.cumsum(n)[:-1]]).tolist()
    assert total == int(n.sum())


def test_100k_mixed_tensors_match_reference():
    rng = np.random.default_rng(7)
    count = 100_000
    a = rng.choice(np.array(ALIGNMENTS), size=count)
    n = a * rng.integers(0, 50, size=count)  # ~2% zero-size
    off, total = L.packed_offsets(n, a)
    ref_off, ref_total = ref_packed_offsets(n.tolist(), a.tolist())
    assert total == ref_total
    np.testing.assert_array_equal(off, ref_off)


# -- group_by_block: the receiver's inverse of the sender's split ----------------


@st.composite
def split_tensors(draw):
    tensors = draw(tensors_st)
    n, a = as_arrays(tensors)
    nonzero = np.flatnonzero(n > 0).tolist()
    # A block starts at a non-empty tensor (zero-size ones at a boundary stay
    # with the block before, as the sender places them); the first starts at 0.
    cuts = sorted(draw(st.sets(st.sampled_from(nonzero[1:]))) if len(nonzero) > 1 else set())
    bounds = [0] + cuts + [len(tensors)] if nonzero else [0]
    return n, a, bounds


def sender_blocks(n, a, bounds):
    blocks, offsets = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        off, total = L.packed_offsets(n[lo:hi], a[lo:hi])
        blocks.append(total)
        offsets.extend(off.tolist())
    return blocks, offsets


@settings(max_examples=300, deadline=None)
@given(case=split_tensors())
def test_group_by_block_inverts_the_sender_split(case):
    n, a, bounds = case
    blocks, offsets = sender_blocks(n, a, bounds)
    assert all(b > 0 for b in blocks)
    got = L.group_by_block(n, a, blocks)
    assert got.bounds.tolist() == bounds
    if not blocks:  # nothing but zero-size tensors: all at offset 0
        offsets = [0] * n.size
    assert got.offsets.tolist() == offsets
    # One block, when everything goes together, is packed_offsets itself.
    if n.any():
        off, total = L.packed_offsets(n, a)
        one = L.group_by_block(n, a, [total])
        assert one.bounds.tolist() == [0, n.size]
        assert one.offsets.tolist() == off.tolist()


@settings(max_examples=300, deadline=None)
@given(case=split_tensors(), data=st.data())
def test_group_by_block_wrong_sizes_raise_with_the_sizes(case, data):
    n, a, bounds = case
    blocks, _ = sender_blocks(n, a, bounds)
    if not blocks:
        blocks = [0]  # nothing to send, yet the receiver got a block
    b = data.draw(st.integers(0, len(blocks) - 1))
    delta = data.draw(st.integers(-blocks[b], 64).filter(lambda d: d != 0))
    wrong = list(blocks)
    wrong[b] += delta
    expect = ref_group_by_block(n.tolist(), a.tolist(), wrong)
    if b == len(blocks) - 1 or wrong[b] <= 0:
        # The last block must hold exactly what is left: no other size works.
        assert expect is None
    if expect is None:
        with pytest.raises(LayoutMismatchError) as info:
            L.group_by_block(n, a, wrong)
        msg = str(info.value)
        # The message names the first block that does not add up (the
        # perturbed one or a later one) with its exact byte count.
        m = re.match(r"block (\d+) has (-?[\d,]+) bytes", msg)
        assert m, msg
        at = int(m.group(1))
        assert at >= b and int(m.group(2).replace(",", "")) == wrong[at]
        assert "same layout" in msg or "at least one byte" in msg
        if "same layout" in msg:
            assert f"{sum(wrong):,} bytes in all" in msg
    else:
        # Another valid split (sizes that happen to land on tensor boundaries).
        got = L.group_by_block(n, a, wrong)
        assert got.bounds.tolist() == expect[0]
        assert got.offsets.tolist() == expect[1]


@settings(max_examples=200, deadline=None)
@given(tensors=tensors_st, blocks=st.lists(st.integers(-2, 3000), max_size=6))
def test_group_by_block_matches_reference_on_any_block_list(tensors, blocks):
    n, a = as_arrays(tensors)
    expect = ref_group_by_block(n.tolist(), a.tolist(), blocks)
    if expect is None:
        with pytest.raises(LayoutMismatchError):
            L.group_by_block(n, a, blocks)
    else:
        got = L.group_by_block(n, a, blocks)
        assert got.bounds.tolist() == expect[0]
        assert got.offsets.tolist() == expect[1]


def test_group_by_block_messages_and_edges():
    n = np.array([1, 8, 16], dtype=np.int64)  # packs to 32 bytes
    a = np.array([1, 8, 16], dtype=np.int64)
    with pytest.raises(LayoutMismatchError, match="block 0 has 33 bytes") as info:
        L.group_by_block(n, a, [33])
    assert "32" in str(info.value)
    with pytest.raises(LayoutMismatchError, match="left over"):
        L.group_by_block(n, a, [])
    with pytest.raises(LayoutMismatchError, match="at least one byte"):
        L.group_by_block(n, a, [0, 32])
    with pytest.raises(LayoutMismatchError):
        L.group_by_block(n, a, [16, 16, 1])  # a block more than there are tensors
    with pytest.raises(LayoutMismatchError):
        L.group_by_block([], [], [16])
    # Nothing sent: no blocks, no tensors or only empty ones.
    assert L.group_by_block([], [], []).bounds.tolist() == [0]
    g = L.group_by_block([0, 0], [4, 8], [])
    assert g.bounds.tolist() == [0] and g.offsets.tolist() == [0, 0]
    # The split after the uint8: each block packs from its own zero.
    g = L.group_by_block(n, a, [1, 8, 16])
    assert g.bounds.tolist() == [0, 1, 2, 3] and g.offsets.tolist() == [0, 0, 0]
    # A LayoutMismatchError is a ValueError too.
    assert issubclass(LayoutMismatchError, ValueError)


def test_group_by_block_many_blocks_large():
    rng = np.random.default_rng(3)
    count = 20_000
    a = rng.choice(np.array(ALIGNMENTS), size=count)
    n = a * rng.integers(0, 30, size=count)
    n[0] = 1
    nonzero = np.flatnonzero(n > 0)
    cuts = sorted(rng.choice(nonzero[1:], size=300, replace=False).tolist())
    bounds = [0] + cuts + [count]
    blocks, offsets = sender_blocks(n, a, bounds)
    got = L.group_by_block(n, a, blocks)
    assert got.bounds.tolist() == bounds
    assert got.offsets.tolist() == offsets


# -- merge_runs over one side: ranges that touch ------------------------------------


def merge_touching(offsets, lengths):
    """Byte ranges merged where one ends where the next starts: merge_runs
    with the same ranges as destinations and sources."""
    off = np.asarray(offsets, dtype=np.int64)
    runs = L.merge_runs(off, off, np.asarray(lengths, dtype=np.int64))
    return runs.dst, runs.nbytes, runs.heads


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.tuples(st.booleans(), st.integers(0, 64), st.integers(1, 100)), max_size=80),
)
def test_merge_runs_of_ranges_matches_reference(pieces):
    # Each range either touches the previous one or starts after a gap.
    offsets, lengths = [], []
    cur = 0
    for touch, gap, length in pieces:
        start = cur if touch else cur + gap + 1
        offsets.append(start)
        lengths.append(length)
        cur = start + length
    ro, rl, rs = merge_touching(offsets, lengths)
    eo, el, es = ref_merge_touching(offsets, lengths)
    assert ro.tolist() == eo and rl.tolist() == el and rs.tolist() == es
    assert int(rl.sum()) == sum(lengths)


@settings(max_examples=100, deadline=None)
@given(
    offsets=st.lists(st.integers(0, 200), max_size=40),
    data=st.data(),
)
def test_merge_runs_of_ranges_in_any_order(offsets, data):
    # Unsorted and overlapping ranges only merge when one ends where the next starts.
    lengths = data.draw(st.lists(st.integers(1, 50), min_size=len(offsets), max_size=len(offsets)))
    ro, rl, rs = merge_touching(offsets, lengths)
    eo, el, es = ref_merge_touching(offsets, lengths)
    assert ro.tolist() == eo and rl.tolist() == el and rs.tolist() == es


def test_merge_runs_of_a_packing_is_one_run():
    n = np.full(500, 4, dtype=np.int64)
    off, total = L.packed_offsets(n, np.full(500, 4))
    ro, rl, rs = merge_touching(off, n)
    assert ro.tolist() == [0] and rl.tolist() == [total] and rs.tolist() == [0]
    empty = merge_touching([], [])
    assert all(x.size == 0 for x in empty)
    with pytest.raises(ValueError):
        merge_touching([0, 1], [1])


# -- fit_prefix: the sender's half of group_by_block --------------------------------


@settings(max_examples=300, deadline=None)
@given(tensors=tensors_st, capacity=st.integers(0, 20_000))
def test_fit_prefix_is_consistent_with_group_by_block(tensors, capacity):
    n, a = as_arrays(tensors)
    k, used = L.fit_prefix(n, a, capacity)
    off, total = L.packed_offsets(n[:k], a[:k])
    assert used == total <= capacity
    if k < n.size:
        # Stopped at a tensor that does not fit; zero-size ones after the
        # last fitting tensor were all taken.
        assert n[k] > 0
        _, with_next = L.packed_offsets(n[: k + 1], a[: k + 1])
        assert with_next > capacity
    # The receiver, given the sender's block sizes, finds the same split.
    if used > 0:
        rest = L.packed_offsets(n[k:], a[k:])[1]
        blocks = [used] + ([rest] if k < n.size else [])
        g = L.group_by_block(n, a, blocks)
        assert g.bounds.tolist()[:2] == [0, k]


@settings(max_examples=150, deadline=None)
@given(tensors=tensors_st, capacities=st.lists(st.integers(1, 20_000), min_size=1, max_size=30))
def test_sender_split_by_fit_prefix_round_trips(tensors, capacities):
    # The pool's fragmented path: fill free blocks in turn with fit_prefix.
    n, a = as_arrays(tensors)
    start, blocks, bounds, offsets = 0, [], [0], []
    for cap in capacities:
        if start == n.size:
            break
        k, used = L.fit_prefix(n[start:], a[start:], cap)
        if k == 0 or used == 0:
            break
        offsets.extend(L.packed_offsets(n[start : start + k], a[start : start + k])[0].tolist())
        blocks.append(used)
        start += k
        bounds.append(start)
    if start < n.size or not blocks:
        return  # did not fit; the pool raises PoolExhaustedError here
    g = L.group_by_block(n, a, blocks)
    assert g.bounds.tolist() == bounds
    assert g.offsets.tolist() == offsets


def test_fit_prefix_edges():
    assert L.fit_prefix([], [], 100) == (0, 0)
    assert L.fit_prefix([0, 0, 4], [1, 1, 4], 0) == (2, 0)  # leading empties fit anywhere
    assert L.fit_prefix([4, 0, 0, 4], [4, 4, 4, 4], 4) == (3, 4)  # trailing empties follow
    assert L.fit_prefix([1, 8], [1, 8], 15) == (1, 1)  # padding counts
    assert L.fit_prefix([1, 8], [1, 8], 16) == (2, 16)
    # Larger than the first doubling window.
    n = np.full(1000, 4, dtype=np.int64)
    assert L.fit_prefix(n, np.full(1000, 4), 2001) == (500, 2000)


# -- import hygiene -----------------------------------------------------------------


def test_layout_imports_without_torch():
    code = (
        "import sys, tensorferry.wire.packing\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "assert 'numpy' in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
