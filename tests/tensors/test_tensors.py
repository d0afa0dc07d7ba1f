"""Tensors <-> layout (_tensors.py: _flatten, _rebuild): flatten, inspect_leaves, unflatten,
match_into and the dtype codes.

The Layout's encoding is tests/test_layout.py's; packing into a pool is
tests/test_pool.py's. Here, the walk over the user's objects: its tokens,
what it refuses and how it names it.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from tensorferry import LayoutMismatchError, UnsupportedTensorError
from tensorferry.tensors import _flatten, _rebuild
from tensorferry.tensors import (
    data_ptrs,
    dtype_code,
    first_replaced,
    flatten,
    gc_paused,
    inspect_leaves,
    match_into,
    torch_dtype,
    unflatten,
)
from tensorferry.wire._layout import DTYPES, TreeOp

pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor"),
]

L, D, T, S = TreeOp.LEAVES, TreeOp.DICT, TreeOp.TUPLE, TreeOp.LIST


def layout_of(obj):
    leaves, ops, counts, keys, _ = flatten(obj)
    return inspect_leaves(obj, leaves, ops, counts, keys).layout


def tokens(obj):
    _, ops, counts, keys, _ = flatten(obj)
    return list(zip(ops, counts)), keys


def structure(x):
    if isinstance(x, dict):
        return ("dict", [(type(k), k, structure(v)) for k, v in x.items()])
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [structure(v) for v in x])
    return ("tensor", x.dtype, tuple(x.shape))


# -- dtype codes -------------------------------------------------------------------------------


def test_every_torch_dtype_of_the_format_has_its_code():
    known = [name for name in DTYPES if isinstance(getattr(torch, name, None), torch.dtype)]
    assert {"bool", "uint8", "float32", "bfloat16", "complex128", "float8_e4m3fn"} <= set(known)
    for name in known:
        dt = getattr(torch, name)
        assert dtype_code(dt) == DTYPES[name][0]
        assert torch_dtype(DTYPES[name][0]) is dt
        assert dt.itemsize == DTYPES[name][1]


# -- flatten: tokens -----------------------------------------------------------------------------


def test_tokens_of_nested_objects():
    t = torch.zeros(1)
    assert tokens(t) == ([(L, 1)], [])
    assert tokens([]) == ([(S, 0)], [])
    assert tokens({}) == ([(D, 0)], [])
    # A run of tensors is one token, however long.
    assert tokens([t] * 100_000) == ([(S, 100_000), (L, 100_000)], [])
    # A run never crosses a container boundary.
    assert tokens([t, [t], t]) == ([(S, 3), (L, 1), (S, 1), (L, 1), (L, 1)], [])
    assert tokens((t, {"a": t, "b": t}, ())) == ([(T, 3), (L, 1), (D, 2), (L, 2), (T, 0)], ["a", "b"])


def test_a_dicts_keys_go_out_when_it_opens():
    t = torch.zeros(1)
    _, keys = tokens({"model": {"w": t, "sub": {"deep": t}}, "optim": {"lr": t}, 3: [{"a": t}]})
    assert keys == ["model", "optim", 3, "w", "sub", "deep", "lr", "a"]


def test_numpy_arrays_share_memory_unless_torch_cannot():
    a = np.arange(6, dtype=np.float32)
    leaves, _, _, _, copied = flatten({"a": a})
    assert copied == 0 and leaves[0].data_ptr() == a.ctypes.data
    ro = np.arange(4.0)
    ro.flags.writeable = False
    leaves, _, _, _, copied = flatten([ro, a[::-1], a[::2]])
    assert copied == 2  # read-only and negative strides: copied once each
    assert [x.tolist() for x in leaves] == [[0, 1, 2, 3], [5, 4, 3, 2, 1, 0], [0, 2, 4]]
    assert leaves[2].data_ptr() == a.ctypes.data  # positive strides are shared


# -- flatten: refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj, path, hint",
    [
        ({"a": 3}, "obj['a']", "not a tensor"),
        ([torch.zeros(1), None], "obj[1]", "NoneType"),
        ({"a": {"b": "text"}}, "obj['a']['b']", "str"),
        ({1.5: torch.zeros(1)}, "obj", "key 1.5 of type float"),
        ({True: torch.zeros(1)}, "obj", "key True of type bool"),
        ({("a", 1): torch.zeros(1)}, "obj", "of type tuple"),
        ({10**31: torch.zeros(1)}, "obj", "more than 31 digits"),
        ({"x": np.array(["a"], dtype=object)}, "obj['x']", "numpy array of dtype object"),
        ({"x": np.array(["ab"])}, "obj['x']", "numeric dtype"),
    ],
)
def test_unsupported_inputs_name_the_path(obj, path, hint):
    with pytest.raises(UnsupportedTensorError) as info:
        flatten(obj)
    msg = str(info.value)
    assert path in msg and hint in msg, msg


def test_every_problem_is_collected_and_the_list_is_bounded():
    with pytest.raises(UnsupportedTensorError, match=r"cannot pack 3 leaves: obj\[0\].*obj\[2\]\['k'\].*obj\[3\]"):
        flatten([1, torch.zeros(1), {"k": None}, "s"])
    with pytest.raises(UnsupportedTensorError, match=r"cannot pack 25 leaves: .*\(and 15 more\)"):
        flatten([None] * 25)


def test_a_cycle_or_absurd_nesting_is_refused_not_a_recursion_error():
    cyc: list = []
    cyc.append(cyc)
    with pytest.raises(UnsupportedTensorError, match="deeper than 256"):
        flatten(cyc)
    deep: list = [torch.zeros(1)]
    for _ in range(300):
        deep = [deep]
    with pytest.raises(UnsupportedTensorError, match="deeper than 256"):
        flatten(deep)
    ok: list = [torch.zeros(1)]
    for _ in range(200):
        ok = [ok]
    assert len(flatten(ok)[0]) == 1


# -- inspect_leaves --------------------------------------------------------------------------------


def _unsupported_dtype() -> torch.dtype:
    known = {getattr(torch, n, None) for n in DTYPES}
    for name in ("bits8", "uint1", "qint8"):
        dt = getattr(torch, name, None)
        if isinstance(dt, torch.dtype) and dt not in known:
            return dt
    pytest.skip("this torch has no dtype outside tensorferry's format")


@pytest.mark.parametrize(
    "make, hint",
    [
        (lambda: torch.zeros(3, 3).to_sparse(), ".to_dense()"),
        (lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8), ".dequantize()"),
        (lambda: torch.empty(3, device="meta"), "materialize"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), ".unbind()"),
        (lambda: torch.empty(4, dtype=_unsupported_dtype()), "convert it with .to(...)"),
    ],
)
def test_leaves_that_cannot_be_sent_are_named_with_the_fix(make, hint):
    obj = {"ok": torch.ones(2), "bad": [make()]}
    leaves, ops, counts, keys, _ = flatten(obj)
    with pytest.raises(UnsupportedTensorError) as info:
        inspect_leaves(obj, leaves, ops, counts, keys)
    msg = str(info.value)
    assert "obj['bad'][0]" in msg and hint in msg and "obj['ok']" not in msg, msg


def test_leaf_metadata_and_which_leaves_are_raw():
    base = torch.arange(24.0).view(4, 6)
    c = torch.ones(3, dtype=torch.complex64)
    obj = [base, base.t(), base[1], torch._neg_view(torch.ones(2)), c.conj(), torch.empty(0)]
    leaves, ops, counts, keys, _ = flatten(obj)
    info = inspect_leaves(obj, leaves, ops, counts, keys)
    assert info.all_cpu and info.storage_ptrs is None
    assert info.data_ptrs.tolist() == [t.data_ptr() for t in leaves]
    # Raw: contiguous, and its bytes are its values (no neg/conj bit).
    assert info.raw.tolist() == [True, False, True, False, False, True]
    assert info.layout.shapes() == [(4, 6), (6, 4), (6,), (2,), (3,), (0,)]


def test_tied_tensors_are_aliases_overlapping_ones_are_not():
    w = torch.randn(5, 4)
    obj = {
        "wte": w,
        "head": w,  # the same view: an alias of 0
        "row": w[0],  # same first byte, another shape: not
        "as_int": w.view(torch.int32),  # same bytes, another dtype: not
        "t": w.t(),
        "t2": w.t(),  # an alias of 4
        "e": torch.empty(0),
        "e2": torch.empty(0),  # empty: nothing to share
    }
    assert layout_of(obj).aliases.tolist() == [[1, 0], [5, 4]]
    assert layout_of([torch.ones(3), torch.ones(3)]).aliases.shape == (0, 2)


# -- unflatten ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        torch.zeros(2, 3),
        torch.tensor(1.5),
        [],
        {},
        [[], {}, ()],
        ((), [((),)], {"a": {}}),
        {1: torch.ones(1), "1": torch.zeros(1), -5: [torch.ones(2)], "": (torch.ones(0),)},
        [torch.nn.Parameter(torch.ones(2)), {"b": torch.ones(3, dtype=torch.uint8)}],
    ],
)
def test_unflatten_rebuilds_what_flatten_took(obj):
    leaves, *_ = flatten(obj)
    back = unflatten(layout_of(obj), leaves)
    assert structure(back) == structure(obj)
    assert [t is u for t, u in zip(flatten(back)[0], leaves)] == [True] * len(leaves)


# -- match_into -------------------------------------------------------------------------------------


def sent():
    return {"emb": torch.zeros(4, 2), "layers": [{"w": torch.zeros(2, 2), "b": torch.zeros(2)}], "step": torch.tensor(0)}


def test_match_into_by_key_whatever_the_order_and_by_position():
    into = {"step": torch.tensor(5), "layers": [{"b": torch.ones(2), "w": torch.ones(2, 2)}], "emb": torch.ones(4, 2)}
    got = match_into(layout_of(sent()), into)
    want = [into["emb"], into["layers"][0]["w"], into["layers"][0]["b"], into["step"]]
    assert [g is w for g, w in zip(got, want)] == [True] * 4


def test_match_into_takes_writable_numpy_arrays_and_parameters():
    lay = layout_of([torch.zeros(3), torch.zeros(2)])
    a = np.zeros(3, dtype=np.float32)
    p = torch.nn.Parameter(torch.zeros(2))
    got = match_into(lay, [a, p])
    assert got[0].data_ptr() == a.ctypes.data and got[1] is p
    a.flags.writeable = False
    with pytest.raises(LayoutMismatchError, match=r"obj\[0\].*read-only"):
        match_into(lay, [a, p])


@pytest.mark.parametrize(
    "change, messages",
    [
        (lambda d: d.pop("step"), ["obj['step']: sent torch.int64[], into= has no such key"]),
        (lambda d: d.update(extra=torch.zeros(1)), ["obj['extra']: into= has torch.float32[1], the sender sent no such key"]),
        (lambda d: d.update(emb=torch.zeros(2, 4)), ["obj['emb']: sent torch.float32[4, 2], into= has torch.float32[2, 4]"]),
        (lambda d: d.update(step=torch.tensor(0.0)), ["obj['step']: sent torch.int64[], into= has torch.float32[]"]),
        (lambda d: d["layers"].append({}), ["obj['layers']: sent a list of 1, into= has a list of 2"]),
        (lambda d: d.update(layers=({"w": torch.zeros(2, 2), "b": torch.zeros(2)},)), None),  # a tuple for a list: fine
        (lambda d: d.update(layers=torch.zeros(1)), ["obj['layers']: sent a list of 1, into= has torch.float32[1]"]),
        (lambda d: d["layers"][0].update(w=[torch.zeros(2, 2)]), ["obj['layers'][0]['w']: sent torch.float32[2, 2], into= has a list of 1"]),
    ],
)
def test_match_into_names_what_differs(change, messages):
    into = sent()
    change(into)
    lay = layout_of(sent())
    if messages is None:
        assert len(match_into(lay, into)) == 4
        return
    with pytest.raises(LayoutMismatchError) as info:
        match_into(lay, into)
    for m in messages:
        assert m in str(info.value), str(info.value)


def test_match_into_lists_five_problems_and_counts_the_rest():
    lay = layout_of([torch.zeros(2)] * 8)
    with pytest.raises(LayoutMismatchError, match=r"obj\[4\].*\(and 3 more\)") as info:
        match_into(lay, [torch.zeros(3)] * 8)
    assert "obj[5]" not in str(info.value)


def test_match_into_a_flat_list_for_a_dict_is_refused():
    with pytest.raises(LayoutMismatchError, match="sent a dict of 3 keys, into= has a list of 4"):
        match_into(layout_of(sent()), [torch.zeros(4, 2), torch.zeros(2, 2), torch.zeros(2), torch.tensor(0)])


# -- gc_paused ---------------------------------------------------------------------------------------


def test_gc_paused_restores_the_collector_as_it_was():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(KeyError):
        with gc_paused():
            raise KeyError
    assert gc.isenabled()


def test_match_into_pauses_the_collector_and_restores_it_when_it_refuses(monkeypatch):
    # It reads 100k shapes with the collector paused (each shape a tuple:
    # otherwise collections over everything alive); a refusal turns it back on.
    lay = layout_of({"a": torch.zeros(2, 3)})
    seen = []
    real = _rebuild._type_problems

    def spy(*args):
        seen.append(gc.isenabled())
        return real(*args)

    monkeypatch.setattr(_rebuild, "_type_problems", spy)
    match_into(lay, {"a": torch.zeros(2, 3)})
    with pytest.raises(LayoutMismatchError):
        match_into(lay, {"a": torch.zeros(3, 2)})
    assert seen == [False, False] and gc.isenabled()


# -- data_ptrs / first_replaced: the kept plans' per-use checks ------------------------


def test_the_check_loops_are_native_here():
    # This install has a C++ compiler and this torch exports its reader: the
    # plans' checks run as C++ loops (the Python fallback is 3 to 5x slower).
    assert _flatten._native is not None and _flatten._READER != 0


def _every_kind_of_dense_tensor() -> list[torch.Tensor]:
    flat = torch.arange(1000, dtype=torch.float32)
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    return [
        flat, flat[10:20], flat[999:], flat[5:5], torch.empty(0), base.t(), base[:, ::2],
        torch.zeros(3, dtype=torch.complex64).conj(), torch.ones(3)._neg_view(),
        torch.from_numpy(np.arange(7, dtype=np.int16)), torch.nn.Parameter(torch.ones(2, 2)),
        torch.empty(3, device="meta"), torch.tensor(True), torch.ones(4, dtype=torch.bfloat16)[1:],
    ]


def test_data_ptrs_are_what_data_ptr_says_for_every_kind_of_tensor():
    ts = _every_kind_of_dense_tensor()
    want = [t.data_ptr() for t in ts]
    assert data_ptrs(ts).tolist() == want
    assert data_ptrs(tuple(ts)).tolist() == want  # any sequence
    assert data_ptrs([]).dtype == np.int64 and data_ptrs([]).size == 0
    many = list(torch.arange(100_000, dtype=torch.float32).split(1))
    assert np.array_equal(data_ptrs(many), np.array([t.data_ptr() for t in many], dtype=np.int64))


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_data_ptrs_raise_what_data_ptr_raises(monkeypatch, native):
    # torch's reader throws a C++ exception for a sparse tensor and for
    # what is not a tensor: caught in the loop, the Python pass raises the
    # usual error (never a crash), wherever the bad one sits.
    if not native:
        monkeypatch.setattr(_flatten, "_READER", 0)
    ok = [torch.ones(3)] * 5
    with pytest.raises(RuntimeError, match="storage"):
        data_ptrs(ok + [torch.ones(3).to_sparse()] + ok)
    with pytest.raises(TypeError):
        data_ptrs(ok + [object()])
    assert data_ptrs(ok).tolist() == [ok[0].data_ptr()] * 5


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_first_replaced_finds_the_first_slot_that_changed(monkeypatch, native):
    if not native:
        monkeypatch.setattr(_flatten, "_native", None)
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    d1, d2 = {"w": a, "b": b}, {"w": c}
    dicts, names, objs = [d1, d1, d2], ["w", "b", "w"], [a, b, c]
    assert first_replaced(dicts, names, objs) == -1
    d2["w"] = torch.ones(3)  # replaced by an equal tensor: another object
    assert first_replaced(dicts, names, objs) == 2
    del d1["b"]  # gone (None is not the tensor)
    assert first_replaced(dicts, names, objs) == 1
    assert first_replaced([], [], []) == -1
