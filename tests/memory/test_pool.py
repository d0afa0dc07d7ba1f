"""MemoryPool: packing, unpacking and lifetime, over every single-process edge case."""

from __future__ import annotations

import gc
import mmap
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import tensorferry
from tensorferry import (
    Block,
    Layout,
    LayoutMismatchError,
    MemoryPool,
    Packed,
    PoolExhaustedError,
    PoolStats,
    TensorferryError,
    UnsupportedTensorError,
    unpack,
)
from tensorferry.wire.packing import BLOCK_ALIGNMENT, packed_offsets
from tensorferry.wire._layout import DTYPES

pytestmark = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental",
    "ignore:The PyTorch API of nested tensors",
    "ignore:Sparse CSR tensor support",
    "ignore:torch.quantize_per_tensor",
)

ALL_DTYPES = [getattr(torch, name) for name in DTYPES]


# -- helpers ------------------------------------------------------------------------


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` as plain bytes (conj and neg bits resolved)."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.array(t, order="C"))  # ascontiguousarray makes 0-d 1-d
    t = t.detach().resolve_conj().resolve_neg().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8)


def assert_same(expected, got, path="obj"):
    """Same nesting (exact container types, key order and key types) and the
    same dtype, shape and bytes at every leaf."""
    if isinstance(expected, dict):
        assert type(got) is dict, path
        assert [(type(k), k) for k in got] == [(type(k), k) for k in expected], path
        for k in expected:
            assert_same(expected[k], got[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected), f"{path}: {type(expected).__name__} became {type(got).__name__}"
        assert len(got) == len(expected), path
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{path}[{i}]")
    else:
        assert isinstance(got, torch.Tensor), path
        if isinstance(expected, np.ndarray):
            expected = torch.from_numpy(np.array(expected, order="C"))
        assert got.dtype == expected.dtype, path
        assert got.shape == expected.shape, path
        assert not got.is_conj() and not got.is_neg(), path
        assert torch.equal(raw_bytes(got), raw_bytes(expected)), f"{path}: values differ"


def leaves_of(x):
    if isinstance(x, dict):
        return [t for v in x.values() for t in leaves_of(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in leaves_of(v)]
    return [x]


def round_trip(pool: MemoryPool, obj):
    """Pack, then rebuild twice: over the pool, and as a receiver would
    (cloned blocks and a layout decoded from bytes). Checks both."""
    packed = pool.pack(obj)
    local = pool.unpack(packed)
    layout = Layout.from_bytes(packed.layout.to_bytes())
    blocks = [pool.view(b).clone() for b in packed.blocks]
    remote = unpack(blocks, layout)
    assert_same(obj, local)
    assert_same(obj, remote)
    check_blocks(pool, packed)
    return packed, local, remote, blocks


def check_blocks(pool: MemoryPool, packed: Packed) -> None:
    cap = pool.stats().capacity_nbytes
    spans = sorted((b.offset, b.offset + b.nbytes) for b in packed.blocks)
    for lo, hi in spans:
        assert lo % BLOCK_ALIGNMENT == 0 and 0 <= lo < hi <= cap
    for (_, hi), (lo, _) in zip(spans, spans[1:]):
        assert hi <= lo


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def random_tensor(dtype, shape, gen):
    numel = int(np.prod(shape)) if shape else 1
    size = torch.zeros(0, dtype=dtype).element_size()
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    data = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    return data.view(dtype).reshape(shape)


@pytest.fixture
def pool():
    with MemoryPool(1 << 20) as p:
        yield p


# -- public API ---------------------------------------------------------------------


def test_all_is_exactly_the_public_api():
    assert tensorferry.__all__ == [
        "__version__",
        "MemoryPool",
        "Packed",
        "Block",
        "PoolStats",
        "unpack",
        "Lease",
        "Layout",
        "Ticket",
        "Sender",
        "Receiver",
        "SendPlan",
        "RecvPlan",
        "ShardedPlan",
        "Box",
        "new_token",
        "TensorferryError",
        "PoolExhaustedError",
        "PoolCreationError",
        "LayoutMismatchError",
        "UnsupportedTensorError",
        "TicketError",
        "TransferError",
        "PeerGoneError",
        "TransferTimeoutError",
        "AuthenticationError",
        "ProtocolError",
        "BackendUnavailableError",
        "ConfigurationError",
        "PlanStaleError",
        "PlanBusyError",
        "MonitorError",
        "NoSuchProcess",
        "ZombieProcess",
        "AccessDenied",
    ]
    for name in tensorferry.__all__:
        assert getattr(tensorferry, name) is not None
    assert sorted(dir(tensorferry)) == sorted(tensorferry.__all__)
    with pytest.raises(AttributeError):
        tensorferry.no_such_name  # noqa: B018
    assert issubclass(PoolExhaustedError, MemoryError) and issubclass(PoolExhaustedError, TensorferryError)
    assert issubclass(UnsupportedTensorError, ValueError) and issubclass(LayoutMismatchError, ValueError)


def test_import_tensorferry_does_not_import_torch():
    code = (
        "import sys, tensorferry\n"
        "assert 'torch' not in sys.modules, 'torch imported eagerly'\n"
        "assert issubclass(tensorferry.PoolExhaustedError, MemoryError)\n"
        "assert 'torch' not in sys.modules\n"
        "tensorferry.MemoryPool\n"
        "assert 'torch' in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# -- layout and packing -------------------------------------------------------------


def test_small_view_of_a_huge_storage_copies_only_the_view():
    huge = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB storage
    view = huge[1_000_000:1_000_100]
    rows = huge.view(4096, 4096)[10:12]
    sparse_rows = huge[::1_000_000]  # 17 elements, one per MiB, not contiguous
    with MemoryPool(1 << 20) as pool:  # far smaller than the storage
        pool.buffer.fill_(0xAB)
        packed, *_ = round_trip(pool, view)
        assert packed.nbytes == 400 and packed.copy_runs == 1 and packed.strided_copies == 0
        assert pool.stats().used_nbytes == 400
        (blk,) = packed.blocks
        # Only the view's bytes were written: the rest of the pool is untouched.
        untouched = torch.cat([pool.buffer[: blk.offset], pool.buffer[blk.offset + blk.nbytes :]])
        assert bool((untouched == 0xAB).all())
        packed.release()

        packed, *_ = round_trip(pool, [rows, sparse_rows])
        assert packed.nbytes == 2 * 4096 * 4 + 17 * 4
        assert pool.stats().used_nbytes == -(-packed.nbytes // 16) * 16
        assert packed.strided_copies == 1  # the strided view, counted
        packed.release()
        assert pool.stats().used_nbytes == 0


def test_mixed_dtypes_are_aligned_and_view_works(pool):
    gen = torch.Generator().manual_seed(0)
    obj = []
    for dt in ALL_DTYPES:
        # A 1-byte tensor before each one forces padding up to its element size.
        obj.append(random_tensor(torch.uint8, (1,), gen))
        obj.append(random_tensor(dt, (3,), gen))
    obj += [random_tensor(torch.float64, (2, 3), gen), random_tensor(torch.complex128, (5,), gen)]
    packed, local, remote, blocks = round_trip(pool, obj)
    assert len(packed.blocks) == 1
    for got in (local, remote):
        for t in got:
            size = t.element_size()
            assert t.data_ptr() % size == 0, t.dtype
            # Typed views of the received bytes work because of the alignment.
            assert torch.equal(t.view(torch.uint8).view(t.dtype).view(torch.uint8), t.view(torch.uint8))
    # The layout's offsets are each tensor's element size apart from the start.
    offsets, total = packed_offsets(packed.layout.nbytes, packed.layout.alignments)
    assert total == packed.blocks[0].nbytes
    assert all(o % a == 0 for o, a in zip(offsets.tolist(), packed.layout.alignments.tolist()))
    # The received blocks can be viewed as the widest dtype directly.
    assert blocks[0].data_ptr() % 16 == 0
    blocks[0][: total // 16 * 16].view(torch.complex128)


def test_pool_sized_exactly_to_the_data_fits():
    obj = [torch.tensor([7], dtype=torch.uint8), torch.tensor([1 + 2j], dtype=torch.complex128)]
    assert packed_offsets([1, 16], [1, 16])[1] == 32  # 15 bytes of padding inside
    with MemoryPool(32) as pool:
        packed, *_ = round_trip(pool, obj)
        s = pool.stats()
        assert (s.used_nbytes, s.free_nbytes, s.largest_free_nbytes, s.free_blocks) == (32, 0, 0, 0)
        packed.release()


def test_one_byte_too_small_raises_with_the_numbers():
    obj = [torch.tensor([1], dtype=torch.uint8), torch.tensor([2.0], dtype=torch.float64), torch.tensor([3], dtype=torch.uint8)]
    _, total = packed_offsets([1, 8, 1], [1, 8, 1])
    assert total == 17
    with MemoryPool(total) as pool:  # 17 rounds up to 32: fits
        round_trip(pool, obj)[0].release()
    with MemoryPool(total - 1) as pool:  # 16 bytes, one short
        before = pool.stats()
        with pytest.raises(PoolExhaustedError) as info:
            pool.pack(obj)
        e = info.value
        assert (e.requested_nbytes, e.free_nbytes, e.largest_free_nbytes, e.capacity_nbytes) == (17, 16, 16, 16)
        msg = str(e)
        assert "cannot hold 17 bytes" in msg and "16 of 16 bytes are free" in msg
        assert "largest free block is 16 bytes" in msg
        assert "capacity_nbytes" in msg and "release" in msg  # the remedy
        assert pool.stats() == before


def test_zero_size_tensors(pool):
    obj = [
        torch.arange(3, dtype=torch.uint8),
        torch.empty(0),
        torch.empty(3, 0, dtype=torch.float64),
        torch.arange(4, dtype=torch.float64),
        torch.empty(0, 5, dtype=torch.complex128),
        torch.empty(0, dtype=torch.bool),
    ]
    packed, local, remote, _ = round_trip(pool, obj)
    assert packed.num_tensors == 6 and packed.nbytes == 3 + 32
    for got in (local, remote):
        assert [tuple(t.shape) for t in got] == [(3,), (0,), (3, 0), (4,), (0, 5), (0,)]
    packed.release()
    # Only zero-size tensors: no blocks at all (regression: IndexError).
    only = {"a": torch.empty(0), "b": [torch.empty(2, 0, dtype=torch.int64)]}
    before = pool.stats()
    packed, *_ = round_trip(pool, only)
    assert packed.blocks == () and packed.nbytes == 0 and packed.copy_runs == 0
    assert pool.stats().used_nbytes == before.used_nbytes
    packed.release()


def test_zero_dim_scalars(pool):
    gen = torch.Generator().manual_seed(1)
    obj = {str(dt): random_tensor(dt, (), gen) for dt in ALL_DTYPES}
    packed, local, remote, _ = round_trip(pool, obj)
    assert all(t.dim() == 0 for t in local.values())
    assert all(t.dim() == 0 for t in remote.values())
    assert packed.num_tensors == len(ALL_DTYPES)
    packed.release()
    # A bare scalar as the whole object.
    packed, local, _, _ = round_trip(pool, torch.tensor(2.5))
    assert local.shape == () and local.item() == 2.5
    packed.release()


@pytest.mark.parametrize("obj", [[], {}, (), [[], {}, ()], {"a": {}, "b": [], "c": ((),)}], ids=repr)
def test_empty_objects(pool, obj):
    before = pool.stats()
    packed, local, remote, blocks = round_trip(pool, obj)
    assert packed.blocks == () and blocks == []
    assert (packed.num_tensors, packed.nbytes, packed.copy_runs, packed.strided_copies) == (0, 0, 0, 0)
    assert pool.stats().used_nbytes == before.used_nbytes
    packed.release()
    assert pool.stats().live_objects == before.live_objects


def test_non_contiguous_tensors_are_copied_and_counted(pool):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    c = torch.arange(12, dtype=torch.float32).to(torch.complex64).reshape(3, 4) * (1 + 1j)
    cases = {
        "transposed": x.t(),
        "strided slice": x[:, ::2],
        "column": x[:, 1],
        "permuted": torch.arange(60, dtype=torch.int16).reshape(3, 4, 5).permute(2, 0, 1),
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "expanded scalar": torch.tensor(5, dtype=torch.int64).expand(4, 3),
        "conj": c.conj(),
        "conj transposed": c.t().conj(),
        "neg view": torch._neg_view(torch.arange(5, dtype=torch.float64)),
        "bf16 strided": torch.arange(10, dtype=torch.bfloat16)[::3],
        "bool strided": (torch.arange(10) % 3 == 0)[1::2],
    }
    contiguous = {"plain": torch.arange(6, dtype=torch.float32), "row": x[1]}
    obj = {**cases, **contiguous}
    packed, local, remote, _ = round_trip(pool, obj)
    assert packed.strided_copies == len(cases)
    assert packed.copy_runs == len(contiguous)
    for got in (local, remote):
        for k, v in cases.items():
            assert got[k].is_contiguous()
            assert torch.equal(got[k], v.resolve_conj().resolve_neg()), k
        assert torch.equal(got["conj"], torch.conj_physical(c))
        assert torch.equal(got["neg view"], -torch.arange(5, dtype=torch.float64))
    packed.release()


def test_overlapping_and_duplicate_views(pool):
    base = torch.arange(100, dtype=torch.int32)
    a = base[0:50]
    obj = [a, base[25:75], base, base[10:20], a, base[49:51], base.view(10, 10)[:, 3]]
    packed, local, remote, _ = round_trip(pool, obj)
    # The same view twice (obj[0], obj[4]) is packed once and unpacked as one
    # tensor under both positions; overlapping views are packed apart.
    assert packed.nbytes == sum(t.numel() * 4 for t in obj) - a.numel() * 4
    assert packed.layout.aliases.tolist() == [[4, 0]]
    for got in (local, remote):
        assert got[4] is got[0] and got[2] is not got[0]
    local[0][0] = -1
    assert local[4][0] == -1 and local[2][0] == 0 and base[0] == 0
    # Across objects: two packs of views of one storage are both right.
    other, *_ = round_trip(pool, {"tail": base[60:], "head": base[:70]})
    assert torch.equal(pool.unpack(packed)[1], base[25:75])
    other.release()
    packed.release()


def test_skipped_tensors_inside_a_run_of_views(pool):
    """Zero-size tensors and aliases take no bytes, so the tensors around
    them touch in the block; the views must still land in their own
    positions (a 1-D run once filled the zero-size one's place and left the
    last None)."""
    w = torch.arange(6.0)
    obj = [torch.ones(10), torch.empty(0), torch.full((2,), 2.0), w, torch.zeros(2, 3), torch.empty(0, 3), torch.ones(2, 3), w, torch.ones(3)]
    packed, local, remote, _ = round_trip(pool, obj)
    for got in (local, remote):
        assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in obj]
        assert got[7] is got[3]
    packed.release()


def test_views_of_one_flat_buffer_are_one_copy(pool):
    flat = torch.randn(20_000)
    views = [flat[i * 20 : (i + 1) * 20] for i in range(1000)]
    packed, *_ = round_trip(pool, views)
    assert packed.copy_runs == 1 and len(packed.blocks) == 1
    packed.release()
    # Reshaped views of the same buffer: still adjacent bytes, still one run.
    shaped = [flat[i * 20 : (i + 1) * 20].view(4, 5) for i in range(100)]
    packed, *_ = round_trip(pool, shaped)
    assert packed.copy_runs == 1
    packed.release()
    # Reversed order or alternating storages: nothing is adjacent.
    packed, *_ = round_trip(pool, views[::-1][:100])
    assert packed.copy_runs == 100
    packed.release()
    other = torch.randn(2000)
    mixed = [t for i in range(50) for t in (flat[i * 20 : (i + 1) * 20], other[i * 20 : (i + 1) * 20])]
    packed, *_ = round_trip(pool, mixed)
    assert packed.copy_runs == 100
    packed.release()
    # Views of different dtypes over adjacent bytes of one storage are raw bytes: one run.
    raw = torch.arange(64, dtype=torch.uint8)
    packed, *_ = round_trip(pool, [raw[0:16].view(torch.float32), raw[16:32].view(torch.int64), raw[32:40]])
    assert packed.copy_runs == 1
    packed.release()
    # Adjacent in the source but not in the pool (a byte before them shifts
    # the int16 view onto a padded offset): two runs, or the copy lands a byte off.
    packed, *_ = round_trip(pool, [torch.ones(1, dtype=torch.uint8), raw[0:2], raw[2:6].view(torch.int16)])
    assert packed.copy_runs == 3
    packed.release()


def test_views_of_one_buffer_split_over_fragmented_blocks():
    # Adjacent in the source, but cut into several pool blocks: one copy per
    # block at most, never a run that spills from one block into the next.
    with MemoryPool(16 << 10) as pool:
        small = [pool.pack(torch.zeros(256)) for _ in range(16)]  # 1 KiB each
        for p in small[::2]:
            p.release()
        flat = torch.arange(1500, dtype=torch.float32)  # 6000 B > any 1 KiB hole
        views = [flat[i * 50 : (i + 1) * 50] for i in range(30)]
        packed, *_ = round_trip(pool, views)
        assert len(packed.blocks) > 1
        assert packed.copy_runs == len(packed.blocks)
        for p in small[1::2]:
            assert bool((pool.unpack(p) == 0).all())  # the neighbours were not overwritten
        packed.release()


def test_many_views_round_trip():
    flat = torch.arange(200_000, dtype=torch.float32)
    views = [flat[i * 10 : (i + 1) * 10] for i in range(20_000)]
    with MemoryPool(1 << 20) as big:
        packed, local, remote, _ = round_trip(big, views)
        assert packed.num_tensors == 20_000 and packed.copy_runs == 1
        assert len(packed.layout.to_bytes()) < 10_000


def test_nested_state_dict_keeps_its_structure(pool):
    t = lambda *s: torch.randn(*s)  # noqa: E731
    sd = {
        "model": {
            "layers": [{"w": t(4, 4), "b": t(4)}, {"w": t(4, 4), "b": t(4), "extra": {"scale": t(1)}}],
            "head": (t(3), t(3, 2)),
            "norms": [t(2), (t(2), [t(1)])],
        },
        "step": torch.tensor(5),
        3: [t(2), ()],
        -7: {},
        "optim": {"state": {0: {"exp_avg": t(4, 4)}, 1: {"exp_avg": t(4)}}, "param_groups": [{"lr": torch.tensor(0.1)}]},
        "ключ 🙂": t(2),
    }
    packed, local, remote, _ = round_trip(pool, sd)
    assert type(local["model"]["head"]) is tuple and type(remote["model"]["norms"][1]) is tuple
    assert list(remote["optim"]["state"]) == [0, 1] and type(next(iter(remote["optim"]["state"]))) is int
    packed.release()


def test_parameters_and_requires_grad(pool):
    params = [torch.nn.Parameter(torch.randn(3, 3)) for _ in range(4)]
    grads = {"a": torch.randn(2, requires_grad=True) * 2, "b": torch.nn.Parameter(torch.randn(2))}
    for obj in (params, grads):
        packed, local, *_ = round_trip(pool, obj)
        packed.release()


def test_numpy_arrays(pool):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    ro = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
    ro_scalar = np.array(2.5)
    ro_scalar.flags.writeable = False
    assert not ro.flags.writeable
    cases = {
        "plain": np.arange(5, dtype=np.int64),
        "negative strides": a[::-1],
        "both negative": a[::-1, ::-2],
        "read-only": ro,
        # Regression: staged through ascontiguousarray, a 0-d array became 1-d.
        "read-only scalar": ro_scalar,
        "negative-stride 1-element": np.arange(3.0)[2:1:-1],
        "fortran": np.asfortranarray(a),
        "strided": a[:, ::2],
        "f16": np.ones(3, dtype=np.float16),
        "bool": np.array([True, False, True]),
        "c128": np.array([1 + 2j, 3 - 4j]),
        "u32": np.arange(4, dtype=np.uint32),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 3)),
    }
    obj = {**cases, "torch": torch.ones(2)}
    packed, local, remote, _ = round_trip(pool, obj)
    for got in (local, remote):
        for k, v in cases.items():
            np.testing.assert_array_equal(got[k].numpy(), v)
    # Staged (negative strides, read-only) and strided (fortran order, step 2)
    # copies are all counted.
    assert packed.strided_copies == 7
    packed.release()


@pytest.mark.parametrize(
    "make, path, hint",
    [
        (lambda: {"a": [torch.ones(1), torch.eye(2).to_sparse()]}, "obj['a'][1]", "to_dense"),
        (lambda: [torch.ones(1), torch.eye(2).to_sparse()], "obj[1]", "to_dense"),
        (lambda: {"csr": torch.eye(2).to_sparse_csr()}, "obj['csr']", "to_dense"),
        (lambda: {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, "obj['q']", "dequantize"),
        (lambda: {"m": [torch.empty(3, device="meta")]}, "obj['m'][0]", "meta"),
        (lambda: {"m0": torch.empty(0, device="meta")}, "obj['m0']", "meta"),
        (lambda: {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, "obj['n']", "unbind"),
        (lambda: {"s": "text"}, "obj['s']", "not a tensor"),
        (lambda: [torch.ones(1), None], "obj[1]", "not a tensor"),
        (lambda: {"i": 3}, "obj['i']", "not a tensor"),
        (lambda: (torch.ones(1), 2.5), "obj[1]", "not a tensor"),
        (lambda: {(1, 2): torch.ones(1)}, "(1, 2)", "keys must be str or int"),
        (lambda: {"x": {None: torch.ones(1)}}, "obj['x'] has key None", "keys must be str or int"),
        (lambda: {True: torch.ones(1)}, "True", "keys must be str or int"),
        (lambda: {10**40: torch.ones(1)}, "integer key", "str key"),
        (lambda: {"o": np.array([object()])}, "obj['o']", "numeric dtype"),
        (lambda: {"u": np.array(["a"])}, "obj['u']", "numeric dtype"),
        (lambda: {"be": np.ones(2, dtype=">f4")}, "obj['be']", "cannot read"),
    ],
)
def test_unsupported_leaves_name_the_path_and_change_nothing(pool, make, path, hint):
    keep = pool.pack([torch.ones(4)])
    before = pool.stats()
    with pytest.raises(UnsupportedTensorError) as info:
        pool.pack(make())
    msg = str(info.value)
    assert path in msg and hint in msg, msg
    assert isinstance(info.value, ValueError) and isinstance(info.value, TensorferryError)
    assert pool.stats() == before
    keep.release()


def test_every_bad_leaf_is_named(pool):
    with pytest.raises(UnsupportedTensorError) as info:
        pool.pack({"a": "x", "b": [torch.ones(1), None], "c": {"d": 1}})
    msg = str(info.value)
    assert "3 leaves" in msg and "obj['a']" in msg and "obj['b'][1]" in msg and "obj['c']['d']" in msg
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(UnsupportedTensorError, match="deeper"):
        pool.pack(cycle)
    assert pool.stats().used_nbytes == 0 and pool.stats().live_objects == 0


# -- pool and lifetime ---------------------------------------------------------------


def test_fragmented_pool_spans_several_blocks():
    with MemoryPool(64 << 10) as pool:
        small = [pool.pack(torch.full((256,), float(i))) for i in range(64)]  # 1 KiB each
        assert pool.stats().free_nbytes == 0
        for p in small[::2]:
            p.release()
        s = pool.stats()
        assert (s.free_nbytes, s.largest_free_nbytes, s.free_blocks) == (32 << 10, 1024, 32)
        gen = torch.Generator().manual_seed(2)
        # ~24 KB in mixed dtypes with padding and zero-size tensors: larger
        # than any free block, smaller than the free total.
        obj = []
        for i in range(60):
            obj.append(random_tensor([torch.uint8, torch.float64, torch.complex128, torch.bfloat16][i % 4], (i % 7 + 3,), gen))
            if i % 9 == 0:
                obj.append(torch.empty(0, dtype=torch.float64))
            obj.append(torch.randn(80, generator=gen))
        total = packed_offsets(*[np.array(x) for x in zip(*[(t.numel() * t.element_size(), t.element_size()) for t in obj])])[1]
        assert 1024 < total < 32 << 10
        packed, local, remote, blocks = round_trip(pool, obj)
        assert len(packed.blocks) > 1
        assert sum(b.nbytes for b in packed.blocks) >= packed.nbytes
        # The new blocks do not overlap the objects still alive, whose data is intact.
        taken = [(b.offset, b.offset + b.nbytes) for p in small[1::2] for b in p.blocks]
        for b in packed.blocks:
            assert all(b.offset + b.nbytes <= lo or b.offset >= hi for lo, hi in taken)
        for i, p in enumerate(small[1::2]):
            assert bool((pool.unpack(p) == float(2 * i + 1)).all())
        # unpack over different blocks: the receiver's blocks live elsewhere.
        again = unpack([b.clone() for b in blocks], Layout.from_bytes(packed.layout.to_bytes()))
        assert_same(obj, again)
        packed.release()
        for p in small[1::2]:
            p.release()
        s = pool.stats()
        assert (s.used_nbytes, s.free_blocks, s.largest_free_nbytes, s.live_objects) == (0, 1, 64 << 10, 0)


def test_out_of_memory_is_atomic_including_a_repack():
    with MemoryPool(4096) as pool:
        x = {"a": torch.arange(600, dtype=torch.float32), "b": torch.arange(300, dtype=torch.int16)}
        packed = pool.pack(x)
        before = pool.stats()
        snapshot = pool.buffer.clone()
        # The same object again, while it still owns its blocks.
        with pytest.raises(PoolExhaustedError) as info:
            pool.pack(x)
        e = info.value
        assert e.requested_nbytes == 3000
        assert (e.free_nbytes, e.largest_free_nbytes, e.capacity_nbytes) == (before.free_nbytes, before.largest_free_nbytes, 4096)
        assert f"{before.free_nbytes:,}" in str(e) and "3,000" in str(e)
        assert pool.stats() == before
        assert torch.equal(pool.buffer, snapshot)
        assert_same(x, pool.unpack(packed))
        # Too big for the whole pool, and tensors too big for any free block.
        for obj in (torch.zeros(2000), [torch.zeros(100), torch.zeros(300)]):
            with pytest.raises(PoolExhaustedError):
                pool.pack(obj)
            assert pool.stats() == before
        packed.release()
        assert pool.stats().used_nbytes == 0


def test_a_failing_copy_returns_its_blocks(monkeypatch):
    with MemoryPool(4096) as pool:
        before = pool.stats()

        def boom(*args, **kwargs):
            raise RuntimeError("copy failed")

        monkeypatch.setattr(pool, "_copy_in", boom)
        with pytest.raises(RuntimeError, match="copy failed"):
            pool.pack([torch.ones(10), torch.ones(5)])
        assert pool.stats() == before


def test_release_free_and_unpack_rules():
    with MemoryPool(4096) as a, MemoryPool(4096) as b:
        p = a.pack([torch.ones(8)])
        assert isinstance(p, Packed) and p.blocks and isinstance(p.blocks[0], Block)
        assert not p.released
        with pytest.raises(ValueError, match="another pool"):
            b.free(p)
        with pytest.raises(ValueError):
            b.unpack(p)
        assert a.stats().live_objects == 1 and b.stats().live_objects == 0
        p.release()
        after = a.stats()
        assert p.released and after.used_nbytes == 0 and after.live_objects == 0
        p.release()  # twice: harmless
        a.free(p)
        assert a.stats() == after
        with pytest.raises(ValueError, match="released"):
            a.unpack(p)
        with a.pack({"x": torch.ones(3)}) as q:
            assert a.stats().live_objects == 1
        assert q.released and a.stats().used_nbytes == 0


def test_stats_fields():
    with MemoryPool(100) as pool:
        s = pool.stats()
        assert isinstance(s, PoolStats)
        assert s == PoolStats(112, 0, 112, 112, 1, 0, 0, 0)  # capacity rounded up to 16
        p = pool.pack([torch.ones(5, dtype=torch.float32), torch.ones(1, dtype=torch.uint8)])
        s = pool.stats()
        assert (s.used_nbytes, s.free_nbytes, s.largest_free_nbytes, s.free_blocks) == (32, 80, 80, 1)
        assert (s.live_objects, s.packs, s.packed_nbytes) == (1, 1, 21)
        p.release()
        s = pool.stats()
        assert (s.used_nbytes, s.live_objects, s.packs, s.packed_nbytes) == (0, 0, 1, 21)
        assert "MemoryPool(capacity_nbytes=112" in repr(pool)
    for bad in (0, -16):
        with pytest.raises(ValueError):
            MemoryPool(bad)


def test_allocate_free_loop_leaks_nothing():
    with MemoryPool(1 << 20) as pool:
        x = torch.randn(64, 64)
        obj = {"w": x, "t": x.t(), "parts": [x[i] for i in range(8)], "s": torch.tensor(1)}
        for _ in range(100):  # warm up allocator caches and lazy imports
            p = pool.pack(obj)
            pool.unpack(p)
            p.release()
            pool.free(pool.pack(obj))
        gc.collect()
        fds, rss = fd_count(), rss_bytes()
        for _ in range(2000):
            p = pool.pack(obj)
            pool.unpack(p)
            p.release()
        gc.collect()
        s = pool.stats()
        assert (s.used_nbytes, s.live_objects, s.free_blocks) == (0, 0, 1)
        assert s.packs == 2200
        assert fd_count() == fds
        assert rss_bytes() - rss < 8 << 20


def test_pools_close_their_memfd():
    fds = fd_count()
    for _ in range(50):
        with MemoryPool(1 << 16) as pool:
            pool.pack([torch.ones(4)])
    assert fd_count() == fds
    pool.close()  # twice: harmless
    with pytest.raises(ValueError, match="closed"):
        pool.pack([torch.ones(1)])
    # A view that outlives its pool keeps the mapping readable (regression:
    # close() unmapped it under the view, a segfault), and the mapping goes
    # with the last view.
    def mapped(name):
        with open("/proc/self/maps") as f:
            return sum(f"/memfd:{name}" in line for line in f)

    p2 = MemoryPool(4096, name="tf-test-outlive")
    view = p2.unpack(p2.pack(torch.arange(4.0)))
    p2.close()
    assert mapped("tf-test-outlive") == 1
    assert view.tolist() == [0.0, 1.0, 2.0, 3.0]
    del view
    gc.collect()
    assert mapped("tf-test-outlive") == 0
    p3 = MemoryPool(4096, name="tf-test-close")
    assert mapped("tf-test-close") == 1
    p3.close()
    assert mapped("tf-test-close") == 0


def _shm_names() -> set[str]:
    """/dev/shm's entries, less the semaphores Python's multiprocessing makes
    there (``sem.mp-*``): other processes on the machine (another test run,
    a benchmark) come and go with theirs, and a pool makes none."""
    names = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return {n for n in names if not n.startswith("sem.mp-")}


def test_pool_is_a_memfd_shared_with_a_child_process():
    shm = _shm_names()
    with MemoryPool(1 << 16) as pool:
        assert pool.fd is not None
        assert os.readlink(f"/proc/self/fd/{pool.fd}").startswith("/memfd:")
        assert not os.get_inheritable(pool.fd)  # only shared on purpose
        assert _shm_names() == shm  # nothing named appears in /dev/shm
        packed = pool.pack({"a": torch.arange(1000, dtype=torch.int32), "b": torch.ones(3, dtype=torch.float64)})
        (blk,) = packed.blocks
        want = bytes(pool.view(blk).numpy())
        code = (
            "import mmap, sys\n"
            "fd, off, n = map(int, sys.argv[1:])\n"
            "m = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)\n"
            "sys.stdout.write(m[off:off + n].hex())\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(pool.fd), str(blk.offset), str(blk.nbytes)],
            pass_fds=(pool.fd,),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert bytes.fromhex(out.stdout) == want
        # What the child reads is the packed object.
        got = unpack([torch.frombuffer(bytearray(bytes.fromhex(out.stdout)), dtype=torch.uint8)], packed.layout)
        assert torch.equal(got["a"], torch.arange(1000, dtype=torch.int32))
        # Writes through the fd are seen in the pool: one shared buffer.
        with mmap.mmap(pool.fd, 0, flags=mmap.MAP_SHARED) as m:
            m[blk.offset : blk.offset + 4] = (7).to_bytes(4, "little")
        assert pool.unpack(packed)["a"][0] == 7


def test_a_killed_process_leaves_nothing_behind():
    shm = _shm_names()
    code = (
        "import os, sys, time\n"
        "import torch\n"
        "from tensorferry import MemoryPool\n"
        "p = MemoryPool(1 << 20)\n"
        "p.pack(torch.ones(1000))\n"
        "print(p.fd, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        fd = int(child.stdout.readline())
        assert os.readlink(f"/proc/{child.pid}/fd/{fd}").startswith("/memfd:tensorferry")
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    # The kernel freed the memfd with the process: no file to clean up.
    assert _shm_names() == shm


def test_threads_pack_and_release_concurrently():
    errors = []
    # Small enough that objects often need the fragmented (several-block) path.
    with MemoryPool(16 << 10) as pool:

        def worker(seed):
            gen = torch.Generator().manual_seed(seed)
            try:
                for i in range(150):
                    obj = [torch.randn(int(torch.randint(1, 300, (1,), generator=gen)), generator=gen) for _ in range(4)]
                    try:
                        p = pool.pack(obj)
                    except PoolExhaustedError:
                        continue
                    assert_same(obj, pool.unpack(p))
                    p.release()
            except Exception as exc:  # a thread's exception is lost otherwise
                errors.append(exc)

        # A few long-lived objects keep the pool fragmented.
        keep = [pool.pack(torch.zeros(200)) for _ in range(20)]
        for k in keep[::2]:
            k.release()
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for k in keep[1::2]:
            k.release()
        assert not errors, errors[:3]
        s = pool.stats()
        assert (s.used_nbytes, s.live_objects, s.free_blocks) == (0, 0, 1)


@pytest.mark.gpu
def test_pack_and_unpack_on_cuda():
    dev = torch.device("cuda")
    with MemoryPool(1 << 20, device=dev) as pool:
        assert pool.fd is None and pool.buffer.device.type == "cuda"
        gen = torch.Generator().manual_seed(3)
        flat = torch.randn(10_000, device=dev)
        obj = {
            "views": [flat[i * 100 : (i + 1) * 100] for i in range(50)],
            "mixed": [random_tensor(dt, (5,), gen).to(dev) for dt in (torch.uint8, torch.float64, torch.complex128, torch.bfloat16)],
            "strided": flat.view(100, 100).t(),
            "from cpu": torch.arange(7, dtype=torch.int64),
            "empty": torch.empty(0, device=dev),
        }
        packed = pool.pack(obj)
        assert packed.copy_runs >= 1 and packed.strided_copies == 1
        local = pool.unpack(packed)
        assert local["views"][0].device.type == "cuda"
        assert torch.equal(local["views"][3], obj["views"][3])
        assert torch.equal(local["strided"], obj["strided"])
        assert torch.equal(local["from cpu"].cpu(), obj["from cpu"])
        blocks = [pool.view(b).clone() for b in packed.blocks]
        remote = unpack(blocks, Layout.from_bytes(packed.layout.to_bytes()))
        for a, b in zip(leaves_of(obj), leaves_of(remote)):
            assert b.device.type == "cuda" and b.dtype == a.dtype and b.shape == a.shape
            assert torch.equal(raw_bytes(a), raw_bytes(b))
            assert b.data_ptr() % b.element_size() == 0
        packed.release()
        assert pool.stats().used_nbytes == 0


def test_unpack_runs_of_equal_and_mixed_shapes_round_trip():
    """Views are made in bulk per stretch of equal shapes; every mix of
    stretches (lengths 1..5, 0-d, 1-D, 3-D, dtype changes) must come back exact."""
    import random

    rng = random.Random(7)
    shapes = [(), (3,), (2, 3), (2, 2, 2), (5,), (1, 4)]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.int16, torch.float64]
    objs = []
    for _ in range(60):
        shape, dtype = rng.choice(shapes), rng.choice(dtypes)
        for _ in range(rng.randint(1, 5)):
            objs.append((torch.randn(shape) * 100).to(dtype))
    with MemoryPool(1 << 20) as pool:
        packed = pool.pack(objs)
        out = pool.unpack(packed)
        assert len(out) == len(objs)
        for a, b in zip(objs, out):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        packed.release()


def test_reserve_leases_raw_bytes_counted_in_stats_and_released_once(pool):
    """The pool's raw-memory API: a lease is counted while alive, its
    release is idempotent, an owned view releases it with its storage,
    and a request too large is a PoolExhaustedError with nothing taken."""
    import gc

    before = pool.stats()
    with pool.reserve(4096) as lease:
        assert pool.stats().leases == before.leases + 1
        assert pool.stats().used_nbytes == before.used_nbytes + 4096
        lease.view().fill_(7)
        assert int(pool.buffer[lease.offset : lease.offset + 4096].sum()) == 7 * 4096
    lease.release()  # twice: harmless
    assert pool.stats().leases == before.leases and pool.stats().used_nbytes == before.used_nbytes
    view = pool.reserve(8192).owned_view()
    part = view[100:200].view(torch.int32)  # a derived view keeps the storage
    del view
    gc.collect()
    assert pool.stats().leases == before.leases + 1
    del part
    gc.collect()
    assert pool.stats().leases == before.leases and pool.stats().used_nbytes == before.used_nbytes
    with pytest.raises(PoolExhaustedError):
        pool.reserve(pool.capacity_nbytes * 2)
    assert pool.stats() == before
    big = pool.reserve_up_to(pool.capacity_nbytes * 2, min_nbytes=16)
    assert big is not None and big.nbytes == before.largest_free_nbytes
    assert pool.reserve_up_to(16, min_nbytes=16) is None  # nothing left
    big.release()
    assert pool.stats() == before


def test_unpack_takes_what_pack_returns(pool):
    obj = {"a": torch.arange(6.0).view(2, 3), "b": [torch.ones(2, dtype=torch.int64)]}
    packed = pool.pack(obj)
    for got in (tensorferry.unpack(packed), tensorferry.unpack([pool.view(b) for b in packed.blocks], packed.layout)):
        assert torch.equal(got["a"], obj["a"]) and torch.equal(got["b"][0], obj["b"][0])
    with pytest.raises(LayoutMismatchError, match="needs a layout"):
        tensorferry.unpack([pool.view(b) for b in packed.blocks])
    packed.release()
