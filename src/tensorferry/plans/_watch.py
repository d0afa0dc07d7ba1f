"""What a kept plan checks before each use: its tensors are still where it
found them, as it found them (addresses, dtypes, sizes, strides, a module's
own slots), and the storages it holds so that a copy by the planned
addresses reads live memory."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..copy import executor, finish
from ..errors import PlanStaleError, UnsupportedTensorError
from ..shards import Box, is_shard
from ..tensors import Recorded, data_ptrs, first_replaced, flatten

__all__ = ["PUT", "Watch", "outcome"]


class Watch:
    """What a kept plan checks before each use: that its tensors are still
    where and as it found them (same addresses, dtypes, sizes and strides:
    a tensor re-viewed in place, ``t_()`` or ``.data =`` a view of the same
    memory in another shape, keeps its address but not its layout) and,
    for a module, still the module's own (a parameter or buffer replaced
    is another tensor). Each check is one C++ pass over the tensors
    (``_tensor_meta``)."""

    def __init__(self, leaves: Sequence[torch.Tensor], names: list[Any] | None, module: torch.nn.Module | None, ops: Sequence[int], counts: Sequence[int], keys: Sequence[Any], *, hold: bool = False,
                 slotted: Sequence[Any] | None = None) -> None:
        self.leaves = leaves = leaves if type(leaves) is list else list(leaves)
        self.names = names
        self.recorded = Recorded(leaves)
        self.ptrs = self.recorded.ptrs
        self.numels = self.recorded.numels()
        self.tree = (list(ops), list(counts), list(keys))
        # Per tensor, the module dict it lives in and its name there, and
        # what that slot holds: the leaf, or the shard (a DTensor) whose
        # local tensor the leaf is (``slotted``).
        self.slotted = list(slotted) if slotted is not None else leaves
        self.slots = _module_slots(module, names or [], self.slotted) if module is not None else None
        self.shards = _Shards.of(module, self.slots, self.slotted, leaves) if self.slots is not None and slotted is not None else None
        # Recorded with the addresses (never later: a copy trusts both).
        self.storages = _Storages.of(leaves, self.numels) if hold else None

    def check(self, what: str, fix: str) -> None:
        """Raises PlanStaleError naming the first tensor that changed."""
        leaves = self.leaves
        if self.slots is not None:
            i = first_replaced(*self.slots, self.slotted) if self.shards is None else self.shards.first_replaced(self)
            if i >= 0:
                raise PlanStaleError(
                    f"{what}: the module's {self.name(i)} is no longer the tensor the plan was made with "
                    f"(reassigned, e.g. by load_state_dict(assign=True) or a new nn.Parameter); {outcome(what)}: "
                    f"make a new plan with {fix}"
                )
        # One pass (0.05 us a tensor): what can make the plan read or write
        # memory that is no longer the tensor's (`.data =`, set_,
        # module.to(), a resize_ that grows) moves it; what makes the
        # planned bytes another layout of the tensor (t_(), as_strided_(),
        # `.data =` a view of the same memory) changes its sizes or strides.
        # A resize_ that shrinks keeps the address and the storage's bytes:
        # it is caught as a change of sizes.
        i = self.recorded.first_changed(leaves)
        if i >= 0:
            raise PlanStaleError(f"{what}: {self._change(i)}; {outcome(what)}: make a new plan with {fix}")

    def _change(self, i: int) -> str:
        """What became of tensor ``i`` since the plan was made (the first that changed)."""
        t = self.leaves[i]
        if _no_address(t):
            return (f"{self.name(i)} has no memory of its own any more (a sparse or storage-less tensor was swapped in, "
                    "e.g. by torch.utils.swap_tensors)")
        ptr, numel = t.data_ptr(), t.numel()
        if ptr != self.ptrs[i]:
            try:
                moved = int((data_ptrs(self.leaves) != self.ptrs).sum())
            except (RuntimeError, TypeError):
                moved = 1
            change = f"moved from address {self.ptrs[i]:#x} to {ptr:#x}" + (
                f" and was resized from {self.numels[i]:,} to {numel:,} elements" if numel != self.numels[i] else "")
            return f"{self.name(i)} {change} since the plan was made ({moved:,} tensors moved; e.g. `.data` reassigned, module.to(), resize_)"
        sizes, strides = self.recorded.shape_of(i)
        dtype = self.recorded.dtype(i)
        now = f"{tuple(t.shape)} with strides {t.stride()}" + (f" as {t.dtype}" if t.dtype is not dtype else "")
        return (f"{self.name(i)} was {sizes} with strides {strides} and is {now} at the same address since the plan was made "
                "(re-viewed in place: t_(), as_strided_(), resize_(), `.data =` a view of the same memory)")

    def guarded(self, move: Callable[[], Any], what: str, fix: str, *, overlap: bool) -> Any:
        """``move()``, which reads or writes the planned tensors' memory by
        address, and :meth:`check`: first; or, with ``overlap`` and the
        tensors in few storages (held since the plan was made, checked
        first), on a copy thread while ``move()`` runs, raising after it."""
        storages = self.storages if overlap else None
        try:
            if storages is None:
                self.check(what, fix)
                return move()
            storages.check(self, what, fix)
            future = executor().submit(self.check, what, fix)
            try:
                result = move()
            except BaseException as exc:
                # A stale tensor explains what the move tripped on (a
                # value-copied leaf replaced by one of another size): that
                # error wins; else the move's own.
                stale = future.exception() if not future.cancel() else _stale(self.check, what, fix)
                if isinstance(stale, PlanStaleError):
                    raise stale from exc
                raise
            finish(future, self.check, what, fix)
            return result
        except PlanStaleError:
            # A stale plan raises on every use: it need not keep the memory
            # its tensors left (no copy is running any more).
            self.storages = None
            raise

    def matches(self, obj: Any) -> bool:
        """Whether ``obj``'s tensors are the planned tensors' memory as
        planned (addresses, dtypes, sizes, strides), nested the same way:
        a flatten and one C++ pass."""
        src = obj.state_dict(keep_vars=True) if isinstance(obj, torch.nn.Module) else obj
        try:
            leaves, ops, counts, keys, staged = flatten(src)
        except UnsupportedTensorError:
            return False
        if staged or len(leaves) != len(self.leaves) or (ops, counts, keys) != self.tree:
            return False
        return self.recorded.first_changed(leaves) < 0

    def name(self, i: int) -> str:
        if self.names is not None and i < len(self.names):
            return f"tensor {self.names[i]!r}"
        return f"tensor #{i}"


def _no_address(t: Any) -> bool:
    """Whether ``t.data_ptr()`` raises (a sparse tensor, not a tensor)."""
    try:
        t.data_ptr()
    except (RuntimeError, TypeError, AttributeError):
        return True
    return False


def _stale(check: Callable[[str, str], None], what: str, fix: str) -> BaseException | None:
    """The error ``check(what, fix)`` raises, or None."""
    try:
        check(what, fix)
    except BaseException as exc:  # returned, not raised: the caller chooses
        return exc
    return None


class _Storages:
    """The storages a plan's tensors live in, held, with where they were.

    A tensor moved by ``.data =``, ``set_`` or ``module.to()`` leaves its
    old storage, which is held here, so a copy by the planned addresses
    still reads memory that is alive (the plan keeps that memory until a
    use finds it stale). What frees a held storage's memory in place (a
    ``resize_`` that grows it, ``untyped_storage().resize_(0)``) changes its
    address or size, which :meth:`check` sees before any copy starts. Like
    the check it replaces, this assumes nothing changes the tensors while a
    put runs (another thread's ``resize_`` during the copy could still
    free what it reads), and it cannot see memory freed behind torch's back
    (numpy's ``resize(refcheck=False)`` under a ``from_numpy`` tensor)."""

    def __init__(self, storages: list[Any], ptrs: np.ndarray, nbytes: np.ndarray) -> None:
        self.storages, self.ptrs, self.nbytes = storages, ptrs, nbytes

    @classmethod
    def of(cls, leaves: Sequence[torch.Tensor], numels: np.ndarray) -> "_Storages | None":
        """Those of ``leaves`` if they are few (at most one per 8 tensors:
        views of flat buffers), else None."""
        live = np.flatnonzero(numels > 0)
        if not live.size:
            return None
        every = [leaves[i].untyped_storage() for i in live.tolist()]
        # Told apart by the storage itself, not its address: two storages
        # can share one (a tensor and its from_dlpack or from_numpy alias),
        # and either may be reallocated; every one is held and checked.
        ids = np.fromiter(map(_get_cdata, every), dtype=np.int64, count=len(every))
        _, first = np.unique(ids, return_index=True)
        if first.size * 8 > len(leaves):
            return None
        held = [every[i] for i in first.tolist()]
        ptrs = np.fromiter(map(torch.UntypedStorage.data_ptr, held), dtype=np.int64, count=len(held))
        return cls(held, ptrs, np.fromiter(map(torch.UntypedStorage.nbytes, held), dtype=np.int64, count=len(held)))

    def check(self, watch: "Watch", what: str, fix: str) -> None:
        """Raises PlanStaleError if a held storage's memory moved or shrank."""
        now = np.fromiter(map(torch.UntypedStorage.data_ptr, self.storages), dtype=np.int64, count=len(self.storages))
        size = np.fromiter(map(torch.UntypedStorage.nbytes, self.storages), dtype=np.int64, count=len(self.storages))
        bad = np.flatnonzero((now != self.ptrs) | (size < self.nbytes))
        if bad.size:
            j = int(bad[0])
            lo, hi = int(self.ptrs[j]), int(self.ptrs[j] + self.nbytes[j])
            i = int(np.flatnonzero((watch.ptrs >= lo) & (watch.ptrs < hi))[0])
            raise PlanStaleError(
                f"{what}: the memory of {watch.name(i)} (a storage of {self.nbytes[j]:,} bytes at {lo:#x}) moved to {now[j]:#x} "
                f"and holds {size[j]:,} bytes since the plan was made (e.g. resize_); {outcome(what)}: make a new plan with {fix}"
            )



_get_cdata = operator.attrgetter("_cdata")


class _Shards:
    """A sharded module's slots (FSDP2's ``fully_shard``, or DTensor
    parameters of tensor parallelism): which hold a DTensor whose local
    tensor is a planned leaf, and the FSDP2 parameter group of each.

    FSDP2 registers a group's unsharded parameters (plain tensors, or
    SHARDED_POST_FORWARD DTensors) in the module's slots between its
    all-gather and its reshard (a forward, then the backward), and its
    sharded DTensors, the planned ones, back after: a slot is checked only
    while its group says it is sharded (``FSDPParamGroup.is_sharded``),
    so a put between a forward and a backward is no false alarm. The
    planned leaves stay where they were meanwhile (FSDP2 gathers into
    memory of its own), so the address check holds in every state. A
    slot in no group (tensor parallelism alone) is always checked, but in
    a module FSDP2 sharded whose groups cannot be read (another torch):
    there a slot is checked while it holds a DTensor (FSDP2 registers
    plain unsharded parameters)."""

    def __init__(self, groups: list[Any], member: np.ndarray, dtensors: np.ndarray, unread: bool = False) -> None:
        self.groups = groups
        self.member = member  # per slot: its group's index, or -1
        self.dtensors = dtensors  # slots that hold a DTensor whose local tensor is a leaf
        self.unread = unread  # an FSDP2 module whose groups could not be read
        self._live: dict[tuple[bool, ...], tuple[np.ndarray, list, list, list]] = {}

    @classmethod
    def of(cls, module: torch.nn.Module, slots: tuple[list[dict], list[Any]], slotted: list[Any], leaves: list[torch.Tensor]) -> "_Shards":
        where = {}
        for group in _fsdp_groups(module):
            for param in getattr(group, "fsdp_params", ()):
                info = getattr(param, "_module_info", None)
                if info is None:
                    continue
                owners = [(info.module, info.param_name)]
                owners += list(zip(getattr(info, "shared_modules", ()), getattr(info, "shared_param_names", ())))
                for m, name in owners:
                    where[(id(m._parameters), name)] = group
        groups: list[Any] = []
        index: dict[int, int] = {}
        member = np.full(len(leaves), -1, dtype=np.int64)
        for i, (d, name) in enumerate(zip(*slots)):
            group = where.get((id(d), name))
            if group is not None:
                member[i] = index.setdefault(id(group), len(groups))
                if member[i] == len(groups):
                    groups.append(group)
        dtensors = np.fromiter((i for i, (x, t) in enumerate(zip(slotted, leaves)) if x is not t and is_shard(x) and type(x) is not Box),
                               dtype=np.int64)
        unread = not groups and any(hasattr(m, "_get_fsdp_state") for m in module.modules())
        return cls(groups, member, dtensors, unread)

    def first_replaced(self, watch: "Watch") -> int:
        """The first slot, of those whose group is sharded now, that holds
        another object than planned, or a DTensor whose local tensor is not
        at the planned leaf's address (swapped in place, e.g. by
        ``torch.utils.swap_tensors``); -1 if none."""
        state = tuple(bool(getattr(g, "is_sharded", True)) for g in self.groups)
        live = self._live.get(state)
        if live is None:
            keep = np.append(np.asarray(state, dtype=bool), True)[self.member]
            idx = np.flatnonzero(keep)
            dicts, names = watch.slots
            live = self._live[state] = (idx, [dicts[i] for i in idx.tolist()], [names[i] for i in idx.tolist()],
                                        [watch.slotted[i] for i in idx.tolist()])
        idx, dicts, names, objects = live
        shards = self.dtensors[np.append(np.asarray(state, dtype=bool), True)[self.member[self.dtensors]]] if self.dtensors.size else self.dtensors
        if self.unread:
            # Only the slots that hold a DTensor now (the others: unsharded).
            holding = np.fromiter((is_shard(d.get(k)) for d, k in zip(dicts, names)), dtype=bool, count=len(dicts))
            idx, shards = idx[holding], shards[np.isin(shards, idx[holding])]
            keep = np.flatnonzero(holding).tolist()
            dicts, names, objects = [dicts[j] for j in keep], [names[j] for j in keep], [objects[j] for j in keep]
        i = first_replaced(dicts, names, objects)
        first = int(idx[i]) if i >= 0 else -1
        if shards.size:
            with torch.no_grad():  # to_local() is then the local tensor itself, not a view made for autograd
                now = data_ptrs([watch.slotted[j].to_local() for j in shards.tolist()])
            moved = np.flatnonzero(now != watch.ptrs[shards])
            if moved.size and (first < 0 or int(shards[moved[0]]) < first):
                first = int(shards[moved[0]])
        return first


def _fsdp_groups(module: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of ``module`` and its submodules (none
    for a module ``fully_shard`` was not applied to)."""
    groups: list[Any] = []
    for m in module.modules():
        state_of = getattr(m, "_get_fsdp_state", None)
        if state_of is None:
            continue
        try:
            state = state_of()
        except (AssertionError, AttributeError, RuntimeError):
            continue
        found = getattr(state, "_fsdp_param_groups", None)
        if found is None:
            one = getattr(state, "_fsdp_param_group", None)
            found = [one] if one is not None else []
        groups.extend(g for g in found if all(g is not h for h in groups))
    return groups


def outcome(what: str) -> str:
    """What a stale plan's error says became of the data."""
    return "nothing was sent" if what.startswith("put") else "nothing was written"


# What a stale sender plan's error says: the call, and the fix.
PUT = ("put(plan)", "sender.plan(...)")


def _module_slots(module: torch.nn.Module, keys: list[Any], leaves: Sequence[torch.Tensor]) -> tuple[list[dict], list[Any]]:
    """Where each state-dict entry lives in the module: the owning module's
    _parameters or _buffers, and its name there (two lists), so a put can
    look each up again and see whether it was replaced. An entry a
    state_dict hook made has no such place: its slot holds the planned
    tensor (checked by address and size only)."""
    where: dict[str, tuple[dict, str]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        head = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                where[head + name] = (m._parameters, name)
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                where[head + name] = (m._buffers, name)
    slots = [where.get(k) or ({k: t}, k) for k, t in zip(keys, leaves)]
    return [d for d, _ in slots], [k for _, k in slots]
