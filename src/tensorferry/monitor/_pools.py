"""Pool figures a process exposes through the monitor's collector.

A process that owns a ``MemoryPool`` (a ``Sender``, a ``Receiver``'s cache)
registers a callable returning a plain dict; the monitor never imports torch
or the pool module, so it stays importable (and cheap) in processes that
have neither.

Labels stay the same across restarts: a pool is labelled by its name and its
role; the process's pid, where a registered name carries it as one of its
``:``-separated parts (the receive cache registers as
``receive-cache:<pid>:<n>``), is taken out of the name and kept apart, to be
exported as a label of its own only where asked for.
"""

from __future__ import annotations

__all__ = [
    "POOL_KEYS",
    "PoolFigures",
    "PoolLabels",
    "collect_labelled_pool_figures",
    "collect_pool_figures",
    "register_pool_source",
    "unregister_pool_source",
]

import os
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import NamedTuple

from ..errors import ConfigurationError

POOL_KEYS = ("capacity_nbytes", "used_nbytes", "largest_free_nbytes", "transfers", "bytes_moved")
"""The keys a pool source's dict must have, all non-negative ints."""


class PoolFigures(NamedTuple):
    """One pool's figures at one scrape."""

    name: str
    """The name it was registered under."""
    capacity_nbytes: int
    """Bytes the pool's buffer holds in all."""
    used_nbytes: int
    """Bytes allocated to live groups."""
    largest_free_nbytes: int
    """The largest contiguous free block: the biggest group that fits now."""
    transfers: int
    """Transfers served since the pool was made (a counter)."""
    bytes_moved: int
    """Bytes moved by those transfers (a counter)."""


class PoolLabels(NamedTuple):
    """How a pool is labelled in the exported metrics."""

    pool: str
    """The registered name without this process's pid (``receive-cache:1`` for
    ``receive-cache:<pid>:1``): the same after a restart."""
    role: str
    """What the pool serves (``sender``, ``receive-cache``, ...)."""
    pid: int
    """The process that holds the pool (exported only where asked for: it changes at every restart)."""


class _Source(NamedTuple):
    call: Callable[[], Mapping[str, int]]
    labels: PoolLabels


_lock = threading.Lock()
_sources: dict[str, _Source] = {}
_warned: set[str] = set()


def _label(name: str, pid: int) -> str:
    """``name`` without ``pid`` where it is one of its ``:``-separated parts."""
    parts = name.split(":")
    kept = [p for p in parts if p != str(pid)]
    return ":".join(kept) if kept and len(kept) < len(parts) else name


def register_pool_source(name: str, source: Callable[[], Mapping[str, int]], *, role: str | None = None) -> None:
    """Expose a pool's figures through the monitor's Prometheus collector.

    A ``Sender``'s ``stats`` is such a source as it is:
    ``register_pool_source("weights", sender.stats, role="sender")``.

    Args:
        name: a short name, the same at every run (``weights``), or one that
            carries this process's pid as a ``:``-separated part (unique
            within the process; the pid leaves the ``pool`` label); registering
            the same name again replaces the source.
        source: called at each scrape, in the scraping thread; returns a dict
            with the keys in ``POOL_KEYS``, the int fields of
            [``PoolFigures``][tensorferry.monitor.PoolFigures] (others are
            ignored). It should be cheap and must not block (read counters,
            do not lock the pool for long).
        role: the ``role`` label (``sender``, ``receiver``, ``receive-cache``);
            by default the name's first ``:``-separated part.

    Raises:
        ConfigurationError: ``name`` or ``role`` is empty or ``source`` is not callable.
    """
    if not name or not isinstance(name, str):
        raise ConfigurationError(
            f"register_pool_source(name={name!r}): must be a non-empty str (the pool label, e.g. 'sender')"
        )
    if not callable(source):
        raise ConfigurationError(
            f"register_pool_source(source={source!r}) for {name!r}: must be a callable returning a dict "
            f"with keys {', '.join(POOL_KEYS)} (e.g. lambda: pool.stats()._asdict())"
        )
    if role is not None and (not isinstance(role, str) or not role):
        raise ConfigurationError(
            f"register_pool_source(role={role!r}) for {name!r}: must be a non-empty str "
            "(what the pool serves, e.g. 'sender') or None (the name's first ':'-part)"
        )
    pid = os.getpid()
    label = _label(name, pid)
    entry = _Source(source, PoolLabels(label, role or label.split(":", 1)[0], pid))
    with _lock:
        _sources[name] = entry
        _warned.discard(name)


def unregister_pool_source(name: str) -> None:
    """Stop exposing the pool registered as ``name`` (no error if absent)."""
    with _lock:
        _sources.pop(name, None)


def collect_pool_figures() -> tuple[list[PoolFigures], int]:
    """Call every source; returns ``(figures, failed_count)``.

    A source that raises or returns a malformed dict is skipped (and warned
    about once): one broken pool must not take the process's metrics down.
    """
    labelled, failed = collect_labelled_pool_figures()
    return [f for f, _ in labelled], failed


def collect_labelled_pool_figures() -> tuple[list[tuple[PoolFigures, PoolLabels]], int]:
    """:func:`collect_pool_figures` with each pool's labels (what the exporter serves)."""
    with _lock:
        items = list(_sources.items())
    out: list[tuple[PoolFigures, PoolLabels]] = []
    failed = 0
    for name, entry in items:
        try:
            d = entry.call()
            values = [int(d[k]) for k in POOL_KEYS]
            if any(v < 0 for v in values):
                raise ConfigurationError(f"pool source {name!r} returned a negative figure: {dict(d)!r}")
        except Exception as exc:  # noqa: BLE001 - user callables may raise anything
            failed += 1
            if name not in _warned:
                _warned.add(name)
                warnings.warn(
                    f"pool source {name!r} failed ({type(exc).__name__}: {exc}); it must return "
                    f"a dict with non-negative int keys {', '.join(POOL_KEYS)}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            continue
        out.append((PoolFigures(name, *values), entry.labels))
    return out, failed
