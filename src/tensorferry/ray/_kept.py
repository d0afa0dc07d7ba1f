"""A source actor's kept plan: the same tensors returned again replay it.

A method with ``tensor_transport="tensorferry"`` that returns the same
tensors on every call (a model's weights after each step) would pay the
per-tensor work of a fresh put (inspecting each tensor, the layout, the
copy runs) on every call, since Ray hands the transport a fresh list each
time. The producer keeps one plan (``Sender.plan``) of what it sent:

* a fresh put remembers the tensors' addresses and, weakly, the storages of
  the first and the last (a storage's Python object lives as long as its
  memory), which costs no per-tensor Python work; the last two such
  objects are remembered;
* an object with the same addresses as one of those, whose first and last
  storages are those very storages, still alive, is planned on the first
  segment and sent by that plan;
* later objects that the plan matches (``SendPlan.matches``: the same
  nesting, and tensors at the same addresses with the same dtypes, sizes
  and strides, one C++ pass) replay it; anything else takes the fresh
  path, and the plan stays for the next call (a producer that returns its
  weights from one method and fresh outputs from another keeps replaying
  the weights' plan) until another object is sent twice in a row, which
  replaces it.

The plan holds the tensors it was made of (and, for views of a few
buffers, those buffers) until it is replaced or the process ends: the
weights of a model are alive anyway; a transient object returned twice
stays alive until another object is.

A replay copies the tensors' current contents into the pool like a fresh
put (a snapshot: the producer may change them as soon as the method has
returned). Runs on the source actor only; thread-safe (a put that finds the
plan in use by another thread takes the fresh path).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from ..errors import PlanStaleError, PoolExhaustedError, UnsupportedTensorError
from ..tensors import data_ptrs

__all__ = ["KeptPlan"]

_SEEN = 2


class _Seen(NamedTuple):
    """What a fresh put leaves to recognise the same tensors next time."""

    ptrs: np.ndarray
    first: Any  # weakref to the first tensor's storage
    last: Any


def _seen(tensors: list) -> _Seen | None:
    if not tensors:
        return None
    try:
        ptrs = data_ptrs(tensors)
        return _Seen(ptrs, weakref.ref(tensors[0].untyped_storage()), weakref.ref(tensors[-1].untyped_storage()))
    except (RuntimeError, TypeError):  # a tensor without memory of its own: never kept
        return None


class KeptPlan:
    """The producer's plan of the tensors it sent last, replayed while they are the same.

    Args:
        enabled: keep plans (False: every put takes the fresh path).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._busy = threading.Lock()
        self._plan: Any = None
        self._sender: Any = None
        # The last objects put fresh: two, so a producer alternating two
        # methods (weights and fresh outputs) still finds its weights again.
        self._seen: deque[_Seen] = deque(maxlen=_SEEN)
        self.plans_made = 0
        self.plan_puts = 0

    @property
    def plan(self) -> Any:
        """The kept ``SendPlan``, or None."""
        return self._plan

    def put(self, segments: Any, tensors: list) -> tuple[Any, Any]:
        """Put ``tensors`` for any number of readers: by the kept plan when
        they are the tensors it holds, else fresh (``Segments.put``).

        Returns:
            ``(sender, ticket)``, as ``Segments.put``.

        Raises:
            What ``Segments.put`` raises.
        """
        if not self.enabled or not self._busy.acquire(blocking=False):
            return segments.put(tensors)
        try:
            return self._put(segments, tensors)
        finally:
            self._busy.release()

    # -- internals (the _busy lock held) -------------------------------------------------

    def _drop(self) -> None:
        self._plan = self._sender = None
        self._seen.clear()

    def _put(self, segments: Any, tensors: list) -> tuple[Any, Any]:
        # matches: the same nesting, then one C++ pass over the tensors'
        # addresses, dtypes, sizes and strides (about 0.05 us a tensor).
        if self._plan is not None and self._plan.matches(tensors):
            try:
                ticket = self._sender.put(self._plan, readers=None, one_shot=True)
                self.plan_puts += 1
                return self._sender, ticket
            except PoolExhaustedError:
                # Earlier objects still fill the first segment: this one
                # goes where there is room; the plan stays for the next.
                return segments.put(tensors)
            except PlanStaleError:
                self._drop()  # a tensor moved between the match and the copy
        elif self._seen_again(tensors):
            # One of the last two fresh objects again: it replaces the plan.
            kept = self._keep(segments.first, tensors)
            if kept is not None:
                return kept
        sender, ticket = segments.put(tensors)
        seen = _seen(tensors)
        if seen is not None:
            self._seen.append(seen)
        return sender, ticket

    def _seen_again(self, tensors: list) -> bool:
        """Whether ``tensors`` are those of a recent fresh put (which is then forgotten)."""
        for i, seen in enumerate(self._seen):
            if len(tensors) != len(seen.ptrs) or not tensors:
                continue
            first, last = seen.first(), seen.last()
            # Alive and the same storages: not new memory at recycled addresses.
            if first is None or last is None:
                continue
            if tensors[0].untyped_storage() is not first or tensors[-1].untyped_storage() is not last:
                continue
            try:
                same = bool((data_ptrs(tensors) == seen.ptrs).all())
            except (RuntimeError, TypeError):
                return False
            if same:
                del self._seen[i]
                return True
        return False

    def _keep(self, sender: Any, tensors: list) -> tuple[Any, Any] | None:
        """Plan ``tensors`` on ``sender`` (the first segment) and put them by it."""
        try:
            plan = sender.plan(tensors)
        except UnsupportedTensorError:
            return None  # the fresh put says why
        if plan.total_nbytes > sender.pool.capacity_nbytes:
            return None  # never fits the first segment: fresh puts grow the pool
        self._plan, self._sender = plan, sender
        self.plans_made += 1
        try:
            ticket = sender.put(plan, readers=None, one_shot=True)
        except PoolExhaustedError:
            return None
        self.plan_puts += 1
        return sender, ticket
