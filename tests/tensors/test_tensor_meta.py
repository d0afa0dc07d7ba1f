"""_tensor_meta: every tensor's address, dtype, sizes, strides and flags in
one C++ pass, against what torch's own Python methods say, and the check a
kept plan runs (Recorded.first_changed) for every kind of change; the same
with the Python passes the module falls back to without the extension."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tensorferry.tensors import _meta as tm
from tensorferry.tensors import _raw
from tensorferry.tensors._types import _CODE_BY_TORCH


@pytest.fixture(params=("c++", "shim", "python"))
def mode(request, monkeypatch):
    # c++: kept plans check by raw reads (_raw.py); shim: through torch's C
    # shim, as where raw reads could not be learned; python: no extension.
    if request.param == "python":
        monkeypatch.setattr(tm, "native", False)
    if request.param in ("shim", "python"):
        monkeypatch.setattr(tm, "_RAW", False)
    return request.param


def _kinds() -> list[torch.Tensor]:
    flat = torch.arange(48, dtype=torch.float32)
    z = torch.randn(3, dtype=torch.complex64)
    return [
        flat[:12].view(3, 4),
        flat[:12].view(3, 4).t(),
        flat[12:36].view(2, 3, 4).permute(2, 0, 1),
        flat[1::2],
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 5),
        torch.empty(2, 0, dtype=torch.int64),
        torch.ones(4, dtype=torch.bfloat16),
        torch.zeros(3, dtype=torch.bool),
        torch.nn.Parameter(torch.ones(2, 2)),
        z,
        z.conj(),
        z.conj().imag,  # the negative bit
        torch.arange(10, dtype=torch.uint8).expand(3, 10),
    ]


def test_the_cpp_pass_is_built_and_bound():
    # Built wherever a C++ compiler is: missing, kept plans' checks and the
    # sender's inspection fall back to slower Python passes silently.
    assert tm.native, "tensorferry.tensors._ptrs was not built or could not bind torch's C shim"


def test_columns_are_what_torch_says_of_every_kind_of_tensor(mode):
    ts = _kinds()
    cols = tm.read_columns(ts)
    assert cols is not None
    assert cols.ptrs.tolist() == [t.data_ptr() for t in ts]
    assert [cols.dtype(i) for i in range(len(ts))] == [t.dtype for t in ts]
    assert cols.codes.tolist() == [_CODE_BY_TORCH[t.dtype] for t in ts]
    assert cols.ndims.tolist() == [t.dim() for t in ts]
    assert cols.sizes.tolist() == [d for t in ts for d in t.shape]
    assert cols.strides.tolist() == [d for t in ts for d in t.stride()]
    raw = [t.is_contiguous() and not t.is_neg() and not t.is_conj() for t in ts]
    want = raw if cols.raw_bits else [t.is_contiguous() for t in ts]
    assert cols.contiguous.tolist() == want
    assert cols.cpu.all()
    if mode == "c++":  # the C++ pass reads the element counts with the sizes; the Python one leaves them to the Layout
        assert cols.numels.tolist() == [t.numel() for t in ts]
    rec = tm.Recorded(ts)
    assert rec.numels().tolist() == [t.numel() for t in ts]
    assert [rec.shape_of(i) for i in range(len(ts))] == [(tuple(t.shape), t.stride()) for t in ts]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_what_has_no_reading_is_none(mode):
    assert tm.read_columns([torch.ones(3), torch.ones(3).to_sparse()]) is None
    assert tm.read_columns([torch.ones(3), "not a tensor"]) is None
    # Dtypes with no wire code are read, and marked so (inspect_leaves refuses them by name).
    cols = tm.read_columns([torch.ones(1), torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)])
    assert cols is not None and cols.codes.tolist() == [_CODE_BY_TORCH[torch.float32], tm.NOT_SENDABLE]


@pytest.mark.parametrize(
    "change",
    [
        lambda ts: ts[0].t_(),
        lambda ts: setattr(ts[1], "data", ts[1].data.view(2, 6)),
        lambda ts: ts[2].resize_(5),  # shrinks in place: the address stays
        lambda ts: ts[2].resize_(10_000),  # grows: new memory
        lambda ts: ts[3].as_strided_((2, 2), (1, 2)),
        lambda ts: ts[0].set_(torch.ones(3, 4).untyped_storage()),
        lambda ts: ts.__setitem__(3, ts[3].view(torch.int32)),
        lambda ts: ts.__setitem__(1, ts[1].clone()),
        lambda ts: ts.__setitem__(2, "not a tensor"),
        lambda ts: torch.utils.swap_tensors(ts[3], torch.ones(4).to_sparse()),
    ],
    ids=["t_", "data-view", "resize-shrinks", "resize-grows", "as_strided_", "set_", "dtype-view", "clone", "not-a-tensor", "swapped-sparse"],
)
def test_first_changed_names_the_first_tensor_not_as_recorded(mode, change):
    flat = torch.arange(40, dtype=torch.float32)
    ts = [flat[:12].view(3, 4), flat[12:24].view(3, 4), flat[24:32], flat[32:36], torch.ones(2)]
    rec = tm.Recorded(ts)
    assert rec.first_changed(ts) == -1
    assert rec.first_changed([t.view(t.shape) for t in ts]) == -1  # other objects, the same views
    before = [(t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if isinstance(t, torch.Tensor) else None for t in ts]
    change(ts)
    after = []
    for t in ts:
        try:
            after.append((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()))
        except (AttributeError, RuntimeError):
            after.append("unreadable")
    want = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    assert rec.first_changed(ts) == want


def test_many_tensors_are_checked_to_the_last(mode):
    ts = [torch.ones(3, 2) for _ in range(5000)]
    rec = tm.Recorded(ts)
    assert rec.first_changed(ts) == -1
    ts[4999].t_()
    assert rec.first_changed(ts) == 4999
    assert rec.first_changed(ts[:10]) == 10  # fewer tensors than recorded
    assert np.array_equal(rec.ptrs, np.array([t.data_ptr() for t in ts], dtype=np.int64))


def test_a_local_layout_is_the_layout_built_from_the_same_columns(mode):
    # A pack's Layout.of_local takes the element counts the pass read
    # instead of recomputing them; all it derives from them must be what
    # the checked constructor derives (0-d, empty and tied tensors too).
    from tensorferry.tensors._flatten import flatten, inspect_leaves
    from tensorferry.wire._layout import Layout

    ts = _kinds()
    obj = {"kinds": ts, "tied": ts[0], "again": ts[7]}
    leaves, ops, counts, keys, _ = flatten(obj)
    local = inspect_leaves(obj, leaves, ops, counts, keys).layout
    assert local.aliases.tolist() == [[len(ts), 0], [len(ts) + 1, 7]]
    checked = Layout(local.dtype_codes, local.ndims, local.dims, local.tree_ops, local.tree_counts, local.keys, local.aliases)
    for name in ("numels", "nbytes", "alignments"):
        assert getattr(local, name).tolist() == getattr(checked, name).tolist(), name
    assert local.numels.tolist() == [t.numel() for t in leaves]
    assert local.nbytes[-2:].tolist() == [0, 0]
    assert local.same_as(checked) and Layout.from_bytes(local.to_bytes()).same_as(checked)


class _Marked(torch.Tensor):
    """A tensor subclass: readable, but not one the fast passes take as plain."""


def test_plain_only_leaves_subclasses_to_the_caller(mode):
    ts = [torch.ones(3), torch.nn.Parameter(torch.ones(2)), torch.ones(4).as_subclass(_Marked)]
    assert tm.read_columns(ts, plain_only=True) is None
    cols = tm.read_columns(ts)
    assert cols is not None and cols.ptrs.tolist() == [t.data_ptr() for t in ts]
    plain = tm.read_columns(ts[:2], plain_only=True)
    assert plain is not None and plain.sizes.tolist() == [3, 2]


def test_mark_written_bumps_each_counter_once_and_skips_inference_tensors():
    # The C++ loop over torch's own bump (where bound), and torch's binding
    # for what it stops at: a view shares its base's counter; a tensor made
    # under inference_mode has none and is skipped anywhere in the list,
    # the tensors after it still marked.
    base = torch.zeros(8)
    view = base[2:5]
    own = torch.ones(3)
    param = torch.nn.Parameter(torch.ones(2))
    with torch.inference_mode():
        frozen = torch.zeros(2)
    before = {name: t._version for name, t in (("base", base), ("own", own), ("param", param))}
    tm.mark_written([base, own, frozen, param])
    assert base._version == view._version == before["base"] + 1
    assert own._version == before["own"] + 1 and param._version == before["param"] + 1
    tm.mark_written([view, view])  # a view bumps its base's counter, once a time it is listed
    assert base._version == before["base"] + 3
    assert tm._BUMP == tm.native, "torch's bump_version was not bound: marking goes through torch's binding"


def test_a_tensor_marked_written_fails_the_backward_that_saved_it():
    # What the marking is for: a get writes weights by address; a backward
    # that saved them before must refuse rather than use the new values.
    w = torch.ones(3, requires_grad=True)
    x = w.detach().clone()
    y = (w * x).sum()
    tm.mark_written([x])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_the_loops_prefetch_through_the_storage_and_version_counter_words():
    # Found once on sample tensors; checked here on others: the storage
    # word is each tensor's StorageImpl, the version word is shared by a
    # view and its base and by no unrelated tensor. (Prefetches cannot
    # fault, so a wrong word would only slow the loops; this says it is right.)
    storage_at, version_at = tm._PREFETCH
    assert tm.native and storage_at >= 0 and version_at >= 0, tm._PREFETCH
    a, b = torch.arange(10, dtype=torch.int32), torch.randn(3, 3)
    va = a[4:]
    words = {name: tm._impl_words(t) for name, t in (("a", a), ("b", b), ("va", va))}
    assert words["a"][storage_at // 8] == a.untyped_storage()._cdata
    assert words["b"][storage_at // 8] == b.untyped_storage()._cdata
    assert words["a"][version_at // 8] == words["va"][version_at // 8] != words["b"][version_at // 8]


def test_raw_reads_are_learned_and_read_what_torch_says():
    # Learned once on samples (tensors/_raw.py); here on other tensors: the
    # records hold each storage's data, offset and dtype, and a plan's check
    # takes them (missing, it falls back to the shim's slower pass).
    assert tm._RAW, "raw reads could not be learned on this torch"
    flat = torch.arange(100, dtype=torch.float64)
    ts = [flat[7:19].view(3, 4), torch.ones(2, 5, dtype=torch.bfloat16)[:, 1:], torch.zeros(3, dtype=torch.int8)[2:], torch.tensor(1.5)]
    rec = tm.Recorded(ts)
    assert rec._raw is not None
    assert rec._raw[:, 0].tolist() == [t.untyped_storage().data_ptr() for t in ts]
    assert rec._raw[:, 3].tolist() == [t.storage_offset() for t in ts]
    codes = rec._raw[:, 4].tolist()
    assert codes[0] != codes[1] != codes[2] and min(codes) >= 0
    assert tm.Recorded([torch.ones(3, dtype=torch.float64)])._raw[0, 4] == codes[0]


def test_words_that_differ_for_no_change_cost_a_read_not_a_false_alarm():
    # A word that moved without the tensor changing (a record from another
    # object of the same memory, say): the shim's reading decides, and the
    # words are recorded again, so the next check is raw again.
    ts = [torch.ones(4, 3) for _ in range(50)]
    rec = tm.Recorded(ts)
    assert rec._raw is not None
    want = rec._raw.copy()
    rec._raw[7, 1] ^= 0x5A5A
    rec._raw[31, 2] += 8
    assert rec.first_changed(ts) == -1
    assert np.array_equal(rec._raw, want)
    ts[31].t_()
    rec._raw[7, 1] ^= 0x5A5A
    assert rec.first_changed(ts) == 31


def test_tensors_of_more_dims_than_kept_inline_are_checked_through_the_shim(mode):
    # Sizes past 5 dims live out of line, where a change keeps the pointer:
    # such a tensor has no raw record and is read through the shim each time.
    ts = [torch.ones(3), torch.ones(1, 2, 1, 2, 1, 2), torch.ones(2)]
    rec = tm.Recorded(ts)
    if mode == "c++":
        assert rec._raw is not None and rec._raw[1, 4] == -1 and rec._raw[0, 4] >= 0
    assert rec.first_changed(ts) == -1
    ts[1].as_strided_((2, 1, 2, 1, 2, 1), (4, 4, 2, 2, 1, 1))
    assert rec.first_changed(ts) == 1


@pytest.mark.skipif(not hasattr(torch, "_lazy_clone"), reason="this torch has no copy-on-write clones")
def test_a_copy_on_write_clone_of_a_planned_tensor_makes_it_changed(mode):
    # A lazy clone shares the storage until one side writes: a copy into the
    # planned address would change the clone too. The storage's deleter and
    # context words change (raw reads); torch's data_ptr() copies it out.
    ts = [torch.arange(6.0), torch.arange(4.0)]
    rec = tm.Recorded(ts)
    clone = torch._lazy_clone(ts[1])
    assert rec.first_changed(ts) == 1
    assert torch.equal(clone, torch.arange(4.0))


def test_raw_reads_refuse_records_that_disagree_with_the_columns(monkeypatch):
    # A plan's records are checked against the shim's addresses once: a
    # disagreement (here, element sizes made wrong) leaves the plan on the shim.
    ts = [torch.arange(12, dtype=torch.int16)[3:]]
    assert tm.Recorded(ts)._raw is not None
    monkeypatch.setattr(_raw, "_SIZE_BY_UINT8", np.full(256, 3, np.int64))
    rec = tm.Recorded(ts)
    assert rec._raw is None and rec.first_changed(ts) == -1


@pytest.mark.skipif(not tm._RAW, reason="raw reads are off in this torch: nothing to turn off")
def test_a_layout_that_cannot_be_proved_turns_raw_reads_off_with_one_warning(monkeypatch):
    # Another torch (2.14 and later) may lay a TensorImpl out differently:
    # where the offsets do not fit, bind() says so once and kept plans check
    # through torch's calls, with the same results.
    def no_fit():
        raise _raw._NoFit("dtype: no field fits")

    monkeypatch.setattr(_raw, "_learn", no_fit)
    try:
        with pytest.warns(RuntimeWarning, match=r"could not be proved: dtype: no field fits") as seen:
            assert _raw.bind(tm._native, tm._PREFETCH[0]) is False
        assert len(seen) == 1
        monkeypatch.setattr(tm, "_RAW", False)
        ts = [torch.ones(4), torch.zeros(2, 3)]
        rec = tm.Recorded(ts)
        assert rec.first_changed(ts) == -1
        ts[1].t_()
        assert rec.first_changed(ts) == 1
    finally:
        monkeypatch.undo()
        assert _raw.bind(tm._native, tm._PREFETCH[0]) is True  # raw reads back on for the tests after this one
