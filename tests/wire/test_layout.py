"""Layout.to_bytes / from_bytes: round trips, size, and hostile bytes."""

from __future__ import annotations

import struct
import time
import tracemalloc
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorferry.tensors import flatten, inspect_leaves, torch_dtype, unflatten
from tensorferry.errors import LayoutMismatchError, TensorferryError, TicketError
from tensorferry.wire._layout import _HEADER, _MAGIC, DTYPES, MAX_LAYOUT_NBYTES, Layout, TreeOp

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

TORCH_DTYPES = [getattr(torch, name) for name in DTYPES if isinstance(getattr(torch, name, None), torch.dtype)]


def layout_of(obj) -> Layout:
    leaves, ops, counts, keys, _ = flatten(obj)
    return inspect_leaves(obj, leaves, ops, counts, keys).layout


def direct_layout(codes, shapes, ops=None, counts=None, keys=()) -> Layout:
    """A Layout built from arrays (no tensors): a flat list of len(codes) tensors by default."""
    ndims = np.array([len(s) for s in shapes], dtype=np.uint8)
    dims = np.array([d for s in shapes for d in s], dtype=np.int64)
    if ops is None:
        ops, counts = [TreeOp.LIST, TreeOp.LEAVES], [len(codes), len(codes)]
    return Layout(
        np.asarray(codes, dtype=np.uint8),
        ndims,
        dims,
        np.asarray(ops, dtype=np.uint8),
        np.asarray(counts, dtype=np.int64),
        tuple(keys),
    )


def forge(codes=(), ndims=(), dims=(), ops=(), counts=(), kinds=(), lens=(), blob=b"", *, dims32=True, flags=None, version=1):
    """Bytes with a correct header and checksum around an arbitrary body:
    what a hostile peer (not line noise) would send."""
    body = b"".join(
        (
            bytes(codes),
            bytes(ndims),
            np.asarray(dims, dtype="<u4" if dims32 else "<i8").tobytes(),
            bytes(ops),
            np.asarray(counts, dtype="<u4").tobytes(),
            bytes(kinds),
            np.asarray(lens, dtype="<u4").tobytes(),
            blob,
        )
    )
    fl = (2 if dims32 else 0) if flags is None else flags
    header = _HEADER.pack(_MAGIC, version, fl, len(codes), len(dims), len(ops), len(kinds), len(blob), len(body), zlib.crc32(body))
    return header + body


def structure(x):
    """The nesting with every tensor replaced by (dtype, shape)."""
    if isinstance(x, dict):
        return ("dict", [(type(k), k, structure(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [structure(v) for v in x])
    return ("tensor", x.dtype, tuple(x.shape))


# -- round trips ------------------------------------------------------------------

leaf_st = st.builds(
    lambda dt, shape: torch.zeros(shape, dtype=dt),
    st.sampled_from(TORCH_DTYPES),
    st.lists(st.integers(0, 4), max_size=4).map(tuple),
)
key_st = st.one_of(st.text(max_size=12), st.integers(-(2**63), 2**63), st.sampled_from(["", "é", "ключ", "🙂", "a.b", "0"]))
obj_st = st.recursive(
    leaf_st,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(key_st, kids, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=obj_st)
def test_round_trip_any_nesting(obj):
    lay = layout_of(obj)
    data = lay.to_bytes()
    back = Layout.from_bytes(data)
    assert back.same_as(lay)
    assert back.to_bytes() == data
    assert back.nbytes.tolist() == lay.nbytes.tolist()
    assert back.alignments.tolist() == lay.alignments.tolist()
    leaves, *_ = flatten(obj)
    assert back.dtype_names() == [str(t.dtype).removeprefix("torch.") for t in leaves]
    assert back.shapes() == [tuple(t.shape) for t in leaves]
    # Keys keep their type (1 and "1" are different keys) and their order.
    rebuilt = unflatten(back, leaves)
    assert structure(rebuilt) == structure(obj)
    # Other buffer types decode alike.
    assert Layout.from_bytes(bytearray(data)).same_as(lay)
    assert Layout.from_bytes(memoryview(data)).same_as(lay)


def test_round_trip_special_keys_and_shapes():
    t = torch.zeros(2)
    obj = {"\ud800lone surrogate": t, "": t, 0: t, -1: t, 2**63: t, "1": t, 1: t, "ключ🙂": {"x": (t,)}}
    lay = layout_of(obj)
    back = Layout.from_bytes(lay.to_bytes())
    assert back.keys == ("\ud800lone surrogate", "", 0, -1, 2**63, "1", 1, "ключ🙂", "x")
    assert [type(k) for k in back.keys] == [str, str, int, int, int, str, int, str, str]
    # Dimensions above 2^32 switch to 8-byte dims.
    big = direct_layout([DTYPES["uint8"][0], DTYPES["float32"][0]], [(1 << 33, 0), (3, 1 << 40)])
    back = Layout.from_bytes(big.to_bytes())
    assert back.same_as(big) and back.shapes() == [(1 << 33, 0), (3, 1 << 40)]
    # A bare tensor, a 0-dim tensor, an empty list and an empty dict.
    for obj in (torch.zeros(3, 4), torch.tensor(1.5), [], {}, [[], {}, ()], {"a": {}}):
        lay = layout_of(obj)
        back = Layout.from_bytes(lay.to_bytes())
        assert back.same_as(lay)
        assert structure(unflatten(back, flatten(obj)[0])) == structure(obj)


def test_every_dtype_code_round_trips():
    for dt in TORCH_DTYPES:
        name = str(dt).removeprefix("torch.")
        code, size = DTYPES[name]
        lay = layout_of([torch.zeros(3, dtype=dt)])
        back = Layout.from_bytes(lay.to_bytes())
        assert back.dtype_names() == [name]
        assert int(back.alignments[0]) == size == torch.zeros(0, dtype=dt).element_size()
        assert torch_dtype(code) is dt
        assert int(back.nbytes[0]) == 3 * size


def test_100k_tensor_list_is_small():
    rng = np.random.default_rng(0)
    n = 100_000
    codes = rng.choice([DTYPES[d][0] for d in ("float32", "bfloat16", "int64", "uint8")], size=n).astype(np.uint8)
    ndims = rng.integers(1, 3, size=n).astype(np.uint8)
    dims = rng.integers(1, 5000, size=int(ndims.sum())).astype(np.int64)
    lay = Layout(codes, ndims, dims, np.array([TreeOp.LIST, TreeOp.LEAVES], np.uint8), np.array([n, n]))
    data = lay.to_bytes()
    assert len(data) < 1_000_000, len(data)  # random shapes: the worst case
    assert Layout.from_bytes(data).same_as(lay)
    # A model's parameters repeat their shapes: a few KB, not MB.
    same = direct_layout(np.full(n, DTYPES["float32"][0]), [(4096, 4096)] * n)
    data = same.to_bytes()
    assert len(data) < 64_000, len(data)
    assert Layout.from_bytes(data).same_as(same)


def test_100k_state_dict_with_realistic_keys_is_under_4mb():
    parts = [
        ("self_attn.q_proj.weight", (4096, 4096)),
        ("self_attn.k_proj.weight", (1024, 4096)),
        ("self_attn.v_proj.weight", (1024, 4096)),
        ("self_attn.o_proj.weight", (4096, 4096)),
        ("mlp.gate_proj.weight", (14336, 4096)),
        ("mlp.up_proj.weight", (14336, 4096)),
        ("mlp.down_proj.weight", (4096, 14336)),
        ("input_layernorm.weight", (4096,)),
        ("post_attention_layernorm.weight", (4096,)),
        ("self_attn.q_norm.weight", (128,)),
    ]
    keys = [f"model.layers.{i // len(parts)}.{parts[i % len(parts)][0]}" for i in range(100_000)]
    shapes = [parts[i % len(parts)][1] for i in range(100_000)]
    codes = np.full(100_000, DTYPES["bfloat16"][0])
    lay = direct_layout(codes, shapes, [TreeOp.DICT, TreeOp.LEAVES], [100_000, 100_000], keys)
    data = lay.to_bytes()
    assert len(data) < 4 << 20, len(data)
    back = Layout.from_bytes(data)
    assert back.same_as(lay)
    assert back.keys[12345] == keys[12345]


# -- hostile bytes ----------------------------------------------------------------


def small_layout_bytes() -> bytes:
    obj = {"w": torch.zeros(3, 4), 7: [torch.zeros(2, dtype=torch.int64), (torch.tensor(1.0),)], "é": torch.zeros(0)}
    return layout_of(obj).to_bytes()


def compressed_layout_bytes() -> bytes:
    obj = {f"layer.{i}.weight": torch.zeros(i % 7, 3) for i in range(300)}
    data = layout_of(obj).to_bytes()
    flags = struct.unpack_from("<H", data, 6)[0]
    assert flags & 1, "expected a zlib body"
    return data


def decode_or_error(data: bytes) -> Layout | None:
    """from_bytes must return a Layout or raise a TensorferryError: nothing else."""
    try:
        return Layout.from_bytes(data)
    except TensorferryError:
        return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make", [small_layout_bytes, compressed_layout_bytes])
def test_truncated_at_every_prefix(make):
    data = make()
    assert Layout.from_bytes(data) is not None
    for n in range(len(data)):
        with pytest.raises(TensorferryError):
            Layout.from_bytes(data[:n])
    # And one byte too many.
    with pytest.raises(TicketError):
        Layout.from_bytes(data + b"\0")


@pytest.mark.timeout(60)
def test_every_single_byte_corruption_of_a_small_layout():
    data = small_layout_bytes()
    for i in range(len(data)):
        for v in range(256):
            if v == data[i]:
                continue
            bad = bytearray(data)
            bad[i] = v
            # The checksum covers the body and the header's counts fix its
            # size: no single-byte change can decode.
            with pytest.raises(TensorferryError):
                Layout.from_bytes(bytes(bad))


@pytest.mark.timeout(60)
def test_single_byte_corruption_of_a_compressed_layout():
    data = compressed_layout_bytes()
    original = Layout.from_bytes(data)
    rng = np.random.default_rng(5)
    harmless = 0
    for i in range(len(data)):
        for v in {data[i] ^ 0xFF, data[i] ^ 0x01, int(rng.integers(0, 256))} - {data[i]}:
            bad = bytearray(data)
            bad[i] = v
            got = decode_or_error(bytes(bad))
            if got is not None:
                # Only a change deflate ignores (padding bits after the last
                # block, an unused code) may decode: then the body, which the
                # checksum covers, is the original one.
                assert i >= _HEADER.size
                assert got.same_as(original)
                harmless += 1
    assert harmless < len(data) // 20


def test_nested_dicts_keep_their_keys():
    # Regression: keys went out in walk order, so an inner dict's keys were
    # handed to the outer one ({'model': {'optim': ...}, 'w': ...}).
    t = torch.zeros(1)
    obj = {"model": {"w": t, "sub": {"deep": t}}, "optim": {"lr": t}, 3: [{"a": t}, {"b": t}]}
    lay = Layout.from_bytes(layout_of(obj).to_bytes())
    assert lay.keys == ("model", "optim", 3, "w", "sub", "deep", "lr", "a", "b")
    assert structure(unflatten(lay, flatten(obj)[0])) == structure(obj)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400))
def test_random_bytes_rejected(data):
    with pytest.raises(TensorferryError):
        Layout.from_bytes(data)


@settings(max_examples=300, deadline=None)
@given(rest=st.binary(min_size=_HEADER.size - 8, max_size=300))
def test_random_bytes_after_a_valid_magic_and_version(rest):
    with pytest.raises(TensorferryError):
        Layout.from_bytes(_MAGIC + struct.pack("<HH", 1, 2) + rest)


@settings(max_examples=250, deadline=None)
@given(
    n=st.integers(0, 6),
    data=st.data(),
)
def test_forged_bodies_with_valid_checksums(n, data):
    # A hostile peer gets the checksum right: validation alone must hold.
    codes = data.draw(st.lists(st.one_of(st.integers(0, 20), st.integers(0, 255)), min_size=n, max_size=n))
    ndims = data.draw(st.lists(st.sampled_from([0, 1, 2, 3, 65]), min_size=n, max_size=n))
    ndim_total = sum(ndims) if data.draw(st.booleans()) else data.draw(st.integers(0, 40))
    dims = data.draw(
        st.lists(st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)), min_size=ndim_total, max_size=ndim_total)
    )
    tree = data.draw(st.sampled_from(["random", "list", "dict"]))
    if tree == "random":
        ntok = data.draw(st.integers(0, 6))
        ops = data.draw(st.lists(st.integers(0, 5), min_size=ntok, max_size=ntok))
        counts = data.draw(st.lists(st.sampled_from([0, 1, 2, 3, n, 2**32 - 1]), min_size=ntok, max_size=ntok))
        nkeys = data.draw(st.integers(0, 4))
    else:
        op = TreeOp.LIST if tree == "list" else TreeOp.DICT
        ops, counts = ([op, TreeOp.LEAVES], [n, n]) if n else ([op], [0])
        nkeys = n if tree == "dict" else 0
    kinds = data.draw(st.lists(st.integers(0, 2), min_size=nkeys, max_size=nkeys))
    blob = data.draw(st.sampled_from([b"", b"abc", "é🙂".encode(), b"-12", b"\xff\xfe", "²".encode(), b"--5", b"1_0"]))
    lens = data.draw(st.lists(st.integers(0, len(blob)), min_size=nkeys, max_size=nkeys))
    got = decode_or_error(forge(codes, ndims, dims, ops, counts, kinds, lens, blob))
    if got is not None:
        # Whatever decodes describes real tensors and re-encodes to itself.
        assert got.num_tensors == n
        assert (got.nbytes >= 0).all() and (got.numels >= 0).all()
        assert Layout.from_bytes(got.to_bytes()).same_as(got)


def test_forged_regressions():
    one = dict(ops=[TreeOp.LEAVES], counts=[1])
    # 2^62 complex128 elements: numel * 16 wrapped to 0 bytes.
    with pytest.raises(LayoutMismatchError, match="more bytes"):
        Layout.from_bytes(forge([DTYPES["complex128"][0]], [2], [1 << 31, 1 << 31], **one))
    # Tensors of 2^60 bytes each, fine alone, whose sum passes 2^63.
    n = 8
    with pytest.raises(LayoutMismatchError, match="more bytes"):
        Layout.from_bytes(
            forge([DTYPES["uint8"][0]] * n, [2] * n, [1 << 30, 1 << 30] * n, ops=[TreeOp.LIST, TreeOp.LEAVES], counts=[n, n])
        )
    assert Layout.from_bytes(forge([DTYPES["uint8"][0]], [2], [1 << 30, 1 << 30], **one)).total_nbytes == 1 << 60
    dict2 = dict(ops=[TreeOp.DICT, TreeOp.LEAVES], counts=[2, 2])
    # Key lengths that cut a UTF-8 character in two (raised UnicodeDecodeError).
    with pytest.raises(LayoutMismatchError, match="UTF-8"):
        Layout.from_bytes(forge([1, 1], [0, 0], [], kinds=[0, 0], lens=[1, 1], blob="é".encode(), **dict2))
    dict1 = dict(ops=[TreeOp.DICT, TreeOp.LEAVES], counts=[1, 1])
    # Integer keys int() cannot read (raised ValueError).
    for text in ("²", "--5", "1_0", " 5", "", "5" * 33):
        with pytest.raises(LayoutMismatchError, match="integer key"):
            Layout.from_bytes(forge([1], [0], [], kinds=[1], lens=[len(text.encode())], blob=text.encode(), **dict1))
    assert Layout.from_bytes(forge([1], [0], [], kinds=[1], lens=[3], blob=b"-42", **dict1)).keys == (-42,)
    # Nesting: two roots, a run overflowing its list, too deep, unknown opcode.
    for ops, counts in (
        ([0, 0], [1, 1]),
        ([TreeOp.LIST, 0], [1, 2]),
        ([TreeOp.LIST] * 300 + [0], [1] * 300 + [1]),
        ([7], [1]),
        ([TreeOp.LIST], [2]),
        ([0], [0]),
    ):
        ntensors = sum(c for o, c in zip(ops, counts) if o == TreeOp.LEAVES)
        with pytest.raises(LayoutMismatchError):
            Layout.from_bytes(forge([1] * ntensors, [0] * ntensors, [], ops, counts))


# Headers whose counts claim ~4G tensors, dims, tokens or keys over a 32-byte body.
_HUGE_COUNTS = ((2**32 - 1, 0, 1, 0), (1, 2**64 - 1, 1, 0), (1, 0, 2**32 - 1, 0), (1, 0, 1, 2**32 - 1))


def _huge_header(n: int, dims: int, ntok: int, nkeys: int, body: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, 1, 2, n, dims, ntok, nkeys, 0, len(body), zlib.crc32(body))


@pytest.mark.timeout(20)
def test_header_claiming_4g_tensors_with_a_tiny_body():
    body = b"\0" * 32
    for counts in _HUGE_COUNTS:
        tracemalloc.start()
        with pytest.raises(TicketError):
            Layout.from_bytes(_huge_header(*counts, body))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        # Nothing sized by the claimed counts was allocated.
        assert peak < 256 << 10, peak
    # Counts that agree with body_n but exceed max_nbytes: rejected before reading.
    n = 10_000_000
    header = _HEADER.pack(_MAGIC, 1, 2, n, 0, 1, 0, 0, 2 * n + 5, 0)
    with pytest.raises(TicketError, match="limit"):
        Layout.from_bytes(header + body, max_nbytes=1 << 20)


@pytest.mark.timeout(30)
def test_zlib_bomb_is_bounded():
    bomb = zlib.compress(b"\0" * (64 << 20), 9)  # ~64 KB that inflates to 64 MiB
    cases = [
        # Counts say 2 * 100 + 5 bytes; the stream has 64 MiB.
        _HEADER.pack(_MAGIC, 1, 3, 100, 0, 1, 0, 0, 205, 0),
        # Counts say an empty body (zlib's max_length=0 means "unlimited").
        _HEADER.pack(_MAGIC, 1, 3, 0, 0, 0, 0, 0, 0, zlib.crc32(b"")),
    ]
    for header in cases:
        tracemalloc.start()
        with pytest.raises(TicketError):
            Layout.from_bytes(header + bomb)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 4 << 20, peak
    # A body within max_nbytes but over the caller's limit is refused unread.
    data = compressed_layout_bytes()
    body_n = struct.unpack_from("<Q", data, _HEADER.size - 12)[0]
    with pytest.raises(TicketError, match="limit"):
        Layout.from_bytes(data, max_nbytes=body_n - 1)
    assert Layout.from_bytes(data, max_nbytes=body_n) is not None
    assert MAX_LAYOUT_NBYTES >= 4 << 20


def test_wrong_version_magic_and_flags():
    data = bytearray(small_layout_bytes())
    v2 = bytearray(data)
    struct.pack_into("<H", v2, 4, 2)
    with pytest.raises(TicketError, match="version 2 is not supported"):
        Layout.from_bytes(bytes(v2))
    bad = bytearray(data)
    bad[:4] = b"PK\x03\x04"
    with pytest.raises(TicketError, match="not a tensorferry layout"):
        Layout.from_bytes(bytes(bad))
    fl = bytearray(data)
    struct.pack_into("<H", fl, 6, 0x80)
    with pytest.raises(TicketError, match="unknown flags"):
        Layout.from_bytes(bytes(fl))
    with pytest.raises(TicketError, match="truncated"):
        Layout.from_bytes(b"")
    # Every decode error is a TensorferryError and a ValueError.
    assert issubclass(TicketError, TensorferryError) and issubclass(TicketError, ValueError)
    assert issubclass(LayoutMismatchError, TensorferryError) and issubclass(LayoutMismatchError, ValueError)


# -- aliases (tied tensors) -----------------------------------------------------------------


def test_aliases_round_trip_and_take_no_bytes():
    w = torch.randn(5, 4)
    obj = {"wte": w, "ln": torch.ones(4), "head": w, "t": w.t(), "t2": w.t(), "e": torch.empty(0), "e2": torch.empty(0)}
    lay = layout_of(obj)
    # Zero-size tensors share an address but are not aliases: nothing to share.
    assert lay.aliases.tolist() == [[2, 0], [4, 3]]
    assert lay.nbytes.tolist() == [80, 16, 0, 80, 0, 0, 0]
    back = Layout.from_bytes(lay.to_bytes())
    assert back.same_as(lay) and back.aliases.tolist() == [[2, 0], [4, 3]]
    assert back.nbytes.tolist() == lay.nbytes.tolist()
    # Without aliases the encoding is the one of before (flag unset).
    plain = layout_of({"a": torch.ones(3), "b": torch.ones(3)})
    assert plain.aliases.shape == (0, 2)
    assert struct.unpack_from("<H", plain.to_bytes(), 6)[0] & 4 == 0
    assert not plain.same_as(layout_of([torch.ones(3), torch.ones(3)]))


def _with_aliases(pairs, *, count=None) -> bytes:
    """A valid 3-tensor layout's bytes with forged alias pairs (checksum fixed)."""
    lay = direct_layout([8, 8, 4], [(2,), (2,), (2,)])
    data = bytearray(Layout(lay.dtype_codes, lay.ndims, lay.dims, lay.tree_ops, lay.tree_counts, (), np.array([[1, 0]])).to_bytes())
    fields = list(_HEADER.unpack_from(data, 0))
    head = _HEADER.size
    body = bytes(data[head + 4 :])
    body = body[:-8] + np.asarray(pairs, dtype="<u4").tobytes()
    fields[8] = len(body)
    fields[9] = zlib.crc32(body)
    return _HEADER.pack(*fields) + struct.pack("<I", len(pairs) if count is None else count) + body


@pytest.mark.parametrize(
    "pairs, count",
    [
        ([[0, 1]], None),  # points forward
        ([[1, 1]], None),  # to itself
        ([[2, 0]], None),  # another dtype
        ([[5, 0]], None),  # out of range
        ([[1, 0], [2, 1]], None),  # an alias of an alias (and dtype)
        ([[1, 0]], 3),  # count disagrees with the body
        ([[1, 0]], 0),  # flag set, no aliases
    ],
)
def test_forged_aliases_are_rejected(pairs, count):
    assert Layout.from_bytes(_with_aliases([[1, 0]])).aliases.tolist() == [[1, 0]]
    with pytest.raises((TicketError, LayoutMismatchError)):
        Layout.from_bytes(_with_aliases(pairs, count=count))


def test_aliases_of_another_shape_are_rejected():
    lay = direct_layout([8, 8], [(2, 3), (3, 2)])
    forged = Layout(lay.dtype_codes, lay.ndims, lay.dims, lay.tree_ops, lay.tree_counts, (), np.array([[1, 0]]))
    with pytest.raises(LayoutMismatchError, match="another shape"):
        Layout.from_bytes(forged.to_bytes())


# -- timing (deselected by default: `pytest -m timing`) --------------------------------


@pytest.mark.timing
def test_every_single_byte_corruption_is_rejected_within_30_seconds():
    """All 255 corruptions of every byte of a small layout: the rejections
    (checked in the default run) take well under 30 s in all."""
    data = small_layout_bytes()
    t0 = time.perf_counter()
    for i in range(len(data)):
        bad = bytearray(data)
        for v in range(256):
            if v != data[i]:
                bad[i] = v
                with pytest.raises(TensorferryError):
                    Layout.from_bytes(bytes(bad))
    assert time.perf_counter() - t0 < 30


@pytest.mark.timing
def test_a_header_claiming_4g_tensors_is_rejected_within_half_a_second():
    body = b"\0" * 32
    for counts in _HUGE_COUNTS:
        t0 = time.perf_counter()
        with pytest.raises(TicketError):
            Layout.from_bytes(_huge_header(*counts, body))
        assert time.perf_counter() - t0 < 0.5, counts
