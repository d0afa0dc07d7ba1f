"""The copy threads: one small pool per process, and how many a copy uses.

``TENSORFERRY_COPY_THREADS`` sets how many threads one copy uses (default:
the CPUs this process may run on, at most 4; ``1`` turns the split off).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ConfigurationError

__all__ = ["copy_threads", "executor", "finish", "run_parts", "PARALLEL_MIN_NBYTES"]

# A copy is split across threads only when it is big enough for the split
# to pay (thread hand-off is ~50 us) and its runs are long enough that the
# threads spend their time in memmove, not taking turns at the GIL.
PARALLEL_MIN_NBYTES = 16 << 20

_MAX_DEFAULT_THREADS = 4

_ENV = "TENSORFERRY_COPY_THREADS"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()

# Threads of the one pool every background copy of this process runs on:
# parallel memcpy parts, the copy-out of streamed chunks, moving the bytes
# while views are built. A wait never blocks on a part that has not started
# (it runs it itself, see run_parts), so nested use cannot deadlock.
_POOL_THREADS = 8
def copy_threads() -> int:
    """How many threads one large copy uses (``TENSORFERRY_COPY_THREADS``)."""
    raw = os.environ.get(_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if not 1 <= value <= 64:
            raise ConfigurationError(f"{_ENV}={raw!r}: expected a whole number of threads from 1 to 64 (1 turns the parallel copy off)")
        return value
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_DEFAULT_THREADS, cpus))


def executor() -> ThreadPoolExecutor:
    """The process's one pool of copy threads (made on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_POOL_THREADS, thread_name_prefix="tensorferry-copy")
        return _pool


def _forget_pool_in_child() -> None:
    # A forked child has the pool object but none of its threads.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def finish(future: Any, fn: Any, *args: Any) -> Any:
    """Wait for ``future`` = ``submit(fn, *args)``; if no thread has started
    it yet, run it here instead. A wait on the copy threads never depends on
    a free one, so work submitted from a copy thread cannot deadlock."""
    if future.cancel():
        return fn(*args)
    return future.result()


def run_parts(fn: Any, parts: Sequence[tuple[Any, ...]]) -> None:
    """``fn(*part)`` for every part at once: the first on this thread, the
    rest on the copy threads. Returns when all are done; the first error is
    raised. A part no thread has started by the time this thread gets to it
    is run here instead (cancelled in the pool): a wait never depends on a
    free thread, so a part may itself call run_parts."""
    pool = executor()
    futures = [pool.submit(fn, *part) for part in parts[1:]]
    errors: list[BaseException] = []
    try:
        fn(*parts[0])
    except BaseException as exc:  # still wait: the caller frees the memory on return
        errors.append(exc)
    for part, f in zip(parts[1:], futures):
        try:
            finish(f, fn, *part)
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
